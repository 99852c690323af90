"""`pagedllm bench spec` as a user runs it (a subprocess): the code-edit prompts from the standard library, both
engines, the JSON it writes."""
from __future__ import annotations

import json

from pagedllm.bench.spec import code_edit_tasks
from tests.test_cli import run_cli


def test_the_code_edit_prompts_repeat_their_function_with_one_name_changed():
    tasks = code_edit_tasks(8)
    assert len({t.prompt for t in tasks}) == 8
    for t in tasks:
        old, new = t.prompt.split("`")[1], t.prompt.split("`")[3]
        assert new == f"{old}_arg" and new in t.reference and old in t.prompt.split("```python")[1]
        body = t.prompt.split("```python\n")[1].split("\n```")[0]
        assert t.reference.replace(new, old).rstrip("`\n") == body


def test_bench_spec_runs_both_engines_and_writes_json(tmp_path):
    from pagedllm.demo import demo_model_path

    out = tmp_path / "spec.json"
    res = run_cli("bench", "spec", "--model", str(demo_model_path()), "--batch-sizes", "1", "2", "--num-prompts", "2",
                  "--runs", "1", "--output-len", "6", "--max-num-seqs", "2", "--max-model-len", "1024",
                  "--max-num-batched-tokens", "512", "--output-json", str(out))
    assert res.returncode == 0, res.stderr[-3000:]
    data = json.loads(out.read_text())
    assert json.loads(data["speculative_config"])["method"] == "ngram"
    assert [r["batch_size"] for r in data["results"]] == [1, 2]
    for row in data["results"]:
        assert row["forced"] and row["plain_tok_s"] > 0 and row["spec_tok_s"] > 0
        assert sum(r["tokens"] for r in row["runs"]["plain"]) == sum(r["tokens"] for r in row["runs"]["spec"]) == 12
    assert "batch   1 (2 prompts, forced)" in res.stdout
