"""Start-up warm-up: synthetic prompts run through a new engine's own steps before it serves, so
what a step's shape selects the first time it is met (a Triton kernel's variant, a cuBLAS
kernel, a FlashInfer plan) loads then, not in a served request's first token. Owns no state:
its requests are not cacheable (Request.cacheable: no prefix-cache entry, KV event, tier copy
or lookup), they finish before it returns, and the engine then drops the step parts they ran
on (Engine.__init__: step counters, the seeded sampler, step timings start at serving).

On a GPU, served runs (bench/RESULTS.md, 2026-12-06) had a fresh server's first requests at TTFT
270-660 ms against ~40-90 ms later for prompts of the same lengths; the RoPE/KV-write kernel
alone has a variant per power of two of a step's tokens (rope_kv_kernel.heads_per_program), and
beside its odd number of decoders the second pass's steps mostly carry odd token counts where
the first pass's are even (a budget-filling step, or drafts, can make them even again). Off
CUDA there is nothing to load: the engine runs it on CUDA only unless told
(EngineConfig.warm_up; `--no-warm-up`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from engine.config import EngineConfig, ModelConfig
from engine.kv_cache.manager import KVCacheManager
from engine.sampling.sampling_params import SamplingParams
from engine.say import say

ID = "kvrelay-warm-up"  # its requests' ids start so
# requests decoding while the second pass's prompts arrive (mixed steps): odd, so that beside
# the first pass's even step sizes those steps carry odd token counts (a Triton kernel may build
# a variant per the alignment of a step's packed per-token rows: rope_kv_kernel.py)
NUM_DECODERS = 7
DECODER_PROMPT = 15  # tokens: less than a block, so a decoder's prompt takes one
PROGRESS_EVERY_S = 15.0  # a long warm-up (kernels compiling) says how far it is this often


@dataclass(frozen=True)
class WarmUpRun:
    step_sizes: tuple[int, ...]  # prompt tokens run together: alone, then beside decodes
    num_decoders: int
    num_steps: int
    seconds: float


class Engine(Protocol):
    """What the warm-up uses of engine.engine.Engine (which imports this module)."""

    config: EngineConfig
    kv: KVCacheManager
    model_config: ModelConfig
    block_size: int
    max_model_len: int
    device: torch.device

    @property
    def has_unfinished_requests(self) -> bool: ...
    def add_request(
        self, req_id: str, prompt: Sequence[int], params: SamplingParams, cacheable: bool
    ) -> Any: ...
    def step(self) -> Any: ...
    def is_unfinished(self, req_id: str) -> bool: ...
    def abort(self, req_id: str) -> bool: ...


def step_sizes(max_step_tokens: int) -> list[int]:
    """1, 2, 3, 4, 6, 8, 12, ... (each power of two and the midpoint above it) up to a step's
    token budget, the budget itself, and 1.5 budgets (a prompt of two chunks: the second one
    attends a cached prefix). Any step's token count lies within a factor of 1.5 of one."""
    sizes: set[int] = set()
    power = 1
    while power <= max_step_tokens:
        sizes.update(n for n in (power, power + power // 2) if n <= max_step_tokens)
        power *= 2
    sizes.update((max_step_tokens, max_step_tokens + max_step_tokens // 2))
    return sorted(sizes)


def split_prompt(size: int, max_prompt_tokens: int) -> list[int]:
    """size tokens as the fewest prompts of at most max_prompt_tokens each, as even as can be
    (they arrive together: one step computes them all when the budget allows)."""
    parts = -(-size // max_prompt_tokens)
    return [size // parts + (i < size % parts) for i in range(parts)]


def warm_up(engine: Engine) -> WarmUpRun:
    """Run prompts of each of step_sizes' token counts (split where one prompt cannot hold
    them) alone, then again while NUM_DECODERS requests decode; greedy, one output token each;
    none of them cacheable. Leaves the engine with no request and every block free."""
    started = time.perf_counter()
    config, kv = engine.config, engine.kv
    budget = config.scheduler.max_num_batched_tokens
    seats = config.scheduler.max_num_seqs or NUM_DECODERS + 1
    num_decoders = max(0, min(NUM_DECODERS, seats - 1))
    if num_decoders and num_decoders % 2 == 0:  # odd, as NUM_DECODERS says why
        num_decoders -= 1
    if engine.max_model_len < DECODER_PROMPT + 2:  # no room for a decoder's prompt and a token
        num_decoders = 0
    # a prompt and the decoders fit the pool together, each prompt leaving a token to decode
    pool_tokens = kv.num_blocks * engine.block_size
    room = min(engine.max_model_len - 1, pool_tokens // 2 - num_decoders * 2 * engine.block_size)
    sizes = step_sizes(budget) if room > 0 else []
    sizes = [n for n in sizes if n <= budget or n <= room]  # 1.5 budgets: as one prompt only
    vocab = engine.model_config.vocab_size
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    num_steps = 0
    passes = 2 * len(sizes)  # each size alone, then beside the decoders
    said = time.perf_counter()
    if sizes:
        say(
            f"warm-up: {len(sizes)} step sizes ({sizes[0]}..{sizes[-1]} prompt tokens), alone "
            f"and beside {num_decoders} decoding requests (on a machine's first start its "
            "kernels compile: a minute or two)"
        )

    def progress(done: int) -> None:
        nonlocal said
        if time.perf_counter() - said >= PROGRESS_EVERY_S:
            said = time.perf_counter()
            say(f"warm-up: {done} of {passes} passes, {said - started:.0f} s")

    def prompt(length: int, offset: int) -> list[int]:
        return [(offset + 7 * i) % (vocab - 1) + 1 for i in range(length)]  # no two alike

    def run_until(done: Callable[[], bool]) -> None:
        nonlocal num_steps
        while not done():
            engine.step()
            num_steps += 1

    def idle() -> bool:
        return not engine.has_unfinished_requests

    for n, size in enumerate(sizes):
        for i, length in enumerate(split_prompt(size, room)):
            offset = 100 * n + i
            engine.add_request(f"{ID}-alone-{n}-{i}", prompt(length, offset), one, cacheable=False)
        run_until(idle)
        progress(n + 1)
    decoders = [f"{ID}-decoder-{i}" for i in range(num_decoders)]
    long = SamplingParams(
        max_tokens=max(1, min(engine.max_model_len - DECODER_PROMPT - 1, 4096)),
        temperature=0.0,
        ignore_eos=True,
    )
    for i, req_id in enumerate(decoders):
        engine.add_request(req_id, prompt(DECODER_PROMPT, 10_000 + i), long, cacheable=False)
    for _ in range(2 if decoders else 0):  # prefilled, then decoding
        engine.step()
        num_steps += 1
    for n, size in enumerate(sizes):
        parts = split_prompt(size, room)
        mixed = [f"{ID}-mixed-{n}-{i}" for i in range(len(parts))]
        for i, (req_id, length) in enumerate(zip(mixed, parts, strict=True)):
            engine.add_request(req_id, prompt(length, 20_000 + 100 * n + i), one, cacheable=False)
        run_until(lambda: not any(map(engine.is_unfinished, mixed)))  # noqa: B023 (run at once)
        progress(len(sizes) + n + 1)
    for req_id in decoders:
        engine.abort(req_id)
    run_until(idle)
    if engine.device.type == "cuda":  # what ~30 step shapes left cached, for the card's others
        torch.cuda.empty_cache()
    return WarmUpRun(tuple(sizes), num_decoders, num_steps, time.perf_counter() - started)


def report(run: WarmUpRun) -> None:
    sizes = run.step_sizes
    span = f"{sizes[0]}..{sizes[-1]}" if sizes else "none"
    say(
        f"warm-up: {len(sizes)} step sizes ({span} prompt tokens) alone and beside "
        f"{run.num_decoders} decoding requests, {run.num_steps} steps in {run.seconds:.1f} s"
    )
