"""Clusters of prefill TP 2 / decode TP 1 and prefill TP 1 / decode TP 2 (a TP worker: two Ray
actors in a placement group, gloo) on a tiny random Llama (4 heads, 2 KV heads): each decode
rank reads the KV heads it owns straight from the prefill rank holding them (head slices of
each block over NIXL, each rank its own agent; no gather on the prefill side), a prompt's full
blocks from each holder rank's own host tier (host leases), its last from the device. Greedy
outputs equal transformers' token for token, a repeated prefix is a hit on the decode side
(fewer blocks pulled), every block of every worker is free after, and status lists a TP
worker's two ranks on one node. A holder whose layout cannot be mapped is refused before any
read."""

from __future__ import annotations

from pathlib import Path

import pytest
import ray

from common.messages import GenerateRequest
from engine.config import CacheConfig, EngineConfig
from engine.sampling.sampling_params import SamplingParams
from kvtransfer.handshake import IncompatiblePeerError
from tests.factories import make_tiny_checkpoint, transformers_greedy
from tests.integration.cluster_support import (
    cluster_spec,
    collect,
    running_cluster,
    start_extra_prefill,
    tokens_of,
    wait_until_no_leaks,
)

NEW_TOKENS = 8
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
PREFIX = [(7 * i + 3) % 500 + 1 for i in range(48)]  # three blocks of 16
PROMPTS = [[5, 17, 300, 42], [*PREFIX, 9, 8], [*PREFIX, 1, 2, 3, 4, 5]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), num_heads=4, num_kv_heads=2)


@pytest.fixture(scope="module", params=[(2, 1), (1, 2)], ids=["prefill-tp2", "decode-tp2"])
def cluster(request, loop, checkpoint):
    # host leases: the holder leases its host tier's copies of a prompt's full blocks
    cache = CacheConfig(num_blocks=64, host_kv_cache_bytes=4 << 20, keep_on_host=True)
    engine = EngineConfig(model=str(checkpoint), cache=cache)
    prefill_tp, decode_tp = request.param
    spec = cluster_spec(
        engine=engine,
        num_prefill=1,
        num_decode=1,
        prefill_tp=prefill_tp,
        decode_tp=decode_tp,
        redis_url="",
    )
    yield from running_cluster(loop, spec)


def test_any_tp_pairing_is_token_exact_with_a_decode_prefix_hit_and_leak_free(
    cluster, loop, checkpoint
) -> None:
    expected = transformers_greedy(checkpoint, PROMPTS, NEW_TOKENS)
    [decode] = cluster.decode_actors.values()

    async def run(i: int) -> list[int]:
        request = GenerateRequest(f"tp{i}", tuple(PROMPTS[i]), GREEDY)
        return tokens_of(await collect(cluster.backend, request))

    got, pulled, from_host = [], [], []
    for i in range(len(PROMPTS)):  # one after the other: the third finds the second's prefix
        got.append(loop.run_until_complete(run(i)))
        stats = ray.get(decode.stats.remote())
        pulled.append(stats.num_transferred_blocks)
        from_host.append(stats.num_host_read_blocks)
    assert got == expected
    second, third = pulled[1] - pulled[0], pulled[2] - pulled[1]
    assert second == 4  # 50 prompt tokens: 4 blocks pulled
    # its 3 full blocks from the holder ranks' host tiers (each rank's own heads), the last
    # from their device caches
    assert from_host[1] - from_host[0] == 3
    assert third < 4, f"the shared prefix was pulled again ({third} blocks)"
    assert ray.get(decode.stats.remote()).num_recomputed == 0

    loop.run_until_complete(wait_until_no_leaks(cluster))
    status = ray.get(cluster.controller.status.remote(False))
    spec = cluster.spec
    for role, tp in (("prefill", spec.prefill_tp), ("decode", spec.decode_tp)):
        [worker] = status.pool(role).workers
        assert [r.rank for r in worker.ranks] == ([0, 1] if tp == 2 else [])
        assert len({r.node_id for r in worker.ranks}) == (1 if tp == 2 else 0)


def test_an_unmappable_holder_is_refused_before_any_read_and_nothing_leaks(
    cluster, loop, checkpoint, tmp_path_factory
) -> None:
    """A holder serving a model of the same name with 4 KV heads instead of 2: the TP decode
    worker's handshake refuses it, naming the layouts, and neither side holds a block."""
    if cluster.spec.decode_tp == 1:
        pytest.skip("one holder checked, against the TP 2 decode worker")
    other = make_tiny_checkpoint(
        tmp_path_factory.mktemp("odd") / checkpoint.name, num_heads=4, num_kv_heads=4
    )
    engine = EngineConfig(model=str(other), cache=CacheConfig(num_blocks=64))
    holder = start_extra_prefill("odd-holder", engine)
    try:
        [decode] = cluster.decode_actors.values()
        with pytest.raises(IncompatiblePeerError, match=r"layout \(block shape, every KV head\)"):
            ray.get(decode.check_peer.remote("odd-holder"), timeout=120)
        assert ray.get(decode.stats.remote()).num_refused_handshakes == 1
        assert ray.get(holder.check_no_leaks.remote()).clean
        loop.run_until_complete(wait_until_no_leaks(cluster))
    finally:
        ray.kill(holder)
