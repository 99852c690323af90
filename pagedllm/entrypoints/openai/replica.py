"""`python -m pagedllm.entrypoints.openai.replica SETTINGS`: one data-parallel replica (data_parallel.py starts
them), a lone server whose parsed command line is read from the SETTINGS file; it dies with the router."""
from __future__ import annotations

import pickle
import sys
from pathlib import Path

from pagedllm.entrypoints.command import run_command
from pagedllm.entrypoints.openai.api_server import run_server
from pagedllm.utils import die_with_parent


def main() -> int:
    die_with_parent()
    ns = pickle.loads(Path(sys.argv[1]).read_bytes())
    return run_command(run_server, ns)


if __name__ == "__main__":
    sys.exit(main())
