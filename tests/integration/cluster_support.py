"""Test support for the embedded cluster: start one, read its workers' block accounting, drive
a prefill worker outside its pools against its decode worker."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

import ray
from ray.exceptions import RayActorError

from common.cluster_state import LeakCheck, WorkerStats
from common.messages import GenerateRequest, KVHandle, TokenDelta
from deploy.local_cluster import ClusterSpec, LocalCluster
from deploy.router_flags import RouterOptions
from engine.config import CacheConfig, EngineConfig
from engine.llm import LLM
from engine.sampling.sampling_params import SamplingParams
from prefill_worker.worker import PrefillWorker, PrefillWorkerConfig
from router.access import ApiKeys
from router.frontend import Frontend
from router.metrics import RouterMetrics
from router.serve import RouterServers
from router.tokenizer import RouterTokenizer
from tests.server_harness import LoopThread

NUM_BLOCKS = 256


def running_cluster(loop: Any, spec: ClusterSpec) -> Iterator[LocalCluster]:
    """A module fixture's body: the LocalCluster of spec, started quietly, closed after."""
    cluster = loop.run_until_complete(LocalCluster(spec).start(progress=lambda m: None))
    yield cluster
    loop.run_until_complete(cluster.close())


def cluster_spec(**overrides) -> ClusterSpec:
    engine = EngineConfig(cache=CacheConfig(num_blocks=NUM_BLOCKS))
    fields = dict(engine=engine, num_prefill=2, num_decode=1, threads_per_worker=1, lease_s=20.0)
    fields.update(overrides)
    return ClusterSpec(**fields)


async def collect(backend, request: GenerateRequest) -> list[TokenDelta]:
    return [delta async for delta in backend.generate(request)]


async def leave_after(backend, request: GenerateRequest, num_deltas: int) -> list[TokenDelta]:
    """A client that reads `num_deltas` deltas of a stream, then goes away (closes it)."""
    stream = backend.generate(request)
    got: list[TokenDelta] = []
    async for delta in stream:
        got.append(delta)
        if len(got) == num_deltas:
            break
    await stream.aclose()
    return got


def greedy_output(llm: LLM, prompt: list[int], max_tokens: int, **fields) -> Any:
    """The offline engine's greedy output of one prompt (the cluster must give the same)."""
    return llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0, **fields))[0]


def tokens_of(deltas: list[TokenDelta]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


async def worker_accounts(
    cluster: LocalCluster, extra: dict[str, Any] | None = None
) -> dict[str, LeakCheck]:
    """Each live worker's accounts. A worker a test killed is skipped (its blocks died with it)
    while the router has not yet dropped it (its membership sync runs every second)."""
    actors = {**cluster.prefill_actors, **cluster.decode_actors, **(extra or {})}
    results = await asyncio.gather(
        *(a.check_no_leaks.remote() for a in actors.values()), return_exceptions=True
    )
    accounts = {}
    for name, result in zip(actors, results, strict=True):
        if isinstance(result, RayActorError):
            continue
        if isinstance(result, BaseException):
            raise result
        accounts[name] = result
    return accounts


async def wait_until_no_leaks(
    cluster: LocalCluster, timeout_s: float = 20.0, extra: dict[str, Any] | None = None
) -> None:
    """Poll every worker (and the `extra` actors) until all blocks are free, none stranded and
    nothing in flight (leases are released asynchronously by NIXL notifications)."""
    deadline = time.monotonic() + timeout_s
    while True:
        accounts = await worker_accounts(cluster, extra)
        busy = {name: acc for name, acc in accounts.items() if not acc.clean}
        if not busy:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"blocks still in use: {busy}")
        await asyncio.sleep(0.05)


def reference_batch(
    make_engine, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
) -> list[list[int]]:
    """Each prompt's tokens from one engine alone, all of them batched in it (`params` for all,
    or one per prompt): what a cluster run must equal."""
    per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    engine = make_engine()
    for i, (prompt, sampling) in enumerate(zip(prompts, per_prompt, strict=True)):
        engine.add_request(f"ref{i}", prompt, sampling)
    out: dict[str, list[int]] = {}
    while engine.has_unfinished_requests:
        for o in engine.step():
            out.setdefault(o.req_id, []).extend(o.new_token_ids)
    return [out[f"ref{i}"] for i in range(len(prompts))]


