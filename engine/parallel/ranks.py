"""Joins one rank to its tensor-parallel group: a TCP store on rank 0's address, then this
group's own c10d groups (NCCL on CUDA, gloo on CPU, for the model; gloo for host messages).
Owns nothing once joined: the TensorParallel it returns holds the groups, the store stays
alive through them."""

from __future__ import annotations

import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.parallel.tensor_parallel import TensorParallel

# How long a follower waits for rank 0's next message (rank 0 may be idle for long; a rank 0
# that is gone closes its sockets, which ends the wait at once).
IDLE_TIMEOUT = timedelta(days=7)
# How long the ranks wait for each other to start (spawning imports torch, then the store).
START_TIMEOUT = timedelta(minutes=5)
LOOPBACK = "127.0.0.1"


def free_address(host: str = LOOPBACK) -> str:
    """host:port with a port free now (rank 0's store listens there)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return f"{host}:{s.getsockname()[1]}"


def join_group(
    rank: int, world_size: int, address: str, device: torch.device, timeout_s: float
) -> TensorParallel:
    """Join the group whose store rank 0 serves at address; returns once every rank has.
    timeout_s bounds each of the model's collectives (a rank gone or stuck: an error)."""
    host, port = address.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), world_size, rank == 0, timeout=START_TIMEOUT)
    timeout = timedelta(seconds=timeout_s)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        group = dist.ProcessGroupNCCL(dist.PrefixStore("model", store), rank, world_size, options)
    else:
        group = _gloo(dist.PrefixStore("model", store), rank, world_size, host, timeout)
    control = _gloo(dist.PrefixStore("control", store), rank, world_size, host, IDLE_TIMEOUT)
    return TensorParallel(rank, world_size, group, control)


def _gloo(
    store: dist.Store, rank: int, world_size: int, host: str, timeout: timedelta
) -> dist.ProcessGroupGloo:
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(store, rank, world_size, options)
