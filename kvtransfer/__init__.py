"""KV block transfer between workers: interface (base), descriptor layout, handshake, NIXL impl,
and the handoff's state machines (torch-free: handoff, leases: LeaseLedger, kv_holder: KVHolder,
pulls: PullLedger).

`from kvtransfer.nixl_transfer import NixlTransfer` for the implementation (imports torch; NIXL
itself is imported only when a tensor is registered).
"""

from kvtransfer.base import (
    AgentMetadata,
    KVTransfer,
    KVTransferError,
    Notification,
    TransferHandle,
    TransferState,
)
from kvtransfer.handshake import (
    PROTOCOL_VERSION,
    IncompatiblePeerError,
    check_compatible,
    compat_hash,
)
from kvtransfer.layout import BlockRun, Descriptor, RegionLayout, block_descriptors, coalesce_runs

__all__ = [
    "PROTOCOL_VERSION",
    "AgentMetadata",
    "BlockRun",
    "Descriptor",
    "IncompatiblePeerError",
    "KVTransfer",
    "KVTransferError",
    "Notification",
    "RegionLayout",
    "TransferHandle",
    "TransferState",
    "block_descriptors",
    "check_compatible",
    "coalesce_runs",
    "compat_hash",
]
