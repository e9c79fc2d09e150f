"""How the controller starts, checks and stops one worker actor (holds no state): the actor's
Ray options (its pool's custom resource), the handshake with the other pool, the warm-up
request through a prefill -> decode pair, and the drain's wait for in-flight work."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, replace
from typing import Any

import ray

from common.cluster_state import NAMESPACE, WARMUP_REQ_PREFIX, LeakCheck, WorkerState
from common.messages import GenerateRequest, ServedModel
from engine.config import EngineConfig
from engine.sampling_params import SamplingParams

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
    gpus_per_worker: float = 0.0
    router_timeout_s: float = 10.0  # decode: a router silent this long has its requests aborted
    # decode: prompt tokens computed per step beside the running decodes (conditional prefill,
    # a failed pull's recompute); None: the engine's own max_num_batched_tokens.
    decode_prefill_chunk_tokens: int | None = None
    publish_decode_cache: bool = (
        False  # decode: its prefix cache to the index (conditional prefill)
    )


def pool_resource(role: str) -> str:
    """The custom resource a node declares to host workers of a pool."""
    return f"{role}_pool"


def decode_engine_config(template: WorkerTemplate) -> EngineConfig:
    """A decode worker's engine: its step budget is its batch (one token per running request)
    plus the prompt chunk, so a prompt computed there never delays the decodes by more than
    one chunk per step."""
    chunk = template.decode_prefill_chunk_tokens
    if chunk is None:
        return template.engine
    scheduler = template.engine.scheduler
    budget = scheduler.max_num_seqs + chunk
    return replace(template.engine, scheduler=replace(scheduler, max_num_batched_tokens=budget))


def spawn(role: str, worker_id: str, template: WorkerTemplate) -> Any:
    """A named worker actor on a node of its pool (pending until such a node exists)."""
    if role == "prefill":
        from prefill_worker.worker import PrefillWorker, PrefillWorkerConfig

        worker_cls: type = PrefillWorker
        config: Any = PrefillWorkerConfig(
            worker_id,
            template.engine,
            template.redis_url,
            template.lease_s,
            num_threads=template.threads_per_worker,
        )
    else:
        from decode_worker.worker import DecodeWorker, DecodeWorkerConfig

        worker_cls = DecodeWorker
        config = DecodeWorkerConfig(
            worker_id,
            decode_engine_config(template),
            template.redis_url,
            template.transfer_timeout_s,
            num_threads=template.threads_per_worker,
            router_timeout_s=template.router_timeout_s,
            publish_cache=template.publish_decode_cache,
        )
    return (
        ray.remote(worker_cls)
        .options(
            name=worker_id,
            namespace=NAMESPACE,
            num_cpus=0,
            num_gpus=template.gpus_per_worker,
            resources={pool_resource(role): 1},
            max_concurrency=1000,
        )
        .remote(config, worker_id)
    )


async def handshake(decode_actor: Any, prefill_actor_names: list[str]) -> None:
    """The decode worker checks protocol and KV layout with each prefill worker now."""
    await asyncio.gather(*(decode_actor.check_peer.remote(name) for name in prefill_actor_names))


def warmup_request(worker_id: str, model: ServedModel) -> GenerateRequest:
    """Two blocks of fixed tokens, two output tokens, salted apart from user prefixes."""
    num_tokens = 2 * model.block_size
    prompt = tuple(1 + i % max(1, model.vocab_size - 1) for i in range(num_tokens))
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    return GenerateRequest(
        f"{WARMUP_REQ_PREFIX}{worker_id}", prompt, params, cache_salt="kvrelay-warmup"
    )


async def warm_up(prefill_actor: Any, decode_actor: Any, request: GenerateRequest) -> None:
    """One request end to end: prefill, KV handoff over NIXL, decode. Raises on any failure."""
    handle = await prefill_actor.prefill.remote(request)
    if handle.finish_reason is not None:
        return
    mailbox = f"{request.req_id}-mailbox"
    await decode_actor.submit.remote(request, handle, mailbox)
    deadline = time.monotonic() + WARMUP_TIMEOUT_S
    while time.monotonic() < deadline:
        for delta in await decode_actor.next_deltas.remote(mailbox, 1.0):
            if delta.finish_reason == "error":
                raise RuntimeError(f"warm-up request failed: {delta.error}")
            if delta.finished:
                return
    await decode_actor.abort.remote(request.req_id)
    raise TimeoutError(f"warm-up request got no answer in {WARMUP_TIMEOUT_S:.0f} s")


async def drain(actor: Any, grace_s: float, timeout_s: float) -> tuple[LeakCheck | None, str]:
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


async def stop(actor: Any, loaded: bool = True) -> None:
    """Withdraw the worker from Redis, close its NIXL agent, end its process. A worker that has
    not loaded yet (loaded=False) has published nothing, and its shutdown call would wait for
    its constructor: its process is ended at once."""
    if loaded:
        try:
            await asyncio.wait_for(actor.shutdown.remote(), 30.0)
        except Exception as e:  # dead already, or hung: it is killed either way
            logger.info("worker shutdown call failed: %s", e)
    ray.kill(actor, no_restart=True)
