"""The tensor-parallel layers that are not plain Linears: the vocabulary-parallel embedding
(owns its rows of the table). Column-parallel projections are plain Linears of a rank's rows;
row-parallel ones are plain Linears of its columns whose output the model all-reduces."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from engine.parallel.tensor_parallel import TensorParallel, rank_shard


class VocabParallelEmbedding(nn.Module):
    """Rows [vocab.start, vocab.stop) of the embedding table: each rank looks up the ids in its
    range (zeros for the rest) and the ranks' rows are summed, so every rank gets every id's
    embedding. weight has the name and layout of nn.Embedding's (a tied LM head reads it)."""

    def __init__(self, vocab: range, hidden_size: int, tp: TensorParallel):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(len(vocab), hidden_size))
        self.vocab_start, self.vocab_stop = vocab.start, vocab.stop
        self.tp = tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_stop)
        local_ids = (input_ids - self.vocab_start).masked_fill_(outside, 0)
        out = F.embedding(local_ids, self.weight).masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


def vocab_embedding(config: ModelConfig, tp: TensorParallel) -> nn.Module:
    """The model's embedding: nn.Embedding on one rank, a rank's vocabulary range on several."""
    if not tp.is_parallel:
        return nn.Embedding(config.vocab_size, config.hidden_size)
    return VocabParallelEmbedding(rank_shard(config, tp).vocab, config.hidden_size, tp)


def lm_head(config: ModelConfig, tp: TensorParallel) -> nn.Linear:
    """The untied LM head: the full vocabulary on one rank, a rank's range on several (the
    model gathers the logits: TensorParallel.gather_vocab)."""
    rows = config.vocab_size if not tp.is_parallel else len(rank_shard(config, tp).vocab)
    return nn.Linear(config.hidden_size, rows, bias=False)
