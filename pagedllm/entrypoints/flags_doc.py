"""docs/flags.md, written from the parsers themselves (the engine's from the flag table in engine/arg_utils.py):
`python -m pagedllm.entrypoints.flags_doc > docs/flags.md`. A test checks the file is what this prints."""
from __future__ import annotations

import argparse

HEADER = """# Command-line flags

Generated from the parsers (`python -m pagedllm.entrypoints.flags_doc > docs/flags.md`); the engine's flags
come from one table, `EngineArgs` in `pagedllm/engine/arg_utils.py`, whose fields are also `LLM(...)`'s
keyword arguments (`--max-model-len 4096` is `LLM(..., max_model_len=4096)`).
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _row(action: argparse.Action) -> str:
    names = ", ".join(f"`{name}`" for name in action.option_strings) or f"`{action.metavar or action.dest}`"
    default = "" if action.default in (None, argparse.SUPPRESS) or action.nargs == 0 else f"`{action.default}`"
    if isinstance(action, argparse.BooleanOptionalAction):
        default = "" if action.default is None else ("on" if action.default else "off")
    choices = ", ".join(str(c) for c in action.choices) if action.choices else ""
    help_text = "" if action.help in (None, argparse.SUPPRESS) else action.help
    return f"| {names} | {_cell(default)} | {_cell(choices)} | {_cell(help_text)} |"


def command_markdown(title: str, what: str, parser: argparse.ArgumentParser) -> str:
    out = [f"## `{title}`", "", what[:1].upper() + what[1:] + ".", ""]
    for group in parser._action_groups:
        actions = [a for a in group._group_actions
                   if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)) and a.help != argparse.SUPPRESS]
        if not actions:
            continue
        out += [f"### {group.title}", "", "| flag | default | choices | what it does |", "|---|---|---|---|"]
        out += [_row(a) for a in actions] + [""]
    return "\n".join(out)


def flags_markdown() -> str:
    from pagedllm.entrypoints.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    what = {a.dest: a.help for a in sub._choices_actions}
    sections = [HEADER] + [command_markdown(f"pagedllm {name}", what[name], sub.choices[name])
                           for name in ("serve", "generate", "plan")]
    return "\n".join(sections).rstrip() + "\n"


if __name__ == "__main__":
    print(flags_markdown(), end="")
