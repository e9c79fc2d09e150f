"""Rank 0's side of a tensor-parallel engine: Leader (its TensorParallel, the handles of the
follower ranks, whether the group has failed), and the runner and block copier that send each
step's plan and copies to the followers before running them here.

Rank 0 alone schedules, keeps block state (the KVCacheManager) and samples: the followers keep
no block state, so rank 0's leak checks cover every rank. A collective that fails (a rank gone:
its sockets close; a rank stuck: the group's timeout) raises RankLost, naming the ranks that
exited; the group is then dead (no later step runs on it).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import Protocol

import torch
from torch import nn

from engine.execution.backend_builder import DeviceSide
from engine.execution.block_copies import BlockCopies
from engine.execution.runner import ModelRunner
from engine.execution.step_inputs import StepInputs, TokenFill
from engine.kv_cache.block_copy import BlockCopy
from engine.kv_cache.disk_tier import Spill
from engine.kv_cache.manager import KVCacheManager
from engine.parallel import step_plan
from engine.parallel.disk_ranks import SpillRow
from engine.parallel.tensor_parallel import TensorParallel

EXIT_NOTICE_S = 2.0  # fail(): how long a rank that broke a collective has to show its exit


class RankLost(RuntimeError):
    """A tensor-parallel rank is gone or stuck: the engine cannot step any more."""


class FollowerHandle(Protocol):
    """A follower rank as rank 0 holds it (a process here; a Ray actor in a worker)."""

    rank: int

    def exit_description(self) -> str | None:
        """How it ended (e.g. "exit code -9"), None while it runs."""

    def stop(self, timeout_s: float) -> None:
        """Wait up to timeout_s for it to end by itself, then end it."""


class Leader:
    def __init__(self, tp: TensorParallel, followers: Sequence[FollowerHandle], timeout_s: float):
        self.tp = tp
        self.followers = list(followers)
        self.timeout_s = timeout_s
        self.lost: RankLost | None = None  # set once a collective failed

    def check_followers(self) -> RankLost | None:
        """The group's failure: recorded earlier, or a follower's process found ended now (then
        recorded, so the next send raises it)."""
        if self.lost is None:
            for follower in self.followers:
                if (how := follower.exit_description()) is not None:
                    self.lost = RankLost(f"rank {follower.rank} exited ({how})")
                    break
        return self.lost

    def send(self, message: step_plan.Message) -> None:
        self.check_alive()
        try:
            step_plan.send(self.tp, message, self.timeout_s)
        except RuntimeError as error:
            raise self.fail(error) from error

    def read_on_ranks(self, plan: step_plan.ReadPlan) -> bool:
        """Every follower reads its own heads of plan's blocks; True when all of them did
        (they read at once, each over its own agent; this returns when they are done)."""
        self.send(plan)
        return self.agree(True)

    def sync_copies(self) -> None:
        """Return once every follower has run the copies sent so far (they agree on it)."""
        self.send(step_plan.CopyPlan([], wait=True, ack=True))
        self.agree(True)

    def agree(self, ok: bool) -> bool:
        """Whether ok holds on every rank (each follower answering the message just sent)."""
        try:
            return step_plan.agree(self.tp, ok, self.timeout_s)
        except RuntimeError as error:
            raise self.fail(error) from error

    def check_alive(self) -> None:
        if self.lost is not None:
            raise RankLost(f"the tensor-parallel group failed earlier: {self.lost}")

    def fail(self, error: BaseException) -> RankLost:
        """The error to raise for a failed collective; the group is dead from now on. A rank
        whose sockets closed is often not yet seen to have exited (a Ray actor's death notice
        comes a moment later): up to EXIT_NOTICE_S is given for its exit to show."""
        deadline = time.monotonic() + EXIT_NOTICE_S
        while True:
            exited = [
                f"rank {f.rank} ({how})"
                for f in self.followers
                if (how := f.exit_description()) is not None
            ]
            if exited or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        who = (
            f"{', '.join(exited)} exited"
            if exited
            else f"no rank exited: one is stuck past tensor_parallel_timeout_s={self.timeout_s}"
        )
        self.lost = RankLost(f"tensor-parallel collective failed ({who}): {error}")
        return self.lost

    def shutdown(self) -> None:
        """End the followers (a Shutdown message, then a wait; a dead group's are killed)."""
        if self.lost is None:
            try:
                step_plan.send(self.tp, step_plan.Shutdown(), self.timeout_s)
            except RuntimeError as error:
                self.fail(error)
        for follower in self.followers:
            follower.stop(0.0 if self.lost is not None else self.timeout_s)
        if self.lost is None:
            self.lost = RankLost("the tensor-parallel group was shut down")


class LeaderRunner(ModelRunner):
    """ModelRunner on rank 0: every forward pass is sent to the followers first, and they run
    it at the same time (they join its all-reduces and the logits' gather)."""

    def __init__(
        self,
        leader: Leader,
        model: nn.Module,
        side: DeviceSide,
        kv: KVCacheManager,
        block_size: int,
    ):
        super().__init__(model, side, kv, block_size)
        self.leader = leader

    def run_inputs(
        self, inputs: StepInputs, rows: list[int], fill: TokenFill | None = None
    ) -> torch.Tensor:
        if inputs.pending_index:
            raise ValueError("tensor parallelism runs no overlapped steps (pending tokens)")
        self.leader.send(step_plan.StepPlan(inputs, rows))
        try:
            return super().run_inputs(inputs, rows, fill)
        except RuntimeError as error:
            raise self.leader.fail(error) from error


class LeaderCopies(BlockCopies):
    """BlockCopies on rank 0: every batch of block copies (the one place they all run) is
    sent to the followers, which run it on their own caches in the same order."""

    def __init__(self, leader: Leader, kv_cache: torch.Tensor, host_kv_cache_bytes: int):
        super().__init__(kv_cache, host_kv_cache_bytes)
        self.leader = leader

    def run(self, copies: Sequence[BlockCopy], wait: bool = False) -> None:
        if copies:
            self.leader.send(step_plan.CopyPlan(list(copies), wait))
        super().run(copies, wait)

    def offload_owed(self, kv: KVCacheManager, sync: bool = False) -> None:
        """sync (kept host slots are about to be read by a peer, from every rank's own host
        memory): also wait until every follower's offloads are done (an acknowledged, empty
        CopyPlan: a follower runs each message after rank 0 has sent it)."""
        super().offload_owed(kv, sync)
        if sync:
            self.leader.sync_copies()

    def spill_row(self, spill: Spill) -> object:
        """Rank 0's row, and the spill: each follower writes its own heads' row of it."""
        row = super().spill_row(spill)
        assert isinstance(row, torch.Tensor)
        return SpillRow(spill, row)

    def flush_to_disk(self, kv: KVCacheManager) -> None:
        """As BlockCopies' on a live group; a lost group writes nothing (no rank could
        write its heads), and the shutdown that calls this goes on."""
        if self.leader.lost is not None:
            return
        with contextlib.suppress(RankLost):  # recorded in leader.lost; shutdown goes on
            super().flush_to_disk(kv)
