"""The KV handoff's state machines between real workers (Ray actors, NIXL, SmolLM2, Redis): a
late release of a previous epoch cannot free a re-prefill's lease, and no handoff (normal,
aborted on either side, expired, too late to read) leaves a stranded block on either side."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest
import ray

from common.messages import GenerateRequest
from deploy.local_cluster import LocalCluster
from engine.sampling.sampling_params import SamplingParams
from tests.integration.cluster_support import (
    cluster_spec,
    decode_handle,
    reference_tokens,
    start_extra_prefill,
    wait_until_no_leaks,
)

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
BRIEF_LEASE_S = 1.0


@pytest.fixture(scope="module")
def cluster(loop):
    spec = cluster_spec(num_prefill=1, num_decode=1)
    cluster = loop.run_until_complete(LocalCluster(spec).start(progress=lambda m: None))
    yield cluster
    loop.run_until_complete(cluster.close())


@pytest.fixture(scope="module")
def holders(cluster, loop):
    """Two prefill workers outside the pools, driven directly: leases of 20 s and of 1 s."""
    engine = cluster.spec.engine
    actors = {
        "holder": start_extra_prefill("handoff-holder", engine),
        "brief": start_extra_prefill("handoff-brief", engine, lease_s=BRIEF_LEASE_S),
    }

    async def started() -> None:  # the model loaded, the KV pool registered with NIXL
        await asyncio.gather(*(actor.describe.remote() for actor in actors.values()))

    loop.run_until_complete(started())
    yield actors
    for actor in actors.values():
        ray.kill(actor)


@pytest.fixture
def holder(holders):
    return holders["holder"]


@pytest.fixture(autouse=True)
def no_leaks_after(cluster, holders, loop):
    """Every pool and both holders end each test with every block free and none stranded."""
    yield
    loop.run_until_complete(wait_until_no_leaks(cluster, extra=holders))


def request(req_id: str, tokenizer, text: str) -> GenerateRequest:
    prompt = tokenizer.encode(f"{text} " * 6)  # several blocks
    return GenerateRequest(req_id, tuple(prompt), GREEDY)


def moves(stats) -> dict[str, int]:
    return dict(stats.handoff_transitions)


def grew(before, after, name: str) -> int:
    return moves(after)[name] - moves(before)[name]


async def stats_when(actor, ready, timeout_s: float = 30.0):
    """The actor's stats once `ready(stats)` holds (a lease ends on the holder's own tick)."""
    deadline = time.monotonic() + timeout_s
    while not ready(stats := await actor.stats.remote()):
        assert time.monotonic() < deadline, f"not reached in {timeout_s} s: {stats}"
        await asyncio.sleep(0.05)
    return stats


def test_a_late_release_of_a_previous_epoch_spares_the_re_prefilled_lease(
    cluster, loop, holder, tokenizer, make_engine
):
    req = request("fenced", tokenizer, "An epoch fences every grant of a lease.")

    async def run():
        before = await holder.stats.remote()
        first = await holder.prefill.remote(req)
        assert await holder.release.remote(req.req_id, first.epoch)
        second = await holder.prefill.remote(req)  # the same req_id, prefilled again
        assert second.epoch != first.epoch
        assert not await holder.release.remote(req.req_id, first.epoch)  # late: ignored
        held = await holder.stats.remote()
        assert await holder.num_leases.remote() == 1
        decoded = await decode_handle(cluster, req, second)
        return first, second, before, held, decoded

    first, second, before, held, (tokens, dec_before, dec_after) = loop.run_until_complete(run())
    shared = set(first.block_ids) & set(second.block_ids)  # the prefix cache gave them back
    assert len(shared) >= len(first.block_ids) - 1  # all but the partial last block
    assert held.num_stale_releases == before.num_stale_releases + 1
    assert held.num_blocks_held == len(second.block_ids) and held.num_stranded_blocks == 0
    # The new lease's blocks were still pinned: the decode worker read them, token-exact.
    assert tokens == reference_tokens(make_engine, req.prompt_token_ids, GREEDY)
    assert dec_after.num_recomputed == dec_before.num_recomputed
    assert dec_after.num_transferred_blocks > dec_before.num_transferred_blocks


def test_a_normal_handoff_moves_both_ledgers_and_strands_nothing(cluster, loop, holder, tokenizer):
    req = request("normal", tokenizer, "A normal handoff is read once, then released.")

    async def run():
        before = await holder.stats.remote()
        handle = await holder.prefill.remote(req)
        _, dec_before, dec_after = await decode_handle(cluster, req, handle)
        after = await stats_when(holder, lambda s: grew(before, s, "being_read->released"))
        return before, after, dec_before, dec_after

    before, after, dec_before, dec_after = loop.run_until_complete(run())
    assert grew(before, after, "held->being_read") == 1  # the BEGIN notice
    assert grew(before, after, "being_read->released") == 1  # the READ's DONE notice
    assert after.num_stale_releases == before.num_stale_releases  # nobody released it twice
    for name in ("new->queued", "queued->reserved", "reserved->reading", "reading->committed"):
        assert grew(dec_before, dec_after, name) == 1, name
    assert after.num_stranded_blocks == dec_after.num_stranded_blocks == 0
    assert dec_after.num_blocks_reading == dec_after.num_blocks_reserved == 0


def test_aborted_handoffs_strand_nothing(cluster, loop, holder, tokenizer):
    decode = next(iter(cluster.decode_actors.values()))

    async def run():
        before = await holder.stats.remote()
        # The holder's own abort (the router gave up before handing the handle on).
        await holder.prefill.remote(request("dropped", tokenizer, "Aborted before any handoff."))
        await holder.abort.remote("dropped")
        dropped = await holder.stats.remote()
        # The decode worker's abort, right after the handoff (whatever state it reached).
        req = request("cut", tokenizer, "Aborted on the decode worker as it arrives.")
        handle = await holder.prefill.remote(req)
        dec_before = await decode.stats.remote()
        await decode.submit.remote(req, handle, "test-router")
        await decode.abort.remote(req.req_id)
        dec_after = await decode.stats.remote()
        after = await stats_when(holder, lambda s: s.num_blocks_held + s.num_blocks_being_read == 0)
        return before, dropped, dec_before, dec_after, after

    before, dropped, dec_before, dec_after, after = loop.run_until_complete(run())
    assert grew(before, dropped, "held->released") == 1
    assert dropped.num_stranded_blocks == 0 and dropped.num_blocks_held == 0
    assert dec_after.num_stranded_blocks == 0
    ended = sum(grew(dec_before, dec_after, m) for m in ("queued->aborted", "reserved->aborted"))
    ended += grew(dec_before, dec_after, "reading->aborted")
    ended += grew(dec_before, dec_after, "reading->committed")  # done before the abort came
    assert ended == 1
    assert after.num_stranded_blocks == 0


def test_an_expired_lease_frees_its_blocks_and_a_late_release_is_stale(loop, holders, tokenizer):
    brief = holders["brief"]
    req = request("forgotten", tokenizer, "Nobody reads this lease; it expires.")

    async def run():
        before = await brief.stats.remote()
        handle = await brief.prefill.remote(req)
        assert handle.lease_s == BRIEF_LEASE_S
        expired = await stats_when(
            brief, lambda s: s.num_expired_leases > before.num_expired_leases
        )
        released = await brief.release.remote(req.req_id, handle.epoch)  # after the expiry
        return before, expired, released, await brief.stats.remote()

    before, expired, released, after = loop.run_until_complete(run())
    assert grew(before, expired, "held->expired") == 1
    assert expired.num_blocks_held == 0 and expired.num_stranded_blocks == 0
    assert not released and after.num_stale_releases == before.num_stale_releases + 1


def test_a_handle_with_no_time_left_is_recomputed_and_its_lease_released(
    cluster, loop, holder, tokenizer, make_engine
):
    req = request("too-late", tokenizer, "The decode worker reckons this lease has no time left.")

    async def run():
        before = await holder.stats.remote()
        handle = await holder.prefill.remote(req)
        late = dataclasses.replace(handle, lease_s=0.0)  # its deadline is its arrival
        decoded = await decode_handle(cluster, req, late)
        after = await stats_when(holder, lambda s: grew(before, s, "held->released"))
        return before, after, decoded

    before, after, (tokens, dec_before, dec_after) = loop.run_until_complete(run())
    assert tokens == reference_tokens(make_engine, req.prompt_token_ids, GREEDY)
    assert dec_after.num_recomputed == dec_before.num_recomputed + 1
    assert grew(dec_before, dec_after, "reserved->failed") == 1
    assert grew(before, after, "held->being_read") == 0  # no READ was posted
    assert after.num_stranded_blocks == dec_after.num_stranded_blocks == 0
