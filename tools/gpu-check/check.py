"""GPU check of pagedllm: one part per call, results as JSON lines on stdout and in $OUT.

Parts: env, parity, seed, planacc, throughput, latency, profile, audio, serve; (issue 21, memory truth)
memprobe, offload_parity, planacc2, seed2; (issue 22, attention backends) parity_triton, attnbench, tput;
(issue 23, CUDA graphs) graphs, host; (issue 26) speechload. Run from the project's root (pagedllm importable).
GPUCHECK_SMOKE=1 runs every part on CPU with tiny sizes, to test this script without a GPU.

This is ../shared/gpu-check/check.py with the issue-21 and issue-22 parts added (at the end). To use it: run
the shared prepare.sh, copy this file over .gpu/check.py, and add pytest's wheels (parity_triton imports the
test suite's constants): `pip download --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64
-d .gpu/whl pytest`. GPUCHECK_ATTN=triton,torch runs the latency and throughput parts once per attention
backend, in one process; GPUCHECK_GRAPHS=on,off once with CUDA graphs and once with --enforce-eager (default:
on); GPUCHECK_NO_HF=1 skips latency's transformers runs; GPUCHECK_N sets throughput's prompt count.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time

import torch

SMOKE = os.environ.get("GPUCHECK_SMOKE") == "1"
DEV = "cpu" if SMOKE else "cuda"
OUT = os.environ.get("OUT", "/tmp/gpucheck-out")
os.makedirs(OUT, exist_ok=True)


def emit(part: str, **kw) -> None:
    row = {"part": part, **kw}
    line = json.dumps(row, default=str)
    print(line, flush=True)
    with open(os.path.join(OUT, "results.jsonl"), "a") as f:
        f.write(line + "\n")


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def part_env() -> None:
    import transformers

    info = {"torch": torch.__version__, "transformers": transformers.__version__, "cuda": torch.cuda.is_available()}
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        p = torch.cuda.get_device_properties(0)
        info |= {"gpu": p.name, "total_gib": total / 2**30, "free_gib": free / 2**30,
                 "integrated": getattr(p, "is_integrated", None)}
        # read bandwidth: sum of a 4 GiB bf16 tensor (reads it once)
        x = torch.empty(2 * 2**30, dtype=torch.bfloat16, device="cuda").normal_()
        for _ in range(3):
            x.sum()
        sync()
        t = time.perf_counter()
        for _ in range(10):
            x.sum()
        sync()
        info["read_bw_GBps"] = 10 * x.numel() * 2 / (time.perf_counter() - t) / 1e9
        del x
        torch.cuda.empty_cache()
    emit("env", **info)


def tiny_model(path: str, arch: str = "llama") -> None:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
                  eos_token_id=None, bos_token_id=None, pad_token_id=None)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=False, **common))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(tie_word_embeddings=True, **common))
    model.save_pretrained(path)


def part_parity() -> None:
    """Greedy tokens on the device: pagedllm (several regimes) against transformers generate, fp32."""
    from transformers import AutoModelForCausalLM

    from pagedllm import LLM, SamplingParams

    rng = random.Random(0)
    for arch in ("llama", "qwen2"):
        path = f"/tmp/gpucheck-tiny-{arch}"
        tiny_model(path, arch)
        prompts = [[rng.randint(3, 500) for _ in range(n)] for n in (3, 9, 17, 33, 60, 5, 24, 48)]
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(DEV).eval()
        ref = []
        with torch.no_grad():
            for p in prompts:
                out = hf.generate(torch.tensor([p], device=DEV), max_new_tokens=32, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)
                ref.append(out[0, len(p):].tolist())
        del hf
        regimes = {
            "default": {},
            "block4_preempt": dict(block_size=4, num_gpu_blocks_override=40, max_num_seqs=8),
            "chunked7": dict(max_num_batched_tokens=7, max_num_seqs=4),
            "fp8_kv": dict(kv_cache_dtype="fp8"),
        }
        for name, kw in regimes.items():
            kw = {"max_model_len": 128, "kv_cache_memory": "1GiB", **kw}
            if "num_gpu_blocks_override" in kw:
                kw.pop("kv_cache_memory")
            try:
                llm = LLM(path, device=DEV, dtype="float32", **kw)
                outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                                    SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
                got = [list(o.outputs[0].token_ids) for o in outs]
                same = sum(g == r for g, r in zip(got, ref))
                first_diff = [next((i for i, (a, b) in enumerate(zip(g, r)) if a != b), None) for g, r in zip(got, ref)]
                pre = llm.llm_engine.preemption_stats
                emit("parity", arch=arch, regime=name, identical=f"{same}/{len(ref)}", first_diff=first_diff,
                     preemptions=pre.swap + pre.recompute)
                del llm
            except Exception as e:  # report and go on
                emit("parity", arch=arch, regime=name, error=f"{type(e).__name__}: {e}"[:2000])
            if DEV == "cuda":
                torch.cuda.empty_cache()


def hold_memory(gib: float) -> subprocess.Popen:
    """Another process holding `gib` GiB of the device until killed."""
    holder = subprocess.Popen([sys.executable, "-c", (
        "import torch,time,sys\n"
        f"x=torch.empty(int({gib}*2**30),dtype=torch.uint8,device='{DEV}')\n"
        "print('held',flush=True)\ntime.sleep(900)\n")], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def part_seed() -> None:
    """The seed's failure on a real GPU: another process holds most of the memory, then the engine starts."""
    from pagedllm import LLM, SamplingParams

    model = "qwen2.5-0.5b" if SMOKE else "llama-3.1-8b"
    hold_gib = 0.1 if SMOKE else float(os.environ.get("GPUCHECK_HOLD_GIB", "105"))
    holder = hold_memory(hold_gib)
    try:
        plan_cmd = [sys.executable, "-m", "pagedllm", "plan", model, "--device", DEV, "--dtype", "bfloat16",
                    "--gpu-memory-utilization", "0.8", "--max-model-len", "2048", "--json"]
        p = subprocess.run(plan_cmd, capture_output=True, text=True, timeout=300)
        plan = json.loads(p.stdout) if p.stdout.strip().startswith("{") else {}
        txt = subprocess.run(plan_cmd[:-1], capture_output=True, text=True, timeout=300)
        emit("seed_plan", rc=p.returncode, fits=plan.get("fits"), used_gib=(plan.get("device_used_bytes") or 0) / 2**30,
             total_gib=(plan.get("device_total_bytes") or 0) / 2**30, cause=plan.get("cause"), fixes=plan.get("fixes"),
             table=txt.stdout[-3000:], stderr=p.stderr[-1500:])
        t = time.perf_counter()
        try:
            llm = LLM(model, load_format="dummy", device=DEV, dtype="bfloat16", gpu_memory_utilization=0.8,
                      max_model_len=2048)
            emit("seed_engine", started=True, note="engine started although the plan said it does not fit"
                 if plan.get("fits") is False else "fits")
            del llm
        except Exception as e:
            emit("seed_engine", started=False, error_type=type(e).__name__, message=str(e)[-3000:],
                 seconds=time.perf_counter() - t)
        if DEV == "cuda":
            torch.cuda.empty_cache()
        # Apply each suggested fix in turn; each must start the engine and generate.
        for fix in (plan.get("fixes") or [])[:3]:
            flag, value = fix.get("flag"), fix.get("value")
            kw = dict(load_format="dummy", device=DEV, dtype="bfloat16", gpu_memory_utilization=0.8,
                      max_model_len=2048)
            key = flag.lstrip("-").replace("-", "_")
            kw[key] = parse_value(value)
            try:
                llm = LLM(model, **kw)
                out = llm.generate([{"prompt_token_ids": [11, 12, 13, 14]}], SamplingParams(max_tokens=8,
                                   ignore_eos=True), use_tqdm=False)
                emit("seed_fix", flag=flag, value=value, started=True, tokens=len(out[0].outputs[0].token_ids),
                     plan_blocks=llm.memory_plan.num_blocks)
                del llm
            except Exception as e:
                emit("seed_fix", flag=flag, value=value, started=False, error=f"{type(e).__name__}: {e}"[-1500:])
            if DEV == "cuda":
                torch.cuda.empty_cache()
    finally:
        holder.kill()
        holder.wait()


