"""Sampler: turns a step's logits into tokens (greedy, temperature, top-k/p, min-p, seeds).

Stateless except for the engine-wide generator used by requests without a seed. A request
with a seed samples from its own generator, so its output does not depend on its batch mates.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class SampleRow:
    params: SamplingParams
    generator: torch.Generator | None


@dataclass(frozen=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[float] | None  # log-probability of each chosen token, when any row asked


class Sampler:
    def __init__(self, device: torch.device, seed: int | None = None):
        self.device = device
        self.generator = torch.Generator(device=device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, rows: list[SampleRow]) -> SampleResult:
        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, row in enumerate(rows) if not row.params.greedy]
        if random_rows:
            index = torch.tensor(random_rows, device=logits.device)
            sampled = self._sample(logits[index], [rows[i] for i in random_rows])
            tokens[index] = sampled
        logprobs = None
        if any(row.params.logprobs for row in rows):
            chosen = torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None])
            logprobs = chosen.squeeze(1).tolist()
        return SampleResult(tokens.tolist(), logprobs)

    def _sample(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        device = logits.device
        temps = torch.tensor([r.params.temperature for r in rows], device=device)
        logits = logits / temps[:, None]
        if any(r.params.top_k or r.params.top_p < 1.0 for r in rows):
            logits = self._filter_top_k_top_p(logits, rows)
        probs = torch.softmax(logits, dim=-1)
        min_ps = torch.tensor([r.params.min_p for r in rows], device=device)
        if bool((min_ps > 0).any()):
            floor = probs.amax(dim=-1, keepdim=True) * min_ps[:, None]
            probs = probs.masked_fill(probs < floor, 0.0)
        # Exponential-race sampling: argmax(p / q), q ~ Exp(1), equals sampling from p. One
        # draw for every row from the engine's generator, then seeded rows redraw from their own.
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, row in enumerate(rows):
            if row.generator is not None:
                noise[i].exponential_(generator=row.generator)
        return (probs / noise).argmax(dim=-1)

    @staticmethod
    def _filter_top_k_top_p(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        device = logits.device
        vocab = logits.shape[-1]
        top_ks = torch.tensor([r.params.top_k or vocab for r in rows], device=device)
        top_ps = torch.tensor([r.params.top_p for r in rows], device=device)
        sorted_logits, sorted_index = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=device)[None, :]
        sorted_logits = sorted_logits.masked_fill(ranks >= top_ks[:, None], float("-inf"))
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        probs_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        # Keep the smallest set of tokens whose mass reaches top_p (the first always stays).
        sorted_logits = sorted_logits.masked_fill(probs_before >= top_ps[:, None], float("-inf"))
        return torch.full_like(logits, float("-inf")).scatter(1, sorted_index, sorted_logits)
