"""The request rules, in one place (no state, torch-free): the prompt, its length, sampling
ranges, penalties, logit_bias, stop ids and the vocabulary. The router's front ends and
Engine.add_request both call check_request; a broken rule raises InvalidField naming the
request field."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

from engine.sampling.sampling_params import STRUCTURED_KINDS, SamplingParams

MAX_SEED = 2**63  # seeds are signed 64-bit integers
MAX_N = 16  # choices per request
MAX_TOP_K = 2**31 - 1  # gRPC's field is an int32; larger is no filter anyway
# Stop strings are matched against every new token's text on the router's event loop: a
# request with 200,000 of them held every other client for over a minute.
MAX_STOP = 64
MAX_STOP_CHARS = 1024
# A penalty divides or multiplies logits: past these the float32 logits overflow (inf, NaN).
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0


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
    check_structured(params)


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


def check_prefilled(
    num_prompt_tokens: int,
    first_token_id: int,
    max_model_len: int,
    limits: tuple[int, int, int],
) -> None:
    """A decode engine's own limits for a prompt prefilled elsewhere (the router and the
    prefill engine checked the request's rules; this engine's may be smaller). limits: the
    blocks the prompt and its first token need, the pool's blocks, the vocabulary size."""
    blocks_needed, num_blocks, vocab_size = limits
    if num_prompt_tokens + 1 > max_model_len or blocks_needed > num_blocks:
        raise ValueError(
            f"the prompt has {num_prompt_tokens} tokens, more than this decode engine can hold "
            f"(max_model_len {max_model_len}, {num_blocks} blocks)"
        )
    if not 0 <= first_token_id < vocab_size:
        raise ValueError(f"first token {first_token_id} is outside the vocabulary")


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
    if not _is_int(params.top_k) or not 0 <= params.top_k <= MAX_TOP_K:
        raise InvalidField(
            f"top_k must be in [0, {MAX_TOP_K}] (0 disables it), got {params.top_k}", "top_k"
        )
    if not 0.0 <= params.min_p <= 1.0:
        raise InvalidField(f"min_p must be in [0, 1], got {params.min_p}", "min_p")
    if params.seed is not None and (
        not _is_int(params.seed) or not -MAX_SEED <= params.seed < MAX_SEED
    ):
        raise InvalidField("seed must fit in a signed 64-bit integer", "seed")
    if not _is_int(params.n) or not 1 <= params.n <= MAX_N:
        raise InvalidField(f"n must be an integer in [1, {MAX_N}], got {params.n!r}", "n")
    if params.seed is not None and params.seed + params.n > MAX_SEED:
        raise InvalidField("seed + n must fit in a signed 64-bit integer", "seed")
    for token_id in params.stop_token_ids:
        if not _is_int(token_id) or not 0 <= token_id < vocab_size:
            raise InvalidField(
                f"stop_token_ids: {token_id!r} is outside the vocabulary [0, {vocab_size})",
                "stop_token_ids",
            )
    if any(not s for s in params.stop):
        raise InvalidField("stop strings must be non-empty", "stop")
    if len(params.stop) > MAX_STOP:
        raise InvalidField(f"at most {MAX_STOP} stop strings, got {len(params.stop)}", "stop")
    if any(len(s) > MAX_STOP_CHARS for s in params.stop):
        raise InvalidField(f"a stop string has at most {MAX_STOP_CHARS} characters", "stop")
    check_logits_processing(params, vocab_size)


MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0


def check_logits_processing(params: SamplingParams, vocab_size: int) -> None:
    """Penalties, logit_bias and top_logprobs (their meaning: sampling_params.py)."""
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(params, name)
        if not _is_number(value) or not -2.0 <= value <= 2.0:
            raise InvalidField(f"{name} must be a number in [-2, 2], got {value!r}", name)
    penalty = params.repetition_penalty
    low, high = MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY
    if not _is_number(penalty) or not low <= penalty <= high:
        raise InvalidField(
            f"repetition_penalty must be in [{low}, {high:g}] (1 is off), got {penalty!r}",
            "repetition_penalty",
        )
    for token_id, bias in params.logit_bias:
        if not _is_int(token_id) or not 0 <= token_id < vocab_size:
            raise InvalidField(
                f"logit_bias: token id {token_id!r} is outside the vocabulary [0, {vocab_size})",
                "logit_bias",
            )
        if not _is_number(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise InvalidField(
                f"logit_bias: the bias of token {token_id} must be in [-100, 100], got {bias!r}",
                "logit_bias",
            )
    k = params.top_logprobs
    if not _is_int(k) or not 0 <= k <= MAX_TOP_LOGPROBS:
        raise InvalidField(f"top_logprobs must be in [0, 20], got {k!r}", "top_logprobs")
    if k and not params.logprobs:
        raise InvalidField("top_logprobs needs logprobs to be on", "top_logprobs")


def _is_number(value: object) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_STRUCTURED_FIELDS = {
    "json_object": "response_format",
    "json_schema": "response_format",
    "regex": "guided_regex",
    "grammar": "guided_grammar",
}
STRUCTURED_FIELDS = frozenset(_STRUCTURED_FIELDS.values())  # the names structured_field gives


def structured_field(kind: str) -> str:
    """The request field (OpenAI's or vLLM's name) a structured output of this kind came from."""
    return _STRUCTURED_FIELDS.get(kind, "response_format")


def check_structured(params: SamplingParams) -> None:
    """The shape of a grammar spec; the engine's compiler (structured.py) checks the rest."""
    spec = params.structured
    if spec is None:
        return
    field = structured_field(spec.kind)
    if spec.kind not in STRUCTURED_KINDS:
        raise InvalidField(f"unknown structured output kind {spec.kind!r}", field)
    if not isinstance(spec.spec, str) or (spec.kind != "json_object" and not spec.spec):
        raise InvalidField(f"{field}: the {spec.kind} must be a non-empty string", field)
    if spec.kind == "json_schema":
        try:
            schema = json.loads(spec.spec)
        except ValueError as e:
            raise InvalidField(f"{field}: the schema is not valid JSON ({e})", field) from None
        if not isinstance(schema, dict):
            raise InvalidField(f"{field}: the schema must be a JSON object", field)


def resumed_tokens(num_resumed_tokens: int, num_prompt_tokens: int) -> int:
    """A migrated leg's count of prompt tokens that are an earlier leg's output (checked)."""
    if not 0 <= num_resumed_tokens < num_prompt_tokens:
        raise ValueError(
            f"num_resumed_tokens must be in [0, {num_prompt_tokens}), got {num_resumed_tokens}"
        )
    return num_resumed_tokens
