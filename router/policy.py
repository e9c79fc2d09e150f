"""Placement: which prefill worker and which decode worker get a request (pure, no I/O).

Owns only the cursor of RoundRobinPolicy and the RNG of RandomPolicy; inputs are snapshots
(WorkerInfo lists from the KV index or the local registry, overlap counts in blocks).
"""

from __future__ import annotations

import abc
import random
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from common.messages import WorkerInfo, WorkerLoad
from common.placement_rules import LocalPrefill

POLICY_NAMES = ("kv_aware", "round_robin", "random")


class NoWorkerAvailable(RuntimeError):
    """No live worker of the needed role: the request cannot be placed now."""


class Placement(NamedTuple):
    """The chosen worker, how many prompt tokens it already holds, and why it won."""

    worker: WorkerInfo
    num_cached_tokens: int
    score: float
    policy: str


def load_key(load: WorkerLoad) -> tuple[int, int]:
    """Lower is less loaded: queued prompt tokens first, then requests waiting + running."""
    return (load.queued_tokens, load.waiting + load.running)


# A leading block found only in a worker's host tier saves its compute at the price of a copy
# back over the host link (2 MiB in ~40 us at ~50 GB/s on an H200 for the 8B shape, against
# ~0.4 ms to compute its 16 tokens): credited by the worker's copy-back time measured at start
# (tier_credit), this fraction of a device block until the worker has measured its compute.
HOST_HIT_CREDIT = 0.8
# A leading block found only in a worker's disk tier, or in the cluster-shared store, saves its
# compute at the price of reading and checking its file: credited by the worker's measured cost
# of that tier (tier_credit), this fraction of a device block until the worker has measured both
# that tier's reads and its compute.
DISK_HIT_CREDIT = 0.5
UNMEASURED_CREDIT = {"host": HOST_HIT_CREDIT, "disk": DISK_HIT_CREDIT, "shared": DISK_HIT_CREDIT}


class Overlap(dict[str, int]):
    """worker_id -> how many leading prompt blocks it holds (device memory, then its host
    tier, then its disk tier, then the cluster-shared store any worker loads); `host` / `disk`
    / `shared`: how many of those are only in its host / disk tier / the shared store (0 when
    absent)."""

    def __init__(
        self,
        total: Mapping[str, int] | None = None,
        host: Mapping[str, int] | None = None,
        disk: Mapping[str, int] | None = None,
        shared: Mapping[str, int] | None = None,
    ):
        super().__init__(total or {})
        self.host: dict[str, int] = dict(host or {})
        self.disk: dict[str, int] = dict(disk or {})
        self.shared: dict[str, int] = dict(shared or {})


def _cached_tokens(worker: WorkerInfo, overlap: Mapping[str, int], block_size: int) -> int:
    return max(0, overlap.get(worker.worker_id, 0)) * block_size


SLOWER_TIERS = ("host", "disk", "shared")


def _tier_tokens(worker: WorkerInfo, overlap: Mapping[str, int], block_size: int, tier: str) -> int:
    """Tokens only in its host tier, only in its disk tier, or only in the shared store: each
    loaded from that tier (a copy back, or a checked file)."""
    found = getattr(overlap, tier, {})
    return max(0, found.get(worker.worker_id, 0)) * block_size


def tier_credit(worker: WorkerInfo, block_size: int, tier: str = "disk") -> float:
    """The share of a block's compute a hit in the worker's host tier, disk tier or the shared
    store saves: 1 - that tier's measured load time over the time it takes to compute
    block_size tokens (0 when a load costs more: for a file tier, the worker's own gate, which
    weighs each tier by its own read time, computes such a hit again); UNMEASURED_CREDIT's
    until it has measured both. The compute rate is the one that gate uses, the worker's
    prompt rate (prompt_tok_s), and its all-steps rate until it has one: on a worker whose
    steps are mostly decodes the all-steps rate makes computing look slow and a slow read look
    worth taking."""
    load = worker.load
    rate = load.compute_tok_s
    load_us = {
        "host": load.host_load_us,
        "disk": load.disk_load_us,
        "shared": load.shared_load_us,
    }[tier]
    if not load_us or not rate:
        return UNMEASURED_CREDIT[tier]
    compute_us = block_size * 1e6 / rate
    return min(1.0, max(0.0, 1.0 - load_us / compute_us))


class PrefillPolicy(abc.ABC):
    """Chooses a prefill worker for one prompt.

    Invariants: `choose` returns one of `workers` (raises NoWorkerAvailable when it is empty);
    the result does not depend on the order of `workers`; workers missing from `overlap` hold
    nothing (0 blocks); `overlap` counts leading blocks, so cached tokens = count * block_size.
    """

    name: str

    @abc.abstractmethod
    def choose(
        self, workers: Sequence[WorkerInfo], overlap: Mapping[str, int], block_size: int
    ) -> Placement: ...