def part_planacc() -> None:
    """The dry-run plan's numbers against what the engine really allocates, on the device."""
    from pagedllm import LLM

    model = "qwen2.5-0.5b" if SMOKE else "llama-3.1-8b"
    p = subprocess.run([sys.executable, "-m", "pagedllm", "plan", model, "--device", DEV, "--dtype", "bfloat16",
                        "--max-model-len", "4096", "--json"], capture_output=True, text=True, timeout=300)
    plan = json.loads(p.stdout) if p.stdout.strip().startswith("{") else {}
    llm = LLM(model, load_format="dummy", device=DEV, dtype="bfloat16", max_model_len=4096)
    real = llm.memory_plan.to_json()
    peak = torch.cuda.max_memory_allocated() / 2**30 if DEV == "cuda" else None
    free = torch.cuda.mem_get_info()[0] / 2**30 if DEV == "cuda" else None
    total = torch.cuda.mem_get_info()[1] / 2**30 if DEV == "cuda" else None
    emit("plan_vs_engine", device_used_gib=None if total is None else total - free, budget_gib=real.get("budget_bytes", 0) / 2**30, dry_run_blocks=plan.get("num_blocks"), engine_blocks=real.get("num_blocks"),
         dry_weights=plan.get("weights_bytes"), engine_weights=real.get("weights_bytes"),
         dry_act=plan.get("activation_peak_bytes"), engine_act=real.get("activation_peak_bytes"),
         engine_kv_gib=(real.get("kv_cache_bytes") or 0) / 2**30, torch_peak_alloc_gib=peak, free_after_gib=free)
    del llm


def parse_value(v):
    """A fix's value as the engine argument: numbers from strings, sizes ('4GiB') and words kept."""
    if not isinstance(v, str):
        return v
    try:
        f = float(v)
    except ValueError:
        return v
    return int(f) if f.is_integer() and "." not in v else f


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randint(10, min(vocab, 32000) - 1) for _ in range(length)] for _ in range(n)]


def attention_backends() -> list[str]:
    """GPUCHECK_ATTN: pagedllm's attention backends to run, in one process (default: auto)."""
    return os.environ.get("GPUCHECK_ATTN", "auto").split(",")


def engine_variants() -> list[tuple[str, bool]]:
    """(attention backend, enforce_eager) pairs: GPUCHECK_ATTN x GPUCHECK_GRAPHS (on = CUDA graphs)."""
    modes = os.environ.get("GPUCHECK_GRAPHS", "on").split(",")
    return [(attn, mode == "off") for attn in attention_backends() for mode in modes]


def graphs_info(llm) -> dict:
    g = llm.llm_engine.executor.driver.graphs
    if g is None:
        return {"graphs": "off"}
    return {"graphs": "on", "graph_sizes": len(g.sizes), "capture_s": g.capture_seconds,
            "graph_pool_mib": None if g.pool_bytes is None else g.pool_bytes / 2**20,
            "planned_graph_pool_mib": llm.llm_engine.memory_plan.graph_pool_bytes / 2**20}


