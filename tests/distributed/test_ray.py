"""`--distributed-executor-backend ray` on a local Ray cluster this test starts (`ray start --head`, as a user
would on the head machine): TP=2 ranks placed by a placement group, greedy tokens equal to one rank's, with
chunked prefill; no reachable cluster is a clear error that says how to start one."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.executor.multiproc import free_port
from tests.sampling_features import ENGINE_FEATURES, run_features, same_greedy_outputs


PROMPTS = [[5 + i for i in range(n)] for n in (7, 19, 33)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
ENGINE = {"dtype": "float32", "device": "cpu", "max_model_len": 64, "block_size": 4}


def _ray_cli() -> str:
    return shutil.which("ray", path=os.path.dirname(sys.executable)) or "ray"


@pytest.fixture(scope="module")
def ray_cluster():
    """A one-machine Ray cluster (2 CPUs) at a free port; RAY_ADDRESS names it while the tests run."""
    port = free_port()
    subprocess.run([_ray_cli(), "start", "--head", "--port", str(port), "--num-cpus", "2",
                    "--include-dashboard=false", "--disable-usage-stats"], check=True, capture_output=True,
                   timeout=120)
    previous = os.environ.get("RAY_ADDRESS")
    os.environ["RAY_ADDRESS"] = f"127.0.0.1:{port}"
    try:
        yield os.environ["RAY_ADDRESS"]
    finally:
        import ray

        ray.shutdown()
        subprocess.run([_ray_cli(), "stop", "--force"], capture_output=True, timeout=120)
        if previous is None:
            os.environ.pop("RAY_ADDRESS", None)
        else:
            os.environ["RAY_ADDRESS"] = previous


def test_ranks_on_ray_generate_what_one_rank_does(tiny_models, ray_cluster):
    path = str(tiny_models["qwen3"])
    with LLM(path, **ENGINE) as one:
        reference = [o.outputs[0].token_ids for o in one.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                                                                   use_tqdm=False)]
    with LLM(path, tensor_parallel_size=2, distributed_executor_backend="ray", max_num_batched_tokens=16,
             **ENGINE) as two:
        workers = two.llm_engine.executor.workers
        assert type(workers).__name__ == "RayWorkers" and len(workers.worker_pids()) == 1
        assert workers.worker_pids()[0] != os.getpid()
        got = [o.outputs[0].token_ids for o in two.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                                                             use_tqdm=False)]
    assert got == reference


def test_every_sampling_feature_holds_on_ray_ranks(tiny_models, ray_cluster):
    """The feature batch of tests/sampling_features.py on two ranks placed by Ray, with an fp8 KV cache, int8
    weights and swap space: each constraint holds (structured outputs' bitmask, logit_bias, min_tokens ...), and
    the greedy outputs are one rank's with the same settings."""
    path = str(tiny_models["qwen2"])
    settings = ENGINE_FEATURES | {"kv_cache_dtype": "fp8", "quantization": "int8", "swap_space": 0.001}
    with LLM(path, **settings) as one:
        reference = run_features(one)
    with LLM(path, tensor_parallel_size=2, distributed_executor_backend="ray", **settings) as two:
        outs = run_features(two)
        assert two.llm_engine.preemption_stats.total > 0
    same_greedy_outputs(outs, reference)


def test_higgs_audio_on_ray_ranks_speaks_what_one_rank_does(tmp_path, ray_cluster):
    from tests.distributed.test_tensor_parallel import speaks_what_one_rank_does

    speaks_what_one_rank_does(tmp_path, "ray")


def test_no_reachable_cluster_says_how_to_start_one(tiny_models, monkeypatch):
    import ray

    if ray.is_initialized():
        ray.shutdown()
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{free_port()}")  # nothing listens there
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"no Ray cluster answers at RAY_ADDRESS=.*ray start --head"):
        LLM(str(tiny_models["llama"]), tensor_parallel_size=2, distributed_executor_backend="ray", device="cpu")
    assert time.monotonic() - start < 30
