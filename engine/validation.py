"""The request rules, in one place (no state, torch-free): the prompt, its length, sampling
ranges, stop ids and the vocabulary. The router's front ends and Engine.add_request both call
check_request; a broken rule raises InvalidField naming the request field."""

from __future__ import annotations

import math
from collections.abc import Sequence

from engine.sampling_params import SamplingParams

MAX_SEED = 2**63  # seeds are signed 64-bit integers


class InvalidField(ValueError):
    """A request field breaks a rule; `field` names it (None: the request as a whole), `code`
    is a machine-readable kind where one exists (OpenAI's "context_length_exceeded")."""

    def __init__(self, message: str, field: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.field = field
        self.code = code


def check_request(
    prompt_token_ids: Sequence[int],
    params: SamplingParams,
    vocab_size: int,
    max_model_len: int,
    prompt_field: str = "prompt",
) -> None:
    """Every rule an engine or the router needs before a request is queued."""
    check_prompt(prompt_token_ids, vocab_size, max_model_len, prompt_field)
    check_sampling(params, vocab_size)


def check_prompt(
    prompt_token_ids: Sequence[int], vocab_size: int, max_model_len: int, field: str = "prompt"
) -> None:
    if not prompt_token_ids:
        raise InvalidField("the prompt is empty", field)
    bad = [t for t in prompt_token_ids if not _is_int(t) or not 0 <= t < vocab_size]
    if bad:
        raise InvalidField(
            f"token id {bad[0]!r} is outside the vocabulary [0, {vocab_size})", field
        )
    if len(prompt_token_ids) >= max_model_len:
        raise InvalidField(
            f"the prompt has {len(prompt_token_ids)} tokens, but this model's context length "
            f"(max_model_len) is {max_model_len} tokens and the prompt must leave room for at "
            "least one output token",
            field,
            "context_length_exceeded",
        )


def check_sampling(params: SamplingParams, vocab_size: int) -> None:
    if not _is_int(params.max_tokens) or params.max_tokens <= 0:
        raise InvalidField(
            f"max_tokens must be a positive integer, got {params.max_tokens!r}", "max_tokens"
        )
    for name in ("temperature", "top_p", "min_p"):
        if not math.isfinite(getattr(params, name)):
            raise InvalidField(f"{name} must be a finite number", name)
    if params.temperature < 0:
        raise InvalidField(f"temperature must be >= 0, got {params.temperature}", "temperature")
    if not 0.0 < params.top_p <= 1.0:
        raise InvalidField(f"top_p must be in (0, 1], got {params.top_p}", "top_p")
    if not _is_int(params.top_k) or params.top_k < 0:
        raise InvalidField(f"top_k must be >= 0 (0 disables it), got {params.top_k}", "top_k")
    if not 0.0 <= params.min_p <= 1.0:
        raise InvalidField(f"min_p must be in [0, 1], got {params.min_p}", "min_p")
    if params.seed is not None and (
        not _is_int(params.seed) or not -MAX_SEED <= params.seed < MAX_SEED
    ):
        raise InvalidField("seed must fit in a signed 64-bit integer", "seed")
    for token_id in params.stop_token_ids:
        if not _is_int(token_id) or not 0 <= token_id < vocab_size:
            raise InvalidField(
                f"stop_token_ids: {token_id!r} is outside the vocabulary [0, {vocab_size})",
                "stop_token_ids",
            )
    if any(not s for s in params.stop):
        raise InvalidField("stop strings must be non-empty", "stop")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
