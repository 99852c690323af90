"""`pagedllm bench spec`: speculative decoding's speed, with and without drafts, in one sitting.

The workload is code editing, built from the Python standard library's own source (text that ships with every
Python): each prompt shows a function and asks for it with one parameter renamed; the answer repeats the function
with that name changed, so most of it is a span of the prompt, which is what n-gram (prompt lookup) drafts find.

Dummy weights do not copy text, so by default (`--forced`) each request's output is held to its reference answer
by a structured output (a `choice` of that one string): the target model's forward, sampling and draft checks run
as they would for a model that makes the edit, and drafts are kept exactly where such a model would copy its
prompt. `--no-forced` lets the dummy model write what it likes (drafts are then almost never kept: what the
on/off rule is for). Both engines get the same requests and the same constraint; the prompts' K/V is computed
once in a warm-up, so the timed runs measure decoding.

Reported per batch size: ms per output token and output tok/s, with and without --speculative-config (n-gram by
default; a draft model when the config names one), the ratio, the acceptance rate and the steps that checked drafts
or left them unchecked (the on/off rule). Runs alternate between the two engines;
medians of --runs.
"""
from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import json
import random
import statistics
import time
from dataclasses import dataclass

from pagedllm.bench.throughput import make_llm

STDLIB_MODULES = ("textwrap", "shlex", "fnmatch", "difflib", "statistics", "calendar", "heapq", "bisect",
                  "string", "glob", "csv", "argparse", "json.encoder", "json.decoder", "ipaddress", "fractions",
                  "configparser", "gettext", "tokenize", "pprint", "colorsys", "base64", "quopri", "locale")


@dataclass
class EditTask:
    prompt: str
    reference: str  # the function with the parameter renamed


def code_edit_tasks(num: int, seed: int = 0, min_lines: int = 8, max_lines: int = 30) -> list[EditTask]:
    """`num` rename-a-parameter tasks from standard-library functions of min_lines..max_lines lines."""
    candidates = []
    for name in STDLIB_MODULES:
        source = inspect.getsource(importlib.import_module(name))
        lines = source.splitlines()
        for node in ast.walk(ast.parse(source)):
            if not isinstance(node, ast.FunctionDef) or not min_lines <= node.end_lineno - node.lineno + 1 <= max_lines:
                continue
            params = [a.arg for a in node.args.args if len(a.arg) >= 3 and a.arg not in ("self", "cls")]
            if params:
                text = "\n".join(lines[node.lineno - 1:node.end_lineno])
                candidates.append((inspect.cleandoc("\n" + text) if text.startswith(" ") else text, params))
    rng = random.Random(seed)
    rng.shuffle(candidates)
    tasks = []
    for text, params in candidates[:num]:
        old = rng.choice(params)
        new = f"{old}_arg"
        renamed = _rename(text, old, new)
        prompt = (f"Rename the parameter `{old}` to `{new}` in this Python function, and change nothing else.\n\n"
                  f"```python\n{text}\n```\n\nThe function with `{old}` renamed to `{new}`:\n\n```python\n")
        tasks.append(EditTask(prompt, renamed + "\n```"))
    if len(tasks) < num:
        raise ValueError(f"the standard library gave {len(tasks)} functions of {min_lines}-{max_lines} lines, "
                         f"fewer than --num-prompts {num}")
    return tasks


def _rename(text: str, old: str, new: str) -> str:
    """`old` as a whole identifier replaced by `new` (a regex on word boundaries: enough for a benchmark's answer)."""
    import re

    return re.sub(rf"\b{re.escape(old)}\b", new, text)


def _params(task: EditTask, output_len: int, forced: bool):
    from pagedllm import SamplingParams
    from pagedllm.sampling_params import GuidedDecodingParams

    guided = GuidedDecodingParams(choice=[task.reference]) if forced else None
    return SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=not forced, guided_decoding=guided)


