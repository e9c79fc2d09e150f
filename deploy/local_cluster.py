"""LocalCluster: an embedded kvrelay cluster on one machine (local Ray, optional local
redis-server, N prefill and M decode worker actors, a ClusterBackend). Owns those processes
and stops them all in close()."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from dataclasses import dataclass, field, replace
from typing import Any

from engine.config import EngineConfig

logger = logging.getLogger(__name__)
NAMESPACE = "kvrelay"


@dataclass(frozen=True)
class ClusterSpec:
    engine: EngineConfig = field(default_factory=EngineConfig)
    num_prefill: int = 1
    num_decode: int = 1
    redis_url: str | None = None  # None: start a local redis-server; "" : run without Redis
    policy: str = "kv_aware"
    lease_s: float = 30.0
    transfer_timeout_s: float = 10.0
    threads_per_worker: int | None = None
    ray_address: str = "local"
    name_prefix: str = "kvrelay"


class LocalCluster:
    def __init__(self, spec: ClusterSpec):
        self.spec = spec
        self.redis: Any = None
        self.redis_url: str | None = None
        self.prefill_actors: dict[str, Any] = {}
        self.decode_actors: dict[str, Any] = {}
        self.backend: Any = None
        self.model: Any = None  # common.messages.ServedModel, once started
        self._owns_ray = False
        self._worker_pids: list[int] = []  # local worker processes (embedded Ray only)

    async def start(self, progress=print) -> LocalCluster:
        import ray

        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        spec = self.spec
        if spec.redis_url is None:
            from common.redis_url import redact
            from deploy.redis_local import LocalRedis

            self.redis = LocalRedis().start()
            self.redis_url = self.redis.url
            progress(f"kvrelay: local redis-server at {redact(self.redis_url)}")
        else:
            self.redis_url = spec.redis_url or None
        if not ray.is_initialized():
            if spec.ray_address == "local":
                num_workers = spec.num_prefill + spec.num_decode
                ray.init(
                    address="local",
                    namespace=NAMESPACE,
                    include_dashboard=False,
                    num_cpus=max(2, num_workers + 1),
                    resources={"prefill_pool": spec.num_prefill, "decode_pool": spec.num_decode},
                )
            else:  # an existing cluster (`ray up`): its nodes declare the pool resources
                ray.init(address=spec.ray_address, namespace=NAMESPACE)
            self._owns_ray = True
        if spec.engine.device == "auto":
            spec = self.spec = replace(
                spec, engine=replace(spec.engine, device=self._pick_device(ray, progress))
            )
        threads = spec.threads_per_worker or max(1, (os.cpu_count() or 2) // 2)
        progress(
            f"kvrelay: starting {spec.num_prefill} prefill and {spec.num_decode} decode workers"
        )
        for i in range(spec.num_prefill):
            self._start_prefill(f"{spec.name_prefix}-prefill-{i}", threads)
        for i in range(spec.num_decode):
            self._start_decode(f"{spec.name_prefix}-decode-{i}", threads)
        actors = [*self.prefill_actors.values(), *self.decode_actors.values()]
        self._worker_pids = list(await asyncio.gather(*(a.pid.remote() for a in actors)))
        self.backend = await self._make_backend()
        progress("kvrelay: workers ready")
        return self

    def _pick_device(self, ray: Any, progress) -> str:
        """--device auto: cuda when the Ray cluster has a GPU for every worker, else cpu."""
        gpus = int(ray.cluster_resources().get("GPU", 0))
        workers = self.spec.num_prefill + self.spec.num_decode
        if gpus >= workers:
            progress(f"kvrelay: device cuda ({gpus} GPUs for {workers} workers, one each)")
            return "cuda"
        why = "no GPU visible to Ray" if gpus == 0 else f"{gpus} GPUs for {workers} workers"
        progress(f"kvrelay: device cpu ({why}; --device cuda to insist)")
        return "cpu"

    def _start_prefill(self, name: str, threads: int) -> None:
        from prefill_worker.worker import PrefillWorker, PrefillWorkerConfig

        config = PrefillWorkerConfig(
            name, self.spec.engine, self.redis_url, self.spec.lease_s, num_threads=threads
        )
        self.prefill_actors[name] = self._spawn(PrefillWorker, "prefill_pool", name, config)

    def _start_decode(self, name: str, threads: int) -> None:
        from decode_worker.worker import DecodeWorker, DecodeWorkerConfig

        config = DecodeWorkerConfig(
            name,
            self.spec.engine,
            self.redis_url,
            self.spec.transfer_timeout_s,
            num_threads=threads,
        )
        self.decode_actors[name] = self._spawn(DecodeWorker, "decode_pool", name, config)

    def _spawn(self, worker_cls: type, pool: str, name: str, config: Any) -> Any:
        """One named worker actor on a node of its pool (one GPU each on CUDA)."""
        import ray

        return (
            ray.remote(worker_cls)
            .options(
                name=name,
                namespace=NAMESPACE,
                num_cpus=0,
                num_gpus=self._gpus_per_worker,
                resources={pool: 1},
                max_concurrency=1000,
            )
            .remote(config, name)
        )

    @property
    def _gpus_per_worker(self) -> int:
        return 1 if self.spec.engine.device.startswith("cuda") else 0

    async def _make_backend(self):
        from router.cluster_backend import ClusterBackend
        from router.policy import make_prefill_policy
        from router.prefix_index import PrefixIndex
        from router.worker_set import WorkerSet

        workers = WorkerSet()
        for name, actor in self.prefill_actors.items():
            workers.add(name, "prefill", actor, name)
        for name, actor in self.decode_actors.items():
            workers.add(name, "decode", actor, name)
        first = next(iter(self.prefill_actors.values()))
        self.model = model = await first.served_model.remote()
        index = PrefixIndex(self.redis_url, model.model_id) if self.redis_url else None
        if index is not None:
            await index.probe()  # a refused password or TLS setup is logged now, not per request
        return ClusterBackend(
            model.model_id,
            model.max_model_len,
            model.vocab_size,
            model.block_size,
            workers,
            index,
            make_prefill_policy(self.spec.policy),
        )

    async def close(self) -> None:
        import ray

        if self.backend is not None:
            await self.backend.close()
            if self.backend.index is not None:
                await self.backend.index.close()
        for actor in [*self.prefill_actors.values(), *self.decode_actors.values()]:
            try:
                await actor.shutdown.remote()
                actor.__ray_terminate__.remote()
            except Exception as e:
                logger.info("worker shutdown: %s", e)
        self.prefill_actors.clear()
        self.decode_actors.clear()
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
            if self.spec.ray_address == "local":  # the workers are processes of this machine
                await _reap(self._worker_pids)  # one Ray has not stopped yet must not outlive us
        if self.redis is not None:
            self.redis.stop()


async def _reap(pids: list[int], grace_s: float = 10.0) -> None:
    """Wait for the worker processes of an embedded Ray to exit; SIGKILL any still there."""
    deadline = time.monotonic() + grace_s
    alive = [pid for pid in pids if _alive(pid)]
    while alive and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        alive = [pid for pid in alive if _alive(pid)]
    for pid in alive:
        logger.warning("worker process %d did not exit with Ray; killing it", pid)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (exited, not yet reaped by its parent) counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True
