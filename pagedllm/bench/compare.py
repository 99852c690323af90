"""`pagedllm bench compare --peer vllm`: pagedllm and a peer engine on the same workloads, one after the other in
one sitting, medians and ratios printed.

Offline (always): peer_workload.py under each engine's Python, --runs times, the order alternating (peer first in
odd runs): W (--num-prompts x --input-len random ids in, --output-len out, ignore_eos, temperature 1.0) in output
tok/s, and batch 1 in ms per output token. Serving (--serve): both engines' OpenAI servers up side by side on the
same dummy model, loaded in turn by `bench serve`'s client (random --serve-input-len ids in, --serve-output-len out,
greedy, ignore_eos), --runs loads each at every --concurrency, the order alternating: median TTFT, TPOT, output tok/s.
Both get the same KV cache, whole GiB that hold --concurrency sequences at their longest (vLLM's CPU build otherwise
takes most of the machine's memory, and the second server would find none).

The peer is a vLLM installation given by its Python (--peer-python, e.g. ../shared/peers/vllm-cpu's venv), run with
the settings vLLM's CPU guide asks for (all cores for the model, Intel OpenMP preloaded where the venv has it;
--peer-env adds or overrides). `--peer pagedllm` compares with another pagedllm (another checkout's venv).
Dummy weights of the model's config.json: a folder, or a built-in shape name (pagedllm/model_configs/).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

WORKLOAD = Path(__file__).with_name("peer_workload.py")
SERVED_NAME = "compared-model"


@dataclass
class Engine:
    """One side of the comparison: which engine, the Python that runs it, the environment it runs in."""

    name: str  # "vllm" or "pagedllm"
    label: str  # how the tables name it
    python: str
    env: dict[str, str] = field(default_factory=dict)

    def environ(self) -> dict[str, str]:
        return {**os.environ, **self.env}


def vllm_cpu_env(python: str, cores: int) -> dict[str, str]:
    """What vLLM's CPU install guide asks for: every core bound to the model's OpenMP threads, none reserved for the
    front end (on 2 cores vLLM otherwise computes on one, ~1.9x slower), Intel OpenMP preloaded when installed."""
    env = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    iomp = Path(python).parent.parent / "lib" / "libiomp5.so"
    if iomp.is_file():
        env["LD_PRELOAD"] = ":".join(p for p in (str(iomp), os.environ.get("LD_PRELOAD", "")) if p)
    return env


def model_folder(model: str, scratch: Path) -> Path:
    """A folder holding the model's config.json (what both engines load dummy weights from)."""
    from pagedllm.model_executor.model_files import resolve_model_path

    path = resolve_model_path(model, allow_download=False)
    if path.is_dir():
        return path
    folder = scratch / "model"
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(path, folder / "config.json")
    return folder


def run_offline(engine: Engine, folder: Path, args: argparse.Namespace) -> dict[str, float]:
    """One run of peer_workload.py: {"W_tok_s": ..., "batch1_ms": ...}."""
    cmd = [engine.python, str(WORKLOAD), engine.name, str(folder), str(args.num_prompts), str(args.input_len),
           str(args.output_len), str(args.input_len + args.output_len + 16)]
    done = subprocess.run(cmd, env=engine.environ(), capture_output=True, text=True, timeout=args.timeout)
    parts = {}
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            parts[row["part"]] = row
    if done.returncode != 0 or set(parts) != {"W", "batch1"}:
        raise RuntimeError(f"{engine.label}'s workload failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return {"W_tok_s": parts["W"]["output_tok_s"], "batch1_ms": parts["batch1"]["ms_per_token"]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serving_kv_gib(folder: Path, args: argparse.Namespace) -> int:
    """Whole GiB of bf16 KV cache that hold every served sequence at its longest (both servers get this much: up
    side by side, neither may take the machine's memory for itself, as vLLM's CPU build does by default)."""
    import torch

    from pagedllm.memory.model_size import kv_bytes_per_token
    from pagedllm.model_executor.model_files import load_hf_config

    per_token = kv_bytes_per_token(load_hf_config(folder), torch.bfloat16)
    tokens = max(args.concurrency) * (args.serve_input_len + args.serve_output_len + 16)
    return max(1, -(-per_token * tokens * 5 // (4 * 2**30)))  # rounded up, with a quarter more for block rounding


def server_command(engine: Engine, folder: Path, port: int, args: argparse.Namespace, kv_gib: int) -> list[str]:
    common = ["--load-format", "dummy", "--dtype", "bfloat16", "--port", str(port), "--host", "127.0.0.1",
              "--max-model-len", str(args.serve_input_len + args.serve_output_len + 16),
              "--max-num-seqs", str(max(args.concurrency)), "--served-model-name", SERVED_NAME]
    if engine.name == "vllm":  # (the `vllm` script looks up a distribution named vllm; the CPU build's is vllm-cpu)
        return [engine.python, "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", str(folder),
                "--skip-tokenizer-init", *common]  # (its KV cache: VLLM_CPU_KVCACHE_SPACE, in Server)
    return [engine.python, "-m", "pagedllm", "serve", str(folder), "--kv-cache-memory", f"{kv_gib}GiB", *common]


def wait_until_serving(proc: subprocess.Popen, base: str, timeout: float, log: Path) -> None:
    """Poll the server's /v1/models until it answers (or the process exits, or `timeout` passes)."""
    import logging

    import httpx

    logging.getLogger("httpx").setLevel(logging.WARNING)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before serving:\n"
                               f"{log.read_text()[-3000:]}")
        try:
            if httpx.get(base + "/v1/models", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)  # (polling a process we do not control; nothing waits on this for correctness)
    raise RuntimeError(f"the server did not answer within {timeout:.0f} s:\n{log.read_text()[-3000:]}")


class Server:
    """One engine's OpenAI server on a free port, its output in a log file."""

    def __init__(self, engine: Engine, folder: Path, args: argparse.Namespace, scratch: Path, kv_gib: int) -> None:
        self.engine, self.port = engine, free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = scratch / f"{engine.label}-server.log"
        env = engine.environ()
        if engine.name == "vllm":
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_gib))
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(server_command(engine, folder, self.port, args, kv_gib), env=env,
                                         stdout=out, stderr=subprocess.STDOUT)

    def load(self, prompts: list, concurrency: int) -> dict:
        """One load at `concurrency`: bench serve's metrics; a failed request is an error."""
        from pagedllm.bench.serve import compute_metrics, run_load

        records, duration = asyncio.run(run_load(self.base, "/v1/completions", SERVED_NAME, prompts, concurrency,
                                                 float("inf"), True, 0, show_progress=False))
        failed = [r.error for r in records if not r.ok]
        if failed:
            raise RuntimeError(f"{self.engine.label}: {len(failed)} requests failed: {failed[0]}")
        return compute_metrics(records, duration)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


