"""`pagedllm plan` as a user runs it: text and --json output, exit codes, one-line errors.

The seed's scenario (text, and each fix re-planned with --json) and one bad input run as real
subprocesses, started together (each costs seconds of imports); the other cases call the same
`main()` in-process, which is where the exit code and the stderr line come from.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.entrypoints.cli import main
from pagedllm.entrypoints.plan import dry_run_plan
from pagedllm.memory.plan import GiB, KiB

ALLOWED_FLAGS = {"--max-model-len", "--gpu-memory-utilization", "--dtype", "--max-num-batched-tokens",
                 "--kv-cache-memory", "--num-gpu-blocks-override", "--kv-cache-dtype",
                 "--quantization", "--cpu-offload-gb"}
SEED = ["plan", "llama-3.2-3b", "--device", "cuda", "--device-memory", "119.7GiB", "--device-memory-used", "90GiB",
        "--unified-memory", "--gpu-memory-utilization", "0.8", "--max-model-len", "2048"]
JSON_KEYS = ("fits", "device_total_bytes", "device_used_bytes", "budget_bytes", "weights_bytes",
             "activation_peak_bytes", "overhead_bytes", "kv_cache_bytes", "kv_bytes_per_token", "block_size",
             "num_blocks", "max_model_len", "max_model_len_fit", "max_concurrency", "cause", "fixes")


def seed_plan():
    # The CLI plans a server: its grammar-compile worker (10 s, 2 GiB by default) is part of unified memory.
    return dry_run_plan(EngineArgs(model="llama-3.2-3b", gpu_memory_utilization=0.8, max_model_len=2048,
                                   structured_outputs_compile_timeout=10.0),
                        device="cuda", device_memory="119.7GiB", device_memory_used="90GiB", unified=True)


@pytest.fixture(scope="module")
def cli_runs():
    """Start every subprocess case at once; name -> CompletedProcess-like (returncode, stdout, stderr)."""
    cases = {
        "text": SEED,
        "bad_size": ["plan", "llama-3.2-3b", "--device-memory", "lots"],
    }
    fixes = seed_plan().fixes()
    for fix in fixes:
        cases[f"fix {fix.flag}"] = SEED + [fix.flag, fix.value, "--json"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    procs = {name: subprocess.Popen([sys.executable, "-m", "pagedllm", *args], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, env=env) for name, args in cases.items()}
    results = {}
    for name, p in procs.items():
        out, err = p.communicate(timeout=300)
        results[name] = subprocess.CompletedProcess(p.args, p.returncode, out, err)
    results["_fixes"] = fixes
    return results


def run_main(capsys, *argv: str):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_error_line(err: str, *fragments: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ") and "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


# -- the seed's scenario ---------------------------------------------------------------------------
def test_seed_scenario_text(cli_runs):
    res = cli_runs["text"]
    assert res.returncode == 1, res.stderr
    assert "Traceback" not in res.stderr
    lines = res.stdout.splitlines()
    assert lines[0] == "memory plan for llama-3.2-3b: does NOT fit"
    out = res.stdout
    assert "unified memory total" in out and "119.70 GiB" in out
    assert "used by other processes and the OS" in out and "90.00 GiB" in out
    assert "model weights (bfloat16)" in out and "5.98 GiB" in out
    assert "KV cache per token" in out and "112.0 KiB" in out
    assert "one sequence of max_model_len 2048" in out and "224.0 MiB" in out
    cause = next(line for line in lines if line.strip().startswith("cause:"))
    assert "other processes and the OS already use 90.00 GiB" in cause
    fixes = cli_runs["_fixes"]
    assert fixes and "fixes (each alone makes the plan fit):" in out
    for fix in fixes:
        assert f"    {fix.flag} {fix.value}: {fix.effect}" in lines


def test_seed_scenario_json(cli_runs, capsys):
    code, out, err = run_main(capsys, *SEED, "--json")
    assert code == 1, err
    data = json.loads(out)
    for key in JSON_KEYS:
        assert key in data, key
    assert data == json.loads(json.dumps(seed_plan().to_json()))  # the CLI is the dry run, verbatim
    assert data["fits"] is False and data["unified_memory"] is True and data["dtype"] == "bfloat16"
    assert data["device_total_bytes"] == int(119.7 * GiB) and data["device_used_bytes"] == 90 * GiB
    assert data["budget_bytes"] == int(int(119.7 * GiB) * 0.8)
    assert data["kv_bytes_per_token"] == 2 * 28 * 8 * 128 * 2 == 112 * KiB
    assert data["num_blocks"] == 0 and data["kv_cache_bytes"] == 0 and data["max_model_len"] == 2048
    assert "90.00 GiB" in data["cause"] and "other processes" in data["cause"]
    assert data["fixes"] and all(set(f) == {"flag", "value", "effect"} for f in data["fixes"])
    assert {f["flag"] for f in data["fixes"]} <= ALLOWED_FLAGS
    assert [(f["flag"], f["value"]) for f in data["fixes"]] == [(f.flag, f.value) for f in cli_runs["_fixes"]]


def test_seed_scenario_each_fix_fits_through_the_cli(cli_runs):
    fixes = cli_runs["_fixes"]
    assert fixes
    for fix in fixes:
        res = cli_runs[f"fix {fix.flag}"]
        assert res.returncode == 0, (fix, res.stdout, res.stderr)
        data = json.loads(res.stdout)
        assert data["fits"] is True and data["cause"] is None and data["fixes"] == []
        assert data["num_blocks"] > 0 and data["max_concurrency"] >= 1.0
        assert fix.effect.startswith("KV cache ") and f"= {data['num_blocks'] * 16} tokens" in fix.effect


# -- bad inputs: exit 2, one line on stderr ---------------------------------------------------------
def test_unparsable_device_memory_in_a_real_process(cli_runs):
    res = cli_runs["bad_size"]
    assert res.returncode == 2 and res.stdout == ""
    assert_one_error_line(res.stderr, "'lots'", "memory size")


def test_invalid_config_json_in_a_folder(capsys, tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    code, out, err = run_main(capsys, "plan", str(tmp_path), "--device-memory", "10GiB")
    assert code == 2 and out == ""
    assert_one_error_line(err, "config.json", "not a valid JSON")


@pytest.mark.parametrize("model, says", [
    ("/no/such/model/folder", "no such file or folder"),  # a path: never looked up on the hub
    ("no-such-org/no-such-model", "HF_HUB_OFFLINE"),  # a hub id: not in the local cache, downloading off
])
def test_missing_model_offline(capsys, monkeypatch, tmp_path, model, says):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    code, out, err = run_main(capsys, "plan", model, "--device-memory", "10GiB")
    assert code == 2 and out == ""
    assert_one_error_line(err, model, says, "llama-3.1-8b")


@pytest.mark.parametrize("util", ["-0.5", "1.5", "0"])
def test_bad_gpu_memory_utilization(capsys, util):
    code, out, err = run_main(capsys, "plan", "llama-3.2-3b", "--device-memory", "10GiB",
                              "--gpu-memory-utilization", util)
    assert code == 2 and out == ""
    assert_one_error_line(err, "gpu_memory_utilization must be in (0, 1]", f"got {float(util)}")


def test_unparsable_device_memory(capsys):
    code, out, err = run_main(capsys, "plan", "llama-3.2-3b", "--device-memory", "lots")
    assert code == 2 and out == ""
    assert_one_error_line(err, "'lots'", "memory size")


def test_max_model_len_above_the_model_limit(capsys):
    code, out, err = run_main(capsys, "plan", "llama-3.2-3b", "--device-memory", "80GiB", "--max-model-len", "200000")
    assert code == 2 and out == ""
    assert_one_error_line(err, "max_model_len=200000", "131072")


def test_device_memory_used_above_total(capsys):
    code, out, err = run_main(capsys, "plan", "llama-3.2-3b", "--device-memory", "10GiB",
                              "--device-memory-used", "11GiB")
    assert code == 2 and out == ""
    assert_one_error_line(err, "--device-memory-used")


# -- plans that fit --------------------------------------------------------------------------------------
def test_a_plan_that_fits_exits_0(capsys):
    code, out, err = run_main(capsys, "plan", "llama-3.2-3b", "--device", "cuda", "--device-memory", "24GiB",
                              "--max-model-len", "8192")
    assert code == 0, err
    assert out.splitlines()[0] == "memory plan for llama-3.2-3b: fits"
    assert "cause:" not in out and "fixes" not in out


def test_auto_max_model_len_json(capsys):
    code, out, err = run_main(capsys, "plan", "llama-3.2-3b", "--device", "cuda", "--device-memory", "12GiB",
                              "--max-model-len", "auto", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["fits"] is True
    assert data["max_model_len"] == data["max_model_len_fit"]
    assert 0 < data["max_model_len"] < 131072 and data["max_model_len"] % data["block_size"] == 0
    assert data["max_model_len"] == data["num_blocks"] * data["block_size"]
    code, out, _ = run_main(capsys, "plan", "llama-3.2-3b", "--device", "cuda", "--device-memory", "12GiB",
                            "--max-model-len", str(data["max_model_len"] + 16), "--json")
    assert code == 1 and json.loads(out)["fits"] is False
    code, out, _ = run_main(capsys, "plan", "llama-3.2-3b", "--device", "cuda", "--device-memory", "1000GiB",
                            "--max-model-len", "auto", "--json")
    assert code == 0 and json.loads(out)["max_model_len"] == json.loads(out)["max_model_len_fit"] == 131072


def test_a_windowed_model_counts_its_window_groups(capsys):
    """gpt-oss-20b: its 12 windowed layers hold a 128-token window (9 blocks of 16 at most), so about twice the
    sequences of a full-attention count fit; the text names the groups and both counts."""
    argv = ["plan", "gpt-oss-20b", "--device", "cuda", "--device-memory", "80GiB", "--max-model-len", "32768"]
    code, out, err = run_main(capsys, *argv, "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["kv_groups"] == "2 groups of 12 layers: 12 full-attention, 12 with a 128-token window"
    per_sequence = 32768 // 16 + 9  # the full group's blocks and the window's
    assert data["max_concurrency"] == pytest.approx((data["num_blocks"] - 1) / per_sequence, abs=1e-3)
    assert data["max_concurrency_full_attention"] == pytest.approx(data["num_blocks"] * 16 / 2 / 32768, abs=1e-3)
    code, out, _ = run_main(capsys, *argv)
    assert f"not {2 * 32768 // 16}" in out and "KV groups" in out


def test_plan_of_a_model_folder_reads_its_safetensors_headers(capsys, tiny_models):
    import torch

    from pagedllm.memory.model_size import weight_bytes_from_headers
    from pagedllm.model_executor.model_files import weight_files

    path = tiny_models["qwen2"]
    code, out, err = run_main(capsys, "plan", str(path), "--device", "cpu", "--device-memory", "4GiB",
                              "--dtype", "float32", "--max-model-len", "64", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["sources"]["weights"] == "safetensors headers"
    assert data["weights_bytes"] == weight_bytes_from_headers(weight_files(path), torch.float32, True)
    assert data["kv_bytes_per_token"] == 2 * 2 * 1 * 16 * 4  # 2 layers, 1 kv head, head_dim 16, float32


def test_plan_measures_this_machine_when_no_memory_is_given(tiny_models, capsys):
    from pagedllm.entrypoints.cli import main

    code = main(["plan", str(tiny_models["llama"]), "--device", "cpu", "--max-model-len", "128", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["fits"] is True
    assert out["sources"]["device"] == "measured" and out["device"] == "cpu"
    assert out["device_total_bytes"] > 1 << 30 and out["device_used_bytes"] >= 0


def test_speculative_decoding_has_its_own_line_and_a_fix_that_turns_it_off(capsys):
    """n-gram drafts add logits rows (one per checked draft, up to the step's token budget); no draft weights or
    draft KV cache. A plan they push over the edge names the fix that turns speculation off."""
    args = ["plan", "qwen2.5-0.5b", "--device", "cuda", "--device-memory", "5GiB", "--max-model-len", "32768"]
    spec = ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}']
    code, out, err = run_main(capsys, *args, "--json")
    assert code == 0, err
    base = json.loads(out)
    code, out, _ = run_main(capsys, *args, *spec, "--json")
    data = json.loads(out)
    assert code == 1 and data["fits"] is False
    vocab, rows = 151936, 256 * 4  # 256 sequences x 4 drafts, within the 2048-token budget
    assert data["spec_decode_bytes"] == rows * vocab * (2 + 8)
    assert base["spec_decode_bytes"] == 0
    assert [f for f in data["fixes"] if f["flag"] == "without --speculative-config"]
    code, out, _ = run_main(capsys, *args, *spec)
    assert "speculative decoding (ngram, 4 drafts): 1024 more logits rows" in out
    assert "without --speculative-config: " in out and "decoding runs one token per step" in out
    code, out, _ = run_main(capsys, *args, *spec[:1], '{"method": "ngram", "num_speculative_tokens": 4, '
                            '"disable_by_batch_size": 8}', "--json")
    assert code == 0 and json.loads(out)["spec_decode_bytes"] == 8 * 4 * vocab * (2 + 8)


def test_a_draft_model_adds_its_weights_and_its_kv_per_token(capsys):
    """Qwen2.5-0.5B drafting for Qwen2.5-7B (a vocabulary padded to 151,936 rows against 152,064: one tokenizer):
    the draft's weights from its shapes, and its K/V per token beside the target's in every block."""
    args = ["plan", "qwen2.5-7b", "--device", "cuda", "--device-memory", "40GiB", "--max-model-len", "8192", "--json"]
    code, out, err = run_main(capsys, *args)
    assert code == 0, err
    base = json.loads(out)
    spec = '{"method": "draft_model", "model": "qwen2.5-0.5b", "num_speculative_tokens": 4}'
    code, out, err = run_main(capsys, *args, "--speculative-config", spec)
    assert code == 0, err
    data = json.loads(out)
    half_b = json.loads(run_main(capsys, "plan", "qwen2.5-0.5b", "--device", "cuda", "--device-memory", "40GiB",
                                 "--json")[1])
    assert data["draft_weight_bytes"] == half_b["weights_bytes"]
    assert data["draft_kv_bytes_per_token"] == half_b["kv_bytes_per_token"] == 24 * 2 * 2 * 64 * 2
    assert data["kv_bytes_per_token"] == base["kv_bytes_per_token"] + data["draft_kv_bytes_per_token"]
    code, out, _ = run_main(capsys, *args[:-1], "--speculative-config", spec)
    assert "draft model weights (qwen2.5-0.5b)" in out and "draft KV cache per token" in out
