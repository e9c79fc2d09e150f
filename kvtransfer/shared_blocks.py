"""SharedBlockFiles: the cluster-shared KV store's block files in a directory every worker of the
cluster reads (a shared filesystem), through the same NIXL POSIX backend and file format as the
disk tier (kvtransfer/disk_blocks.py). It owns no state beyond its NIXL agent and staging row:
the directory is the store, and which blocks it holds is whatever files are there.

One writer a block: a block is written whole under a temporary name of its writer, fsynced, then
hard-linked to its content-addressed name (`link` fails when the name exists, so the first
complete copy wins and a reader never sees a half-written file), and the temporary name removed.
Its retention priority is the file's eviction hint (the header's last bytes, outside its
checksum); its age is its modification time, which a hit refreshes (least recently used).
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import NamedTuple

import torch

from kvtransfer.disk_blocks import SUFFIX, DiskBlockFiles

# A temporary file older than this is a write cut short (its writer died): removed by a scan.
STALE_TEMP_S = 600.0


class SharedEntry(NamedTuple):
    """One block file of the store as an eviction scan saw it."""

    priority: int
    mtime: float
    block_hash: int
    salt_root: int  # its cache_salt's chain root (0: none)


class SharedBlockFiles(DiskBlockFiles):
    """Block files of one layout under root, written once by whichever worker comes first."""

    AGENT_PREFIX = "kvrelay-shared"

    def exists(self, block_hash: int) -> bool:
        return self.path(block_hash).exists()

    def publish(
        self, block_hash: int, row: torch.Tensor, priority: int, salt_root: int = 0
    ) -> bool:
        """Publish row as block_hash's file unless one is there: True when this call wrote it,
        False when another writer (or an earlier call) had. Raises OSError (ENOSPC: the
        store's filesystem is full) with nothing left behind."""
        if self.exists(block_hash):
            return False
        tmp = self.write_temp(block_hash, row, priority, salt_root, durable=True)
        try:
            os.link(tmp, self.path(block_hash))
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)
        return True

    def read(self, block_hash: int) -> torch.Tensor:
        """As DiskBlockFiles.read; a hit makes the file the newest (its age for eviction)."""
        row = super().read(block_hash)
        with contextlib.suppress(OSError):  # evicted meanwhile: the KV read is whole
            os.utime(self.path(block_hash))
        return row

    def entries(self) -> list[SharedEntry]:
        """Every block file of this layout now (any order); temporary files older than
        STALE_TEMP_S are removed (their writer died)."""
        found = []
        now = time.time()
        with os.scandir(self.dir) as it:
            for entry in it:
                try:
                    if entry.name.endswith(".tmp"):
                        if now - entry.stat().st_mtime > STALE_TEMP_S:
                            os.unlink(entry.path)
                        continue
                    if not entry.name.endswith(SUFFIX):
                        continue
                    block_hash = int(entry.name.removesuffix(SUFFIX), 16)
                    mtime = entry.stat().st_mtime
                except (OSError, ValueError):  # removed meanwhile, or not a block's name
                    continue
                priority, salt_root = self.hint(block_hash) or (0, 0)
                found.append(SharedEntry(priority, mtime, block_hash, salt_root))
        return found
