"""The values an Engine step deals in (RequestOutput, InFlightStep, EngineStats) and the small
pure helpers around them: which tokenizer a checkpoint ships, the id a model is served under,
a resumed leg's token count, top logprobs onto an output. Owns no state.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from engine.loader import DEFAULT_MODEL
from engine.request import Request
from engine.sampler import PendingSample, SampleResult, TopLogprobs
from engine.scheduler import SchedulerOutput
from engine.step_rate import StepRate
from engine.tokenizer import Tokenizer


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one request."""

    req_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    new_logprobs: list[float] | None = None
    held_block_ids: tuple[int, ...] = ()  # prefill role: blocks kept under a lease
    num_held_host_blocks: int = 0  # of which the first ones are host-tier slots (host leases)
    index: int = 0  # which of the request's n choices (engine/fork.py)
    new_top_logprobs: list[TopLogprobs] | None = None  # one per new token, when asked
    num_accepted_tokens: int = 0  # speculative decoding: drafted tokens accepted so far


@dataclass
class InFlightStep:
    """A step queued on the device whose sampled tokens the host has not read yet."""

    scheduled: SchedulerOutput
    reqs: list[Request]  # the requests that sample this step, in row order
    sample: PendingSample
    update_pending: bool  # scheduler.update waits until the step before it has finished
    pending_reqs: list[Request] = field(default_factory=list)  # a pending token each: ran ahead
    # n > 1: the prompt's last logits row of each request whose choices fork off this step.
    fork_logits: dict[str, torch.Tensor] = field(default_factory=dict)
    # Speculative decoding: each verifying request's drafted tokens (its rows: 1 + len).
    drafts: dict[str, tuple[int, ...]] = field(default_factory=dict)


@dataclass
class EngineStats:
    num_steps: int = 0
    num_computed_tokens: int = 0  # tokens run through the model (prefill chunks + decodes)
    num_generated_tokens: int = 0
    num_steps_ahead: int = 0  # steps launched before the previous step's tokens were read
    rate: StepRate = field(default_factory=StepRate)  # recent step times and token rate


def find_tokenizer(folder: Path) -> Tokenizer | None:
    """The checkpoint's tokenizer; None when it ships none (token-id requests only)."""
    has_tokenizer = any((folder / name).exists() for name in ("tokenizer.json", "tokenizer.model"))
    return Tokenizer(folder) if has_tokenizer else None


def stop_token_ids(model_eos_ids: Iterable[int], tokenizer: Tokenizer | None) -> set[int]:
    """The ids that end a request (unless ignore_eos): the model config's and the tokenizer's."""
    ids = set(model_eos_ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def served_model_id(model: str) -> str:
    if model.lower() in (
        "default",
        DEFAULT_MODEL.lower(),
        f"huggingfacetb/{DEFAULT_MODEL}".lower(),
    ):
        return DEFAULT_MODEL
    return Path(model).stem if model.endswith(".gguf") else Path(model).name


def resumed_tokens(num_resumed_tokens: int, num_prompt_tokens: int) -> int:
    """A migrated leg's count of prompt tokens that are an earlier leg's output (checked)."""
    if not 0 <= num_resumed_tokens < num_prompt_tokens:
        raise ValueError(
            f"num_resumed_tokens must be in [0, {num_prompt_tokens}), got {num_resumed_tokens}"
        )
    return num_resumed_tokens


def with_top_logprobs(
    output: RequestOutput, result: SampleResult, row: int, k: int
) -> RequestOutput:
    """output with row's k most likely tokens attached (unchanged when none were asked)."""
    if not k or result.top_logprobs is None:
        return output
    return replace(output, new_top_logprobs=[result.top_logprobs[row][:k]])


def merged(first: RequestOutput, later: RequestOutput) -> RequestOutput:
    """One output for two of one request's steps' worth of tokens (a verify step's several
    tokens; no logprobs: a speculating request returns none)."""
    return replace(
        later,
        new_token_ids=first.new_token_ids + later.new_token_ids,
        new_text=first.new_text + later.new_text,
    )


def row_offsets(reqs: list[Request]) -> list[int]:
    """Each sampling row's place among its request's rows (a request's rows are adjacent)."""
    offsets: list[int] = []
    for i, req in enumerate(reqs):
        offsets.append(offsets[-1] + 1 if i and reqs[i - 1] is req else 0)
    return offsets
