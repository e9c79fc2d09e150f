"""How the controller starts, checks and stops one worker actor (holds no state): the actor's
Ray options (its pool's custom resource, its part of a GPU), its engine config, the handshake
with the other pool, the warm-up request through a prefill -> decode pair (a decode worker
alone while the prefill pool is sized 0: aggregated), and the drain's wait for in-flight work.

A tensor-parallel worker (its pool's tp N > 1) is N Ray actors in a placement group of N
bundles (STRICT_PACK: one node; a GPU each on CUDA, a CPU each on CPU): the worker actor is
rank 0 in bundle 0 (with the pool's resource), and starts ranks 1..N-1 in bundles 1..N-1
(common/rank_actors.py). The group is the worker's: stop() removes it, which ends every rank.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, replace
from typing import Any

import ray

from common.cluster_state import NAMESPACE, WARMUP_REQ_PREFIX, LeakCheck, WorkerState
from common.messages import GenerateRequest, ServedModel
from common.worker_actors import DecodeActor, PrefillActor, WorkerActor
from engine.config import EngineConfig
from engine.execution.memory_budget import DEFAULT_MAX_NUM_SEQS
from engine.finish_reason import FinishReason
from engine.sampling.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
WARMUP_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class WorkerTemplate:
    """What every worker of the cluster is started with."""

    engine: EngineConfig
    redis_url: str | None
    lease_s: float = 30.0
    transfer_timeout_s: float = 10.0
    threads_per_worker: int | None = None
    gpus_per_worker: float = 0.0  # Ray num_gpus; a fraction: that many workers share a GPU
    router_timeout_s: float = 10.0  # decode: a router silent this long has its requests aborted
    # decode: prompt tokens computed per step beside the running decodes (conditional prefill,
    # a failed pull's recompute); None: the engine's own max_num_batched_tokens.
    decode_prefill_chunk_tokens: int | None = None
    publish_decode_cache: bool = (
        False  # decode: its prefix cache to the index (conditional prefill)
    )
    # Tensor-parallel ranks of each pool's workers (engine.tensor_parallel_size is ignored).
    prefill_tp: int = 1
    decode_tp: int = 1
    otlp_endpoint: str | None = None  # every worker's traces go there (None: tracing off)

    def __post_init__(self) -> None:
        for role in ("prefill", "decode"):
            if self.tp(role) < 1:
                raise ValueError(f"{role}_tp must be >= 1, got {self.tp(role)}")
        if max(self.prefill_tp, self.decode_tp) > 1 and 0.0 < self.gpus_per_worker < 1.0:
            raise ValueError(
                f"a tensor-parallel worker takes whole GPUs (a rank each); gpus_per_worker "
                f"{self.gpus_per_worker} shares one"
            )

    def tp(self, role: str) -> int:
        """Ranks of a worker of role's pool."""
        return self.prefill_tp if role == "prefill" else self.decode_tp


def pool_resource(role: str) -> str:
    """The custom resource a node declares to host workers of a pool."""
    return f"{role}_pool"


def check_gpus_per_worker(gpus_per_worker: float) -> None:
    """A CUDA worker's part of a GPU: 0 < F <= 1 (Ray gives no worker more than one GPU)."""
    if not 0.0 < gpus_per_worker <= 1.0:
        raise ValueError(f"--gpus-per-worker must be in (0, 1], got {gpus_per_worker}")


def workers_per_gpu(gpus_per_worker: float) -> int:
    """Workers one GPU holds: Ray packs fractions on a card and never splits one across two."""
    check_gpus_per_worker(gpus_per_worker)
    return int(1.0 / gpus_per_worker + 1e-9)


def gpus_needed(num_workers: int, gpus_per_worker: float) -> int:
    """Whole GPUs that num_workers workers of gpus_per_worker each need (0.4 each: 2 per GPU)."""
    return math.ceil(num_workers / workers_per_gpu(gpus_per_worker))


