"""Device memory as the engine reads it, with simulated readings (no GPU here): cudaMemGetInfo,
is_integrated and NVML monkeypatched, /proc/meminfo and the cgroup files written to a temporary folder.

The seed's scenario measured on a unified-memory machine (a DGX Spark: 119.7 GiB shared with the OS,
60 GiB of it page cache after reading a checkpoint, 30 GiB held by processes): the plan counts the
page cache as free and fits; the same readings with nothing reclaimable give the cause and fixes.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.entrypoints.cli import main
from pagedllm.memory import device as device_mod
from pagedllm.memory import nvml
from pagedllm.entrypoints.plan import dry_run_plan
from pagedllm.memory.plan import DROP_CACHES, GiB, MiB, kv_allocation_failure

TOTAL = int(119.7 * GiB) // 1024 * 1024  # /proc/meminfo counts kB
KIB = 1024


def write_meminfo(path, total: int, free: int, available: int) -> None:
    path.write_text(f"MemTotal:       {total // KIB} kB\nMemFree:        {free // KIB} kB\n"
                    f"MemAvailable:   {available // KIB} kB\nBuffers:           1024 kB\n")


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """A simulated machine: set_meminfo(held, page_cache), a CUDA device (unified or discrete), NVML."""
    meminfo = tmp_path / "meminfo"
    monkeypatch.setattr(device_mod, "MEMINFO", meminfo)
    monkeypatch.setattr(device_mod, "CGROUP_V2", tmp_path / "no-cgroup")
    monkeypatch.setattr(device_mod, "CGROUP_V1", tmp_path / "no-cgroup-v1")
    monkeypatch.setattr(device_mod, "_own_rss", lambda: 0)
    monkeypatch.setattr(device_mod, "_context_bytes", {})
    state = SimpleNamespace(reserved=0, nvml=[], integrated=True, name="NVIDIA GB10", cuda_free=None)

    def set_meminfo(held: int, page_cache: int, total: int = TOTAL) -> None:
        free = total - held - page_cache
        write_meminfo(meminfo, total, free, free + page_cache)
        if state.cuda_free is None or state.integrated:
            state.cuda_free = free  # cudaMemGetInfo on an integrated GPU: about MemFree

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i=None: SimpleNamespace(name=state.name, is_integrated=int(state.integrated)))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i=None: (state.cuda_free, state.device_total))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda i=None: state.reserved)
    monkeypatch.setattr(nvml, "free_bytes", lambda i: state.nvml.pop(0) if state.nvml else None)
    state.device_total = TOTAL
    state.set_meminfo = set_meminfo
    return state


def seed_args(**changes) -> EngineArgs:
    return EngineArgs(**{"model": "llama-3.2-3b", "gpu_memory_utilization": 0.8, "max_model_len": 2048, **changes})


def test_seed_scenario_on_unified_memory_counts_the_page_cache_as_free(machine):
    machine.set_meminfo(held=30 * GiB, page_cache=60 * GiB)
    plan = dry_run_plan(seed_args(), device="cuda")
    d = plan.device
    assert d.unified and d.name == "NVIDIA GB10" and d.source == "measured"
    assert d.total_bytes == TOTAL
    assert d.used_by_others_bytes == 30 * GiB  # what is really held, not total - cudaMemGetInfo's free (90 GiB)
    assert d.page_cache_bytes == 60 * GiB
    assert plan.fits and plan.cause is None
    assert plan.kv_budget_bytes == plan.budget_bytes - 30 * GiB - plan.non_kv_bytes
    table = plan.table()
    page_row = next(line for line in table.splitlines() if line.strip().startswith("page cache (reclaimable)"))
    assert "60.00 GiB" in page_row and "counted as free" in page_row
    # The engine's start needs more than MemFree's 29.7 GiB: the plan says how much page cache goes, and how
    # to free it now.
    engine = plan.non_kv_bytes + plan.kv_cache_bytes
    assert plan.page_cache_reclaimed_bytes == engine - (TOTAL - 90 * GiB) > 0
    assert DROP_CACHES in table
    data = plan.to_json()
    assert data["page_cache_bytes"] == 60 * GiB and data["device_used_bytes"] == 30 * GiB
    assert data["page_cache_reclaimed_bytes"] == plan.page_cache_reclaimed_bytes


def test_seed_scenario_without_reclaimable_cache_gives_the_cause_and_fixes(machine):
    machine.set_meminfo(held=90 * GiB, page_cache=0)
    plan = dry_run_plan(seed_args(), device="cuda")
    assert plan.device.used_by_others_bytes == 90 * GiB and plan.device.page_cache_bytes == 0
    assert not plan.fits
    assert plan.cause.startswith("other processes and the OS already use 90.00 GiB of the 119.70 GiB unified memory")
    assert "less than the model's weights" in plan.cause
    flags = {f.flag for f in plan.fixes()}
    assert "--gpu-memory-utilization" in flags
    assert not flags & {"--cpu-offload-gb", "--swap-space"}  # nothing to move anywhere on unified memory
    assert "--cpu-offload-gb and --swap-space would move nothing out of it: not offered" in plan.table()
    for fix in plan.fixes():  # each fix alone fits on the same readings
        field = fix.flag.lstrip("-").replace("-", "_")
        value = {"gpu_memory_utilization": float, "max_model_len": int}.get(field, str)(fix.value)
        assert dry_run_plan(seed_args(**{field: value}), device="cuda").fits, fix


def test_page_cache_in_the_cause_is_named_as_not_in_the_way(machine):
    machine.set_meminfo(held=95 * GiB, page_cache=10 * GiB)
    plan = dry_run_plan(seed_args(), device="cuda")
    assert not plan.fits
    assert "95.00 GiB of the 119.70 GiB unified memory (besides 10.00 GiB of page cache, counted as free" in plan.cause


def test_unified_memory_within_a_cgroup_limit(machine, tmp_path, monkeypatch):
    """A container limited to 64 GiB: its limit is the total; its file pages are its page cache."""
    machine.set_meminfo(held=10 * GiB, page_cache=5 * GiB)
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    (cgroup / "memory.max").write_text(str(64 * GiB))
    (cgroup / "memory.current").write_text(str(40 * GiB))
    (cgroup / "memory.stat").write_text(f"anon {25 * GiB}\nfile {15 * GiB}\nactive_file {9 * GiB}\n"
                                        f"inactive_file {6 * GiB}\nshmem 0\n")
    monkeypatch.setattr(device_mod, "CGROUP_V2", cgroup)
    d = dry_run_plan(seed_args(), device="cuda").device
    assert d.total_bytes == 64 * GiB and d.used_by_others_bytes == 25 * GiB and d.page_cache_bytes == 15 * GiB
    host = device_mod.host_memory()
    assert (host.total_bytes, host.used_by_others_bytes, host.page_cache_bytes) == (64 * GiB, 25 * GiB, 15 * GiB)


def test_own_process_memory_is_not_others(machine, monkeypatch):
    """This process's resident set and reserved device memory, and the CUDA context its first reading
    creates, are the engine's; a later reading keeps the context apart."""
    machine.set_meminfo(held=30 * GiB, page_cache=0)
    rss = iter([2 * GiB, 2 * GiB + 100 * MiB])  # before the first CUDA call, after it
    monkeypatch.setattr(device_mod, "_own_rss", lambda: next(rss, 2 * GiB + 100 * MiB))
    # The context (300 MiB of device memory, 100 MiB of it resident) appears with the first CUDA call.
    real_mem_get_info = torch.cuda.mem_get_info

    def first_call(i=None):
        machine.set_meminfo(held=30 * GiB + 400 * MiB, page_cache=0)
        monkeypatch.setattr(torch.cuda, "mem_get_info", real_mem_get_info)
        return real_mem_get_info(i)
    monkeypatch.setattr(torch.cuda, "mem_get_info", first_call)
    first = device_mod.cuda_memory(0)
    assert first.used_by_others_bytes == 28 * GiB  # 30 GiB held less this process's 2 GiB resident
    assert device_mod._context_bytes[0] == 300 * MiB
    machine.reserved = 8 * GiB
    machine.set_meminfo(held=30 * GiB + 400 * MiB + 8 * GiB, page_cache=0)
    assert device_mod.cuda_memory(0).used_by_others_bytes == 28 * GiB
    assert device_mod.held_since("cuda:0", first) == 2 * GiB + 400 * MiB + 8 * GiB