def part_throughput(pagedllm_only: bool = False) -> None:
    """W on the device: N prompts x 128 in x 128 out, ignore_eos, sampling T=1; pagedllm vs transformers."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    from pagedllm import LLM, SamplingParams
    from pagedllm.model_executor.model_files import load_hf_config, resolve_model_path

    models = ["qwen2.5-0.5b"] if SMOKE else os.environ.get("GPUCHECK_MODELS", "qwen2.5-0.5b,llama-3.1-8b").split(",")
    n = 8 if SMOKE else int(os.environ.get("GPUCHECK_N", "256" if pagedllm_only else "512"))
    inp, outl = (16, 8) if SMOKE else (128, 128)
    for model in models:
        cfg = load_hf_config(resolve_model_path(model))
        prompts = random_prompts(n, inp, cfg.vocab_size)
        for attn, eager in engine_variants():
            llm = LLM(model, load_format="dummy", device=DEV, dtype="bfloat16", max_model_len=512, max_num_seqs=256,
                      attention_backend=attn, enforce_eager=eager)
            sp = SamplingParams(temperature=1.0, max_tokens=outl, ignore_eos=True)
            llm.generate([{"prompt_token_ids": p[::-1]} for p in prompts[:4]], SamplingParams(max_tokens=4),
                         use_tqdm=False)
            sync()
            t = time.perf_counter()
            llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
            sync()
            el = time.perf_counter() - t
            emit("throughput", model=model, backend="pagedllm", attention=llm.llm_engine.executor.driver.attn_backend.name,
                 prompts=n, out_tok_s=n * outl / el, seconds=el, **graphs_info(llm))
            del llm
            if DEV == "cuda":
                torch.cuda.empty_cache()
        if pagedllm_only:
            continue
        torch.manual_seed(0)
        hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).to(DEV).eval()
        for bs in ([8] if SMOKE else [int(b) for b in os.environ.get("GPUCHECK_HF_BS", "256").split(",")]):
            t = time.perf_counter()
            with torch.no_grad():
                for i in range(0, n, bs):
                    ids = torch.tensor(prompts[i:i + bs], device=DEV)
                    hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                                top_k=0, top_p=1.0, max_new_tokens=outl, min_new_tokens=outl, pad_token_id=0)
            sync()
            el = time.perf_counter() - t
            emit("throughput", model=model, backend=f"transformers static bs{bs}", prompts=n, out_tok_s=n * outl / el,
                 seconds=el)
        try:  # transformers' own continuous batching with its paged cache
            gen = GenerationConfig(max_new_tokens=outl, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                   eos_token_id=None, pad_token_id=0)
            t = time.perf_counter()
            with torch.no_grad():
                hf.generate_batch(inputs=prompts, generation_config=gen, progress_bar=False)
            sync()
            el = time.perf_counter() - t
            emit("throughput", model=model, backend="transformers generate_batch (CB)", prompts=n,
                 out_tok_s=n * outl / el, seconds=el)
        except Exception as e:
            emit("throughput", model=model, backend="transformers generate_batch (CB)", error=str(e)[:500])
        del hf
        if DEV == "cuda":
            torch.cuda.empty_cache()


def part_latency() -> None:
    """Batch-1 decode: ms per output token against the weight-read floor at the measured bandwidth."""
    from transformers import AutoModelForCausalLM

    from pagedllm import LLM, SamplingParams
    from pagedllm.model_executor.model_files import load_hf_config, resolve_model_path

    bw = float(os.environ.get("GPUCHECK_BW", "4.0e12"))
    for model in (["qwen2.5-0.5b"] if SMOKE else ["qwen2.5-0.5b", "llama-3.1-8b"]):
        outl = 16 if SMOKE else 256
        cfg = load_hf_config(resolve_model_path(model))
        prompt = random_prompts(1, 128, cfg.vocab_size)[0]
        for attn, eager in engine_variants():
            llm = LLM(model, load_format="dummy", device=DEV, dtype="bfloat16", max_model_len=1024,
                      kv_cache_memory="4GiB", attention_backend=attn, enforce_eager=eager)
            wbytes = llm.memory_plan.weight_bytes
            llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
            res = {}
            for k in (1, outl + 1):
                sync()
                t = time.perf_counter()
                llm.generate([{"prompt_token_ids": prompt}],
                             SamplingParams(max_tokens=k, temperature=0, ignore_eos=True), use_tqdm=False)
                sync()
                res[k] = time.perf_counter() - t
            ms = (res[outl + 1] - res[1]) / outl * 1000
            floor = wbytes / bw * 1000
            emit("latency", model=model, backend="pagedllm", attention=llm.llm_engine.executor.driver.attn_backend.name,
                 ms_per_token=ms, floor_ms=floor, ratio=ms / floor, weight_gib=wbytes / 2**30, ttft_ms=res[1] * 1000,
                 **graphs_info(llm))
            del llm
            if DEV == "cuda":
                torch.cuda.empty_cache()
        if os.environ.get("GPUCHECK_NO_HF") == "1":
            continue
        torch.manual_seed(0)
        hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).to(DEV).eval()
        ids = torch.tensor([prompt], device=DEV)
        with torch.no_grad():
            hf.generate(input_ids=ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
            for k in (1, outl + 1):
                sync()
                t = time.perf_counter()
                hf.generate(input_ids=ids, max_new_tokens=k, min_new_tokens=k, do_sample=False, pad_token_id=0)
                sync()
                res[k] = time.perf_counter() - t
        ms = (res[outl + 1] - res[1]) / outl * 1000
        emit("latency", model=model, backend="transformers", ms_per_token=ms, floor_ms=floor, ratio=ms / floor)
        del hf
        if DEV == "cuda":
            torch.cuda.empty_cache()


def part_serve() -> None:
    """README's main job on the device: pagedllm serve (demo model), one completion, /v1/memory."""
    import urllib.request

    port = "8571"
    log = open(os.path.join(OUT, "serve.log"), "w")
    srv = subprocess.Popen([sys.executable, "-m", "pagedllm", "serve", "--device", DEV, "--port", port],
                           stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        up = _wait_healthy(base, srv, 150)
        body = json.dumps({"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0}).encode()
        req = urllib.request.Request(base + "/v1/completions", body, {"Content-Type": "application/json"})
        comp = json.loads(urllib.request.urlopen(req, timeout=60).read())
        mem = json.loads(urllib.request.urlopen(base + "/v1/memory", timeout=10).read())
        emit("serve", up_seconds=up, text=comp["choices"][0]["text"], memory={k: mem.get(k) for k in list(mem)[:12]})
    finally:
        srv.terminate()
        srv.wait(timeout=30)


def _wait_healthy(base: str, srv: subprocess.Popen, seconds: float) -> float:
    """Seconds until the server's /health answered (polled each second); an exited server is an error."""
    import urllib.request

    t = time.perf_counter()
    while time.perf_counter() - t < seconds:
        try:
            urllib.request.urlopen(base + "/health", timeout=2)
            break
        except Exception:
            if srv.poll() is not None:
                raise RuntimeError(f"the server exited with {srv.returncode}") from None
            time.sleep(1)
    return time.perf_counter() - t


def _table_total_us(table: str) -> float:
    """The profiler table's footer 'Self CUDA time total: 181.834ms' (the kernels' time, counted once)."""
    import re

    m = re.search(r"Self (?:CUDA|Device) time total: ([0-9.]+)(us|ms|s)", table)
    if not m:
        return 0.0
    return float(m.group(1)) * {"us": 1, "ms": 1e3, "s": 1e6}[m.group(2)]


def part_profile() -> None:
    """Where a decode step's time goes: GPU-busy share of wall time, kernel launches per step, top ops."""
    from torch.profiler import ProfilerActivity, profile

    from pagedllm import LLM, SamplingParams
    from pagedllm.model_executor.model_files import load_hf_config, resolve_model_path

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEV == "cuda" else [])
    cases = [("qwen2.5-0.5b", 1), ("qwen2.5-0.5b", 64)] if SMOKE else [
        ("qwen2.5-0.5b", 1), ("qwen2.5-0.5b", 64), ("llama-3.1-8b", 1)]
    steps = 4 if SMOKE else 32
    llm, loaded = None, None
    for model, batch in cases:
        if loaded != model:
            del llm
            if DEV == "cuda":
                torch.cuda.empty_cache()
            llm = LLM(model, load_format="dummy", device=DEV, dtype="bfloat16", max_model_len=1024,
                      kv_cache_memory="4GiB")
            loaded = model
        cfg = load_hf_config(resolve_model_path(model))
        prompts = [{"prompt_token_ids": p} for p in random_prompts(batch, 128, cfg.vocab_size, seed=batch)]
        sp = SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True)
        llm.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)  # warm, cache prompt
        sync()
        with profile(activities=acts) as prof:
            t = time.perf_counter()
            llm.generate(prompts, sp, use_tqdm=False)
            sync()
            wall = time.perf_counter() - t
        events = prof.key_averages()
        gpu_us = _table_total_us(events.table(row_limit=1)) if DEV == "cuda" else 0  # kernels only, once each
        launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
        try:
            table = events.table(sort_by="self_device_time_total" if DEV == "cuda" else "self_cpu_time_total",
                                 row_limit=18)
        except Exception:
            table = events.table(sort_by="self_cuda_time_total", row_limit=18)
        name = f"profile-{model}-b{batch}.txt"
        with open(os.path.join(OUT, name), "w") as f:
            f.write(table)
        emit("profile", model=model, batch=batch, steps=steps + 1, wall_ms_per_step=wall / (steps + 1) * 1000,
             gpu_busy_ms_per_step=gpu_us / 1000 / (steps + 1), gpu_busy_share=(gpu_us / 1e6) / wall if wall else None,
             launches_per_step=launches / (steps + 1), table=name)


