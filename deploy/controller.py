"""Controller (a named, detached Ray actor): owns each pool's desired size and every worker's
record (state, timestamped transitions, node, exit check), starts workers on nodes of their pool,
admits them to traffic once ready, drains the ones a scale-down removes, replaces the ones that
die, and lists membership for routers and status for the CLI."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any, cast

import ray
from ray.exceptions import ActorUnavailableError, RayActorError

from common.cluster_state import (
    CONTROLLER_NAME,
    NAMESPACE,
    ROLES,
    ClusterStatus,
    KVEvictRequest,
    LeakCheck,
    Member,
    PoolStatus,
    RouterConfig,
    RouterStatus,
    ScaleRequest,
    Transition,
    WorkerDescription,
    WorkerState,
    WorkerStats,
    WorkerStatus,
    combined_attainment,
    pool_settled,
)
from common.messages import ServedModel
from common.placement_rules import LocalPrefill, SloTargets
from common.worker_actors import ControllerActor, DecodeActor, PrefillActor, WorkerActor
from common.worker_stats import gather_stats
from deploy import worker_launch
from deploy.autoscale import AutoscaleConfig
from deploy.autoscale_driver import AutoscaleDriver
from deploy.controller_redis import forget_in_index, redis_status
from deploy.engine_flags import as_flags
from deploy.worker_launch import WorkerTemplate

logger = logging.getLogger(__name__)
RECONCILE_S = 1.0
HEALTH_CHECK_S = 1.0  # a dead worker is seen within about this (plus Ray's own notice)
ROUTER_EXPIRY_S = 10.0
MAX_GONE_KEPT = 100  # gone workers kept in status for their history
LIVE = (WorkerState.JOINING, WorkerState.READY)


@dataclass(frozen=True)
class ControllerConfig:
    template: WorkerTemplate
    policy: str = "kv_aware"
    max_migrations: int = 2  # per request, for the routers
    name_prefix: str = "kvrelay"
    drain_grace_s: float = 2.0  # after draining is published, before in-flight work is counted
    drain_timeout_s: float = 600.0
    max_start_failures: int = 3  # consecutive failed starts of a pool before it stops trying
    local_prefill: LocalPrefill = field(default_factory=LocalPrefill)  # for the routers
    slo: SloTargets = field(default_factory=SloTargets)  # for the routers
    autoscale: AutoscaleConfig | None = None  # None: pools change only on `kvrelay scale`
    access_digest: str | None = None  # for the routers: the serve's API keys and limits


@dataclass
class _Record:
    """One worker as the controller tracks it (mutable; only the controller's loop touches it)."""

    worker_id: str
    role: str
    actor: WorkerActor  # a PrefillActor or a DecodeActor, as role says
    transitions: list[Transition] = field(default_factory=list)
    description: WorkerDescription | None = None  # set once loaded
    exit_check: LeakCheck | None = None
    last_stats: WorkerStats | None = None  # taken as it retired (status of a gone worker)
    error: str | None = None
    task: asyncio.Task[None] | None = None
    ready_seen: float | None = None  # the controller's time.monotonic() when it turned ready
    group: Any = None  # a tensor-parallel worker's placement group (its ranks'); None at tp 1

    @property
    def state(self) -> WorkerState:
        return self.transitions[-1].state

    def move(self, state: WorkerState, note: str = "", at: float | None = None) -> None:
        self.transitions.append(Transition(state, time.time() if at is None else at, note))
        logger.info("%s: %s %s", self.worker_id, state.value, note)


class Controller:
    """Invariants: a worker is READY only after its handshake and warm-up succeeded and it
    published `ready` itself; a pool's JOINING + READY count converges to its desired size; a
    drained worker's exit check is taken after it stopped taking requests."""

    def __init__(self, config: ControllerConfig, sizes: dict[str, int]):
        self.config = config
        self._desired = {role: sizes.get(role, 0) for role in ROLES}
        self._records: dict[str, _Record] = {}
        self._num_started = dict.fromkeys(ROLES, 0)
        self._num_failures = dict.fromkeys(ROLES, 0)
        self._routers: dict[str, RouterStatus] = {}
        self._model: ServedModel | None = None
        self._error = ""
        self._loop_task: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        self._autoscale = AutoscaleDriver(config.autoscale) if config.autoscale else None
        self._autoscale_notes: dict[str, str] = {}
        if config.autoscale is not None:
            for role in config.autoscale.autoscaled:
                low, high = config.autoscale.min_size[role], config.autoscale.max_size[role]
                self._autoscale_notes[role] = f"autoscale {low}..{high}"
        # An embedded cluster (`kvrelay serve` on one machine): the most workers its memory or
        # GPUs hold, and why (set_capacity); None: nodes join as pools need them.
        self._capacity: tuple[int, str] | None = None

    # ---- actor API -----------------------------------------------------------------------
    async def start(self) -> None:
        """Start reconciling (idempotent): call once after creating the actor."""
        if self._loop_task is None:
            self._wake = asyncio.Event()
            self._loop_task = asyncio.create_task(self._run())
            self._request_nodes()

    async def set_capacity(self, max_workers: int, why: str) -> None:
        """This cluster's machine holds at most `max_workers` workers of its model (both pools,
        no node joins): a scale past it is refused, an autoscale grow past it not made."""
        self._capacity = (max_workers, why)

    async def scale(self, request: ScaleRequest) -> dict[str, int]:
        """Set desired pool sizes; returns them. The loop starts or drains workers to match.
        ValueError naming the flag for a size the machine cannot hold (set_capacity) or outside
        the pool's autoscale bounds (it would be undone)."""
        wanted = request.sizes()
        self._check_bounds(wanted)
        self._check_capacity({**self._desired, **wanted}, wanted)
        for role, size in wanted.items():
            if self._desired[role] != size:
                self._num_failures[role] = 0
                self._error = ""
            self._desired[role] = size
            if self._autoscale is not None:
                self._autoscale.operator_changed(role, time.monotonic())
        self._request_nodes()
        self._poke()
        return dict(self._desired)

    async def status(self, with_stats: bool = True) -> ClusterStatus:
        records = list(self._records.values())
        stats = await self._gather_stats(records) if with_stats else {}
        pools = tuple(
            PoolStatus(
                role,
                self._desired[role],
                tuple(
                    self._worker_status(r, stats.get(r.worker_id))
                    for r in records
                    if r.role == role
                ),
                self._autoscale_notes.get(role, ""),
            )
            for role in ROLES
        )
        now = time.time()
        routers = tuple(r for r in self._routers.values() if now - r.last_seen < ROUTER_EXPIRY_S)
        model_id = self._model.model_id if self._model else ""
        return ClusterStatus(
            model_id,
            pools,
            routers,
            await redis_status(self.config.template.redis_url, self._model_id()),
            self._error,
        )

    async def evict_kv(self, request: KVEvictRequest) -> dict[str, dict[str, int] | str]:
        """`kvrelay kv evict`: every loaded worker (not gone) drops the blocks from its tiers,
        and the shared store's files with them (each worker tries; the first removes them);
        worker id -> blocks dropped per tier, or the error it answered with."""
        asked = [
            r
            for r in self._records.values()
            if r.state != WorkerState.GONE and r.description is not None
        ]
        answers = await asyncio.gather(
            *(r.actor.evict_kv.remote(request.prompt, request.cache_salt) for r in asked),
            return_exceptions=True,
        )
        return {
            r.worker_id: answer
            if isinstance(answer, dict)
            else f"{type(answer).__name__}: {answer}"
            for r, answer in zip(asked, answers, strict=True)
        }

    async def members(self, router: RouterStatus | None = None) -> list[Member]:
        """Workers routers may know (joining ones that loaded, ready, draining); a router's
        call also records it for status."""
        if router is not None:
            self._routers[router.router_id] = replace(router, last_seen=time.time())
        return [
            Member(r.worker_id, r.role, r.worker_id, r.state)
            for r in self._records.values()
            if r.state != WorkerState.GONE and r.description is not None
        ]

    async def forget_router(self, router_id: str) -> None:
        self._routers.pop(router_id, None)

    async def router_config(self, timeout_s: float = 600.0) -> RouterConfig:
        """What a router needs; waits until a first worker has loaded the model."""
        deadline = time.monotonic() + timeout_s
        while self._model is None:
            if time.monotonic() > deadline:
                raise TimeoutError("no worker has loaded the model yet")
            await asyncio.sleep(0.2)
        template = self.config.template
        config = self.config
        return RouterConfig(
            self._model,
            template.redis_url,
            config.policy,
            config.max_migrations,
            config.local_prefill,
            config.slo,
            shared_store=template.engine.cache.shared_kv_cache_bytes > 0,
            access_digest=config.access_digest,
        )

    async def shutdown(self) -> None:
        """Stop every worker at once (no drain): `kvrelay serve` exiting; its request to Ray's
        autoscaler is withdrawn, so idle nodes go after their idle timeout."""
        self._desired = dict.fromkeys(ROLES, 0)
        self._request_nodes()
        if self._loop_task is not None:
            self._loop_task.cancel()
        for record in self._records.values():
            if record.task is not None:
                record.task.cancel()
        live = [r for r in self._records.values() if r.state != WorkerState.GONE]
        await asyncio.gather(
            *(
                worker_launch.stop(r.actor, loaded=r.description is not None, group=r.group)
                for r in live
            ),
            return_exceptions=True,
        )
        for record in live:
            if record.state != WorkerState.GONE:  # a cancelled start has recorded its own end
                record.move(WorkerState.GONE, "cluster shut down")

    # ---- the reconcile loop ----------------------------------------------------------------
    async def _run(self) -> None:
        next_check = 0.0
        while True:
            try:
                self._reconcile()
                if time.monotonic() >= next_check:
                    await self._check_health()
                    next_check = time.monotonic() + HEALTH_CHECK_S
                if self._autoscale is not None:
                    await self._autoscale.tick(self, time.monotonic())
            except Exception:
                logger.exception("controller: reconcile failed")
            assert self._wake is not None
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), RECONCILE_S)

    # ---- what the autoscaler uses (deploy/autoscale_driver.Pools) --------------------------
    def ready_workers(self, role: str) -> list[tuple[WorkerActor, float]]:
        return [
            (r.actor, r.ready_seen)
            for r in self._records.values()
            if r.role == role and r.state == WorkerState.READY and r.ready_seen is not None
        ]

    def slo_attainment(self, role: str) -> float | None:
        """Live routers' recent requests against the pool's objective (TTFT: prefill, TPOT:
        decode), weighted by their counts; None when none reported any."""
        now = time.time()
        reports = [
            r.attainment
            for r in self._routers.values()
            if r.attainment is not None and now - r.last_seen < ROUTER_EXPIRY_S
        ]
        return combined_attainment(reports, "ttft" if role == "prefill" else "tpot")

    def settled(self, role: str) -> bool:
        states = [r.state for r in self._records.values() if r.role == role]
        return pool_settled(self._desired[role], states)

    def resize(self, role: str, size: int, reason: str) -> bool:
        """The autoscaler's decision, applied; False when held (past the capacity)."""
        assert self.config.autoscale is not None
        low, high = self.config.autoscale.min_size[role], self.config.autoscale.max_size[role]
        when = time.strftime("%H:%M:%S")
        try:
            self._check_capacity({**self._desired, role: size}, {role: size})
        except ValueError:
            assert self._capacity is not None
            note = f"held at {self._desired[role]} at {when}: {reason}, but {self._capacity[1]}"
            self._autoscale_notes[role] = f"autoscale {low}..{high}, {note}"
            return False
        note = f"{self._desired[role]} -> {size} at {when}: {reason}"
        self._autoscale_notes[role] = f"autoscale {low}..{high}, last {note}"
        self._desired[role] = size
        self._request_nodes()
        self._poke()
        return True

    def _check_bounds(self, wanted: dict[str, int]) -> None:
        """An autoscaled pool's size stays within its bounds (outside, the autoscaler would
        undo it)."""
        autoscale = self.config.autoscale
        for role, size in wanted.items():
            if autoscale is None or role not in autoscale.autoscaled:
                continue
            low, high = autoscale.min_size[role], autoscale.max_size[role]
            if not low <= size <= high:
                raise ValueError(
                    f"--{role} {size}: the {role} pool is autoscaled within {low}..{high} "
                    f"(serve's --autoscale-{role} {low}:{high}); a size outside it would be undone"
                )

    def _check_capacity(self, sizes: dict[str, int], wanted: dict[str, int]) -> None:
        """ValueError naming the wanted flags when `sizes` (both pools) exceed the capacity."""
        if self._capacity is None:
            return
        most, why = self._capacity
        if sum(sizes.values()) > most and sum(sizes.values()) > sum(self._desired.values()):
            flags = " ".join(f"--{role} {size}" for role, size in wanted.items())
            raise ValueError(
                f"{flags}: {why}, so at most {most} workers of both pools "
                f"(now prefill {sizes['prefill']} + decode {sizes['decode']})"
            )

    def _poke(self) -> None:
        if self._wake is not None:
            self._wake.set()

    def _reconcile(self) -> None:
        for role in ROLES:
            live = [r for r in self._records.values() if r.role == role and r.state in LIVE]
            missing = self._desired[role] - len(live)
            if missing > 0 and self._num_failures[role] < self.config.max_start_failures:
                for _ in range(missing):
                    self._start_worker(role)
            elif missing < 0:
                # joining workers first (no traffic yet), then the newest ready ones
                order = sorted(live, key=lambda r: (r.state == WorkerState.READY, -_started_at(r)))
                for record in order[:-missing]:
                    self._remove(record)
        self._prune_gone()

    def _start_worker(self, role: str) -> None:
        index = self._num_started[role]
        self._num_started[role] += 1
        worker_id = f"{self.config.name_prefix}-{role}-{index}"
        template = self.config.template
        group = worker_launch.rank_group(role, worker_id, template)
        try:
            actor = worker_launch.spawn(role, worker_id, template, group)
        except Exception as e:  # e.g. an engine config its TP refuses: a failed start as any
            worker_launch.release_ranks(group)  # each retry would otherwise hold more GPUs
            self._start_failed(role, start_error(e))
            return
        record = _Record(worker_id, role, actor, group=group)
        record.move(
            WorkerState.JOINING, f"waiting for a node with {worker_launch.pool_resource(role)}"
        )
        self._records[worker_id] = record
        record.task = asyncio.create_task(self._join(record))

    async def _join(self, record: _Record) -> None:
        try:
            record.description = description = await record.actor.describe.remote()
            self._model = self._model or description.model
            record.move(
                WorkerState.JOINING,
                f"model loaded, KV pool registered with NIXL on {description.node_ip}",
            )
            prefill, decode = await self._pair_for(record)
            if prefill is not None:
                await worker_launch.handshake(cast(DecodeActor, decode.actor), [prefill.worker_id])
            if record.role == "decode":  # it will pull from every prefill worker: check them all
                others = [r.worker_id for r in self._loaded("prefill") if r is not prefill]
                await worker_launch.handshake(cast(DecodeActor, record.actor), others)
            else:  # every decode worker will pull from it: each checks it now
                for other in [r for r in self._loaded("decode") if r is not decode]:
                    await worker_launch.handshake(
                        cast(DecodeActor, other.actor), [record.worker_id]
                    )
            partner = decode if record.role == "prefill" else prefill
            with_whom = "no prefill pool" if partner is None else f"with {partner.worker_id}"
            record.move(WorkerState.JOINING, f"handshake checked ({with_whom})")
            request = worker_launch.warmup_request(record.worker_id, description.model)
            prefill_actor = None if prefill is None else cast(PrefillActor, prefill.actor)
            await worker_launch.warm_up(prefill_actor, cast(DecodeActor, decode.actor), request)
            record.move(WorkerState.JOINING, "warm-up request done")
            at = await record.actor.set_state.remote(WorkerState.READY)
            record.move(WorkerState.READY, "taking traffic", at=at)
            record.ready_seen = time.monotonic()
            self._num_failures[record.role] = 0
        except asyncio.CancelledError:
            await worker_launch.stop(
                record.actor, loaded=record.description is not None, group=record.group
            )
            record.move(WorkerState.GONE, "start cancelled (pool scaled down)")
            raise
        except Exception as e:
            record.error = start_error(e)
            await worker_launch.stop(record.actor, group=record.group)
            record.move(WorkerState.GONE, f"failed to start: {record.error}")
            self._start_failed(record.role, record.error, permanent=refused_start(e))
        finally:
            self._poke()

    def _start_failed(self, role: str, error: str, permanent: bool = False) -> None:
        """One more start of role's pool failed in a row; at max_start_failures (at once when
        `permanent`: the next start would fail the same way) the pool stops trying until the
        next scale, and status says why."""
        self._num_failures[role] += 1
        if permanent:
            self._num_failures[role] = max(self._num_failures[role], self.config.max_start_failures)
            self._error = (
                f"{role} pool: its worker refused to start (another try would fail the same "
                f"way), not trying again until the next scale: {error}"
            )
        elif self._num_failures[role] >= self.config.max_start_failures:
            self._error = (
                f"{role} pool: {self._num_failures[role]} starts failed in a row, not trying "
                f"again until the next scale; last: {error}"
            )
        if self._num_failures[role] >= self.config.max_start_failures:
            logger.error("controller: %s", self._error)

    async def _pair_for(self, record: _Record) -> tuple[_Record | None, _Record]:
        """A prefill and a decode worker to warm `record` up with: itself and a worker of the
        other pool that has loaded (a ready one preferred), waiting for one if none has. A
        decode worker while the prefill pool is sized 0 has none (aggregated): (None, record)."""
        other_role = "decode" if record.role == "prefill" else "prefill"
        while True:
            loaded = self._loaded(other_role)
            if loaded:
                partner = min(loaded, key=lambda r: (r.state != WorkerState.READY, r.worker_id))
                return (record, partner) if record.role == "prefill" else (partner, record)
            if record.role == "decode" and self._desired["prefill"] == 0:
                return None, record
            await asyncio.sleep(0.2)

    def _loaded(self, role: str) -> list[_Record]:
        return [
            r
            for r in self._records.values()
            if r.role == role and r.state in LIVE and r.description is not None
        ]

    def _remove(self, record: _Record) -> None:
        if record.state == WorkerState.JOINING:
            if record.task is not None:
                record.task.cancel()
            return
        record.move(WorkerState.DRAINING, "no new placements; in-flight work finishes")
        record.task = asyncio.create_task(self._drain(record))

    async def _drain(self, record: _Record) -> None:
        config = self.config
        try:
            check, note = await worker_launch.drain(
                record.actor, config.drain_grace_s, config.drain_timeout_s
            )
            record.exit_check = check
            with contextlib.suppress(Exception):
                record.last_stats = await asyncio.wait_for(record.actor.stats.remote(), 5.0)
            await worker_launch.stop(record.actor, group=record.group)
            clean = (
                "" if check is None else (" (no block in use)" if check.clean else f" ({check})")
            )
            record.move(WorkerState.GONE, f"{note}, exited{clean}")
        except RayActorError as e:
            record.error = f"died while draining: {e}"
            worker_launch.release_ranks(record.group)
            record.move(WorkerState.GONE, record.error)
        finally:
            self._poke()

    async def _check_health(self) -> None:
        """A worker whose actor died is gone; the next reconcile starts a replacement."""
        watched = [
            r
            for r in self._records.values()
            if r.state in (WorkerState.READY, WorkerState.DRAINING) and r.description is not None
        ]

        async def ping(record: _Record) -> None:
            try:
                await asyncio.wait_for(record.actor.pid.remote(), 10.0)
            except ActorUnavailableError as e:  # may come back; a dead one fails the next ping
                logger.warning("controller: %s is unavailable for now: %s", record.worker_id, e)
            except RayActorError as e:
                if record.state == WorkerState.GONE:
                    return
                if record.task is not None:
                    record.task.cancel()
                record.error = f"died: {e}"
                record.move(WorkerState.GONE, "actor died")
                worker_launch.release_ranks(record.group)  # its other ranks end with it
                await forget_in_index(
                    self.config.template.redis_url, self._model_id(), record.worker_id
                )
            except TimeoutError:
                logger.warning("controller: %s did not answer a ping in 10 s", record.worker_id)

        await asyncio.gather(*(ping(r) for r in watched))

    def _model_id(self) -> str | None:
        return self._model.model_id if self._model else None

    def _prune_gone(self) -> None:
        gone = [r for r in self._records.values() if r.state == WorkerState.GONE]
        for record in gone[: max(0, len(gone) - MAX_GONE_KEPT)]:
            del self._records[record.worker_id]

    def _request_nodes(self) -> None:
        """Tell Ray's autoscaler (when there is one) how many pool slots the cluster needs."""
        gpus = self.config.template.gpus_per_worker
        bundles = []
        for role in ROLES:
            bundle: dict[str, float] = {worker_launch.pool_resource(role): 1}
            if gpus:  # a TP worker's ranks share one node: a GPU each
                bundle["GPU"] = gpus * self.config.template.tp(role)
            bundles += [bundle] * self._desired[role]
        try:
            from ray.autoscaler.sdk import request_resources

            request_resources(bundles=bundles)
        except Exception as e:  # no autoscaler API on this cluster: pending actors still wait
            logger.info("controller: request_resources failed: %s", e)

    # ---- status ----------------------------------------------------------------------------
    async def _gather_stats(self, records: list[_Record]) -> dict[str, WorkerStats]:
        asked = [r for r in records if r.state != WorkerState.GONE and r.description is not None]
        return await gather_stats({r.worker_id: r.actor for r in asked})

    def _worker_status(self, record: _Record, stats: WorkerStats | None) -> WorkerStatus:
        desc = record.description
        return WorkerStatus(
            record.worker_id,
            record.role,
            record.state,
            tuple(record.transitions),
            node_ip=desc.node_ip if desc else "",
            node_id=desc.node_id if desc else "",
            pid=desc.pid if desc else 0,
            stats=stats if stats is not None else record.last_stats,
            exit_check=record.exit_check,
            error=record.error,
            ranks=desc.ranks if desc else (),
        )


