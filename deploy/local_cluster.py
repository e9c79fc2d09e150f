"""LocalCluster: an embedded kvrelay cluster on one machine (local Ray, optional local
redis-server, the controller actor and its prefill and decode workers, one in-process router's
ClusterBackend). Owns those processes and stops them all in close(): none outlives it."""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
from dataclasses import dataclass, field, replace
from typing import Any

from common.cluster_state import CONTROLLER_NAME, NAMESPACE, WorkerState
from common.placement_rules import LocalPrefill, SloTargets
from common.redis_url import redact
from common.worker_actors import ControllerActor
from deploy.autoscale import AutoscaleConfig
from deploy.controller import ControllerConfig, start_controller
from deploy.controller_redis import forget_in_index
from deploy.progress import follow
from deploy.ray_local import EmbeddedRay, ProcessId, cluster_processes, embedded_ray, reap
from deploy.router_launch import build_backend
from deploy.worker_launch import WorkerTemplate, check_gpus_per_worker, gpus_needed
from engine.config import EngineConfig

logger = logging.getLogger(__name__)
LOCAL_POOL_SLOTS = 64  # workers of each pool an embedded (single-node) Ray can host
STATUS_TIMEOUT_S = 10.0  # close(): asking the controller which workers it has
SHUTDOWN_TIMEOUT_S = 45.0  # close(): every worker withdrawn and stopped (each has 30 s)
REAP_GRACE_S = 10.0  # close(): an embedded Ray's processes exit by themselves within this


