"""LocalCluster: an embedded kvrelay cluster on one machine (local Ray, optional local
redis-server, a controller actor per served model with that model's prefill and decode workers,
one in-process router's ClusterBackend per model, behind a ModelsBackend when there are several).
Owns those processes and stops them all in close(): none outlives it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
from collections.abc import Callable
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
REDIS_WATCH_S = 1.0  # keep_redis: how often the embedded redis-server is looked at
REDIS_RETRY_S = 5.0  # and how long it waits after a failed start before the next try
LOCAL_POOL_SLOTS = 64  # workers of each pool an embedded (single-node) Ray can host
STATUS_TIMEOUT_S = 10.0  # close(): asking the controller which workers it has
SHUTDOWN_TIMEOUT_S = 45.0  # close(): every worker withdrawn and stopped (each has 30 s)
REAP_GRACE_S = 10.0  # close(): an embedded Ray's processes exit by themselves within this


@dataclass(frozen=True)
class ModelPools:
    """One model of a cluster and its pools' sizes (a cluster serving several has one each)."""

    engine: EngineConfig
    num_prefill: int = 1
    num_decode: int = 1
    autoscale: AutoscaleConfig | None = None


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
    # The serve's API keys and per-key limits as a digest (RouterOptions.access_digest; None:
    # none): a `kvrelay router` that joins must bring the same.
    access_digest: str | None = None
    # The models served beside `engine`'s (the first, the default), each with its own pools,
    # controller and index namespace; they share every other field.
    more_models: tuple[ModelPools, ...] = ()

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
    def models(self) -> tuple[ModelPools, ...]:
        """Every served model's pools, the default (`engine`'s) first."""
        first = ModelPools(self.engine, self.num_prefill, self.num_decode, self.autoscale)
        return (first, *self.more_models)

    @property
    def num_workers(self) -> int:
        return sum(m.num_prefill + m.num_decode for m in self.models)

    @property
    def num_ranks(self) -> int:
        """Ranks of every worker together (a worker at TP 1 is one)."""
        return sum(
            m.num_prefill * self.prefill_tp + m.num_decode * self.decode_tp for m in self.models
        )

    @property
    def num_cpu_slots(self) -> int:
        """Logical CPUs an embedded Ray declares: a TP worker's CPU bundles take one a rank
        (TP-1 workers take none), up to the autoscaler's largest pools; `kvrelay scale` past
        them leaves a CPU TP worker pending."""
        ranks = 0
        for model in self.models:
            sizes = {"prefill": model.num_prefill, "decode": model.num_decode}
            if model.autoscale is not None and max(self.prefill_tp, self.decode_tp) > 1:
                most = model.autoscale.max_size
                sizes = {role: max(n, most.get(role, 0)) for role, n in sizes.items()}
            ranks += sizes["prefill"] * self.prefill_tp + sizes["decode"] * self.decode_tp
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
        self.router_id = ""  # the embedded router's, once start() built its backends
        self.controller: ControllerActor | None = None
        self.backend: Any = None  # the one model's ClusterBackend, or a ModelsBackend of them
        self.model: Any = None  # common.messages.ServedModel of the default model, once started
        self.models: dict[str, Any] = {}  # model id -> ServedModel, the default first
        self.backends: dict[str, Any] = {}  # model id -> its ClusterBackend
        self.controllers: dict[str, ControllerActor] = {}  # model id -> its controller
        self._owns_ray = False
        self._ray: EmbeddedRay | None = None  # the Ray this process started, if it did

    @property
    def prefill_actors(self) -> dict[str, Any]:
        """Worker id -> actor of the prefill workers the router knows (ready or draining), of
        every model."""
        return {
            i: a for b in self.backends.values() for i, a in b.workers.actors("prefill").items()
        }

    @property
    def decode_actors(self) -> dict[str, Any]:
        return {i: a for b in self.backends.values() for i, a in b.workers.actors("decode").items()}

    def known_workers(self) -> dict[str, int]:
        """Pool -> its ready workers the router knows, over every model (the stats line's
        count, answering or not)."""
        return {
            role: sum(len(b.workers.known(role)) for b in self.backends.values())
            for role in ("prefill", "decode")
        }

    async def start(
        self, progress=print, on_ray_init: Callable[[], None] | None = None
    ) -> LocalCluster:
        """Start it all; on_ray_init: called once ray.init() returned (which puts a SIGTERM
        handler of its own in place: `kvrelay serve` takes its signals back). Cancelled midway,
        what started is recorded for close() to stop."""
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
            if on_ray_init is not None:
                on_ray_init()
        if spec.engine.device == "auto":
            device = self._pick_device(ray, progress)
            more = tuple(
                replace(m, engine=replace(m.engine, device=device)) for m in spec.more_models
            )
            spec = self.spec = replace(
                spec, engine=replace(spec.engine, device=device), more_models=more
            )
        elif spec.engine.device.startswith("cuda") and spec.ray_address == "local":
            self._check_gpus(ray)  # no GPU joins an embedded Ray later: refuse before waiting
        if spec.redis_url is None:
            self.redis = self._start_redis(ray)
            self.redis_url = self.redis.url
            progress(f"kvrelay: local redis-server at {redact(self.redis_url)}")
        else:
            self.redis_url = spec.redis_url or None
        names = controller_names(spec)
        several = len(names) > 1
        progress(
            "kvrelay: starting "
            + ("a controller per model, " if several else "the controller, ")
            + "; ".join(
                f"{f'{name}: ' if several else ''}{m.num_prefill} prefill and {m.num_decode} "
                "decode workers"
                for name, m in zip(names, spec.models, strict=True)
            )
        )
        for model_id, model in zip(names, spec.models, strict=True):  # close() stops each
            controller = await self._start_controller(model_id, names[model_id], model, several)
            self.controllers[model_id] = controller
            self.controller = self.controller or controller
        started = await asyncio.gather(*(follow(c, progress) for c in self.controllers.values()))
        if self._owns_ray and spec.ray_address == "local" and spec.engine.device == "cpu":
            await self._bound_pools(started)  # an embedded CPU cluster cannot outgrow its box
        router_id = f"router-{secrets.token_hex(4)}"  # one router, known to every controller
        self.router_id = router_id
        for model_id, controller in self.controllers.items():
            backend, router_config = await build_backend(controller, router_id=router_id)
            self.backends[model_id] = backend
            self.models[model_id] = router_config.model
            if router_config.model.model_id != model_id:
                raise RuntimeError(
                    f"the workers of {model_id!r} serve {router_config.model.model_id!r}"
                )
        self.model = next(iter(self.models.values()))
        self.backend = self._models_backend() if several else next(iter(self.backends.values()))
        progress("kvrelay: workers ready")
        return self

    async def _bound_pools(self, statuses: list[Any]) -> None:
        """Each model's controller refuses a scale past what this machine's memory holds (its
        own workers measured; several models share the free memory evenly)."""
        from deploy.local_capacity import capacity, free_bytes

        share = free_bytes() // max(1, len(self.controllers))
        for controller, status in zip(self.controllers.values(), statuses, strict=True):
            bound = capacity(status, share)
            if bound is not None:
                await controller.set_capacity.remote(*bound)

    def _models_backend(self) -> Any:
        from router.served_models import ModelsBackend

        return ModelsBackend(self.backends)

    async def _start_controller(
        self, model_id: str, name: str, model: ModelPools, several: bool
    ) -> ControllerActor:
        """One model's controller (its workers named after the model when there are several)."""
        spec = self.spec
        threads = spec.threads_per_worker or max(1, (os.cpu_count() or 2) // 2)
        template = WorkerTemplate(
            model.engine,
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
            f"{spec.name_prefix}-{model_id}" if several else spec.name_prefix,
            drain_grace_s=spec.drain_grace_s,
            local_prefill=spec.local_prefill,
            slo=spec.slo,
            autoscale=model.autoscale,
            access_digest=spec.access_digest,
        )
        sizes = {"prefill": model.num_prefill, "decode": model.num_decode}
        try:
            return await start_controller(config, sizes, name)
        except asyncio.CancelledError:  # Ctrl-C while it started: the detached actor is ours
            import ray

            with contextlib.suppress(Exception):
                ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
            raise

    async def keep_redis(self, say: Callable[[str], None], every_s: float = REDIS_WATCH_S) -> None:
        """While serve runs: the embedded redis-server, should it exit (killed, out of memory),
        is started again, empty, on the same port (the workers re-publish their blocks and
        routers reconnect, as after any Redis outage), with one line saying so; one that
        cannot start again is said once, and tried again each REDIS_RETRY_S. Nothing for a
        cluster without an embedded one."""
        from deploy.redis_local import RedisStartError

        failing = False
        while self.redis is not None:
            await asyncio.sleep(every_s)
            status = self.redis.exit_status
            if status is None:
                continue
            try:
                await asyncio.to_thread(self.redis.restart)
            except (RedisStartError, OSError) as e:
                if not failing:
                    say(
                        f"kvrelay: the embedded redis-server exited (status {status}) and could "
                        f"not start again: {e}; routing by load alone, trying again"
                    )
                failing = True
                await asyncio.sleep(REDIS_RETRY_S)
                continue
            failing = False
            say(
                f"kvrelay: the embedded redis-server exited (status {status}); started it "
                f"again, empty, on the same port (pid {self.redis.pid}): the workers re-publish "
                "their blocks"
            )

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
        """Why the cluster is gone: the embedded Ray's raylet or GCS server exited, or a
        model's controller died (its workers are its actors: Ray ended them with it, and
        nothing starts them again); None while both run."""
        for model, backend in self.backends.items():
            membership = backend.membership
            if membership is not None and membership.controller_died is not None:
                return (
                    f"the controller of {model} died ({membership.controller_died}); its workers "
                    "ended with it"
                )
        why = None if self._ray is None else self._ray.lost()
        return None if why is None else f"the Ray cluster is lost: {why}"

    async def close(self) -> None:
        """Stop the router side, the controller and its workers (each withdraws from Redis
        first), the embedded Ray and every process it started (waited for, killed after
        REAP_GRACE_S), then Redis. Each step runs whatever the one before it raised, and none
        waits on a lost cluster for long: a router-side failure is logged, and the cluster
        behind it still goes down."""
        import ray

        for backend in self.backends.values():
            try:
                await backend.close()
                if backend.index is not None:
                    await backend.index.close()
            except Exception as e:
                logger.warning("router side of the cluster did not close cleanly: %r", e)
        await asyncio.gather(
            *(self._stop_workers(ray, model_id, c) for model_id, c in self.controllers.items())
        )
        self.controller = None
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

    async def _stop_workers(self, ray: Any, model_id: str, controller: ControllerActor) -> None:
        """A model's controller stops every worker (each withdraws from the index), then goes;
        the index entries of any that could not withdraw (dead, or Ray lost) are removed here."""
        worker_ids: list[str] = []
        try:
            status = await asyncio.wait_for(controller.status.remote(False), STATUS_TIMEOUT_S)
            worker_ids = [
                w.worker_id
                for pool in status.pools
                for w in pool.workers
                if w.state != WorkerState.GONE  # a gone one withdrew, or was removed, already
            ]
            await asyncio.wait_for(controller.shutdown.remote(), SHUTDOWN_TIMEOUT_S)
        except Exception as e:
            logger.info("controller shutdown: %r", e)
        try:
            ray.kill(controller, no_restart=True)
        except Exception as e:
            logger.info("controller kill: %r", e)
        if model_id in self.models:
            for worker_id in worker_ids:  # idempotent: a withdrawn worker has nothing left
                await forget_in_index(self.redis_url, model_id, worker_id)


def controller_names(spec: ClusterSpec) -> dict[str, str]:
    """Served model id -> the actor name of its controller: the spec's own name for one model,
    "{name}/{model id}" for each of several; ValueError when two models would share an id (the
    index, the metrics and a request's `model` tell models apart by it)."""
    ids = [m.engine.model_id for m in spec.models]
    repeated = next((m for i, m in enumerate(ids) if m in ids[:i]), None)
    if repeated is not None:
        raise ValueError(
            f"two models would both be served as {repeated!r}: name one otherwise "
            "(`served-model-name` in its models-file flags) or rename its folder"
        )
    if len(ids) == 1:
        return {ids[0]: spec.controller_name}
    return {model_id: f"{spec.controller_name}/{model_id}" for model_id in ids}


def gpu_shortage(num_workers: int, gpus_per_worker: float, needed: int, num_gpus: int) -> str:
    """Why the workers do not fit on this machine's GPUs, and what would make them."""
    return (
        f"{num_workers} CUDA workers at {gpus_per_worker:g} GPU each need {needed} GPUs; Ray "
        f"sees {num_gpus} here. Run fewer workers, or share GPUs (--gpus-per-worker 0.5 puts "
        "two workers on one card), or --device cpu"
    )