def part_audio() -> None:
    """The seed's model shape (Higgs Audio v2 3B, dummy bf16): frames/s, batch 1 and 16, through bench audio."""
    for np_ in ((1,) if SMOKE else (1, 16)):
        cmd = [sys.executable, "-m", "pagedllm", "bench", "audio", "--model", "higgs-audio-v2-3b", "--load-format",
               "dummy", "--dtype", "bfloat16", "--device", DEV, "--frames", "8" if SMOKE else "128",
               "--prompt-len", "64", "--num-prompts", str(np_), "--backend", "pagedllm",
               "--output-json", f"/tmp/gpucheck-audio-{np_}.json"]
        if np_ == 1 and not SMOKE:
            cmd += ["--backend", "transformers"]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
        try:
            data = json.load(open(f"/tmp/gpucheck-audio-{np_}.json"))
        except Exception:
            data = None
        emit("audio", num_prompts=np_, rc=p.returncode, result=data, tail=(p.stdout + p.stderr)[-1500:])


# -- issue 21: memory truth ------------------------------------------------------------------------------------
def _sub(args: list[str], timeout: float) -> tuple[int, str, str]:
    """Run `python .gpu/check.py ARGS` (or `-m pagedllm ARGS` when args[0] is "-m") in a fresh process."""
    cmd = [sys.executable, *args] if args[0] == "-m" else [sys.executable, os.path.abspath(__file__), *args]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        return p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        return 124, (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), "timeout"


