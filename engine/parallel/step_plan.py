"""The messages rank 0 sends its followers (a step's packed inputs, block copies, shutdown) and
their transport over the group's control channel; values and functions, no state.

A message is pickled and broadcast from rank 0 (its length, then its bytes) on the gloo control
group, in the order rank 0 runs them: a follower applies copies and steps in that same order.
Rank 0 sends within the group's timeout (gloo hands a buffer over only once the peer reads:
a stuck follower fails the send); a follower waits for the next message as long as rank 0
idles (the control group's own long timeout).
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.execution.step_inputs import StepInputs
from engine.kv_cache.block_copy import BlockCopy
from engine.parallel.tensor_parallel import TensorParallel


@dataclass(frozen=True)
class StepPlan:
    """One forward pass: the packed inputs (block ids are rank 0's, the same on every rank)
    and the rows whose logits are computed (each rank computes its vocabulary slice of them)."""

    inputs: StepInputs
    rows: list[int]


@dataclass(frozen=True)
class CopyPlan:
    """Block copies on the KV cache (partial reuse, forks, host tier offload and onload), run
    in order; wait: the rank's copies are done before it reads the next message; ack: then
    the ranks agree (agree()) they are done: rank 0 hands kept host slots to a peer, which
    reads each rank's own host memory, only once every rank's offloads have landed there."""

    copies: list[BlockCopy]
    wait: bool = False
    ack: bool = False


@dataclass(frozen=True)
class ReadPlan:
    """A prefilled prompt's KV read by every rank into its own cache (its own KV heads of
    local_block_ids, from the holder's blocks remote_block_ids): `peer` is the holder as the
    ranks' reader knows it (opaque here: the worker's, e.g. its NIXL metadata). The ranks then
    agree (agree()) whether every read succeeded, before rank 0 reads its own heads.
    num_host: the first num_host remote ids are slots of the holder's host tier (a host
    lease: each holder rank's own host memory), the rest its device blocks."""

    peer: object
    remote_block_ids: list[int]
    local_block_ids: list[int]
    num_host: int = 0


@dataclass(frozen=True)
class DiskPlan:
    """A disk KV tier operation each follower runs on its own block files (its heads of each
    block), in rank 0's order; rank 0's DiskTier keeps the bookkeeping
    (engine/parallel/disk_ranks.py). op "write": the block at src (a host slot when
    from_host, else a device block) as block_hash's file; "stage": read and check the file
    for a prefix hit; "take": a staged block is lent to a "from_disk" copy; "unstage": a
    staged block is dropped; "remove": the file goes (and anything staged); "keep" (at
    start): every file but block_hashes goes. After "write" and "stage" the ranks agree
    whether every rank's succeeded."""

    op: str
    block_hashes: tuple[int, ...]
    src: int = 0
    from_host: bool = False


@dataclass(frozen=True)
class Shutdown:
    """The followers leave their loop and their process ends."""


Message = StepPlan | CopyPlan | ReadPlan | DiskPlan | Shutdown


def send(tp: TensorParallel, message: Message, timeout_s: float) -> None:
    """Rank 0: broadcast message to every follower, each taking it within timeout_s."""
    data = torch.frombuffer(bytearray(pickle.dumps(message)), dtype=torch.uint8)
    timeout = timedelta(seconds=timeout_s)
    _broadcast(tp, torch.tensor([data.numel()], dtype=torch.int64), timeout)
    _broadcast(tp, data, timeout)


def receive(tp: TensorParallel) -> Message:
    """A follower: the next message rank 0 sends (waits while rank 0 is idle)."""
    size = torch.empty(1, dtype=torch.int64)
    _broadcast(tp, size)
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    _broadcast(tp, data)
    message = pickle.loads(data.numpy().tobytes())
    if not isinstance(message, StepPlan | CopyPlan | ReadPlan | DiskPlan | Shutdown):
        raise TypeError(f"rank {tp.rank} got {type(message).__name__}, not a step message")
    return message


def agree(tp: TensorParallel, ok: bool, timeout_s: float | None = None) -> bool:
    """Whether every rank's ok is True (a MIN over the control group); rank 0 waits up to
    timeout_s, a follower as long as the control group's timeout."""
    x = torch.tensor([int(ok)], dtype=torch.int64)
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp.MIN
    if timeout_s is not None:
        options.timeout = timedelta(seconds=timeout_s)
    tp.control.allreduce([x], options).wait()
    return bool(x.item())


def _broadcast(tp: TensorParallel, x: torch.Tensor, timeout: timedelta | None = None) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    if timeout is not None:  # else the control group's
        options.timeout = timeout
    tp.control.broadcast([x], options).wait()
