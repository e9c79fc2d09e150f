"""Chained, stable block hashes of token ids; stateless and torch-free so the router can import it.

h_0 = H(root, tokens_0), h_i = H(h_{i-1}, tokens_i) where root = H(model_id, cache_salt).
H is xxh3-64 over a fixed byte layout, so hashes agree across processes and machines.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import xxhash

HASH_VERSION = 1


def root_hash(model_id: str, cache_salt: str | None = None) -> int:
    """The chain's seed: different models or salts never share a block hash."""
    salt = cache_salt or ""
    payload = f"kvrelay/{HASH_VERSION}\x00{model_id}\x00{salt}".encode()
    return xxhash.xxh3_64_intdigest(payload)


def hash_block(parent_hash: int, token_ids: Sequence[int]) -> int:
    """Hash of one full block, chained on the previous block's hash."""
    packed = struct.pack(f"<Q{len(token_ids)}I", parent_hash, *token_ids)
    return xxhash.xxh3_64_intdigest(packed)


def hash_blocks(
    token_ids: Sequence[int],
    block_size: int,
    model_id: str,
    cache_salt: str | None = None,
    start_hashes: Sequence[int] = (),
) -> list[int]:
    """Hashes of every full block of token_ids; start_hashes are already-known leading hashes."""
    hashes = list(start_hashes)
    parent = hashes[-1] if hashes else root_hash(model_id, cache_salt)
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


def hash_hex(block_hash: int) -> str:
    """The form used in Redis keys and logs."""
    return f"{block_hash:016x}"