def part_memprobe() -> None:
    """A fresh process's first readings: NVML free before and after its CUDA context, the context pagedllm
    measures, what it counts as others, and the pinned host-to-device bandwidth."""
    from pagedllm.memory import device as dm
    from pagedllm.memory import nvml

    before = nvml.free_bytes(0) if not SMOKE else None
    mem = dm.device_memory(DEV)
    after = nvml.free_bytes(0) if not SMOKE else None
    free, total = torch.cuda.mem_get_info() if DEV == "cuda" else (None, None)
    emit("memprobe", nvml_free_before_gib=None if before is None else before / 2**30,
         nvml_free_after_gib=None if after is None else after / 2**30,
         cuda_free_gib=None if free is None else free / 2**30, cuda_total_gib=None if total is None else total / 2**30,
         context_mib=dm._context_bytes.get(0, 0) / 2**20, others_gib=mem.used_by_others_bytes / 2**30,
         unified=mem.unified, h2d_GBps=(dm.host_to_device_bytes_per_s() or 0) / 1e9)


def part_offload_parity() -> None:
    """Greedy tokens with --cpu-offload-gb (2, 4 and all 6 layers offloaded; side-stream copies) against the
    same engine without it, fp32 tiny Llama on the device."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.model_executor.offload import param_bytes

    path = "/tmp/gpucheck-tiny-offload"
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=6,
                                 num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
                                 eos_token_id=None, bos_token_id=None, pad_token_id=None)).save_pretrained(path)
    rng = random.Random(1)
    prompts = [{"prompt_token_ids": [rng.randint(3, 500) for _ in range(n)]} for n in (3, 9, 17, 33, 60, 5, 24, 48)]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    dev = "cpu" if SMOKE else "cuda"
    ref_llm = LLM(path, device=dev, dtype="float32", max_model_len=128, kv_cache_memory="64MiB")
    layer = param_bytes(ref_llm.llm_engine.executor.driver.model.decoder_layers()[0])
    ref = [list(o.outputs[0].token_ids) for o in ref_llm.generate(prompts, sp, use_tqdm=False)]
    del ref_llm
    for n in (2, 4, 6):
        try:
            if SMOKE:  # the CPU refuses --cpu-offload-gb: drive the config directly
                from dataclasses import replace

                from pagedllm.engine.arg_utils import EngineArgs
                from pagedllm.engine.llm_engine import LLMEngine
                cfg = EngineArgs(model=path, device="cpu", dtype="float32", max_model_len=128,
                                 kv_cache_memory="64MiB").create_engine_config()
                eng = LLMEngine(replace(cfg, model=replace(cfg.model, cpu_offload_bytes=n * layer)))
                llm = LLM.__new__(LLM)
                llm.llm_engine = eng
            else:
                llm = LLM(path, device=dev, dtype="float32", max_model_len=128, kv_cache_memory="64MiB",
                          cpu_offload_gb=n * layer / 2**30 + 1e-9)
            got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp, use_tqdm=False)]
            emit("offload_parity", offloaded_layers=len(llm.llm_engine.executor.driver.model.layer_offloads),
                 identical=f"{sum(g == r for g, r in zip(got, ref))}/{len(ref)}",
                 pinned=sum(p is not None for p in llm.llm_engine.executor.driver.model.layer_offloader.pinned))
            del llm
        except Exception as e:
            import traceback

            emit("offload_parity", layers=n, error=f"{type(e).__name__}: {e}"[:1500], tb=traceback.format_exc()[-2000:])


def part_planacc2() -> None:
    """Dry-run plan vs engine, and the device memory used after a 256-request run vs the budget, at
    utilization 0.9 and 0.8, each in a fresh process (the CUDA context is measured as the engine's)."""
    for util in ("0.9", "0.8"):
        rc, out, err = _sub(["planacc_one", util], 300)
        for line in out.splitlines():
            if line.startswith("{"):
                print(line, flush=True)
        if rc != 0:
            emit("planacc2", util=util, rc=rc, stderr=err[-2000:])


def part_planacc_one() -> None:
    from pagedllm import LLM, SamplingParams

    util = float(sys.argv[2])
    model = "qwen2.5-0.5b" if SMOKE else "llama-3.1-8b"
    rc, out, err = _sub(["-m", "pagedllm", "plan", model, "--device", DEV, "--dtype", "bfloat16",
                         "--gpu-memory-utilization", str(util), "--max-model-len", "4096", "--json"], 300)
    dry = json.loads(out) if out.strip().startswith("{") else {}
    t = time.perf_counter()
    llm = LLM(model, load_format="dummy", device=DEV, dtype="bfloat16", max_model_len=4096,
              gpu_memory_utilization=util, **({"kv_cache_memory": "256MiB"} if SMOKE else {}))
    start_s = time.perf_counter() - t
    plan = llm.memory_plan
    n = 8 if SMOKE else 256
    prompts = [{"prompt_token_ids": p} for p in random_prompts(n, 128, 32000, seed=3)]
    llm.generate(prompts, SamplingParams(temperature=1.0, max_tokens=8 if SMOKE else 48, ignore_eos=True),
                 use_tqdm=False)
    sync()
    if DEV == "cuda":
        free, total = torch.cuda.mem_get_info()
        used = total - free
        reserved, peak_reserved = torch.cuda.memory_reserved(), torch.cuda.max_memory_reserved()
    else:
        used = total = reserved = peak_reserved = 0
    others = plan.device.used_by_others_bytes
    emit("planacc2", util=util, start_s=start_s, budget_gib=plan.budget_bytes / 2**30, device_used_gib=used / 2**30,
         within_budget=used <= plan.budget_bytes, margin_mib=(plan.budget_bytes - used) / 2**20,
         others_gib=others / 2**30, engine_held_gib=(used - others) / 2**30,
         overhead_measured_mib=plan.overhead_bytes / 2**20, overhead_dry_mib=(dry.get("overhead_bytes") or 0) / 2**20,
         activation_measured_mib=plan.activation_bytes / 2**20,
         activation_dry_mib=(dry.get("activation_peak_bytes") or 0) / 2**20,
         engine_blocks=plan.num_blocks, dry_blocks=dry.get("num_blocks"),
         blocks_ratio=(dry.get("num_blocks") or 0) / max(plan.num_blocks, 1),
         torch_reserved_gib=reserved / 2**30, torch_peak_reserved_gib=peak_reserved / 2**30,
         table=plan.table(), dry_rc=rc)


def part_seed2() -> None:
    """The seed's failure on a real GPU with another process holding most of the memory: the plan, the
    engine's refusal, then every printed fix applied in a fresh process: start time, ms per token, and
    for --cpu-offload-gb the plan's estimate of the per-step cost beside the measured one."""
    model = "qwen2.5-0.5b" if SMOKE else "llama-3.1-8b"
    hold_gib = 0.1 if SMOKE else float(os.environ.get("GPUCHECK_HOLD_GIB", "105"))
    holder = hold_memory(hold_gib)
    try:
        common = [model, "--device", DEV, "--dtype", "bfloat16", "--gpu-memory-utilization", "0.8",
                  "--max-model-len", "2048"]
        rc, out, err = _sub(["-m", "pagedllm", "plan", *common, "--json"], 300)
        plan = json.loads(out) if out.strip().startswith("{") else {}
        _, text, _ = _sub(["-m", "pagedllm", "plan", *common], 300)
        emit("seed2_plan", rc=rc, fits=plan.get("fits"), others_gib=(plan.get("device_used_bytes") or 0) / 2**30,
             overhead_mib=(plan.get("overhead_bytes") or 0) / 2**20, h2d_GBps=(plan.get("h2d_bytes_per_s") or 0) / 1e9,
             cause=plan.get("cause"), fixes=plan.get("fixes"), table=text[-3500:], stderr=err[-1000:])
        rc, out, err = _sub(["seed2_engine", "", ""], 300)
        print(*(line for line in out.splitlines() if line.startswith("{")), sep="\n", flush=True)
        for fix in plan.get("fixes") or []:
            rc, out, err = _sub(["seed2_engine", fix["flag"], fix["value"], str(fix.get("extra_step_ms"))], 240)
            print(*(line for line in out.splitlines() if line.startswith("{")), sep="\n", flush=True)
            if rc != 0:
                emit("seed2_fix", flag=fix["flag"], value=fix["value"], rc=rc, stderr=err[-2000:])
    finally:
        holder.kill()
        holder.wait()


def part_seed2_engine() -> None:
    """One engine start in the seed scenario (argv: flag value [plan's extra ms per step]); generates 1 and
    then 33 tokens, ms per token from the difference."""
    from pagedllm import LLM, SamplingParams

    flag, value = sys.argv[2], sys.argv[3]
    estimate = float(sys.argv[4]) if len(sys.argv) > 4 and sys.argv[4] not in ("None", "") else None
    model = "qwen2.5-0.5b" if SMOKE else "llama-3.1-8b"
    kw = dict(load_format="dummy", device=DEV, dtype="bfloat16", gpu_memory_utilization=0.8, max_model_len=2048)
    if flag:
        kw[flag.lstrip("-").replace("-", "_")] = parse_value(value)
    if SMOKE and flag == "--cpu-offload-gb":
        emit("seed2_fix", flag=flag, value=value, skipped="the CPU refuses --cpu-offload-gb")
        return
    t = time.perf_counter()
    try:
        llm = LLM(model, **kw)
    except Exception as e:
        emit("seed2_fix" if flag else "seed2_engine", flag=flag, value=value, started=False,
             error_type=type(e).__name__, message=str(e)[-3000:], seconds=time.perf_counter() - t)
        return
    start_s = time.perf_counter() - t
    prompt = [{"prompt_token_ids": [11, 12, 13, 14, 15, 16, 17, 18]}]
    times = {}
    for k in (1, 33):
        sync()
        t = time.perf_counter()
        out = llm.generate(prompt, SamplingParams(max_tokens=k, temperature=0, ignore_eos=True), use_tqdm=False)
        sync()
        times[k] = time.perf_counter() - t
    ms = (times[33] - times[1]) / 32 * 1000
    plan = llm.memory_plan
    used = None
    if DEV == "cuda":
        free, total = torch.cuda.mem_get_info()
        used = (total - free) / 2**30
    emit("seed2_fix" if flag else "seed2_engine", flag=flag, value=value, started=True, start_s=start_s,
         tokens=len(out[0].outputs[0].token_ids), ms_per_token=ms, plan_extra_step_ms=estimate,
         engine_offload_step_ms=plan.offload_step_ms, h2d_GBps=(plan.device.h2d_bytes_per_s or 0) / 1e9,
         blocks=plan.num_blocks, device_used_gib=used, budget_gib=plan.budget_bytes / 2**30,
         overhead_mib=plan.overhead_bytes / 2**20, table=plan.table()[-2500:])


# -- issue 22: attention backends ---------------------------------------------------------------------------
def part_parity_triton() -> None:
    """The CPU parity suite's 4 tiny architectures and 5 regimes (tests/models/test_parity.py) on the device
    with --attention-backend triton (and torch, the reference), fp32: greedy tokens vs transformers."""
    sys.path.insert(0, os.getcwd())
    from pagedllm import LLM, SamplingParams
    from tests.helpers import ARCHS, hf_greedy, make_tiny_model
    from tests.models.test_parity import MAX_TOKENS, PROMPTS, REGIMES

    for arch in ARCHS:
        path = make_tiny_model(f"/tmp/gpucheck-parity-{arch}", arch)
        ref = [hf_greedy(path, p, MAX_TOKENS) for p in PROMPTS]
        for backend in ("triton", "torch"):
            for regime, kw in REGIMES.items():
                try:
                    llm = LLM(str(path), device=DEV, attention_backend=backend, dtype="float32", max_model_len=64,
                              **({"num_gpu_blocks_override": 512} | kw))
                    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                                        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                                       logprobs=0), use_tqdm=False)
                    same = sum(o.outputs[0].token_ids == r[0] for o, r in zip(outs, ref))
                    lp = max(abs(lps[t].logprob - b) for o, r in zip(outs, ref)
                             for lps, t, b in zip(o.outputs[0].logprobs, o.outputs[0].token_ids, r[1]))
                    emit("parity_triton", arch=arch, backend=llm.llm_engine.executor.driver.attn_backend.name, regime=regime,
                         identical=f"{same}/{len(ref)}", max_logprob_diff=lp,
                         preemptions=llm.llm_engine.scheduler.num_preemptions)
                    del llm
                except Exception as e:
                    emit("parity_triton", arch=arch, backend=backend, regime=regime, error=f"{type(e).__name__}: {e}"[:1500])


