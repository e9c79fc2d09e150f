"""One step's packed model inputs (StepInputs), the input tokens still on the device (TokenFill)
and what the runner needs of the decode graph replayer (DecodeGraphs); owns no state.

The runner builds StepInputs and the CUDA-graph replayer replays them: both import this module,
neither side imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from engine.attention.base import SeqSpan
from engine.execution.host_tensors import index_tensor


@dataclass(frozen=True)
class TokenFill:
    """Tokens sampled by a step still in flight, on the device: req_id's is source[rows[req_id]].

    With overlapped steps the previous step's sampled tokens are still on the device when the
    next step is launched; they are gathered into its inputs there, at each request's pending
    position (see Request).
    """

    rows: dict[str, int]  # req_id -> row of source
    source: torch.Tensor  # [n] token ids on the device


@dataclass(frozen=True)
class StepInputs:
    """One step's packed tokens, as host lists (one H2D copy makes them device tensors).

    A pending input token has no id on the host: input_ids holds 0 there until write_pending
    copies the TokenFill's token over it on the device, before the forward pass reads it.
    """

    input_ids: list[int]
    positions: list[int]
    slot_block_ids: list[int]
    slot_offsets: list[int]
    seqs: list[SeqSpan]
    pending_index: list[int]  # where in input_ids each pending token goes
    pending_rows: list[int]  # its row of the TokenFill's source

    @property
    def is_decode(self) -> bool:
        return all(seq.q_len == 1 for seq in self.seqs)

    def write_pending(self, ids: torch.Tensor, fill: TokenFill | None) -> None:
        """Gather the pending input tokens into ids (the packed input ids, on the device)."""
        if not self.pending_index:
            return
        assert fill is not None  # the runner found a row for each pending token
        index = index_tensor([self.pending_index, self.pending_rows], device=ids.device)
        ids[index[0]] = fill.source[index[1]]


def smallest_fit(sizes: list[int], n: int) -> int | None:
    """The smallest of the ascending captured sizes that holds n; None: none does (run eager)."""
    return next((size for size in sizes if size >= n), None)


def padded_rows(
    input_ids: list[int],
    positions: list[int],
    slot_block_ids: list[int],
    slot_offsets: list[int],
    size: int,
    pad_block_id: int,
) -> torch.Tensor:
    """A graph's static input rows on the host, [4, size]: ids, positions, KV slot blocks and
    offsets, padded to size with token 0 at position 0 writing into the pad block."""
    num_pad = size - len(input_ids)
    pad = [0] * num_pad
    return index_tensor(
        [
            input_ids + pad,
            positions + pad,
            slot_block_ids + [pad_block_id] * num_pad,
            slot_offsets + pad,
        ]
    )


class DecodeGraphs(Protocol):
    """Pure-decode steps replayed from captured graphs (execution/cuda_graph.py's
    CUDAGraphDecoder)."""

    def padded_size(self, num_seqs: int) -> int | None:
        """The captured batch size a step of num_seqs decodes runs at; None: run eager."""
        ...

    def run(self, inputs: StepInputs, fill: TokenFill | None = None) -> torch.Tensor:
        """Replay one pure-decode step; returns the hidden states [len(inputs.seqs), hidden]."""
        ...