def _started_at(record: _Record) -> float:
    return record.transitions[0].at


async def start_controller(
    config: ControllerConfig, sizes: dict[str, int], name: str = CONTROLLER_NAME
) -> ControllerActor:
    """Create the detached controller actor (on the head node) and start its loop; raises
    ValueError when one of that name already runs on this Ray cluster."""
    try:
        ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        pass
    else:
        raise ValueError(
            f"a kvrelay controller ({name!r}) already runs on this Ray cluster: use `kvrelay "
            "scale` / `kvrelay router` against it, or `kvrelay down` first"
        )
    resources = {}
    if "node:__internal_head__" in ray.cluster_resources():
        resources["node:__internal_head__"] = 0.001
    actor = (
        ray.remote(Controller)
        .options(
            name=name,
            namespace=NAMESPACE,
            lifetime="detached",
            num_cpus=0,
            resources=resources,
            max_concurrency=1000,
        )
        .remote(config, sizes)
    )
    await actor.start.remote()
    return cast(ControllerActor, actor)


def find_controllers(name: str = CONTROLLER_NAME) -> dict[str, ControllerActor]:
    """Every model's controller on this Ray cluster: {"": handle} for a cluster of one model
    (its controller named `name`), {model id: handle} for one of several (each named
    "{name}/{model id}", deploy/local_cluster.controller_names); empty when there is none."""
    found = {}
    for actor in ray.util.list_named_actors(all_namespaces=True):
        actor_name, namespace = actor["name"], actor["namespace"]
        if namespace != NAMESPACE:
            continue
        if actor_name == name:
            found[""] = actor_name
        elif actor_name.startswith(f"{name}/"):
            found[actor_name[len(name) + 1 :]] = actor_name
    return {
        model: cast(ControllerActor, ray.get_actor(actor_name, namespace=NAMESPACE))
        for model, actor_name in sorted(found.items())
    }


