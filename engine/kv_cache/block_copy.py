"""BlockCopy: one block copy the KV cache manager owes the engine (a value; owns no state), and
which batches of them may run on a stream of their own."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import NamedTuple


class BlockCopy(NamedTuple):
    """A block whose KV (every layer) must be copied: src -> dst. kind "device": both are device
    blocks; "to_host": a device block into a host slot; "from_host": a host slot into a device
    block; "from_disk": a disk tier block (src: its hash, its KV staged by OwedCopies) into a
    device block."""

    src_block_id: int
    dst_block_id: int
    kind: str = "device"


def can_run_ahead(copies: Sequence[BlockCopy], freed: Collection[int]) -> bool:
    """The copies may run on a copy stream while the step in flight computes (the next step
    waits for them): only host-tier copies (a device copy may read a block that step still
    writes, and must keep its order with the rest), none touching a device block freed after
    that step was launched (it may still write its pending token there)."""
    for copy in copies:
        if copy.kind == "device":
            return False
        device_block = copy.src_block_id if copy.kind == "to_host" else copy.dst_block_id
        if device_block in freed:
            return False
    return bool(copies)
