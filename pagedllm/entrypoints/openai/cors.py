"""CORS, as vLLM offers it, so a web page on another origin (a browser chat front-end) can call the API directly:
off unless --allowed-origins is given. Outermost, in front of the API key check: a browser's preflight (OPTIONS)
carries no key, and is answered here."""
from __future__ import annotations

import argparse
import json


def _string_list(value: str) -> list[str]:
    """A JSON list (vLLM's form: '["http://localhost:3000"]') or comma-separated values."""
    text = value.strip()
    if text.startswith("["):
        items = json.loads(text)
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise argparse.ArgumentTypeError(f"{value!r} is not a JSON list of strings")
        return items
    return [item.strip() for item in text.split(",") if item.strip()]


def add_cors_args(g) -> None:
    g.add_argument("--allowed-origins", type=_string_list, default=None,
                   help="origins whose pages may call the API from a browser (CORS), as a JSON list or "
                        "comma-separated ('[\"*\"]' for any); unset: no CORS headers, other origins' pages are refused "
                        "by the browser")
    g.add_argument("--allowed-methods", type=_string_list, default=["*"], help="with --allowed-origins (default any)")
    g.add_argument("--allowed-headers", type=_string_list, default=["*"], help="with --allowed-origins (default any)")
    g.add_argument("--allow-credentials", action="store_true", help="with --allowed-origins: allow cookies and auth")


def with_cors(app, ns: argparse.Namespace):
    """`app` behind Starlette's CORS middleware when --allowed-origins is set, else `app` itself."""
    if not ns.allowed_origins:
        return app
    from starlette.middleware.cors import CORSMiddleware

    return CORSMiddleware(app, allow_origins=ns.allowed_origins, allow_methods=ns.allowed_methods,
                          allow_headers=ns.allowed_headers, allow_credentials=ns.allow_credentials)
