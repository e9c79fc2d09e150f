"""SampleRow: what one sampling row draws with (its request's parameters, seeded generator,
position and, for penalties, its token history), and the row of a request. Owns no state."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.sampling.sampling_params import SamplingParams
from engine.step.request import Request


@dataclass(frozen=True)
class SampleRow:
    params: SamplingParams
    generator: torch.Generator | None  # the request's own (seeded) generator, if it has a seed
    position: int = 0  # where the sampled token goes in the sequence (prompt + output so far)
    # Penalties only: every real token so far (prompt + output; no pending one), and how many
    # of them are prompt (the rest count as output for presence / frequency).
    token_ids: Sequence[int] = ()
    num_prompt_tokens: int = 0


def sample_row(req: Request, offset: int = 0) -> SampleRow:
    """req's row `offset` of a step (a verify step samples one row per drafted token, then one)."""
    if not req.sampling.has_penalties:
        return SampleRow(req.sampling, req.generator, req.num_tokens + offset)
    # Penalties read the token history: the engine never runs ahead of it (overlap.py).
    assert not req.num_pending_tokens, "a penalised request ran ahead"
    num_prompt = req.num_prompt_tokens - req.num_resumed_tokens
    return SampleRow(req.sampling, req.generator, req.num_tokens, req.all_token_ids, num_prompt)
