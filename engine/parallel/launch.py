"""Starts a tensor-parallel engine's follower ranks as local processes and joins rank 0 to
their group (start_leader); owns nothing after: the Leader holds the process handles.

A follower is a fresh interpreter (`python -m engine.parallel.follower`), not a multiprocessing
child: it inherits no CUDA state and re-imports no caller's __main__ (a script needs no
`if __name__ == "__main__"` guard).
"""

from __future__ import annotations

import pickle
import subprocess
import sys
from collections.abc import Callable

from engine.config import EngineConfig, ModelConfig
from engine.execution.backend_builder import resolve_device
from engine.parallel.leader import FollowerHandle, Leader
from engine.parallel.ranks import free_address, join_group
from engine.parallel.tensor_parallel import check_tensor_parallel, rank_engine_config

# Starts follower `rank` of config's group, which joins rank 0's store at `address` (a process
# here; a Ray actor in a placement group's bundle in a cluster worker: common/rank_actors.py).
StartFollower = Callable[[EngineConfig, int, str], FollowerHandle]


class ProcessFollower:
    """A follower rank running in a process of its own (spawned: no CUDA state inherited)."""

    def __init__(self, rank: int, process: subprocess.Popen[bytes]):
        self.rank = rank
        self.process = process

    @classmethod
    def start(cls, config: EngineConfig, rank: int, address: str) -> ProcessFollower:
        command = [sys.executable, "-m", "engine.parallel.follower", str(rank), address]
        process = subprocess.Popen(command, stdin=subprocess.PIPE)
        assert process.stdin is not None
        process.stdin.write(pickle.dumps(config))
        process.stdin.close()
        return cls(rank, process)

    def exit_description(self) -> str | None:
        code = self.process.poll()
        return None if code is None else f"exit code {code}"

    def stop(self, timeout_s: float) -> None:
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def start_leader(
    config: EngineConfig,
    model_config: ModelConfig,
    start_follower: StartFollower | None = None,
) -> Leader | None:
    """At tensor_parallel_size N > 1: refuse what cannot be split (naming the numbers), start
    ranks 1..N-1 (start_follower; default: local processes) and join them as rank 0; None for
    one rank. The followers share rank 0's node: the store listens on the loopback address."""
    size = config.tensor_parallel_size
    if size == 1:
        return None
    check_tensor_parallel(model_config, size)
    rank_engine_config(config)  # refusals before any process starts
    address = free_address()
    start = start_follower or ProcessFollower.start
    followers: list[FollowerHandle] = []
    try:
        for rank in range(1, size):
            followers.append(start(config, rank, address))
    except BaseException:
        for follower in followers:
            follower.stop(0.0)
        raise
    try:
        device = resolve_device(config.device)
        tp = join_group(0, size, address, device, config.tensor_parallel_timeout_s)
    except BaseException:
        for follower in followers:
            follower.stop(0.0)
        raise
    return Leader(tp, followers, config.tensor_parallel_timeout_s)