def find_controller(name: str = CONTROLLER_NAME) -> ControllerActor:
    """The running controller's handle; ValueError with what to do when there is none."""
    try:
        return cast(ControllerActor, ray.get_actor(name, namespace=NAMESPACE))
    except ValueError:
        raise ValueError(
            f"no kvrelay controller ({name!r}) on this Ray cluster: start one with `kvrelay "
            "serve` (or `kvrelay up CLUSTER.yaml`)"
        ) from None


# A worker whose start raised one of these refused its checkpoint or a setting
# (engine.config.StartRefused and its CheckpointRefused: a tensor no module takes, a
# config.json field it does not run, a KV tier too small for a block): every start would fail
# the same.
REFUSED_STARTS = ("StartRefused", "CheckpointRefused")


def refused_start(e: Exception) -> bool:
    """e (a failed start) is the worker's refusal of its checkpoint or a setting, not a crash, a
    full GPU, an out-of-memory kill or a lost node that another try may not meet."""
    if not (isinstance(e, RayActorError) and e.actor_init_failed):
        return False
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return bool(lines) and _exception_name(lines[-1]) in REFUSED_STARTS


def _exception_name(line: str) -> str:
    """The exception class a traceback's last line names, without its module."""
    return line.split(":", 1)[0].rsplit(".", 1)[-1]


def start_error(e: Exception) -> str:
    """What a failed start says: for a worker whose start raised (its engine refused a setting,
    a tier's folder could not be made), that exception, its fields named as serve's flags,
    rather than Ray's wrapper of it and the worker's traceback."""
    if isinstance(e, RayActorError) and e.actor_init_failed:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        if lines:
            name, sep, message = lines[-1].partition(":")
            last = f"{_exception_name(name)}{sep}{message}" if " " not in name else lines[-1]
            return f"the worker's start raised {as_flags(last)}"
    return f"{type(e).__name__}: {e}"
