"""Handshake rules: the protocol version and the compatibility hash two peers must share.

Owns no state. Two sides may exchange blocks only if they speak the same protocol and their
blocks mean the same thing: same model, dtype, block size and per-block layout.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

from kvtransfer.base import AgentMetadata

PROTOCOL_VERSION = 3  # 2: head-major blocks; 3: epoch-fenced handoff (begin/done notices)
# Order of a block's dimensions; block_shape alone cannot tell Hkv from block_size when equal.
BLOCK_LAYOUT = "num_layers,kv,num_kv_heads,block_size,head_dim"


class IncompatiblePeerError(ValueError):
    """Refused handshake; `differences` names each field that differs (e.g. "block_size")."""

    def __init__(self, message: str, differences: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.differences = tuple(differences)

    def __reduce__(self) -> tuple[type[IncompatiblePeerError], tuple[str, tuple[str, ...]]]:
        return (type(self), (str(self), self.differences))


def compat_hash(model_id: str, dtype: str, block_size: int, block_shape: Sequence[int]) -> str:
    """Stable hex digest (sha256, 128 bits) of what makes two KV caches interchangeable."""
    payload = json.dumps(
        {
            "model_id": model_id,
            "dtype": dtype,
            "block_size": int(block_size),
            "block_shape": [int(d) for d in block_shape],
            "block_layout": BLOCK_LAYOUT,
        },
        sort_keys=True,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:32]


_FIELDS = (
    ("protocol_version", "protocol version"),
    ("model_id", "model"),
    ("dtype", "dtype"),
    ("block_size", "block size"),
    ("block_shape", "layout (block shape)"),
    ("block_bytes", "block bytes"),
)


def check_compatible(local: AgentMetadata, remote: AgentMetadata) -> None:
    """Raise IncompatiblePeerError naming every field that differs between the two sides."""
    differences: list[str] = []
    details: list[str] = []
    for field, label in _FIELDS:
        mine, theirs = getattr(local, field), getattr(remote, field)
        if mine != theirs:
            differences.append(field)
            details.append(f"{label}: local {mine!r} != remote {theirs!r}")
    if not differences and local.compat_hash != remote.compat_hash:
        differences.append("compat_hash")
        details.append(f"compat hash: local {local.compat_hash} != remote {remote.compat_hash}")
    if differences:
        raise IncompatiblePeerError(
            f"peer {remote.agent_name!r} is incompatible with {local.agent_name!r}: "
            + "; ".join(details),
            differences,
        )
