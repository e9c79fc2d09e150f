"""ModelRunner: owns the model, the KV cache tensor and the attention backend; runs one step.

It turns a SchedulerOutput into packed input ids, positions and AttentionMetadata, runs the
forward pass, and returns the logits of the chunks that end a sequence's known tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.attention.base import AttentionBackend, AttentionMetadata, SeqSpan
from engine.kv_cache.manager import KVCacheManager
from engine.scheduler import SchedulerOutput


@dataclass(frozen=True)
class StepLogits:
    logits: torch.Tensor  # [num_sampling_chunks, vocab]
    chunk_index: list[int]  # which chunk of the SchedulerOutput each row belongs to


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        kv_cache: torch.Tensor,
        attention: AttentionBackend,
        kv: KVCacheManager,
        block_size: int,
    ):
        self.model = model
        self.kv_cache = kv_cache
        self.attention = attention
        self.kv = kv
        self.block_size = block_size
        self.device = kv_cache.device

    def build_metadata(
        self, output: SchedulerOutput
    ) -> tuple[list[int], list[int], AttentionMetadata]:
        input_ids: list[int] = []
        positions: list[int] = []
        slot_blocks: list[int] = []
        slot_offsets: list[int] = []
        seqs: list[SeqSpan] = []
        bs = self.block_size
        for chunk in output.chunks:
            req = chunk.req
            start = chunk.start
            end = start + chunk.num_new_tokens
            block_ids = self.kv.block_ids(req.req_id)
            seqs.append(SeqSpan(len(input_ids), chunk.num_new_tokens, end, block_ids))
            input_ids.extend(req.all_token_ids[start:end])
            span = range(start, end)
            positions.extend(span)
            slot_blocks.extend(block_ids[p // bs] for p in span)
            slot_offsets.extend(p % bs for p in span)
        metadata = AttentionMetadata(
            seqs=seqs,
            slot_block_ids=torch.tensor(slot_blocks, dtype=torch.long, device=self.device),
            slot_offsets=torch.tensor(slot_offsets, dtype=torch.long, device=self.device),
            block_size=bs,
        )
        return input_ids, positions, metadata

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> StepLogits:
        input_ids, positions, metadata = self.build_metadata(output)
        self.attention.plan(metadata)
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.long, device=self.device),
            torch.tensor(positions, dtype=torch.long, device=self.device),
            self.attention,
        )
        chunk_index = [i for i, chunk in enumerate(output.chunks) if chunk.samples]
        last_token = [seq.q_start + seq.q_len - 1 for seq in metadata.seqs]
        rows = torch.tensor(
            [last_token[i] for i in chunk_index], dtype=torch.long, device=self.device
        )
        logits = self.model.compute_logits(hidden[rows])
        return StepLogits(logits, chunk_index)
