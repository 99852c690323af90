"""`--distributed-executor-backend ray`: ranks 1 .. N-1 as Ray actors, placed by a placement group on a
running Ray cluster (`ray start --head` on one machine, `ray start --address HEAD:6379` on the others),
so one engine spans machines. Rank 0 stays in the engine's process on the head; the collectives run over
torch.distributed at a port of the head's address. Ray only places and drives the workers."""
from __future__ import annotations

import logging
import os
import socket

from pagedllm.config import EngineConfig
from pagedllm.errors import WorkerError
from pagedllm.executor.multiproc import free_port, threads_per_rank
from pagedllm.executor.worker import WorkerInfo

logger = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 60.0  # how long the cluster may take to find room for the workers

HOW_TO_START_RAY = (
    "start one: `ray start --head` on this machine (and `ray start --address <this machine's IP>:6379` on each "
    "other machine), or point RAY_ADDRESS at a running cluster; `ray status` shows what it has")


def _ray():
    try:
        import ray
    except ImportError:
        raise ValueError("--distributed-executor-backend ray needs Ray: pip install 'ray>=2.40' (or "
                         "pagedllm[ray]).") from None
    return ray


def _probe(address: str) -> None:
    """A given HOST:PORT that nothing listens on is refused now (Ray itself would retry for minutes)."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return  # "auto", "local", or a form Ray resolves itself
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as e:
        raise ValueError(f"--distributed-executor-backend ray: no Ray cluster answers at RAY_ADDRESS={address} "
                         f"({e}). {HOW_TO_START_RAY}.") from None


class RayWorkers:
    """The workers of ranks 1 .. N-1 as Ray actors; the same calls as multiproc.MultiprocWorkers."""

    def __init__(self, config: EngineConfig) -> None:
        ray = _ray()
        self.ray = ray
        self.config = config
        self.size = config.parallel.tensor_parallel_size
        self.timeout_s = config.parallel.worker_timeout_s
        self.actors: list = []
        self.placement = None
        self.holder = None  # on CUDA: an idle actor in rank 0's bundle, holding rank 0's GPU for it
        self._booting: list = []
        self._replies: list = []
        self._in_flight: list = []
        if not ray.is_initialized():
            address = os.environ.get("RAY_ADDRESS", "auto")
            _probe(address)
            try:
                ray.init(address=address, logging_level=logging.WARNING, log_to_driver=True)
            except ConnectionError as e:
                raise ValueError(f"--distributed-executor-backend ray: no Ray cluster is reachable ({e}). "
                                 f"{HOW_TO_START_RAY}.") from None
        self.head_ip = ray.util.get_node_ip_address()
        self.init_method = f"tcp://{self.head_ip}:{free_port()}"

    def start(self) -> None:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray = self.ray
        gpus = 1 if self.config.device.startswith("cuda") else 0
        bundle = {"CPU": 1, "GPU": gpus} if gpus else {"CPU": 1}
        # Rank 0's own bundle (its GPU) first, pinned to this machine, then one per worker: PACK fills
        # this machine before the next.
        bundles = ([{**bundle, f"node:{self.head_ip}": 0.001}] if gpus else []) + [bundle] * (self.size - 1)
        self.placement = placement_group(bundles, strategy="PACK")
        ready, _ = ray.wait([self.placement.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            raise ValueError(f"the Ray cluster has no room for {self.size - 1} tensor-parallel workers "
                             f"({bundle} each) after {PLACEMENT_TIMEOUT_S:.0f} s; it has "
                             f"{ray.cluster_resources()}. Add machines (`ray start --address ...`) or lower "
                             f"--tensor-parallel-size.")
        actor_cls = ray.remote(RankActor)
        first = 1 if gpus else 0
        if gpus:
            self.holder = ray.remote(GpuHolder).options(num_cpus=0, num_gpus=1,
                                                        scheduling_strategy=PlacementGroupSchedulingStrategy(
                                                            self.placement, placement_group_bundle_index=0)).remote()
        threads = threads_per_rank(self.size)
        self.actors = [actor_cls.options(num_cpus=1, num_gpus=gpus, scheduling_strategy=PlacementGroupSchedulingStrategy(
            self.placement, placement_group_bundle_index=first + i)).remote() for i in range(self.size - 1)]
        self._booting = [actor.boot.remote(self.config, rank, self.size, self.init_method, self.timeout_s, threads)
                         for rank, actor in enumerate(self.actors, start=1)]

    def driver_device(self) -> str:
        """Rank 0's device: on CUDA the head's GPU that Ray reserved in rank 0's bundle (so no worker actor on
        the head is given it too), as this process numbers its visible GPUs; else the CPU."""
        if self.holder is None:
            return "cpu"
        gpu = int(self.ray.get(self.holder.gpu_id.remote()))
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible:
            ids = [int(i) for i in visible.split(",") if i.strip().isdigit()]
            if gpu not in ids:
                raise ValueError(f"Ray reserved GPU {gpu} of this machine for rank 0, but CUDA_VISIBLE_DEVICES="
                                 f"{visible} hides it: unset CUDA_VISIBLE_DEVICES for the server.")
            gpu = ids.index(gpu)
        return f"cuda:{gpu}"

    def ready(self) -> list[WorkerInfo]:
        return self._get(self._booting, timeout=None)

    def send(self, method: str, args: tuple = (), reply: bool = False) -> None:
        self.check_alive()
        refs = [actor.run.remote(method, args) for actor in self.actors]
        if reply:
            self._replies = refs
        else:
            self._in_flight.extend(refs)

    def collect(self) -> list:
        replies, self._replies = self._replies, []
        return self._get(replies, timeout=self.timeout_s)

    def check_alive(self, grace_s: float = 0.0) -> None:
        """Raise the error of any finished step call (a dead actor's, a worker's exception). (`grace_s`: Ray
        reports a dead actor through its calls, which already waited.)"""
        if not self._in_flight:
            return
        done, self._in_flight = self.ray.wait(self._in_flight, num_returns=len(self._in_flight), timeout=0)
        self._get(done, timeout=0)

    def _get(self, refs: list, timeout: float | None) -> list:
        ray = self.ray
        try:
            return ray.get(refs, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise WorkerError(f"a tensor-parallel Ray worker did not answer within {timeout:.0f} s") from None
        except ray.exceptions.RayActorError as e:
            raise WorkerError(f"a tensor-parallel Ray worker died: {e}") from None
        except ray.exceptions.RayTaskError as e:
            raise WorkerError(f"a tensor-parallel Ray worker failed: {e}") from None

    def worker_pids(self) -> list[int]:
        return self.ray.get([actor.pid.remote() for actor in self.actors])

    def shutdown(self, wait_s: float = 10) -> None:
        """Kill the actors (Ray ends their processes) and free the placement group."""
        ray = self.ray
        for actor in self.actors + ([self.holder] if self.holder is not None else []):
            ray.kill(actor)
        self.holder = None
        if self.placement is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.placement)
        self.actors, self.placement = [], None


class GpuHolder:
    """Keeps rank 0's GPU reserved in the placement group while the engine runs (rank 0 is not an actor)."""

    def gpu_id(self) -> str:
        import ray

        return str(ray.get_gpu_ids()[0])


class RankActor:
    """One worker rank inside a Ray actor (Ray sets CUDA_VISIBLE_DEVICES to its GPU: cuda:0 here)."""

    def boot(self, config: EngineConfig, rank: int, size: int, init_method: str, timeout_s: float,
             threads: int) -> WorkerInfo:
        import torch

        from pagedllm.distributed.parallel_state import init_tensor_parallel
        from pagedllm.executor.worker import Worker, device_for_rank

        torch.set_num_threads(threads)
        init_tensor_parallel(rank, size, init_method, torch.device(device_for_rank(config, 0)), timeout_s)
        self.worker = Worker(config, rank, local_rank=0)
        return self.worker.info()

    def run(self, method: str, args: tuple):
        return self.worker.run(method, args)

    def pid(self) -> int:
        return os.getpid()