def decode_engine_config(template: WorkerTemplate) -> EngineConfig:
    """A decode worker's engine: its step budget is its batch (one token per running request)
    plus the prompt chunk, so a prompt computed there never delays the decodes by more than
    one chunk per step. That budget needs the batch limit up front: without one given, the
    decode workers keep DEFAULT_MAX_NUM_SEQS instead of one picked for their pool."""
    chunk = template.decode_prefill_chunk_tokens
    if chunk is None:
        return template.engine
    scheduler = template.engine.scheduler
    num_seqs = scheduler.max_num_seqs or DEFAULT_MAX_NUM_SEQS
    scheduler = replace(scheduler, max_num_seqs=num_seqs, max_num_batched_tokens=num_seqs + chunk)
    return replace(template.engine, scheduler=scheduler)


def worker_engine_config(role: str, template: WorkerTemplate) -> EngineConfig:
    """A worker's engine: the decode step budget, and on a shared GPU its share of the card's
    memory (a pool sized by memory takes gpu_memory_utilization * gpus_per_worker of it)."""
    engine = decode_engine_config(template) if role == "decode" else template.engine
    if 0.0 < template.gpus_per_worker < 1.0:
        engine = replace(engine, gpu_share=template.gpus_per_worker)
    if engine.tensor_parallel_size != template.tp(role):
        engine = replace(engine, tensor_parallel_size=template.tp(role))
    return engine


def rank_bundles(role: str, template: WorkerTemplate) -> list[dict[str, float]]:
    """A TP worker's placement group: a bundle a rank, rank 0's with its pool's resource."""
    unit = {"GPU": 1.0} if template.gpus_per_worker else {"CPU": 1.0}
    return [{pool_resource(role): 1.0, **unit}] + [dict(unit)] * (template.tp(role) - 1)


def ranks_group_name(worker_id: str) -> str:
    return f"{worker_id}-ranks"


def rank_group(role: str, worker_id: str, template: WorkerTemplate) -> Any | None:
    """The placement group a TP worker's ranks share (None at tp 1); it is pending until a
    node has room for all of them."""
    if template.tp(role) == 1:
        return None
    from ray.util.placement_group import placement_group

    bundles = rank_bundles(role, template)
    return placement_group(bundles, strategy="STRICT_PACK", name=ranks_group_name(worker_id))


def actor_options(
    role: str, worker_id: str, template: WorkerTemplate, group: Any | None = None
) -> dict[str, Any]:
    """The worker actor's Ray options: its name, a unit of its pool's resource, its GPU part.
    Ray gives actors on one card the same CUDA_VISIBLE_DEVICES: each sees its GPU as cuda:0.
    In a TP worker's placement group (group): bundle 0, that bundle's resources."""
    options: dict[str, Any] = {
        "name": worker_id,
        "namespace": NAMESPACE,
        "num_cpus": 0,
        "num_gpus": template.gpus_per_worker,
        "resources": {pool_resource(role): 1},
        "max_concurrency": 1000,
    }
    if group is not None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        options["num_cpus"] = 0 if template.gpus_per_worker else 1
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            group, placement_group_bundle_index=0
        )
    return options


def spawn(
    role: str, worker_id: str, template: WorkerTemplate, group: Any | None = None
) -> WorkerActor:
    """A named worker actor on a node of its pool (pending until such a node exists); a TP
    worker's in bundle 0 of group (rank_group)."""
    engine = worker_engine_config(role, template)
    if role == "prefill":
        from prefill_worker.worker import PrefillWorker, PrefillWorkerConfig

        worker_cls: type = PrefillWorker
        config: Any = PrefillWorkerConfig(
            worker_id,
            engine,
            template.redis_url,
            template.lease_s,
            num_threads=template.threads_per_worker,
            otlp_endpoint=template.otlp_endpoint,
        )
    else:
        from decode_worker.worker import DecodeWorker, DecodeWorkerConfig

        worker_cls = DecodeWorker
        config = DecodeWorkerConfig(
            worker_id,
            engine,
            template.redis_url,
            template.transfer_timeout_s,
            num_threads=template.threads_per_worker,
            router_timeout_s=template.router_timeout_s,
            publish_cache=template.publish_decode_cache,
            otlp_endpoint=template.otlp_endpoint,
        )
    options = actor_options(role, worker_id, template, group)
    return ray.remote(worker_cls).options(**options).remote(config, worker_id)