def part_attnbench() -> None:
    """One layer's attention in a decode step (K/V write + attention), Llama-3.1-8B's attention shape
    (32 heads, 8 KV heads, head 128), bf16: the triton backend against the torch backend's gather path;
    batch 64 x 2k-token contexts, and batch 1 x 8k (split-K)."""
    from pagedllm.model_executor.attention import PagedAttention, TorchAttentionBackend, forward_context
    from pagedllm.model_executor.attention.triton_backend import TritonAttentionBackend

    dev = torch.device(DEV)
    heads, kv_heads, dim, bs = (32, 8, 128, 16) if not SMOKE else (8, 2, 64, 16)
    cases = [(64, 2048), (1, 8192)] if not SMOKE else [(4, 64)]
    for batch, context in cases:
        blocks_per = -(-(context + 1) // bs)
        attn = PagedAttention(heads, kv_heads, dim, dim ** -0.5)
        cache = torch.randn(2, kv_heads, batch * blocks_per * bs, dim, device=dev, dtype=torch.bfloat16)
        attn.k_cache, attn.v_cache = cache[0], cache[1]
        perm = torch.randperm(batch * blocks_per).tolist()
        tables = [perm[i * blocks_per:(i + 1) * blocks_per] for i in range(batch)]
        q = torch.randn(batch, heads, dim, device=dev, dtype=torch.bfloat16)
        k = torch.randn(batch, kv_heads, dim, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        row = {}
        outs = {}
        for backend in (TritonAttentionBackend(dev), TorchAttentionBackend()):
            meta = backend.build_metadata([context] * batch, [1] * batch, tables, bs, dev)
            with forward_context(meta), torch.inference_mode():
                for _ in range(3):
                    outs[backend.name] = attn(q, k, v)
                sync()
                reps = 5 if SMOKE else 50
                t = time.perf_counter()
                for _ in range(reps):
                    attn(q, k, v)
                sync()
                row[f"{backend.name}_us"] = (time.perf_counter() - t) / reps * 1e6
        err = (outs["triton"].float() - outs["torch"].float()).abs().max().item()
        kv_bytes = 2 * batch * (context + 1) * kv_heads * dim * 2
        emit("attnbench", batch=batch, context=context, **row, speedup=row["torch_us"] / row["triton_us"],
             triton_GBps=kv_bytes / row["triton_us"] / 1e3, max_abs_diff=err)


def part_tput() -> None:
    """The throughput part without the transformers baselines (pagedllm's backends only)."""
    part_throughput(pagedllm_only=True)


# -- issue 23: CUDA graphs ------------------------------------------------------------------------------------
def part_graphs() -> None:
    """Tokens with CUDA graphs equal tokens without on the device (tests/models/test_cuda_graphs.py's prompts:
    decode batches of 7 .. 1 rows, every size 1/2/4/8 with padded rows), greedy and seeded sampling, fp32;
    greedy also against transformers. Then what capture costs for a real shape: time and pool, measured
    against the plan (Qwen2.5-0.5B and Llama-3.1-8B, dummy bf16, max_num_seqs 256)."""
    sys.path.insert(0, os.getcwd())
    from pagedllm import LLM, SamplingParams
    from tests.helpers import hf_greedy, make_tiny_model
    from tests.models.test_cuda_graphs import MAX_TOKENS, PROMPTS

    for arch in ("llama", "qwen3"):
        path = make_tiny_model(f"/tmp/gpucheck-graphs-{arch}", arch)
        ref = [hf_greedy(path, p, n)[0] for p, n in zip(PROMPTS, MAX_TOKENS)]
        for sampling in ("greedy", "seeded"):
            runs = {}
            for eager in (True, False):
                try:
                    llm = LLM(str(path), device=DEV, dtype="float32", max_model_len=64, max_num_seqs=8,
                              enforce_eager=eager, kv_cache_memory="256MiB",
                              attention_backend="triton" if SMOKE else "auto")  # (smoke: under the interpreter)
                    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) if sampling == "greedy"
                              else SamplingParams(temperature=0.9, top_p=0.95, max_tokens=n, ignore_eos=True, seed=n)
                              for n in MAX_TOKENS]
                    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
                    runs[eager] = [o.outputs[0].token_ids for o in outs]
                    g = llm.llm_engine.executor.driver.graphs
                    captured = None if g is None else sorted(g.steps)
                    del llm
                except Exception as e:
                    emit("graphs", arch=arch, sampling=sampling, eager=eager, error=f"{type(e).__name__}: {e}"[:1500])
                    runs[eager] = None
                    captured = None
            row = {"arch": arch, "sampling": sampling, "captured_sizes": captured,
                   "graphs_equal_eager": runs[True] is not None and runs[True] == runs[False]}
            if sampling == "greedy" and runs[False] is not None:
                row["graphs_vs_transformers"] = f"{sum(a == b for a, b in zip(runs[False], ref))}/{len(ref)}"
            emit("graphs", **row)
    for model in (["qwen2.5-0.5b"] if SMOKE else ["qwen2.5-0.5b", "llama-3.1-8b"]):
        t = time.perf_counter()
        llm = LLM(model, load_format="dummy", device=DEV, dtype="bfloat16", max_model_len=2048,
                  max_num_seqs=8 if SMOKE else 256, attention_backend="triton" if SMOKE else "auto")
        emit("graphs", model=model, start_s=time.perf_counter() - t, **graphs_info(llm))
        del llm
        if DEV == "cuda":
            torch.cuda.empty_cache()


