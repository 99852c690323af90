"""Running a subcommand the same way from every entry point (`pagedllm ...`, the API server's module, a
data-parallel replica)."""
from __future__ import annotations

import argparse
import logging
import sys


def run_command(func, ns: argparse.Namespace) -> int:
    """Run a subcommand; bad input (ValueError, missing files) is one line on stderr and exit code 2."""
    logging.basicConfig(level=ns.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return func(ns)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