def test_discrete_gpu_context_is_measured_through_nvml(machine):
    machine.integrated, machine.name = False, "NVIDIA H200"
    machine.device_total = 140 * GiB
    machine.cuda_free = 140 * GiB - 106 * GiB - 500 * MiB  # others, then our new context
    machine.nvml = [140 * GiB - 106 * GiB, 140 * GiB - 106 * GiB - 500 * MiB]  # before, after the first call
    machine.set_meminfo(held=8 * GiB, page_cache=1 * GiB)
    d = device_mod.cuda_memory(0)
    assert not d.unified and d.page_cache_bytes == 0  # host page cache is not in a discrete GPU's memory
    assert d.used_by_others_bytes == 106 * GiB and device_mod._context_bytes[0] == 500 * MiB
    # The engine loads 15 GiB; what it holds is everything above what others held at the start.
    machine.reserved, machine.cuda_free = 15 * GiB, machine.cuda_free - 15 * GiB - 200 * MiB
    assert device_mod.cuda_memory(0).used_by_others_bytes == 106 * GiB + 200 * MiB  # later growth: not known as ours
    assert device_mod.held_since("cuda:0", d) == 500 * MiB + 15 * GiB + 200 * MiB


def test_without_nvml_the_context_counts_with_others(machine):
    machine.integrated = False
    machine.device_total = 80 * GiB
    machine.cuda_free = 80 * GiB - 10 * GiB - 500 * MiB
    machine.set_meminfo(held=8 * GiB, page_cache=0)
    assert device_mod.cuda_memory(0).used_by_others_bytes == 10 * GiB + 500 * MiB
    assert device_mod._context_bytes[0] == 0
    machine.nvml = [70 * GiB, 60 * GiB - 2 * GiB]  # a difference no context has: another process's doing
    device_mod._context_bytes.clear()
    device_mod.cuda_memory(0)
    assert device_mod._context_bytes[0] == 0


