"""The server's engine thread is the only thread that keeps an OpenMP pool (executor/openmp.py): the pool of
the thread that built the engine is released, and torch computes the same afterwards."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from pagedllm.engine import async_engine
from pagedllm.executor.openmp import release_thread_pool


def _os_threads() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("Threads:"))


def _parallel_work() -> torch.Tensor:
    a = torch.arange(512 * 512, dtype=torch.float32).reshape(512, 512).remainder(7) - 3
    return a @ a.T


@pytest.fixture
def two_openmp_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _wait_for(condition, timeout_s: float = 10.0) -> bool:
    """Pool workers leave after the release returns (a barrier, then thread exit): poll for it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


def test_releasing_the_pool_ends_its_workers_and_torch_still_computes_the_same(two_openmp_threads):
    expected = _parallel_work()  # this thread now holds a pool with one worker
    engine_thread_done = threading.Event()
    result: list[torch.Tensor] = []

    def engine_thread() -> None:  # a second pool, kept alive until the end (its thread's exit would free it)
        result.append(_parallel_work())
        engine_thread_done.wait(30)

    other = threading.Thread(target=engine_thread)
    other.start()
    try:
        assert _wait_for(lambda: len(result) == 1)
        with_two_pools = _os_threads()
        assert release_thread_pool(), "PyTorch's OpenMP runtime was not found in /proc/self/maps"
        assert _wait_for(lambda: _os_threads() <= with_two_pools - 1), "the calling thread's pool kept its worker"
    finally:
        engine_thread_done.set()
        other.join()
    assert torch.equal(result[0], expected)
    assert torch.equal(_parallel_work(), expected)  # the releasing thread gets a fresh pool when it computes


def test_the_async_engine_releases_the_building_threads_pool_before_its_thread_starts(monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(async_engine, "release_thread_pool", lambda: calls.append(threading.current_thread().name))
    started = threading.Event()

    class _Engine:  # the engine thread's loop only needs to start; it waits on the command queue
        pass

    monkeypatch.setattr(async_engine.AsyncLLMEngine, "_loop", lambda self: started.set())
    async_engine.AsyncLLMEngine(_Engine())
    assert started.wait(10)
    assert calls == [threading.current_thread().name]