async def handshake(decode_actor: DecodeActor, prefill_actor_names: list[str]) -> None:
    """The decode worker checks protocol and KV layout with each prefill worker now."""
    await asyncio.gather(*(decode_actor.check_peer.remote(name) for name in prefill_actor_names))


def warmup_request(worker_id: str, model: ServedModel) -> GenerateRequest:
    """Two blocks of fixed tokens (fewer when the model's context is shorter: room is left
    for its output), two output tokens, salted apart from user prefixes."""
    num_tokens = max(1, min(2 * model.block_size, model.max_model_len - 2))
    prompt = tuple(1 + i % max(1, model.vocab_size - 1) for i in range(num_tokens))
    max_tokens = max(1, min(2, model.max_model_len - num_tokens))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return GenerateRequest(
        f"{WARMUP_REQ_PREFIX}{worker_id}", prompt, params, cache_salt="kvrelay-warmup"
    )


async def warm_up(
    prefill_actor: PrefillActor | None, decode_actor: DecodeActor, request: GenerateRequest
) -> None:
    """One request end to end: prefill, KV handoff over NIXL, decode; with no prefill actor
    (an empty prefill pool: aggregated) the decode worker computes the prompt itself. Raises on
    any failure."""
    mailbox = f"{request.req_id}-mailbox"
    if prefill_actor is None:
        await decode_actor.prefill_here.remote(request, mailbox)
    else:
        handle = await prefill_actor.prefill.remote(request)
        if handle.finish_reason is not None:
            return
        await decode_actor.submit.remote(request, handle, mailbox)
    deadline = time.monotonic() + WARMUP_TIMEOUT_S
    while time.monotonic() < deadline:
        for delta in await decode_actor.next_deltas.remote(mailbox, 1.0):
            if delta.finish_reason == FinishReason.ERROR:
                raise RuntimeError(f"warm-up request failed: {delta.error}")
            if delta.finished:
                return
    await decode_actor.abort.remote(request.req_id)
    raise TimeoutError(f"warm-up request got no answer in {WARMUP_TIMEOUT_S:.0f} s")


async def drain(
    actor: WorkerActor, grace_s: float, timeout_s: float
) -> tuple[LeakCheck | None, str]:
    """Stop placements, wait for in-flight work (decodes finish, leases are pulled or expire),
    then retire the worker. Returns its leak check (None if it never went idle) and a note."""
    await actor.set_state.remote(WorkerState.DRAINING)
    await asyncio.sleep(grace_s)  # placements made from a view read before the switch land now
    deadline = time.monotonic() + timeout_s
    while True:
        check = await actor.retire.remote()
        if check is not None:
            return check, "drained"
        if time.monotonic() > deadline:
            logger.warning("drain timed out after %.0f s with work in flight", timeout_s)
            return None, f"drain timed out after {timeout_s:.0f} s; in-flight work was aborted"
        await asyncio.sleep(0.2)


async def stop(actor: WorkerActor, loaded: bool = True, group: Any | None = None) -> None:
    """Withdraw the worker from Redis, close its NIXL agent, end its process. A worker that has
    not loaded yet (loaded=False) has published nothing, and its shutdown call would wait for
    its constructor: its process is ended at once. A TP worker's placement group (group) is
    removed after: Ray ends the ranks still in it."""
    if loaded:
        try:
            await asyncio.wait_for(actor.shutdown.remote(), 30.0)
        except Exception as e:  # dead already, or hung: it is killed either way
            logger.info("worker shutdown call failed: %s", e)
    ray.kill(actor, no_restart=True)
    release_ranks(group)


def release_ranks(group: Any | None) -> None:
    """Remove a TP worker's placement group (its ranks' actors end with it); None: no-op."""
    if group is None:
        return
    from ray.util.placement_group import remove_placement_group

    try:
        remove_placement_group(group)
    except Exception as e:  # removed already
        logger.info("placement group removal failed: %s", e)