def start_extra_prefill(name: str, engine_config: EngineConfig, lease_s: float = 20.0) -> Any:
    """A prefill worker actor outside the cluster's pools (no router places on it)."""
    config = PrefillWorkerConfig(name, engine_config, None, lease_s, num_threads=1)
    actor = ray.remote(PrefillWorker).options(name=name, num_cpus=0)
    return actor.remote(config, name)


def reference_tokens(make_engine, prompt, params: SamplingParams) -> list[int]:
    engine = make_engine()
    engine.add_request("ref", prompt, params)
    tokens = []
    while engine.has_unfinished_requests:
        for out in engine.step():
            tokens.extend(out.new_token_ids)
    return tokens


async def decode_handle(
    cluster: LocalCluster, req: GenerateRequest, handle: KVHandle
) -> tuple[list[int], WorkerStats, WorkerStats]:
    """Decode a prefilled request on the cluster's decode worker: its tokens, and the worker's
    stats before and after."""
    decode = next(iter(cluster.decode_actors.values()))
    before = await decode.stats.remote()
    await decode.submit.remote(req, handle, "test-router")
    tokens = [handle.first_token_id]
    for _ in range(120):
        deltas = await decode.next_deltas.remote("test-router", 1.0)
        deltas = [d for d in deltas if d.req_id == req.req_id]  # not an aborted one's leftovers
        tokens.extend(t for d in deltas for t in d.token_ids)
        if any(d.finished for d in deltas):
            break
    return tokens, before, await decode.stats.remote()


async def decode_from_extra_prefill(
    cluster: LocalCluster, prefill: Any, req: GenerateRequest, kill_prefill: bool = False
) -> tuple[list[int], WorkerStats, WorkerStats]:
    """Prefill on an actor outside the cluster, decode on the cluster's decode worker."""
    handle = await prefill.prefill.remote(req)
    if kill_prefill:
        ray.kill(prefill)
    return await decode_handle(cluster, req, handle)


class ClusterHarness(LoopThread):
    """A LocalCluster behind the router's HTTP and gRPC servers, as `kvrelay serve` runs it."""

    def __init__(
        self, spec: ClusterSpec, api_keys: ApiKeys | None = None, max_running_requests: int = 0
    ):
        super().__init__()
        # as `kvrelay serve` does: a router that joins must bring the same keys
        access = RouterOptions(api_keys=api_keys).access_digest()
        self.cluster = LocalCluster(replace(spec, access_digest=access))
        self.api_keys = api_keys
        self.max_running_requests = max_running_requests
        try:
            self.run(self._start(), timeout_s=300)
        except BaseException:  # a failed start must not leave the loop thread (pytest hangs)
            self.stop()
            raise

    async def _start(self) -> None:
        await self.cluster.start(progress=lambda message: None)
        metrics = RouterMetrics()
        self.cluster.backend.metrics = metrics
        models = self.cluster.models  # several: a tokenizer each, the default's first
        tokenizers = {m: RouterTokenizer(served.checkpoint_dir) for m, served in models.items()}
        tokenizer = tokenizers[self.cluster.model.model_id]
        frontend = Frontend(
            self.cluster.backend,
            tokenizer,
            metrics,
            api_keys=self.api_keys,
            max_running_requests=self.max_running_requests,
            tokenizers=tokenizers,
        )
        self.servers = RouterServers(frontend)
        await self.servers.start("127.0.0.1", 0, 0)

    def wait_until_no_leaks(self) -> None:
        self.run(wait_until_no_leaks(self.cluster))

    def stop(self) -> None:
        try:
            if self.servers is not None:
                self.run(self.servers.stop(0))
            self.run(self.cluster.close(), timeout_s=120)
        finally:
            self.close()
