"""The workers' Ray actor handles as the router and the controller call them: PrefillActor,
DecodeActor and what both roles answer (WorkerActor), and the controller's as a router calls it
(ControllerActor). Protocols only; holds no state.

Ray's ActorHandle is dynamic: `handle.method.remote(*args)` starts a call and returns an
ObjectRef, which is awaited for the method's result (or its error; RayActorError when the actor
died). These Protocols name the methods our code calls, their arguments and what the await
gives; tests/unit/test_worker_actors.py checks them against PrefillWorker, DecodeWorker and the
Controller.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import ParamSpec, Protocol, TypeVar

from common.cluster_state import (
    ClusterStatus,
    KVEvictRequest,
    LeakCheck,
    Member,
    RouterConfig,
    RouterStatus,
    ScaleRequest,
    WorkerDescription,
    WorkerState,
    WorkerStats,
)
from common.messages import GenerateRequest, KVHandle, TokenDelta

P = ParamSpec("P")
R_co = TypeVar("R_co", covariant=True)


class RemoteMethod(Protocol[P, R_co]):
    """One actor method as its handle exposes it (positional arguments, as our calls pass)."""

    def remote(self, *args: P.args, **kwargs: P.kwargs) -> Awaitable[R_co]: ...


class WorkerActor(Protocol):
    """What both roles answer: the controller's life cycle (describe, set_state, retire,
    shutdown), stats for status and /metrics, pid as a liveness probe, the leak check."""

    describe: RemoteMethod[[], WorkerDescription]
    set_state: RemoteMethod[[WorkerState], float]  # returns when the state was published
    stats: RemoteMethod[[], WorkerStats]
    pid: RemoteMethod[[], int]
    retire: RemoteMethod[[], LeakCheck | None]  # None: work still in flight
    check_no_leaks: RemoteMethod[[], LeakCheck]
    # (prompt, cache_salt) -> blocks dropped per tier (kvrelay kv evict)
    evict_kv: RemoteMethod[[str | None, str | None], dict[str, int]]
    shutdown: RemoteMethod[[], None]


class PrefillActor(WorkerActor, Protocol):
    """A prefill worker: computes a prompt and leases its KV blocks to a decode worker."""

    prefill: RemoteMethod[[GenerateRequest], KVHandle]
    release: RemoteMethod[[str, int], bool]  # (req_id, epoch): the lease's blocks go back
    abort: RemoteMethod[[str], None]  # req_id: a prefill not finished yet is dropped
    resync_index: RemoteMethod[[], bool]  # re-publish its whole state to the Redis index


class DecodeActor(WorkerActor, Protocol):
    """A decode worker: pulls a prefilled request's KV (or computes the prompt itself) and
    streams its tokens to the router's long-poll."""

    submit: RemoteMethod[[GenerateRequest, KVHandle, str], None]  # (request, handle, router_id)
    prefill_here: RemoteMethod[[GenerateRequest, str], None]  # (request, router_id)
    next_deltas: RemoteMethod[[str, float], list[TokenDelta]]  # (router_id, timeout_s)
    abort: RemoteMethod[[str], None]  # req_id
    check_peer: RemoteMethod[[str], None]  # a prefill actor's name: the handshake


class ControllerActor(Protocol):
    """The controller as the CLI, the embedded cluster and a router's MembershipSync call it."""

    start: RemoteMethod[[], None]  # its reconcile loop
    scale: RemoteMethod[[ScaleRequest], dict[str, int]]  # -> the pools' desired sizes
    set_capacity: RemoteMethod[[int, str], None]  # an embedded cluster's most workers, and why
    status: RemoteMethod[[bool], ClusterStatus]  # (with_stats)
    members: RemoteMethod[[RouterStatus | None], list[Member]]  # a router reports, gets members
    forget_router: RemoteMethod[[str], None]  # router_id: it stopped
    router_config: RemoteMethod[[], RouterConfig]  # once a worker has loaded the model
    shutdown: RemoteMethod[[], None]  # every pool to 0, the loop stopped
    # every worker drops the blocks -> worker id -> blocks dropped per tier, or its error
    evict_kv: RemoteMethod[[KVEvictRequest], dict[str, dict[str, int] | str]]
