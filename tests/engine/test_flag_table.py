"""One flag table (issue 36): every EngineArgs field is a flag of every command that runs an engine, with the
field's default; every flag in an engine group is a field; choices are the registries' own."""
from __future__ import annotations

import argparse
from dataclasses import MISSING, fields

import pytest
import torch

from pagedllm.config import DTYPES, KV_CACHE_DTYPES, QUANTIZATION_METHODS, resolve_dtype
from pagedllm.engine.arg_utils import SERVER_ONLY, EngineArgs, add_engine_args, engine_args_from, engine_flags
from pagedllm.entrypoints.cli import build_parser
from pagedllm.model_executor.attention import ATTENTION_BACKENDS


def subparser(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def bench_parser(kind: str) -> argparse.ArgumentParser:
    import importlib

    return importlib.import_module(f"pagedllm.bench.{kind}").build_parser()


def api_server_parser() -> argparse.ArgumentParser:
    from pagedllm.entrypoints.openai.api_server import build_parser as server_parser

    return server_parser()


SERVING = {"serve": lambda: subparser("serve"), "plan": lambda: subparser("plan"), "api_server": api_server_parser}
OFFLINE = {"generate": lambda: subparser("generate"), "bench throughput": lambda: bench_parser("throughput"),
           "bench sweep": lambda: bench_parser("sweep"), "bench audio": lambda: bench_parser("audio")}
TABLE_GROUPS = {how.group for _, _, how in engine_flags(server=True)}


def actions_by_dest(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions}


@pytest.mark.parametrize("command", [*SERVING, *OFFLINE])
def test_every_field_is_a_flag_with_the_fields_default(command):
    parser = {**SERVING, **OFFLINE}[command]()
    actions = actions_by_dest(parser)
    for f in fields(EngineArgs):
        if f.metadata["flag"].group == SERVER_ONLY and command in OFFLINE:
            assert f.name not in actions, f"{command} serves nothing, yet has --{f.name}"
            continue
        assert f.name in actions, f"{command} has no flag for EngineArgs.{f.name}"
        default = None if f.default is MISSING else f.default
        assert actions[f.name].default == default, (command, f.name)


@pytest.mark.parametrize("command", [*SERVING, *OFFLINE])
def test_every_flag_in_an_engine_group_is_a_field(command):
    parser = {**SERVING, **OFFLINE}[command]()
    names = EngineArgs.field_names()
    for group in parser._action_groups:
        if group.title in TABLE_GROUPS:
            strays = [a.option_strings for a in group._group_actions if a.dest not in names]
            assert strays == [], f"{command}: flags in group {group.title!r} that no EngineArgs field holds"


def test_parsed_defaults_make_the_same_engine_args_as_llm_defaults():
    """A command line with no engine flag means EngineArgs() (the serve-only defaults left to the server)."""
    assert engine_args_from(subparser("generate").parse_args(["x"])) == EngineArgs()
    served = engine_args_from(subparser("serve").parse_args([]), server=True)
    assert served.structured_outputs_compile_timeout == 10.0
    assert EngineArgs().structured_outputs_compile_timeout is None  # offline: compiled in the caller's process


def test_choices_come_from_the_registries():
    actions = actions_by_dest(subparser("serve"))
    assert actions["attention_backend"].choices == list(ATTENTION_BACKENDS)
    assert actions["kv_cache_dtype"].choices == list(KV_CACHE_DTYPES)
    assert actions["quantization"].choices == list(QUANTIZATION_METHODS)
    assert actions["dtype"].choices == ["auto", *DTYPES]
    assert {"-tp", "--tensor-parallel-size"} <= set(actions["tensor_parallel_size"].option_strings)


@pytest.mark.parametrize("spelling", ["bf16", "bfloat16"])
def test_dtype_spellings_are_the_same_for_llm_and_the_command_line(spelling):
    ns = subparser("generate").parse_args(["x", "--dtype", spelling])
    assert resolve_dtype(engine_args_from(ns).dtype, None, "cpu") == torch.bfloat16
    assert resolve_dtype(spelling, None, "cpu") == torch.bfloat16  # what LLM(dtype=...) goes through


def test_a_bad_choice_is_refused_with_the_choices(capsys):
    with pytest.raises(SystemExit):
        subparser("generate").parse_args(["x", "--dtype", "bf17"])
    assert "bf16" in capsys.readouterr().err


def test_a_field_added_to_the_table_is_a_flag_everywhere(monkeypatch):
    """Adding a flag is one edit: a new field in the table is a flag of a parser made from it."""
    import dataclasses

    from pagedllm.engine import arg_utils

    Extended = dataclasses.make_dataclass(
        "Extended", [("speculative_tokens", int, arg_utils.flag(0, "draft tokens per step"))], bases=(EngineArgs,))
    monkeypatch.setattr(arg_utils, "EngineArgs", Extended)
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert parser.parse_args(["--speculative-tokens", "3"]).speculative_tokens == 3


def test_the_flag_reference_is_what_the_parsers_say():
    """docs/flags.md is generated (python -m pagedllm.entrypoints.flags_doc > docs/flags.md): regenerate it
    when a flag changes."""
    from pathlib import Path

    from pagedllm.entrypoints.flags_doc import flags_markdown

    doc = Path(__file__).resolve().parents[2] / "docs" / "flags.md"
    assert doc.read_text() == flags_markdown()
