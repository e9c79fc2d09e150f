"""Sampler: turns a step's logits into tokens (penalties and logit_bias, then greedy,
temperature, top-k/p, min-p, seeds) and their logprobs and top logprobs.

Stateless except for the engine-wide generator used by requests without a seed. A request
with a seed samples from its own generator, re-seeded from (seed, position) before each draw: its
output depends neither on its batch mates nor on which engine drew its earlier tokens (a prefill
worker draws the first, a decode worker the rest; a migrated request resumes on another one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.execution.host_tensors import index_tensor, to_device
from engine.sampling.logits_processing import needs_processing, process_logits
from engine.sampling.sample_row import SampleRow

if TYPE_CHECKING:
    from engine.sampling.structured import TokenBitmask

TopLogprobs = tuple[tuple[int, float], ...]  # (token id, logprob), most likely first


_MASK_63 = (1 << 63) - 1


def draw_seed(seed: int, position: int) -> int:
    """The generator seed of one draw: a fixed mix of the request's seed and the position."""
    x = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    x ^= x >> 31
    x = (x * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (x ^ (x >> 29)) & _MASK_63


@dataclass(frozen=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[float] | None  # log-probability of each chosen token, when any row asked
    # Per row, the most likely tokens (as many as the row with the most asked), when any asked.
    top_logprobs: list[TopLogprobs] | None = None


class PendingSample:
    """A step's sampled tokens (and logprobs) on their way to the host.

    On CUDA the copy goes to pinned memory without blocking and an event marks its end, so
    result() waits for this step's sampling only, not for work queued after it (the next
    step's forward pass).
    """

    def __init__(
        self,
        tokens: torch.Tensor,
        logprobs: torch.Tensor | None,
        top: tuple[torch.Tensor, torch.Tensor] | None = None,  # (logprobs, token ids) [rows, k]
    ):
        self.tokens = tokens  # on the device: the next step may read it there
        self._event: torch.cuda.Event | None = None
        self._host_tokens, self._host_logprobs, self._host_top = tokens, logprobs, top
        if tokens.device.type == "cuda":
            self._host_tokens = _to_pinned_host(tokens)
            if logprobs is not None:
                self._host_logprobs = _to_pinned_host(logprobs)
            if top is not None:
                self._host_top = (_to_pinned_host(top[0]), _to_pinned_host(top[1]))
            self._event = torch.cuda.Event()
            self._event.record()

    def result(self) -> SampleResult:
        if self._event is not None:
            self._event.synchronize()
        logprobs = None if self._host_logprobs is None else self._host_logprobs.tolist()
        top = None
        if self._host_top is not None:
            values, ids = self._host_top[0].tolist(), self._host_top[1].tolist()
            top = [tuple(zip(i, v, strict=True)) for i, v in zip(ids, values, strict=True)]
        return SampleResult(self._host_tokens.tolist(), logprobs, top)


def _to_pinned_host(tensor: torch.Tensor) -> torch.Tensor:
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host


def plain_greedy(row: SampleRow) -> bool:
    """Greedy, with no logits processing and no logprobs: the argmax is all it needs."""
    return row.params.greedy and not needs_processing(row) and not row.params.logprobs


class Sampler:
    def __init__(self, device: torch.device, seed: int | None = None):
        self.device = device
        self.generator = torch.Generator(device=device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, rows: list[SampleRow]) -> SampleResult:
        return self.sample(logits, rows).result()

    def sample(
        self, logits: torch.Tensor, rows: list[SampleRow], bitmask: TokenBitmask | None = None
    ) -> PendingSample:
        """Sample on the device; nothing waits for the GPU until PendingSample.result().

        logits may come in the model's dtype: a step of plain greedy rows takes the argmax
        there (the same token: widening to float32 is exact), any other works on a float32
        copy (float32 logits are used as they are).
        bitmask: the grammar rows' allowed tokens (sampling/structured.py); the others get -inf
        in the float32 logits (in place: in `logits` itself when it is float32) before anything
        else, greedy rows included."""
        if bitmask is not None or not all(plain_greedy(row) for row in rows):
            logits = logits.float()
        if bitmask is not None:
            bitmask.apply(logits)
        logits = process_logits(logits, rows)  # penalties and logit_bias come first
        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, row in enumerate(rows) if not row.params.greedy]
        if random_rows:
            index = index_tensor(random_rows, device=logits.device)
            sampled = self._sample(logits[index], [rows[i] for i in random_rows])
            tokens[index] = sampled
        logprobs, top = None, None
        if any(row.params.logprobs for row in rows):
            all_logprobs = torch.log_softmax(logits, dim=-1)
            logprobs = all_logprobs.gather(1, tokens[:, None]).squeeze(1)
            k = max(row.params.top_logprobs for row in rows)
            if k:
                values, ids = all_logprobs.topk(k, dim=-1)
                top = (values, ids)
        return PendingSample(tokens, logprobs, top)

    def _sample(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        device = logits.device
        temps = to_device(torch.tensor([r.params.temperature for r in rows]), device)
        logits = logits / temps[:, None]
        if any(r.params.top_k or r.params.top_p < 1.0 for r in rows):
            logits = self._filter_top_k_top_p(logits, rows)
        probs = torch.softmax(logits, dim=-1)
        if any(r.params.min_p > 0 for r in rows):
            min_ps = to_device(torch.tensor([r.params.min_p for r in rows]), device)
            floor = probs.amax(dim=-1, keepdim=True) * min_ps[:, None]
            probs = probs.masked_fill(probs < floor, 0.0)
        # Exponential-race sampling: argmax(p / q), q ~ Exp(1), equals sampling from p. One
        # draw for every row from the engine's generator, then seeded rows redraw from their own.
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, row in enumerate(rows):
            if row.generator is not None and row.params.seed is not None:
                row.generator.manual_seed(draw_seed(row.params.seed, row.position))
                noise[i].exponential_(generator=row.generator)
        return (probs / noise).argmax(dim=-1)

    @staticmethod
    def _filter_top_k_top_p(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        device = logits.device
        vocab = logits.shape[-1]
        top_ks = index_tensor([r.params.top_k or vocab for r in rows], device=device)
        top_ps = to_device(torch.tensor([r.params.top_p for r in rows]), device)
        sorted_logits, sorted_index = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=device)[None, :]
        sorted_logits = sorted_logits.masked_fill(ranks >= top_ks[:, None], float("-inf"))
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        probs_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        # Keep the smallest set of tokens whose mass reaches top_p (the first always stays).
        sorted_logits = sorted_logits.masked_fill(probs_before >= top_ps[:, None], float("-inf"))
        return torch.full_like(logits, float("-inf")).scatter(1, sorted_index, sorted_logits)
