"""Logits processors of one sampling step: repetition, presence and frequency penalties and
logit_bias, applied to every row that asks in one batched pass; stateless. What each one means
is stated in engine/sampling/sampling_params.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.execution.host_tensors import index_tensor, to_device
from engine.sampling.sample_row import SampleRow


def needs_processing(row: SampleRow) -> bool:
    return row.params.has_penalties or bool(row.params.logit_bias)


def process_logits(logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """The logits with each row's penalties, then its logit_bias, applied; `logits` itself is
    left as it is. Rows that ask for none are not touched (no copy when no row asks)."""
    picked = [i for i, row in enumerate(rows) if needs_processing(row)]
    if not picked:
        return logits
    device, vocab = logits.device, logits.shape[-1]
    index = index_tensor(picked, device=device)
    sub = [rows[i] for i in picked]
    part = logits[index].float()
    if any(row.params.repetition_penalty != 1.0 for row in sub):
        seen = token_counts([row.token_ids for row in sub], vocab, device) > 0
        penalty = _column([row.params.repetition_penalty for row in sub], device)
        penalised = torch.where(part > 0, part / penalty, part * penalty)
        part = torch.where(seen, penalised, part)
    if any(row.params.counts_output for row in sub):
        outputs = [row.token_ids[row.num_prompt_tokens :] for row in sub]
        counts = token_counts(outputs, vocab, device)
        presence = _column([row.params.presence_penalty for row in sub], device)
        frequency = _column([row.params.frequency_penalty for row in sub], device)
        part = part - presence * (counts > 0) - frequency * counts
    if any(row.params.logit_bias for row in sub):
        _add_bias(part, sub)
    processed = logits.clone()
    processed[index] = part.to(logits.dtype)
    return processed


def token_counts(
    token_lists: Sequence[Sequence[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """[rows, vocab] float counts of each token id in each row's list (one scatter_add)."""
    width = max((len(ids) for ids in token_lists), default=0)
    padded = torch.full((len(token_lists), max(width, 1)), vocab_size, dtype=torch.long)
    for i, ids in enumerate(token_lists):
        if ids:
            padded[i, : len(ids)] = index_tensor(ids)
    padded = to_device(padded, device)
    counts = torch.zeros(len(token_lists), vocab_size + 1, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=counts.dtype))
    return counts[:, :vocab_size]  # the last column counted the padding


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return to_device(torch.tensor(values, dtype=torch.float32), device)[:, None]


def _add_bias(part: torch.Tensor, rows: Sequence[SampleRow]) -> None:
    """part[i, token_id] += bias for every row's pairs (sparse: a few ids out of the vocab)."""
    pairs = [(i, t, b) for i, row in enumerate(rows) for t, b in row.params.logit_bias]
    row_ids = index_tensor([i for i, _, _ in pairs], device=part.device)
    token_ids = index_tensor([t for _, t, _ in pairs], device=part.device)
    values = to_device(torch.tensor([b for _, _, b in pairs], dtype=part.dtype), part.device)
    part.index_put_((row_ids, token_ids), values, accumulate=True)
