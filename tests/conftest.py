"""Shared pytest fixtures: tiny random-weight checkpoints for every supported architecture, and the demo
model served as the README's first line serves it."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

# The run writes bytecode for what it imports, whatever the environment says (PYTHONDONTWRITEBYTECODE=1 on CI
# machines): its ~100 Python processes (servers, workers, CLI runs) then compile torch's and transformers' modules
# once, not each at every start. The install compiles nothing ahead (most of what it installs is never imported).
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

import pytest  # noqa: E402
import torch  # noqa: E402

# No GPU here: the triton attention backend's kernels run under Triton's interpreter on the CPU. Set
# before anything imports them (Triton reads it when a kernel is defined).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (pyproject's addopts: a worker per core), one compute thread per worker, and per server
# or worker process a test starts: two workers of two threads each on two cores lose more to OpenMP's waiting
# than they gain (the demo model's build took 110 s instead of 20).
if os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") != "1":
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

from pagedllm.model_executor.cpu_isa import available_cpu_isas, expected_cpu_isas
from tests.helpers import ARCHS, MOE_ARCHS, hf_greedy, load_hf_model, make_tiny_model

__all__ = ["hf_greedy", "load_hf_model", "make_tiny_model"]


@pytest.hookimpl(trylast=True)  # after the tmp_path plugin's
def pytest_configure(config: pytest.Config) -> None:
    """The demo model (and anything else pagedllm caches) goes to a cache of this test run's, shared by its xdist
    workers and every process a test starts: built fresh once per run (demo.py's lock), never read from or
    written to the user's ~/.cache."""
    if "PAGEDLLM_CACHE_DIR" not in os.environ:
        run_root = config._tmp_path_factory.getbasetemp()
        if hasattr(config, "workerinput"):  # an xdist worker's basetemp is popen-gwN inside the run's
            run_root = run_root.parent
        os.environ["PAGEDLLM_CACHE_DIR"] = str(run_root / "pagedllm-cache")
    if not hasattr(config, "workerinput"):  # the run's own process, once: not each xdist worker
        config.stash[KERNEL_BUILD] = start_kernel_build()


KERNEL_BUILD = pytest.StashKey["subprocess.Popen | None"]()


def start_kernel_build() -> "subprocess.Popen | None":
    """The native CPU kernels built from the start of the run, in a process of their own (~30 s of two cores on a
    fresh machine; nothing when already built), so that the first tests that need them, a minute later, load them
    instead of every xdist worker waiting on one build while the compiler leaves a core idle. Whatever starts
    first waits on the build's lock (cpu_kernels.py) and never builds twice."""
    from pagedllm.model_executor.cpu_kernels import kernels_built

    if os.environ.get("PAGEDLLM_CPU_KERNELS", "1") == "0" or torch.cuda.is_available() or kernels_built():
        return None
    code = "from pagedllm.model_executor.cpu_kernels import load_cpu_kernels; load_cpu_kernels()"
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)  # its own process group: ninja and the compilers stop with it


def pytest_unconfigure(config: pytest.Config) -> None:
    build = config.stash.get(KERNEL_BUILD, None)
    if build is not None and build.poll() is None:  # a run shorter than the build (one quick test)
        os.killpg(build.pid, signal.SIGINT)  # PyTorch's builder then removes its lock: the next start builds
        try:
            build.wait(timeout=30)
        except subprocess.TimeoutExpired:
            build.kill()
            build.wait()


# The order the xdist workers take files in (pyproject: --no-loadscope-reorder, or xdist would sort them by their
# number of tests): two files that need no native kernels first, one per worker (test_demo trains the demo model
# that later files serve, a minute of one core; Triton's kernels interpreted), while the kernels build from the
# start of the run (pytest_configure); then the longest files first (their seconds in a CI run), so that the
# run does not end with one long file on one worker while the other waits; the rest as collected.
LONGEST_FIRST = ("tests/test_demo.py", "tests/models/test_triton_attention.py",
                 "tests/distributed/test_tensor_parallel.py", "tests/server/test_abuse.py",
                 "tests/distributed/test_data_parallel.py", "tests/server/test_production.py",
                 "tests/distributed/test_tp_server.py", "tests/models/test_parity.py", "tests/test_cli.py",
                 "tests/server/test_fuzz.py", "tests/server/test_web_ui.py", "tests/server/test_audio_server.py", "tests/models/test_cuda_graphs.py",
                 "tests/distributed/test_ray.py", "tests/server/test_guidellm.py", "tests/test_readme.py",
                 "tests/server/test_tool_calls.py", "tests/server/test_errors_and_aborts.py",
                 "tests/models/test_higgs_engine.py", "tests/engine/test_grammar_limits.py")


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))  # stable: the rest as found


@pytest.fixture(params=expected_cpu_isas())
def cpu_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each CPU path this machine can run, best first (amx, avx512_bf16, avx2, none: cpu_isa.py), forced in
    turn with PAGEDLLM_CPU_ISA: a test that takes it states what each path promises, and so checks every
    path at or below this machine's own. The paths are read from the CPU's flags at collection (building
    the kernels there would hold every xdist worker for a minute) and must be what the built kernels say."""
    assert available_cpu_isas() == expected_cpu_isas(), "the kernels built here run other paths than the flags say"
    monkeypatch.setenv("PAGEDLLM_CPU_ISA", request.param)
    return request.param


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """arch -> folder of a tiny checkpoint (built once per test session, ~0.5 s each)."""
    root = tmp_path_factory.mktemp("tiny_models")
    return {arch: make_tiny_model(root / arch, arch) for arch in ARCHS + MOE_ARCHS}


@dataclass
class DemoServer:
    url: str  # http://127.0.0.1:PORT
    log_dir: Path  # its stdout and stderr


@pytest.fixture(scope="session")
def demo_server(tmp_path_factory: pytest.TempPathFactory):
    """`pagedllm serve` with no model (the demo model), on a free port; it must exit cleanly (status 0)."""
    from tests.server.conftest import start_command

    log_dir = tmp_path_factory.mktemp("demo_server")
    proc, url = start_command(lambda port: [sys.executable, "-m", "pagedllm", "serve", "--port", str(port)],
                              log_dir, deadline_polls=600)
    yield DemoServer(url, log_dir)
    proc.terminate()
    assert proc.wait(timeout=60) == 0
