"""Migrating an n > 1 request whose decode worker died: each unfinished choice resumes as a
request of its own, and their streams are merged back into the client's; owns no state.

Choice i of a request samples with seed + i (engine/step/fork.py), drawing by position, so a
single-choice continuation with that seed, its prompt extended by the choice's tokens so far,
continues the same random stream (greedy: the same tokens).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import replace

from common.messages import GenerateRequest, TokenDelta
from engine.finish_reason import FinishReason


def continuation(
    request: GenerateRequest, sent: Sequence[int], req_id: str, index: int = 0
) -> GenerateRequest:
    """The request of one choice that resumes choice `index` of `request` after `sent` tokens:
    their KV is mostly in the prefix cache; a seeded sampler draws by position, so with the
    choice's seed (seed + index) it continues the same random stream; the sent tokens stay
    output for presence / frequency penalties (num_resumed_tokens)."""
    sampling = request.sampling
    seed = None if sampling.seed is None else sampling.seed + index
    return replace(
        request,
        req_id=req_id,
        prompt_token_ids=request.prompt_token_ids + tuple(sent),
        sampling=replace(sampling, n=1, seed=seed, max_tokens=sampling.max_tokens - len(sent)),
        num_resumed_tokens=request.num_resumed_tokens + len(sent),
    )


def as_choice(delta: TokenDelta, req_id: str, index: int) -> TokenDelta:
    """A continuation's delta as the client's choice `index` (its prompt counted once)."""
    return replace(delta, req_id=req_id, index=index, num_prompt_tokens=0, num_cached_tokens=0)


async def merged(streams: Sequence[AsyncIterator[TokenDelta]]) -> AsyncIterator[TokenDelta]:
    """The deltas of every stream as they come; closing this closes them all (their cleanup
    runs: a continuation's leases and decode are released)."""
    queue: asyncio.Queue[TokenDelta | None] = asyncio.Queue()

    async def pump(stream: AsyncIterator[TokenDelta]) -> None:
        try:
            async with contextlib.aclosing(stream) as deltas:  # type: ignore[type-var]
                async for delta in deltas:
                    await queue.put(delta)
        finally:
            queue.put_nowait(None)

    tasks = [asyncio.create_task(pump(stream)) for stream in streams]
    try:
        remaining = len(tasks)
        while remaining:
            delta = await queue.get()
            if delta is None:
                remaining -= 1
            else:
                yield delta
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def resume_choices(
    generate: Callable[[GenerateRequest], AsyncIterator[TokenDelta]],
    request: GenerateRequest,
    open_choices: Mapping[int, Sequence[int]],
) -> AsyncIterator[TokenDelta]:
    """The unfinished choices of `request` (index -> the tokens it sent), each resumed as a
    request of one choice through `generate` (which migrates it again on its own), merged
    into one stream of the client's choices."""
    legs = []
    for index, sent in open_choices.items():
        if len(sent) >= request.sampling.max_tokens:  # every token was out already
            yield TokenDelta(request.req_id, (), True, FinishReason.LENGTH, index=index)
            continue
        leg = continuation(request, sent, f"{request.req_id}@c{index}", index)
        legs.append(_as_choice(generate(leg), request, index))
    async with contextlib.aclosing(merged(legs)) as deltas:  # type: ignore[type-var]
        async for delta in deltas:
            yield delta


async def _as_choice(
    stream: AsyncIterator[TokenDelta], request: GenerateRequest, index: int
) -> AsyncIterator[TokenDelta]:
    async with contextlib.aclosing(stream) as deltas:  # type: ignore[type-var]
        async for delta in deltas:
            yield as_choice(delta, request.req_id, index)