class KVAwarePolicy(PrefillPolicy):
    """score = cached_tokens_saved - load_weight * queued_tokens, where a token cached only in
    a worker's host tier, only in its disk tier or only in the shared store saves that tier's
    tier_credit of one in device memory (measured per worker and tier); ties go to the less
    loaded worker (load_key), then the smaller worker_id. Deterministic."""

    name = "kv_aware"

    def __init__(self, load_weight: float = 1.0) -> None:
        if load_weight < 0:
            raise ValueError(f"load_weight must be >= 0, got {load_weight}")
        self.load_weight = load_weight

    def score(self, worker: WorkerInfo, overlap: Mapping[str, int], block_size: int) -> float:
        saved = _cached_tokens(worker, overlap, block_size)
        for tier in SLOWER_TIERS:
            tokens = _tier_tokens(worker, overlap, block_size, tier)
            if tokens:
                saved -= (1 - tier_credit(worker, block_size, tier)) * tokens
        return saved - self.load_weight * worker.load.queued_tokens

    def choose(
        self, workers: Sequence[WorkerInfo], overlap: Mapping[str, int], block_size: int
    ) -> Placement:
        _require(workers)
        best = min(
            workers,
            key=lambda w: (-self.score(w, overlap, block_size), load_key(w.load), w.worker_id),
        )
        return Placement(
            best,
            _cached_tokens(best, overlap, block_size),
            self.score(best, overlap, block_size),
            self.name,
        )


class RoundRobinPolicy(PrefillPolicy):
    """Cycles through workers in worker_id order, ignoring the cache (a baseline)."""

    name = "round_robin"

    def __init__(self) -> None:
        self._cursor = 0

    def choose(
        self, workers: Sequence[WorkerInfo], overlap: Mapping[str, int], block_size: int
    ) -> Placement:
        ordered = sorted(_require(workers), key=lambda w: w.worker_id)
        worker = ordered[self._cursor % len(ordered)]
        self._cursor += 1
        return Placement(worker, _cached_tokens(worker, overlap, block_size), 0.0, self.name)


class RandomPolicy(PrefillPolicy):
    """Uniform choice, ignoring the cache (a baseline); seedable for reproducible runs."""

    name = "random"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(
        self, workers: Sequence[WorkerInfo], overlap: Mapping[str, int], block_size: int
    ) -> Placement:
        ordered = sorted(_require(workers), key=lambda w: w.worker_id)
        worker = self._rng.choice(ordered)
        return Placement(worker, _cached_tokens(worker, overlap, block_size), 0.0, self.name)


def make_prefill_policy(
    name: str = "kv_aware", load_weight: float = 1.0, seed: int | None = None
) -> PrefillPolicy:
    """The policy called `name` (one of POLICY_NAMES)."""
    if name == "kv_aware":
        return KVAwarePolicy(load_weight)
    if name == "round_robin":
        return RoundRobinPolicy()
    if name == "random":
        return RandomPolicy(seed)
    raise ValueError(f"unknown placement policy {name!r}; choose one of {POLICY_NAMES}")


def route_by_load(workers: Sequence[WorkerInfo]) -> Placement:
    """Fallback when the KV index is unavailable: the least loaded worker (load_key, then id).

    Its num_cached_tokens is 0: without the index nothing is known about caches.
    """
    best = min(_require(workers), key=lambda w: (load_key(w.load), w.worker_id))
    return Placement(best, 0, -float(best.load.queued_tokens), "load")


def choose_decode(workers: Sequence[WorkerInfo], num_blocks_needed: int) -> WorkerInfo:
    """The decode worker for a request needing `num_blocks_needed` KV blocks.

    Order: workers with enough free blocks first (the others would queue the request); then
    the smallest batch (running + waiting), then the most free blocks, then worker_id. When no
    worker has room, the one with the most free blocks still gets it (it admits it when it can).
    """

    def key(worker: WorkerInfo) -> tuple[int, int, int, str]:
        load = worker.load
        batch = load.running + load.waiting
        if load.free_blocks >= num_blocks_needed:
            return (0, batch, -load.free_blocks, worker.worker_id)
        return (1, -load.free_blocks, batch, worker.worker_id)

    return min(_require(workers), key=key)


class LocalPlacement(NamedTuple):
    worker: WorkerInfo
    num_cached_tokens: int
    reason: str  # "short" | "cached" | "slo" (router/slo.py)


def choose_local_prefill(
    rule: LocalPrefill,
    workers: Sequence[WorkerInfo],
    overlap: Mapping[str, int],
    block_size: int,
    num_prompt_tokens: int,
    num_blocks_needed: int,
) -> LocalPlacement | None:
    """The decode worker that should prefill this prompt itself, or None (use the prefill
    pool). Only workers with room for the whole request qualify; among those the rule admits,
    the one with the most of the prompt cached, then choose_decode's order."""
    if not rule.enabled:
        return None
    roomy = [w for w in workers if w.load.free_blocks >= num_blocks_needed]
    admitted = []
    for worker in roomy:
        cached = min(_cached_tokens(worker, overlap, block_size), num_prompt_tokens)
        reason = rule.reason(num_prompt_tokens, cached)
        if reason is not None:
            admitted.append(LocalPlacement(worker, cached, reason))
    if not admitted:
        return None
    most = max(p.num_cached_tokens for p in admitted)
    best = choose_decode([p.worker for p in admitted if p.num_cached_tokens == most], 0)
    return next(p for p in admitted if p.worker is best)


def _require(workers: Sequence[WorkerInfo]) -> Sequence[WorkerInfo]:
    if not workers:
        raise NoWorkerAvailable("no live worker to place the request on")
    return workers