def part_host() -> None:
    """Where the host's time goes in a decode step (`pagedllm bench host`, torch.profiler phases), with async
    output processing on and off: Qwen2.5-0.5B and Llama-3.1-8B shapes, dummy bf16, batch 1 and 256."""
    from pagedllm.bench import host

    models = ["qwen2.5-0.5b"] if SMOKE else os.environ.get("GPUCHECK_MODELS", "qwen2.5-0.5b,llama-3.1-8b").split(",")
    for model in models:
        for overlap in ("--async-output-proc", "--no-async-output-proc"):
            name = f"host-{model}{overlap.replace('--', '-')}.json"
            args = ["--model", model, "--device", DEV, "--output-json", os.path.join(OUT, name),
                    "--batch-sizes", *(["1", "4"] if SMOKE else ["1", "256"]), "--steps", "3" if SMOKE else "20",
                    overlap] + (["--attention-backend", "triton", "--prompt-len", "16"] if SMOKE else [])
            try:
                host.main(args)
                with open(os.path.join(OUT, name)) as f:
                    for row in json.load(f)["rows"]:
                        ms = {k.removesuffix("_s") + "_ms": round(v * 1000, 3) for k, v in row.items() if k.endswith("_s")}
                        emit("host", model=model, overlap=overlap, batch=row["batch"], **ms)
            except Exception as e:
                emit("host", model=model, overlap=overlap, error=f"{type(e).__name__}: {e}"[:1500])
            if DEV == "cuda":
                torch.cuda.empty_cache()