def _timed(llm, tasks: list[EditTask], output_len: int, forced: bool, batch_size: int) -> dict:
    """Every task once, `batch_size` at a time: seconds, output tokens, drafts checked and kept."""
    engine = llm.llm_engine
    before = _spec_counts(engine)
    seconds, tokens = 0.0, 0
    for i in range(0, len(tasks), batch_size):
        chunk = tasks[i:i + batch_size]
        start = time.perf_counter()
        outs = llm.generate([t.prompt for t in chunk], [_params(t, output_len, forced) for t in chunk],
                            use_tqdm=False)
        seconds += time.perf_counter() - start
        tokens += sum(len(o.outputs[0].token_ids) for o in outs)
    after = _spec_counts(engine)
    return {"seconds": seconds, "tokens": tokens, **{k: after[k] - before[k] for k in after}}


def _spec_counts(engine) -> dict:
    s = engine.spec_decode_stats
    if s is None:
        return {"draft_tokens": 0, "accepted": 0, "steps_on": 0, "steps_off": 0}
    return {"draft_tokens": s.num_draft_tokens, "accepted": s.num_accepted_tokens, "steps_on": s.steps_on,
            "steps_off": s.steps_off}


def main(argv: list[str] | None = None) -> int:
    from pagedllm.engine.arg_utils import add_engine_args

    parser = argparse.ArgumentParser(prog="pagedllm bench spec", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(parser)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--num-prompts", type=int, default=None,
                        help="tasks per run (default: 4 at batch 1, else the batch size)")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--forced", action=argparse.BooleanOptionalAction, default=True,
                        help="hold each output to its reference edit (structured output), as a model making the "
                             "edit would write it; --no-forced: the model writes freely")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)
    if args.speculative_config is None:
        args.speculative_config = ('{"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_min": 2, '
                                   '"prompt_lookup_max": 5}')
    spec_config = args.speculative_config
    if args.tokenizer is None and args.load_format == "dummy":
        from pagedllm.demo import demo_model_path

        args.tokenizer = str(demo_model_path())  # a built-in shape has no tokenizer: the demo model's
    args.speculative_config = None
    plain = make_llm(args)
    args.speculative_config = spec_config
    spec = make_llm(args)
    engines = {"plain": plain, "spec": spec}
    method = json.loads(spec_config).get("method", "draft_model" if "model" in json.loads(spec_config) else "ngram")
    most = max(args.num_prompts or (4 if b == 1 else b) for b in args.batch_sizes)
    tasks = code_edit_tasks(most)
    for llm in engines.values():  # warm-up: the prompts' K/V into the prefix cache, the constraints compiled
        _timed(llm, tasks, 4, args.forced, max(args.batch_sizes))
    results = []
    for batch in args.batch_sizes:
        chunk = tasks[:args.num_prompts or (4 if batch == 1 else batch)]
        runs = {name: [] for name in engines}
        for run in range(args.runs):
            order = list(engines) if run % 2 == 0 else list(engines)[::-1]
            for name in order:
                runs[name].append(_timed(engines[name], chunk, args.output_len, args.forced, batch))
        row = {"batch_size": batch, "num_prompts": len(chunk), "forced": args.forced, "runs": runs}
        for name, rs in runs.items():
            row[f"{name}_ms_per_token"] = statistics.median(1e3 * r["seconds"] / r["tokens"] * batch for r in rs)
            row[f"{name}_tok_s"] = statistics.median(r["tokens"] / r["seconds"] for r in rs)
        drafts = sum(r["draft_tokens"] for r in runs["spec"])
        row["acceptance"] = sum(r["accepted"] for r in runs["spec"]) / drafts if drafts else 0.0
        row["steps_checking_drafts"] = sum(r["steps_on"] for r in runs["spec"])
        row["steps_without_drafts"] = sum(r["steps_off"] for r in runs["spec"])
        row["speedup"] = row["spec_tok_s"] / row["plain_tok_s"]
        results.append(row)
        print(f"batch {batch:>3} ({len(chunk)} prompts, {'forced' if args.forced else 'free'}): "
              f"plain {row['plain_ms_per_token']:.1f} ms/token ({row['plain_tok_s']:.1f} tok/s), "
              f"{method} {row['spec_ms_per_token']:.1f} ms/token ({row['spec_tok_s']:.1f} tok/s): "
              f"{row['speedup']:.2f}x; acceptance {row['acceptance']:.2f}, steps with drafts "
              f"{row['steps_checking_drafts']} checked / {row['steps_without_drafts']} left unchecked", flush=True)
    for llm in engines.values():
        llm.shutdown()
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"speculative_config": spec_config, "results": results}, f, indent=1)
    return 0
