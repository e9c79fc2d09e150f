"""The KVTransfer interface and the frozen values it passes around; owns no state itself.

A KVTransfer owns one registered KV tensor (layer-packed: one block = one contiguous region of
`block_bytes`), the peers it has shaken hands with, and the reads it has in flight. Data moves
by pull: the decode side `read`s blocks out of a prefill side's registered tensor.
"""

from __future__ import annotations

import abc
import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType

from kvtransfer.layout import RegionLayout


class KVTransferError(RuntimeError):
    """A transfer or agent operation failed in the transport (not a caller mistake)."""


class TransferState(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True)
class AgentMetadata:
    """Everything a peer needs to read from this side; crosses process boundaries (picklable).

    `block_shape` is one block's shape, (num_layers, 2, num_kv_heads, block_size, head_dim);
    `compat_hash` covers model_id, dtype, block_size and block_shape (see handshake.py).
    """

    agent_name: str
    protocol_version: int
    compat_hash: str
    model_id: str
    dtype: str
    block_size: int
    block_shape: tuple[int, ...]
    nixl_metadata: bytes
    base_addr: int
    num_blocks: int
    block_bytes: int
    device_kind: str  # "cpu" or "cuda"
    device_id: int
    host_base_addr: int = 0  # the host tier's registered memory (DRAM; 0 blocks: none)
    host_num_blocks: int = 0
    # Tensor parallelism: the model's KV heads [kv_head_start, kv_head_start + block_shape[2])
    # are this agent's (its rank's); num_model_kv_heads 0: the block holds every head. A TP
    # holder's rank 0 carries its other ranks' agents (each registered its own cache).
    tp_size: int = 1
    kv_head_start: int = 0
    num_model_kv_heads: int = 0
    rank_agents: tuple[AgentMetadata, ...] = ()
    # An fp8 cache's per-layer (k_scale, v_scale): its blocks hold K / k_scale, V / v_scale,
    # so both sides must scale alike; () when the checkpoint gives none (1.0).
    kv_scales: tuple[tuple[float, float], ...] = ()

    @property
    def kv_heads(self) -> range:
        """The model's KV heads this agent's blocks hold."""
        return range(self.kv_head_start, self.kv_head_start + self.block_shape[2])

    @property
    def model_block_shape(self) -> tuple[int, ...]:
        """A block's shape holding every KV head of the model (the same on both sides)."""
        heads = self.num_model_kv_heads or self.block_shape[2]
        return (*self.block_shape[:2], heads, *self.block_shape[3:])

    @property
    def ranks(self) -> tuple[AgentMetadata, ...]:
        """Every rank's agent, rank 0 (this one) first."""
        return (self, *self.rank_agents)

    def region(self) -> RegionLayout:
        return RegionLayout(self.base_addr, self.num_blocks, self.block_bytes, self.device_id)

    def host_region(self) -> RegionLayout:
        return RegionLayout(self.host_base_addr, self.host_num_blocks, self.block_bytes, 0)


@dataclass(frozen=True)
class TransferHandle:
    """Names one read in flight on the agent that issued it; meaningless in another process."""

    xfer_id: int
    peer: str
    num_blocks: int
    num_descs: int  # descriptors after coalescing adjacent blocks


@dataclass(frozen=True)
class Notification:
    """A message a peer attached to a read of our blocks (sent when that read completed)."""

    peer: str
    msg: bytes


class KVTransfer(abc.ABC):
    """Moves whole KV blocks between processes.

    Invariants: `register` is called once, before any other method but `close`; a read only
    touches the blocks it names; every handle `read` returns is `release`d exactly once; once
    `poll` returns DONE or FAILED it keeps returning it; a read pending past its deadline
    polls FAILED. Not thread-safe: one thread (the engine loop) drives an instance.
    """

    @abc.abstractmethod
    def register(self, kv_tensor: object, host_tensor: object = None) -> None:
        """Register the [num_blocks, num_layers, 2, block_size, kv_heads, head_dim] KV tensor,
        and the host tier's tensor of the same block shape when peers read leases from it."""

    @abc.abstractmethod
    def metadata(self) -> AgentMetadata:
        """This side's handshake and addressing info, to hand to peers."""

    @abc.abstractmethod
    def add_peer(self, meta: AgentMetadata) -> str:
        """Check compatibility (IncompatiblePeerError), connect, return the peer's name."""

    @abc.abstractmethod
    def remove_peer(self, peer: str) -> None:
        """Forget a peer (it left or died); its pending reads fail."""

    @abc.abstractmethod
    def read(
        self,
        peer: str,
        remote_block_ids: Sequence[int],
        local_block_ids: Sequence[int],
        notif_msg: bytes = b"",
        num_remote_host: int = 0,
    ) -> TransferHandle:
        """Start one READ of remote_block_ids[i] into local_block_ids[i] for every i; the first
        num_remote_host remote ids are slots of the peer's host tier, the rest device blocks.

        Raises ValueError for an unknown peer, unpaired or out-of-range ids; `notif_msg`, if
        given, reaches the peer (see `get_notifs`) once the read has completed.
        """

    @abc.abstractmethod
    def poll(self, handle: TransferHandle) -> TransferState:
        """Non-blocking state of a read."""

    @abc.abstractmethod
    def failure_reason(self, handle: TransferHandle) -> str | None:
        """Why a read FAILED (None while it has not)."""

    @abc.abstractmethod
    def release(self, handle: TransferHandle) -> None:
        """Free a read's resources; a PENDING read is cancelled (KVTransferError if it cannot)."""

    @abc.abstractmethod
    def notify(self, peer: str, msg: bytes) -> None:
        """Send `msg` to a known peer now (it arrives before the notification of any read
        posted after this call); KVTransferError if it cannot be sent."""

    @abc.abstractmethod
    def get_notifs(self) -> list[Notification]:
        """Notifications that arrived since the last call, oldest first per peer."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release every read, forget every peer, deregister memory; idempotent."""

    def wait(self, handle: TransferHandle, poll_interval_s: float = 1e-5) -> None:
        """Block until the read is DONE; raise KVTransferError if it FAILED (deadline included)."""
        while (state := self.poll(handle)) is TransferState.PENDING:
            time.sleep(poll_interval_s)
        if state is TransferState.FAILED:
            reason = self.failure_reason(handle)
            raise KVTransferError(f"read from {handle.peer!r} failed: {reason}")

    def __enter__(self) -> KVTransfer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
