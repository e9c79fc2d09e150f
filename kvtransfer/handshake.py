"""Handshake rules: the protocol version and the compatibility hash two peers must share.

Owns no state. Two sides may exchange blocks only if they speak the same protocol and their
blocks mean the same thing: same model, dtype, block size and per-block layout.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

from kvtransfer.base import AgentMetadata

# 2: head-major blocks; 3: epoch-fenced handoff (begin/done notices); 4: tensor-parallel
# layouts (each rank's heads and agent in the handshake; head-slice reads)
PROTOCOL_VERSION = 4
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
    ("model_block_shape", "layout (block shape, every KV head)"),
    ("kv_scales", "KV scales (fp8 cache, per layer)"),
)


def check_compatible(local: AgentMetadata, remote: AgentMetadata) -> None:
    """Raise IncompatiblePeerError naming every field that differs between the two sides, or
    when local's KV heads cannot be read from remote's ranks (head_sources). Two sides of
    different tensor-parallel sizes are compatible when their blocks, holding every head,
    would be alike: each local head is read from a remote rank that holds it."""
    differences: list[str] = []
    details: list[str] = []
    fields = _FIELDS if local.kv_heads != remote.kv_heads else (*_FIELDS, _BLOCK_BYTES)
    for field, label in fields:
        mine, theirs = getattr(local, field), getattr(remote, field)
        if mine != theirs:
            differences.append("block_shape" if field == "model_block_shape" else field)
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
    head_sources(local, remote)


_BLOCK_BYTES = ("block_bytes", "block bytes")


def head_sources(local: AgentMetadata, remote: AgentMetadata) -> list[tuple[AgentMetadata, range]]:
    """Which of remote's ranks each of local's KV heads is read from: (rank's agent, heads)
    runs covering local.kv_heads in order (a head replicated on several ranks: the first).
    Raises IncompatiblePeerError naming the layouts when a read cannot be mapped."""

    def layout(meta: AgentMetadata) -> str:
        heads = meta.kv_heads
        return f"TP {meta.tp_size}, KV heads [{heads.start}, {heads.stop}) of rank 0"

    refuse = f"cannot map {local.agent_name!r} ({layout(local)}) onto {remote.agent_name!r} "
    refuse += f"({layout(remote)}): "
    if len(remote.ranks) != remote.tp_size:
        raise IncompatiblePeerError(
            refuse + f"it names {len(remote.ranks)} rank agents for TP {remote.tp_size}",
            ("rank_agents",),
        )
    sources: list[tuple[AgentMetadata, range]] = []
    for head in local.kv_heads:
        holder = next((m for m in remote.ranks if head in m.kv_heads), None)
        if holder is None:
            raise IncompatiblePeerError(refuse + f"no rank holds KV head {head}", ("kv_heads",))
        if sources and sources[-1][0] is holder and sources[-1][1].stop == head:
            sources[-1] = (holder, range(sources[-1][1].start, head + 1))
        else:
            sources.append((holder, range(head, head + 1)))
    return sources
