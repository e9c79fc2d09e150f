"""Tenant isolation on the whole stack (router with API keys -> Ray prefill worker -> NIXL -> Ray
decode worker, a local redis-server): two tenants sending the same prompt never hit each other's
prefix, neither on the workers nor in the Redis prefix index, whatever cache_salt they send."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import openai
import pytest

from common.cluster_state import KVEvictRequest
from engine.kv_cache.hashing import hash_blocks
from router.access import ApiKeys, tenant_cache_salt
from tests.integration.cluster_support import ClusterHarness, cluster_spec

KEY_A = "sk-tenant-a-0123456789abcdef"
KEY_B = "sk-tenant-b-0123456789abcdef"
MODEL = "SmolLM2-135M-Instruct"
PROMPT = "In a quiet village by the sea, the old lighthouse keeper counted ships " * 3


@pytest.fixture(scope="module")
def stack() -> Iterator[ClusterHarness]:
    keys = ApiKeys.parse(f"{KEY_A} team-a\n{KEY_B} team-b\n")
    harness = ClusterHarness(cluster_spec(num_prefill=1, num_decode=1), api_keys=keys)
    try:
        yield harness
    finally:
        harness.stop()


def cached_tokens(stack: ClusterHarness, key: str, salt: str | None = None) -> int:
    client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=key, max_retries=0)
    reply = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=2,
        temperature=0,
        extra_body={} if salt is None else {"cache_salt": salt},
    )
    return reply.usage.prompt_tokens_details.cached_tokens


def indexed_blocks(stack: ClusterHarness, salt: str | None) -> int:
    """Leading blocks of PROMPT, hashed with `salt`, that the index lists for any prefill worker."""
    backend = stack.cluster.backend
    assert backend.index is not None and stack.servers is not None
    tokens = stack.servers.frontend.tokenizer.encode(PROMPT)
    hashes = hash_blocks(tokens, backend.block_size, backend.model_id, salt)
    overlap = stack.run(backend.index.prefix_overlap(hashes, list(stack.cluster.prefill_actors)))
    return max(overlap.values(), default=0)


def wait_for_index(stack: ClusterHarness, salt: str, timeout_s: float = 20.0) -> int:
    """Workers publish KV events asynchronously: poll until the tenant's blocks are listed."""
    deadline = time.monotonic() + timeout_s
    while (found := indexed_blocks(stack, salt)) == 0 and time.monotonic() < deadline:
        stack.run(asyncio.sleep(0.05))
    return found


def test_two_tenants_never_share_prefix_blocks(stack: ClusterHarness) -> None:
    salt_a, salt_b = tenant_cache_salt("team-a", None), tenant_cache_salt("team-b", None)
    assert cached_tokens(stack, KEY_A) == 0
    assert cached_tokens(stack, KEY_A) >= 32  # team-a's second request reuses its prefix
    num_blocks = wait_for_index(stack, salt_a)
    assert num_blocks >= 2
    # Neither the raw prompt nor team-b's salt reach team-a's entries in the index.
    assert indexed_blocks(stack, None) == 0 and indexed_blocks(stack, salt_b) == 0
    # team-b, whatever salt it sends (none, team-a's name, team-a's derived salt): no hit.
    for salt in (None, "team-a", salt_a):
        assert cached_tokens(stack, KEY_B, salt) == 0, salt
    assert indexed_blocks(stack, salt_a) == num_blocks  # team-a's entries are untouched
    assert wait_for_index(stack, salt_b) >= 2  # team-b has its own entries now
    stack.wait_until_no_leaks()


def evict(stack: ClusterHarness, request: KVEvictRequest) -> dict[str, dict[str, int] | str]:
    """What `kvrelay kv evict` asks the controller."""

    async def call() -> dict[str, dict[str, int] | str]:
        assert stack.cluster.controller is not None
        return await stack.cluster.controller.evict_kv.remote(request)

    return stack.run(call())


def test_kv_evict_drops_a_tenants_blocks_from_every_worker(stack: ClusterHarness) -> None:
    cached_tokens(stack, KEY_A)
    assert cached_tokens(stack, KEY_A) >= 32 and cached_tokens(stack, KEY_B) >= 32
    salt_a = tenant_cache_salt("team-a", None)
    assert wait_for_index(stack, salt_a) >= 2
    request = KVEvictRequest(cache_salt=salt_a)  # `kvrelay kv evict --tenant team-a`
    answers = evict(stack, request)
    assert set(answers) == {*stack.cluster.prefill_actors, *stack.cluster.decode_actors}
    dropped = [answer["device"] for answer in answers.values() if isinstance(answer, dict)]
    assert len(dropped) == len(answers) and sum(dropped) >= 4  # on both sides of the handoff
    deadline = time.monotonic() + 20.0  # the removals reach the index as KV events
    while indexed_blocks(stack, salt_a) and time.monotonic() < deadline:
        stack.run(asyncio.sleep(0.05))
    assert indexed_blocks(stack, salt_a) == 0
    assert cached_tokens(stack, KEY_A) == 0  # computed again
    assert cached_tokens(stack, KEY_B) >= 32  # team-b's blocks untouched
    prompt_only = KVEvictRequest(prompt=PROMPT, cache_salt=tenant_cache_salt("team-b", None))
    answers = evict(stack, prompt_only)
    assert sum(a["device"] for a in answers.values() if isinstance(a, dict)) >= 2
    assert cached_tokens(stack, KEY_B) == 0
    stack.wait_until_no_leaks()
