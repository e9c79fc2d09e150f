"""ModelRunner: runs steps on the model, KV cache, attention backend and CUDA graphs that
engine/execution/backend_builder.py made; owns only the counts of steps replayed from graphs.

It turns a SchedulerOutput into packed input ids, positions and AttentionMetadata, runs the
forward pass (replaying a CUDA graph for pure-decode steps when one is captured; a speculative
verify chunk runs as one decode row per token, so it keeps a step pure-decode; the other
steps, up to the mixed-step graphs' largest bucket, replay per-layer graphs around eager
attention), and returns the logits of the chunks that end a sequence's
known tokens, and of each verified draft.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.attention.base import AttentionBackend, AttentionMetadata, SeqSpan
from engine.execution.host_tensors import index_tensor
from engine.execution.step_inputs import DecodeGraphs, StepInputs, TokenFill
from engine.kv_cache.manager import KVCacheManager
from engine.step.scheduler import ScheduledChunk, SchedulerOutput

if TYPE_CHECKING:
    from engine.execution.backend_builder import DeviceSide


@dataclass(frozen=True)
class StepLogits:
    logits: torch.Tensor  # [num_rows, vocab]: one per sampling chunk, 1 + its drafts if any
    chunk_index: list[int]  # which chunk of the SchedulerOutput each row belongs to


class ModelRunner:
    def __init__(
        self, model: nn.Module, side: DeviceSide, kv: KVCacheManager | None, block_size: int
    ):
        """kv None: a tensor-parallel follower's runner, which runs inputs built elsewhere
        (run_inputs) and builds none."""
        self.model = model
        self.kv_cache = side.kv_cache
        self.attention: AttentionBackend = side.attention
        self.kv = kv
        self.block_size = block_size
        self.device = side.kv_cache.device
        self.graphs: DecodeGraphs | None = side.graphs
        self.mixed = side.mixed  # the other steps' per-layer graphs (None: they run eager)
        self.num_graph_steps = 0

    def build_inputs(self, output: SchedulerOutput, fill: TokenFill | None = None) -> StepInputs:
        inputs = StepInputs([], [], [], [], [], [], [])
        bs, kv = self.block_size, self.kv
        assert kv is not None, "a follower's runner builds no inputs"
        for chunk in output.chunks:
            req = chunk.req
            start = chunk.start
            end = start + chunk.num_new_tokens
            block_ids = kv.block_ids(req.req_id)
            q_start = len(inputs.input_ids)
            if chunk.draft_token_ids:  # a verify step: the last real token, then the drafts
                inputs.input_ids.extend(req.all_token_ids[start:])
                inputs.input_ids.extend(chunk.draft_token_ids)
                # One decode row per token, each seeing the cache up to itself: every K/V is
                # written before any row attends, so this is the causal verify, and a step of
                # decodes and verifies stays a pure-decode step (a CUDA graph replays it).
                inputs.seqs.extend(
                    SeqSpan(q_start + i, 1, start + i + 1, block_ids)
                    for i in range(chunk.num_new_tokens)
                )
            else:
                inputs.seqs.append(SeqSpan(q_start, chunk.num_new_tokens, end, block_ids))
                if end > len(req.all_token_ids):
                    _add_pending(inputs, chunk, fill)
                elif chunk.num_new_tokens == 1:
                    inputs.input_ids.append(req.all_token_ids[start])
                else:
                    inputs.input_ids.extend(req.all_token_ids[start:end])
            if chunk.num_new_tokens == 1:  # a decode: skip the range machinery
                inputs.positions.append(start)
                inputs.slot_block_ids.append(block_ids[start // bs])
                inputs.slot_offsets.append(start % bs)
                continue
            span = range(start, end)
            inputs.positions.extend(span)
            inputs.slot_block_ids.extend(block_ids[p // bs] for p in span)
            inputs.slot_offsets.extend(p % bs for p in span)
        return inputs

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput, fill: TokenFill | None = None) -> StepLogits:
        """Run the step's forward pass (queued on the device; nothing waits for it)."""
        inputs = self.build_inputs(output, fill)
        chunk_index = [
            i
            for i, chunk in enumerate(output.chunks)
            if chunk.samples
            for _ in range(len(chunk.draft_token_ids) + 1)
        ]
        rows, end = [], 0
        for chunk in output.chunks:  # tokens are packed in chunk order
            end += chunk.num_new_tokens
            if chunk.samples:
                rows.extend(range(end - len(chunk.draft_token_ids) - 1, end))
        return StepLogits(self.run_inputs(inputs, rows, fill), chunk_index)

    @torch.inference_mode()
    def run_inputs(
        self, inputs: StepInputs, rows: list[int], fill: TokenFill | None = None
    ) -> torch.Tensor:
        """The forward pass over packed inputs -> the logits of the tokens at rows."""
        graphs = self.graphs
        if graphs is not None and inputs.is_decode and graphs.padded_size(len(inputs.seqs)):
            hidden = graphs.run(inputs, fill)
            self.num_graph_steps += 1
        else:
            hidden = self._forward_eager(inputs, fill)
        if rows == list(range(hidden.shape[0])):
            selected = hidden  # every token samples (pure decode): no gather
        else:
            selected = hidden[index_tensor(rows, device=self.device)]
        return self.model.compute_logits(selected)

    def _forward_eager(self, inputs: StepInputs, fill: TokenFill | None) -> torch.Tensor:
        """A forward pass that no decode graph replays: on the mixed-step graphs where one of
        their buckets holds its tokens, else eager."""
        packed = index_tensor(
            [inputs.input_ids, inputs.positions, inputs.slot_block_ids, inputs.slot_offsets],
            device=self.device,
        )
        inputs.write_pending(packed[0], fill)
        metadata = AttentionMetadata(
            seqs=inputs.seqs,
            slot_block_ids=packed[2],
            slot_offsets=packed[3],
            block_size=self.block_size,
        )
        self.attention.plan(metadata)
        mixed = self.mixed
        size = mixed.bucket(len(inputs.input_ids)) if mixed is not None else None
        if mixed is not None and size is not None:
            return mixed.run(size, packed[0], packed[1])
        return self.model(packed[0], packed[1], self.attention)


def _add_pending(inputs: StepInputs, chunk: ScheduledChunk, fill: TokenFill | None) -> None:
    """The chunk's input tokens when its last one is pending: a 0 the fill overwrites."""
    req = chunk.req
    end = chunk.start + chunk.num_new_tokens
    if end != len(req.all_token_ids) + 1 or fill is None or req.req_id not in fill.rows:
        raise ValueError(
            f"request {req.req_id!r}: input tokens [{chunk.start}, {end}) reach past its "
            f"{len(req.all_token_ids)} real tokens without one token to fill from the device"
        )
    inputs.input_ids.extend(req.all_token_ids[chunk.start :])
    inputs.pending_index.append(len(inputs.input_ids))
    inputs.pending_rows.append(fill.rows[req.req_id])
    inputs.input_ids.append(0)