SERVING_KEYS = {"output_tok_s": "output_throughput", "median_ttft_ms": "median_ttft_ms",
                "median_tpot_ms": "median_tpot_ms", "p99_tpot_ms": "p99_tpot_ms"}


def run_serving(engines: tuple[Engine, Engine], folder: Path, vocab: int, args: argparse.Namespace,
                scratch: Path) -> dict[str, list[dict]]:
    """Both servers up side by side (one warm-up request each); then at each concurrency --runs loads on each, the
    order alternating, so the machine's drift falls on both alike. Per engine and concurrency: every run's metrics
    and their medians."""
    from pagedllm.bench.serve import random_prompts

    servers = []
    kv_gib = serving_kv_gib(folder, args)
    try:
        for engine in engines:  # one at a time: each plans its memory with the other already up
            server = Server(engine, folder, args, scratch, kv_gib)
            servers.append(server)
            wait_until_serving(server.proc, server.base, args.timeout, server.log)
            server.load(random_prompts(1, args.serve_input_len, args.serve_output_len, 0.0, vocab, seed=999), 1)
        results: dict[str, list[dict]] = {e.label: [] for e in engines}
        for c in args.concurrency:
            num = max(args.min_prompts, args.prompts_per_slot * c)
            runs: dict[str, list[dict]] = {e.label: [] for e in engines}
            for i in range(args.runs):
                prompts = random_prompts(num, args.serve_input_len, args.serve_output_len, 0.0, vocab,
                                         seed=1000 * c + i)  # (the same prompts for both engines in a run)
                for server in (servers if i % 2 == 0 else servers[::-1]):
                    m = server.load(prompts, c)
                    runs[server.engine.label].append({k: m[v] for k, v in SERVING_KEYS.items()})
            for label, rows in runs.items():
                results[label].append({"concurrency": c, "num_prompts": num, "runs": rows,
                                       **{k: statistics.median(r[k] for r in rows) for k in SERVING_KEYS}})
        return results
    finally:
        for server in servers:
            server.stop()


def offline_table(runs: dict[str, list[dict]], ours: Engine, peer: Engine) -> tuple[str, dict]:
    """Medians of each engine's runs and the ratios (pagedllm / peer: above 1 is pagedllm ahead)."""
    med = {label: {k: statistics.median(r[k] for r in rows) for k in ("W_tok_s", "batch1_ms")}
           for label, rows in runs.items()}
    ratios = {"W": med[ours.label]["W_tok_s"] / med[peer.label]["W_tok_s"],
              "batch1_speed": med[peer.label]["batch1_ms"] / med[ours.label]["batch1_ms"]}
    lines = [f"{'':<28}{peer.label:>22}{ours.label:>22}{'pagedllm / peer':>18}",
             f"{'W output tok/s (median)':<28}{med[peer.label]['W_tok_s']:>22.1f}{med[ours.label]['W_tok_s']:>22.1f}"
             f"{ratios['W']:>17.2f}x",
             f"{'batch 1 ms/token (median)':<28}{med[peer.label]['batch1_ms']:>22.2f}"
             f"{med[ours.label]['batch1_ms']:>22.2f}{ratios['batch1_speed']:>17.2f}x",
             "runs: " + "; ".join(f"{label} W {_joined(rows, 'W_tok_s', 1)} tok/s, batch 1 "
                                  f"{_joined(rows, 'batch1_ms', 2)} ms" for label, rows in runs.items())]
    return "\n".join(lines), {"medians": med, "ratios": ratios}