def test_kv_allocation_failure_names_page_cache_or_others(machine):
    machine.set_meminfo(held=30 * GiB, page_cache=60 * GiB)
    plan = dry_run_plan(seed_args(), device="cuda")
    text = kv_allocation_failure(plan, "CUDA out of memory")
    assert text.startswith("No available memory for the cache blocks: allocating the planned KV cache")
    assert "counted 60.00 GiB of page cache as free" in text and DROP_CACHES in text
    machine.set_meminfo(held=30 * GiB, page_cache=0)
    text = kv_allocation_failure(dry_run_plan(seed_args(), device="cuda"), "CUDA out of memory")
    assert "another process took memory after the engine measured 30.00 GiB" in text
    assert "lower --gpu-memory-utilization below 0.8" in text


def test_plan_page_cache_flag_describes_another_machine(capsys):
    argv = ["plan", "llama-3.2-3b", "--device", "cuda", "--device-memory", "119.7GiB", "--device-memory-used",
            "30GiB", "--page-cache", "60GiB", "--unified-memory", "--gpu-memory-utilization", "0.8",
            "--max-model-len", "2048"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "page cache (reclaimable)" in out and "60.00 GiB" in out and "given" in out
    assert main([*argv, "--json"]) == 0
    import json

    data = json.loads(capsys.readouterr().out)
    assert data["page_cache_bytes"] == 60 * GiB and data["fits"] is True
    # Without the page cache counted as free (held instead), the same machine does not fit.
    held = [*argv[:7], "90GiB", *argv[10:]]
    assert main(held) == 1 and "cause: other processes" in capsys.readouterr().out


@pytest.mark.parametrize("extra, message", [
    (["--device-memory", "80GiB", "--page-cache", "1GiB"], "goes with --unified-memory"),
    (["--page-cache", "1GiB"], "goes with --device-memory"),
    (["--device-memory", "80GiB", "--device-memory-used", "60GiB", "--page-cache", "30GiB", "--unified-memory"],
     "add up to more than --device-memory"),
])
def test_plan_page_cache_flag_refusals(capsys, extra, message):
    assert main(["plan", "llama-3.2-3b", "--device", "cuda", *extra]) == 2
    assert message in capsys.readouterr().err
