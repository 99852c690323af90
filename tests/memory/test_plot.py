"""`pagedllm plan --plot`: the plan as a picture. The seed's scenario (does not fit: what it needs drawn past the
budget, each fix its own bar) and a plan that fits; the bar's segments are the plan's own numbers, and the PNG and
SVG files decode."""
from __future__ import annotations

import subprocess
import sys

import matplotlib.image

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.entrypoints.plan import dry_run_plan
from pagedllm.memory.plot import plan_segments, plot_plan
from tests.test_cli_plan import SEED, seed_plan


def test_the_seed_plan_draws_its_overflow_and_each_fix():
    plan = seed_plan()
    assert not plan.fits
    segments = {s.name: s for s in plan_segments(plan)}
    assert segments["used by others"].num_bytes == plan.device.used_by_others_bytes
    assert segments["weights"].num_bytes == plan.weight_bytes
    needed = segments["KV cache needed (one max_model_len sequence)"]
    assert needed.overflow and needed.num_bytes == plan.seq_bytes
    drawn = sum(s.num_bytes for s in segments.values())
    assert drawn > plan.budget_bytes  # past the budget line: the overflow
    fixes = plan.fixes()
    assert fixes and all(f.plan is not None and f.plan.fits for f in fixes)
    for fix in fixes:
        fixed = {s.name: s for s in plan_segments(fix.plan)}
        assert not any(s.overflow for s in fixed.values())
        assert fixed["KV cache"].num_bytes == fix.plan.kv_cache_bytes > 0


def test_a_plan_that_fits_is_one_bar_up_to_its_budget(tmp_path):
    plan = dry_run_plan(EngineArgs(model="llama-3.1-8b", max_model_len=8192), device="cuda", device_memory="80GiB")
    assert plan.fits and plan.fixes() == []
    segments = plan_segments(plan)
    assert not any(s.overflow for s in segments)
    assert sum(s.num_bytes for s in segments) == plan.budget_bytes  # the unused budget closes the bar at the line
    plot_plan(plan, str(tmp_path / "fits.svg"))
    assert (tmp_path / "fits.svg").read_text().lstrip().startswith("<?xml")


def test_the_command_writes_a_png_that_decodes(tmp_path):
    out = tmp_path / "seed.png"
    run = subprocess.run([sys.executable, "-m", "pagedllm", *SEED, "--plot", str(out)], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 1 and "does NOT fit" in run.stdout  # (the plan's verdict, as without --plot)
    image = matplotlib.image.imread(out)
    height, width = image.shape[:2]
    assert 900 <= width <= 2000 and 150 <= height <= 600 and out.stat().st_size > 10_000
    from pagedllm.entrypoints.cli import main

    assert main([*SEED, "--plot", str(tmp_path / "plan.docx")]) == 2  # refused before anything is planned
    assert not (tmp_path / "plan.docx").exists()