def _joined(rows: list[dict], key: str, digits: int) -> str:
    return ", ".join(f"{r[key]:.{digits}f}" for r in rows)


def serving_table(serving: dict[str, list[dict]], ours: Engine, peer: Engine) -> str:
    lines = [f"{'concurrency':>11}{'':>3}{'output tok/s':>40}{'median TTFT ms':>40}{'median TPOT ms':>40}",
             f"{'':>14}" + f"{peer.label:>16}{ours.label:>16}{'ratio':>8}" * 3]
    for p_row, o_row in zip(serving[peer.label], serving[ours.label]):
        cells = []
        for key, higher_better in (("output_tok_s", True), ("median_ttft_ms", False), ("median_tpot_ms", False)):
            a, b = p_row[key], o_row[key]
            ratio = (b / a if higher_better else a / b) if a and b else float("nan")
            cells.append(f"{a:>16.1f}{b:>16.1f}{ratio:>7.2f}x")
        lines.append(f"{p_row['concurrency']:>11}{'':>3}" + "".join(cells))
    lines.append("ratios: pagedllm / peer for tok/s, peer / pagedllm for times (above 1: pagedllm ahead)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pagedllm bench compare", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-0.5b", help="a folder with config.json, or a built-in shape name")
    p.add_argument("--peer", choices=["vllm", "pagedllm"], default="vllm")
    p.add_argument("--peer-python", required=True, help="the Python of the peer's installation (its venv's)")
    p.add_argument("--peer-env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment for the peer's processes, beside (or over) vLLM's CPU settings")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--serve", action="store_true", help="also compare the OpenAI servers under load")
    p.add_argument("--no-offline", action="store_true", help="only the servers (with --serve)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--serve-input-len", type=int, default=256)
    p.add_argument("--serve-output-len", type=int, default=128)
    p.add_argument("--prompts-per-slot", type=int, default=4, help="requests per concurrency slot in each load")
    p.add_argument("--min-prompts", type=int, default=8)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds for one workload run or server start")
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    for name in ("runs", "num_prompts", "input_len", "output_len", "serve_input_len", "serve_output_len",
                 "prompts_per_slot", "min_prompts"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if min(args.concurrency) < 1:
        p.error("--concurrency values must be >= 1")
    if args.no_offline and not args.serve:
        p.error("--no-offline leaves nothing to run without --serve")
    if not Path(args.peer_python).is_file():
        p.error(f"--peer-python {args.peer_python}: no such file")
    extra = {}
    for item in args.peer_env:
        key, sep, value = item.partition("=")
        if not sep:
            p.error(f"--peer-env {item!r}: use KEY=VALUE")
        extra[key] = value

    cores = len(os.sched_getaffinity(0))
    peer_env = vllm_cpu_env(args.peer_python, cores) if args.peer == "vllm" else {}
    peer = Engine(args.peer, "vllm" if args.peer == "vllm" else "peer-pagedllm", args.peer_python,
                  {**peer_env, **extra})
    ours = Engine("pagedllm", "pagedllm", sys.executable)
    report: dict = {"model": args.model, "cores": cores, "peer_python": args.peer_python, "peer_env": peer.env}
    with tempfile.TemporaryDirectory(prefix="pagedllm-compare-") as tmp:
        scratch = Path(tmp)
        folder = model_folder(args.model, scratch)
        vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
        print(f"{args.model}: dummy bf16 weights, {cores} cores; peer {args.peer} at {args.peer_python}", flush=True)
        if not args.no_offline:
            runs: dict[str, list[dict]] = {peer.label: [], ours.label: []}
            for i in range(args.runs):
                for engine in ((peer, ours) if i % 2 == 0 else (ours, peer)):
                    result = run_offline(engine, folder, args)
                    runs[engine.label].append(result)
                    print(f"run {i + 1} {engine.label}: W {result['W_tok_s']:.1f} tok/s, batch 1 "
                          f"{result['batch1_ms']:.2f} ms/token", flush=True)
            text, summary = offline_table(runs, ours, peer)
            print(f"\nW: {args.num_prompts} x {args.input_len} in / {args.output_len} out; batch 1: 1 x "
                  f"{args.input_len} in / {args.output_len} out\n{text}")
            report["offline"] = {"runs": runs, **summary}
        if args.serve:
            serving = run_serving((peer, ours), folder, vocab, args, scratch)
            print(f"\nserving: random {args.serve_input_len} in / {args.serve_output_len} out, greedy, ignore_eos; "
                  f"medians of {args.runs} loads each\n{serving_table(serving, ours, peer)}")
            report["serving"] = serving
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=2))
    return 0
