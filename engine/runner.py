"""ModelRunner: owns the model, the KV cache tensor, the attention backend and the decode graphs.

It turns a SchedulerOutput into packed input ids, positions and AttentionMetadata, runs the
forward pass (replaying a CUDA graph for pure-decode steps when one is captured), and returns
the logits of the chunks that end a sequence's known tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.attention.base import AttentionBackend, AttentionMetadata, SeqSpan
from engine.cuda_graph import CUDAGraphDecoder
from engine.host_tensors import index_tensor
from engine.kv_cache.manager import KVCacheManager
from engine.scheduler import SchedulerOutput


@dataclass(frozen=True)
class StepLogits:
    logits: torch.Tensor  # [num_sampling_chunks, vocab]
    chunk_index: list[int]  # which chunk of the SchedulerOutput each row belongs to


@dataclass(frozen=True)
class TokenFill:
    """Input tokens not yet on the host: chunk i's (single) input token is source[rows[i]].

    With overlapped steps the previous step's sampled tokens are still on the device when the
    next step is launched; they are gathered into the inputs there.
    """

    rows: dict[int, int]  # chunk index -> row of source
    source: torch.Tensor  # [n] token ids on the device

    def apply(self, ids: torch.Tensor, seqs: list[SeqSpan]) -> None:
        """Write the device tokens into the packed input ids (ids: [num_tokens], on device)."""
        chunks = list(self.rows)
        positions = index_tensor([seqs[i].q_start for i in chunks], device=ids.device)
        rows = index_tensor([self.rows[i] for i in chunks], device=ids.device)
        ids[positions] = self.source[rows]


@dataclass(frozen=True)
class StepInputs:
    """One step's packed tokens, as host lists (one H2D copy makes them device tensors)."""

    input_ids: list[int]
    positions: list[int]
    slot_block_ids: list[int]
    slot_offsets: list[int]
    seqs: list[SeqSpan]

    @property
    def is_decode(self) -> bool:
        return all(seq.q_len == 1 for seq in self.seqs)


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        kv_cache: torch.Tensor,
        attention: AttentionBackend,
        kv: KVCacheManager,
        block_size: int,
        graphs: CUDAGraphDecoder | None = None,
    ):
        self.model = model
        self.kv_cache = kv_cache
        self.attention = attention
        self.kv = kv
        self.block_size = block_size
        self.device = kv_cache.device
        self.graphs = graphs
        self.num_graph_steps = 0

    def build_inputs(self, output: SchedulerOutput) -> StepInputs:
        inputs = StepInputs([], [], [], [], [])
        bs = self.block_size
        for chunk in output.chunks:
            req = chunk.req
            start = chunk.start
            end = start + chunk.num_new_tokens
            block_ids = self.kv.block_ids(req.req_id)
            inputs.seqs.append(SeqSpan(len(inputs.input_ids), chunk.num_new_tokens, end, block_ids))
            if chunk.num_new_tokens == 1:  # a decode: skip the range machinery
                inputs.input_ids.append(req.all_token_ids[start])
                inputs.positions.append(start)
                inputs.slot_block_ids.append(block_ids[start // bs])
                inputs.slot_offsets.append(start % bs)
                continue
            inputs.input_ids.extend(req.all_token_ids[start:end])
            span = range(start, end)
            inputs.positions.extend(span)
            inputs.slot_block_ids.extend(block_ids[p // bs] for p in span)
            inputs.slot_offsets.extend(p % bs for p in span)
        return inputs

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput, fill: TokenFill | None = None) -> StepLogits:
        """Run the step's forward pass (queued on the device; nothing waits for it)."""
        inputs = self.build_inputs(output)
        chunk_index = [i for i, chunk in enumerate(output.chunks) if chunk.samples]
        graphs = self.graphs
        if graphs is not None and inputs.is_decode and graphs.padded_size(len(inputs.seqs)):
            hidden = graphs.run(
                inputs.input_ids,
                inputs.positions,
                inputs.slot_block_ids,
                inputs.slot_offsets,
                inputs.seqs,
                fill,
            )
            self.num_graph_steps += 1
        else:
            hidden = self._forward_eager(inputs, fill)
        last_token = [seq.q_start + seq.q_len - 1 for seq in inputs.seqs]
        rows = [last_token[i] for i in chunk_index]
        if rows == list(range(hidden.shape[0])):
            selected = hidden  # every token samples (pure decode): no gather
        else:
            selected = hidden[index_tensor(rows, device=self.device)]
        return StepLogits(self.model.compute_logits(selected), chunk_index)

    def _forward_eager(self, inputs: StepInputs, fill: TokenFill | None) -> torch.Tensor:
        packed = index_tensor(
            [inputs.input_ids, inputs.positions, inputs.slot_block_ids, inputs.slot_offsets],
            device=self.device,
        )
        if fill is not None:
            fill.apply(packed[0], inputs.seqs)
        metadata = AttentionMetadata(
            seqs=inputs.seqs,
            slot_block_ids=packed[2],
            slot_offsets=packed[3],
            block_size=self.block_size,
        )
        self.attention.plan(metadata)
        return self.model(packed[0], packed[1], self.attention)
