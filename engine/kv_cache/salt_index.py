"""SaltIndex: which cache_salt each salted block of this worker was computed under (block hash ->
its salt's chain root, root_hash(model, salt)), so an operator can drop a tenant's blocks from
every tier (`kvrelay kv evict --salt`): a chained hash alone does not tell its salt. It owns that
map; the disk and shared stores also keep the root in each file's eviction hint, so blocks found
on disk after a restart or published by another worker are found by a scan. Torch-free.
"""

from __future__ import annotations

from collections.abc import Callable


class SaltIndex:
    def __init__(self, max_entries: int):
        """max_entries: past this many, entries whose block is in no tier any more are pruned
        (the map never grows past twice what the tiers can hold)."""
        self.max_entries = max(1, max_entries)
        self._root_of: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._root_of)

    def record(self, block_hash: int, root: int, held: Callable[[int], bool]) -> None:
        """A salted block committed under the salt whose chain root is root. held: whether a
        hash is in any tier of this worker (for pruning)."""
        self._root_of[block_hash] = root
        if len(self._root_of) > self.max_entries:
            self._root_of = {h: r for h, r in self._root_of.items() if held(h)}
            self.max_entries = max(self.max_entries, 2 * len(self._root_of))

    def root_of(self, block_hash: int) -> int:
        """The block's salt root; 0 when it was not salted (or is unknown here)."""
        return self._root_of.get(block_hash, 0)

    def hashes_of(self, root: int) -> list[int]:
        return [h for h, r in self._root_of.items() if r == root]

    def forget(self, block_hashes: list[int]) -> None:
        for block_hash in block_hashes:
            self._root_of.pop(block_hash, None)
