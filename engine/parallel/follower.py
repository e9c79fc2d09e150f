"""Follower: a rank > 0 of a tensor-parallel engine; owns its model shard, its KV cache (its
KV heads of every block), its host tier and its disk tier files. It keeps no block state: it
runs the copies, disk operations and forward passes rank 0 sends, in order, joining their
collectives, and never samples.

The entry point is the class (build, then run()), so a Ray actor can host a rank as well as the
process `python -m engine.parallel.follower RANK ADDRESS` (the pickled EngineConfig on stdin)
that engine/parallel/launch.py starts.
"""

from __future__ import annotations

import os
import pickle
import sys
from collections.abc import Callable

import torch

from engine.config import EngineConfig
from engine.execution.block_copies import BlockCopies
from engine.execution.disk_setup import build_rank_disk
from engine.execution.model_setup import build_rank_side
from engine.execution.runner import ModelRunner
from engine.models.loader import read_model_config, resolve_model
from engine.parallel import step_plan
from engine.parallel.ranks import join_group


def rank_device(device: str, rank: int) -> torch.device:
    """The device a rank runs on: its own GPU (cuda:rank of the node's visible ones) on CUDA."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)
    return torch.device(device)


class Follower:
    def __init__(
        self, config: EngineConfig, rank: int, address: str, device: torch.device | None = None
    ):
        """Join rank 0's group at address, then load this rank's shard and build its cache.
        device: this rank's (None: rank_device; a Ray actor sees its one GPU as cuda:0)."""
        self.device = device if device is not None else rank_device(config.device, rank)
        size, timeout_s = config.tensor_parallel_size, config.tensor_parallel_timeout_s
        self.tp = join_group(rank, size, address, self.device, timeout_s)
        folder = resolve_model(config.model, cache_dir=config.settings.cache_dir)
        self.model_config = model_config = read_model_config(folder, config.model_id)
        side = build_rank_side(config, model_config, folder, self.device, None, self.tp)
        self.runner = ModelRunner(side.model, side.backend, None, side.config.cache.block_size)
        self.kv_cache = side.backend.kv_cache  # this rank's heads of every block
        self.copies = BlockCopies(side.backend.kv_cache, side.config.cache.host_kv_cache_bytes)
        # its heads of rank 0's disk tier blocks, in files of its own
        self.disk = build_rank_disk(
            side.config.cache, rank, model_config.model_id, self.copies, self.tp
        )
        self.num_steps = 0
        # Reads a ReadPlan's KV into this rank's cache, True once done (its host sets it: a
        # worker's rank reads over its own NIXL agent); None: a ReadPlan fails.
        self.on_read: Callable[[step_plan.ReadPlan], bool] | None = None

    def run(self) -> None:
        """Run rank 0's messages until its Shutdown (a collective error propagates)."""
        while True:
            message = step_plan.receive(self.tp)
            if isinstance(message, step_plan.Shutdown):
                return
            if isinstance(message, step_plan.CopyPlan):
                if self.disk is not None:
                    self.disk.expect(message.copies)
                self.copies.run(message.copies, message.wait)
                if message.ack:
                    if self.kv_cache.is_cuda:  # the copies queued so far have landed
                        torch.cuda.current_stream(self.kv_cache.device).synchronize()
                    step_plan.agree(self.tp, True)
            elif isinstance(message, step_plan.ReadPlan):
                step_plan.agree(self.tp, self._read(message))
            elif isinstance(message, step_plan.DiskPlan):
                if self.disk is None:
                    raise RuntimeError(f"rank {self.tp.rank} has no disk tier for {message.op!r}")
                if (ok := self.disk.run(message)) is not None:
                    step_plan.agree(self.tp, ok)
            else:
                self.runner.run_inputs(message.inputs, message.rows)
                self.num_steps += 1

    def _read(self, plan: step_plan.ReadPlan) -> bool:
        if self.on_read is None:
            return False
        try:
            return self.on_read(plan)
        except Exception as error:  # the ranks agree it failed: rank 0 recomputes the prompt
            print(f"kvrelay rank {self.tp.rank}: read failed: {error!r}", file=sys.stderr)
            return False


def main() -> None:
    """A follower process's entry point: its rank's loop; an error ends the process (exit 1)
    with the error on stderr (rank 0 then fails its next collective with RankLost)."""
    rank, address = int(sys.argv[1]), sys.argv[2]
    try:
        config = pickle.load(sys.stdin.buffer)
        if not isinstance(config, EngineConfig):
            raise TypeError(f"stdin holds a {type(config).__name__}, not an EngineConfig")
        Follower(config, rank, address).run()
    except BaseException as error:  # the process's last word, then its exit
        print(f"kvrelay tensor-parallel rank {rank}: {error!r}", file=sys.stderr, flush=True)
        os._exit(1)


if __name__ == "__main__":
    main()