# -- issue 26: streamed speech under load ------------------------------------------------------------------------
def part_speechload() -> None:
    """The seed's model shape (Higgs Audio v2 3B and its codec, dummy bf16) served, then `bench serve --endpoint
    speech` at concurrency 1, 8 and 32: TTFA p50/p99, RTF, seconds of audio per second (docs/audio.md)."""
    import urllib.request

    if SMOKE:
        sys.path.insert(0, os.getcwd())
        from tests.audio_helpers import make_tiny_audio_tokenizer, make_tiny_higgs_tts

        model = str(make_tiny_higgs_tts("/tmp/gpucheck-th", long_audio=True))
        codec = ["--audio-tokenizer-path", str(make_tiny_audio_tokenizer("/tmp/gpucheck-tc"))]
        extra = []
    else:
        model, codec = "higgs-audio-v2-3b", ["--audio-tokenizer-type", "higgs-audio-v2-tokenizer"]
        extra = ["--load-format", "dummy", "--dtype", "bfloat16"]
    port = "8572"
    log = open(os.path.join(OUT, "speech-server.log"), "w")
    srv = subprocess.Popen([sys.executable, "-m", "pagedllm.entrypoints.openai.api_server", "--model", model, *codec,
                            *extra, "--device", DEV, "--max-model-len", "2048", "--port", port],
                           stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        emit("speechload", up_seconds=_wait_healthy(base, srv, 240))
        from pagedllm.bench.serve import main as bench_serve

        for concurrency, num in ((1, 4), (8, 8)) if SMOKE else ((1, 16), (8, 64), (32, 128)):
            name = os.path.join(OUT, f"speech-c{concurrency}.json")
            code = bench_serve(["--base-url", base, "--endpoint", "speech", "--max-concurrency", str(concurrency),
                                "--num-prompts", str(num), "--random-input-len", "12", "--random-output-len",
                                "30" if SMOKE else "250", "--seed", "1", "--output-json", name])
            with open(name) as f:
                emit("speechload", concurrency=concurrency, rc=code, **json.load(f)["metrics"])
    finally:
        srv.terminate()
        srv.wait(timeout=30)


if __name__ == "__main__":
    part = sys.argv[1]
    t0 = time.perf_counter()
    try:
        globals()[f"part_{part}"]()
    except Exception as e:
        import traceback

        emit(part, fatal=f"{type(e).__name__}: {e}", tb=traceback.format_exc()[-3000:])
    emit(part, done_seconds=time.perf_counter() - t0)