@dataclass(frozen=True)
class ClusterSpec:
    engine: EngineConfig = field(default_factory=EngineConfig)
    num_prefill: int = 1  # 0: aggregated, the decode workers compute every prompt
    num_decode: int = 1
    redis_url: str | None = None  # None: start a local redis-server; "" : run without Redis
    policy: str = "kv_aware"
    lease_s: float = 30.0
    transfer_timeout_s: float = 10.0
    threads_per_worker: int | None = None
    ray_address: str = "local"
    name_prefix: str = "kvrelay"
    controller_name: str = CONTROLLER_NAME
    drain_grace_s: float = 2.0
    max_migrations: int = 2
    router_timeout_s: float = 10.0  # decode workers abort a router's requests after its silence
    local_prefill: LocalPrefill = field(default_factory=LocalPrefill)  # conditional prefill
    slo: SloTargets = field(default_factory=SloTargets)  # objectives the routers place for
    decode_prefill_chunk_tokens: int | None = None  # None: the engine's own step budget
    autoscale: AutoscaleConfig | None = None  # None: sizes change only on `kvrelay scale`
    # CUDA: the part of a GPU each worker gets (None: 1); 0.5 puts two workers on each card,
    # each engine's KV pool then sized from half of gpu_memory_utilization of its memory.
    gpus_per_worker: float | None = None
    # Tensor-parallel ranks of each pool's workers (one Ray actor and, on CUDA, one GPU each).
    prefill_tp: int = 1
    decode_tp: int = 1
    otlp_endpoint: str | None = None  # the workers' traces go there (None: tracing off)

    def __post_init__(self) -> None:
        if self.num_prefill < 0 or self.num_decode < 1:
            raise ValueError(
                f"need num_prefill >= 0 and num_decode >= 1, got {self.num_prefill}, "
                f"{self.num_decode}"
            )
        if self.gpus_per_worker is not None:
            check_gpus_per_worker(self.gpus_per_worker)
        for name in ("prefill_tp", "decode_tp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def num_workers(self) -> int:
        return self.num_prefill + self.num_decode

    @property
    def num_ranks(self) -> int:
        """Ranks of every worker together (a worker at TP 1 is one)."""
        return self.num_prefill * self.prefill_tp + self.num_decode * self.decode_tp

    @property
    def num_cpu_slots(self) -> int:
        """Logical CPUs an embedded Ray declares: a TP worker's CPU bundles take one a rank
        (TP-1 workers take none), up to the autoscaler's largest pools; `kvrelay scale` past
        them leaves a CPU TP worker pending."""
        sizes = {"prefill": self.num_prefill, "decode": self.num_decode}
        if self.autoscale is not None and max(self.prefill_tp, self.decode_tp) > 1:
            sizes = {
                role: max(n, self.autoscale.max_size.get(role, 0)) for role, n in sizes.items()
            }
        ranks = sizes["prefill"] * self.prefill_tp + sizes["decode"] * self.decode_tp
        return max(2, ranks + 1)

    def worker_gpus(self, device: str) -> float:
        """Ray num_gpus of each worker on device: 0 on CPU."""
        if not device.startswith("cuda"):
            return 0.0
        return 1.0 if self.gpus_per_worker is None else self.gpus_per_worker


class LocalCluster:
    def __init__(self, spec: ClusterSpec):
        self.spec = spec
        self.redis: Any = None
        self.redis_url: str | None = None
        self.controller: ControllerActor | None = None
        self.backend: Any = None
        self.model: Any = None  # common.messages.ServedModel, once started
        self._owns_ray = False
        self._ray: EmbeddedRay | None = None  # the Ray this process started, if it did

    @property
    def prefill_actors(self) -> dict[str, Any]:
        """Worker id -> actor of the prefill workers the router knows (ready or draining)."""
        return self.backend.workers.actors("prefill")

    @property
    def decode_actors(self) -> dict[str, Any]:
        return self.backend.workers.actors("decode")

    async def start(self, progress=print) -> LocalCluster:
        import ray

        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        spec = self.spec
        if not ray.is_initialized():
            if spec.ray_address == "local":
                ray.init(
                    address="local",
                    namespace=NAMESPACE,
                    include_dashboard=False,
                    num_cpus=spec.num_cpu_slots,
                    resources={"prefill_pool": LOCAL_POOL_SLOTS, "decode_pool": LOCAL_POOL_SLOTS},
                )
            else:  # an existing cluster (`ray up`): its nodes declare the pool resources
                ray.init(address=spec.ray_address, namespace=NAMESPACE)
            self._owns_ray = True
            self._ray = embedded_ray()
        if spec.engine.device == "auto":
            spec = self.spec = replace(
                spec, engine=replace(spec.engine, device=self._pick_device(ray, progress))
            )
        elif spec.engine.device.startswith("cuda") and spec.ray_address == "local":
            self._check_gpus(ray)  # no GPU joins an embedded Ray later: refuse before waiting
        if spec.redis_url is None:
            self.redis = self._start_redis(ray)
            self.redis_url = self.redis.url
            progress(f"kvrelay: local redis-server at {redact(self.redis_url)}")
        else:
            self.redis_url = spec.redis_url or None
        threads = spec.threads_per_worker or max(1, (os.cpu_count() or 2) // 2)
        template = WorkerTemplate(
            spec.engine,
            self.redis_url,
            spec.lease_s,
            spec.transfer_timeout_s,
            threads,
            gpus_per_worker=spec.worker_gpus(spec.engine.device),
            router_timeout_s=spec.router_timeout_s,
            decode_prefill_chunk_tokens=spec.decode_prefill_chunk_tokens,
            publish_decode_cache=spec.local_prefill.enabled or spec.num_prefill == 0,
            prefill_tp=spec.prefill_tp,
            decode_tp=spec.decode_tp,
            otlp_endpoint=spec.otlp_endpoint,
        )
        config = ControllerConfig(
            template,
            spec.policy,
            spec.max_migrations,
            spec.name_prefix,
            drain_grace_s=spec.drain_grace_s,
            local_prefill=spec.local_prefill,
            slo=spec.slo,
            autoscale=spec.autoscale,
        )
        progress(
            f"kvrelay: starting the controller, {spec.num_prefill} prefill and "
            f"{spec.num_decode} decode workers"
        )
        sizes = {"prefill": spec.num_prefill, "decode": spec.num_decode}
        self.controller = await start_controller(config, sizes, spec.controller_name)
        await follow(self.controller, progress)
        self.backend, router_config = await build_backend(self.controller)
        self.model = router_config.model
        progress("kvrelay: workers ready")
        return self

    def _start_redis(self, ray: Any) -> Any:
        """On an embedded Ray, a loopback redis-server; on a multi-node cluster (`ray up`), one
        on this node's IP that workers on other nodes reach, behind a generated password."""
        from deploy.redis_local import LocalRedis

        if self.spec.ray_address == "local":
            return LocalRedis().start()
        node_ip = ray.util.get_node_ip_address()
        return LocalRedis(host=node_ip, password=secrets.token_urlsafe(24)).start()

    def _pick_device(self, ray: Any, progress) -> str:
        """--device auto: cuda when the Ray cluster has the GPUs every worker needs (at
        --gpus-per-worker each), else cpu."""
        gpus = int(ray.cluster_resources().get("GPU", 0))
        workers, per_worker = self.spec.num_ranks, self.spec.worker_gpus("cuda")
        needed = gpus_needed(workers, per_worker)
        each = "one each" if per_worker == 1 else f"{per_worker:g} GPU each"
        if gpus >= needed:
            progress(f"kvrelay: device cuda ({gpus} GPUs for {workers} workers, {each})")
            return "cuda"
        why = f"{workers} workers at {each} need {needed} GPUs, Ray has {gpus}"
        if gpus == 0:
            why = "no GPU visible to Ray"
        progress(f"kvrelay: device cpu ({why}; --device cuda to insist)")
        return "cpu"

    def _check_gpus(self, ray: Any) -> None:
        """--device cuda on an embedded Ray: refuse a worker count its GPUs cannot hold."""
        gpus = int(ray.cluster_resources().get("GPU", 0))
        workers, per_worker = self.spec.num_ranks, self.spec.worker_gpus("cuda")
        if gpus < (needed := gpus_needed(workers, per_worker)):
            raise ValueError(gpu_shortage(workers, per_worker, needed, gpus))

    def lost(self) -> str | None:
        """Why the embedded Ray is gone (its raylet or GCS server exited); None while it runs,
        or when this cluster runs on a Ray it did not start."""
        return None if self._ray is None else self._ray.lost()

    async def close(self) -> None:
        """Stop the router side, the controller and its workers (each withdraws from Redis
        first), the embedded Ray and every process it started (waited for, killed after
        REAP_GRACE_S), then Redis. Each step runs whatever the one before it raised, and none
        waits on a lost cluster for long: a router-side failure is logged, and the cluster
        behind it still goes down."""
        import ray

        if self.backend is not None:
            try:
                await self.backend.close()
                if self.backend.index is not None:
                    await self.backend.index.close()
            except Exception as e:
                logger.warning("router side of the cluster did not close cleanly: %r", e)
        await self._stop_workers(ray)
        processes: list[ProcessId] = []
        if self._owns_ray and ray.is_initialized():
            if self._ray is not None:
                processes = cluster_processes(self._ray)
            ray.shutdown()
            if self._ray is not None:  # workers a lost raylet left behind are found too
                killed = await reap([*processes, *cluster_processes(self._ray)], REAP_GRACE_S)
                if killed:
                    logger.warning("killed Ray processes that outlived the cluster: %s", killed)
        if self.redis is not None:
            self.redis.close()

    async def _stop_workers(self, ray: Any) -> None:
        """The controller stops every worker (each withdraws from the index), then goes; the
        index entries of any that could not withdraw (dead, or Ray lost) are removed here."""
        if self.controller is None:
            return
        worker_ids: list[str] = []
        try:
            status = await asyncio.wait_for(self.controller.status.remote(False), STATUS_TIMEOUT_S)
            worker_ids = [
                w.worker_id
                for pool in status.pools
                for w in pool.workers
                if w.state != WorkerState.GONE  # a gone one withdrew, or was removed, already
            ]
            await asyncio.wait_for(self.controller.shutdown.remote(), SHUTDOWN_TIMEOUT_S)
        except Exception as e:
            logger.info("controller shutdown: %r", e)
        try:
            ray.kill(self.controller, no_restart=True)
        except Exception as e:
            logger.info("controller kill: %r", e)
        self.controller = None
        if self.model is not None:
            for worker_id in worker_ids:  # idempotent: a withdrawn worker has nothing left
                await forget_in_index(self.redis_url, self.model.model_id, worker_id)


def gpu_shortage(num_workers: int, gpus_per_worker: float, needed: int, num_gpus: int) -> str:
    """Why the workers do not fit on this machine's GPUs, and what would make them."""
    return (
        f"{num_workers} CUDA workers at {gpus_per_worker:g} GPU each need {needed} GPUs; Ray "
        f"sees {num_gpus} here. Run fewer workers, or share GPUs (--gpus-per-worker 0.5 puts "
        "two workers on one card), or --device cpu"
    )
