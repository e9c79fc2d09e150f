"""The disk KV tier of a tensor-parallel engine: RankedBlockFiles (rank 0's BlockFiles: its own
heads' files, each write, check, removal and stage change sent to the followers in order)
and RankDisk (a follower's own files of its heads, the blocks it read for rank 0's prefix
hits and those lent to their copy back). Rank 0's DiskTier alone keeps the bookkeeping
(which blocks, priorities, the bound); every rank's files hold its heads of each block.

Rank r > 0 keeps its files under disk_kv_path/rank<r> (rank 0 under disk_kv_path itself),
each rank's size bound the same count of blocks. A block is on disk only when every rank
wrote its file (the ranks agree after each write; a refused write is removed everywhere),
and a prefix hit loads it only when every rank's file checks out (else it is removed
everywhere and recomputed). A follower's staged and lent blocks mirror rank 0's: it is told
when one is taken or dropped by the staging bound.
"""

from __future__ import annotations

from collections import deque
from pathlib import Path
from typing import NamedTuple, Protocol

import torch

from engine.kv_cache.block_copy import BlockCopy
from engine.kv_cache.disk_tier import BlockFiles, Spill
from engine.parallel.step_plan import DiskPlan, Message


class Scanned(Protocol):
    hashes: list[int]  # the valid block files found, oldest first


class RankFiles(BlockFiles, Protocol):
    """One rank's block files (kvtransfer.disk_blocks.DiskBlockFiles, built by
    engine/execution/disk_setup.py: the engine's one door to kvtransfer)."""

    file_bytes: int
    payload_bytes: int
    dir: Path

    def scan(self) -> Scanned: ...


class Group(Protocol):
    """Rank 0's side of the group (engine.parallel.leader.Leader)."""

    lost: object

    def send(self, message: Message) -> None: ...

    def agree(self, ok: bool) -> bool: ...


class PayloadCopies(Protocol):
    """A follower's BlockCopies: its cache, host tier and where run() finds disk payloads."""

    kv_cache: torch.Tensor
    host: torch.Tensor | None
    disk_payloads: object


def rank_disk_path(root: str, rank: int) -> Path:
    """Where rank keeps its block files (rank 0: root, as an engine of one rank)."""
    return Path(root) if rank == 0 else Path(root) / f"rank{rank}"


class SpillRow(NamedTuple):
    """Rank 0's payload for a spilled block: its row, and where the followers find theirs."""

    spill: Spill
    row: torch.Tensor


class RankedBlockFiles:
    """BlockFiles of rank 0 (its own DiskBlockFiles) whose every operation the followers
    repeat on their own files; a StageListener of rank 0's DiskTier."""

    def __init__(self, files: RankFiles, leader: Group, read_error: type[Exception]):
        """read_error: what a file that must not be loaded raises (the DiskTier's)."""
        self.files = files
        self.leader = leader
        self.read_error = read_error

    @property
    def file_bytes(self) -> int:
        return self.files.file_bytes

    @property
    def payload_bytes(self) -> int:
        return self.files.payload_bytes

    @property
    def dir(self) -> Path:
        return self.files.dir

    def scan(self) -> Scanned:
        return self.files.scan()

    def keep_only(self, block_hashes: list[int]) -> None:
        """At start: the followers remove every file of theirs but block_hashes (the blocks
        rank 0 adopted; one a follower lacks fails its first check and is removed)."""
        self.leader.send(DiskPlan("keep", tuple(block_hashes)))

    def write(self, block_hash: int, row: object, salt_root: int = 0, priority: int = 0) -> None:
        """Every rank writes its heads of the spilled block (rank 0's file names its salt root,
        which `kvrelay kv evict --salt` reads, and its priority, which a warm restart adopts);
        OSError (nothing left on any rank) when one could not."""
        if not isinstance(row, SpillRow):
            raise TypeError(f"a tensor-parallel disk tier writes a SpillRow, not {type(row)}")
        spill = row.spill
        self.leader.send(DiskPlan("write", (block_hash,), spill.src, spill.from_host))
        failure: OSError | None = None
        try:
            self.files.write(block_hash, row.row, salt_root, priority)
        except OSError as error:
            failure = error
        if not self.leader.agree(failure is None):
            self.remove(block_hash)
            raise failure or OSError(f"a tensor-parallel rank could not write {block_hash:016x}")

    def set_priority(self, block_hash: int, priority: int) -> None:
        """Recorded in rank 0's file alone (the one a warm restart adopts by)."""
        self.files.set_priority(block_hash, priority)

    def read(self, block_hash: int) -> object:
        """Rank 0's heads of the block, once every rank has read and checked its own file;
        read_error when one rank's is missing or bad."""
        payload = self.files.read(block_hash)
        self.leader.send(DiskPlan("stage", (block_hash,)))
        if not self.leader.agree(True):
            raise self.read_error(f"{block_hash:016x}: a tensor-parallel rank's file is bad")
        return payload

    def hint(self, block_hash: int) -> tuple[int, int] | None:
        """Rank 0's file's (priority, salt root): every rank holds the same blocks."""
        return self.files.hint(block_hash)

    def remove(self, block_hash: int) -> None:
        self.files.remove(block_hash)
        if self.leader.lost is None:  # a dead group's files stay (scanned at the next start)
            self.leader.send(DiskPlan("remove", (block_hash,)))

    def taken(self, block_hash: int) -> None:
        if self.leader.lost is None:  # a dead group: the worker is ending (as in remove)
            self.leader.send(DiskPlan("take", (block_hash,)))

    def unstaged(self, block_hash: int) -> None:
        if self.leader.lost is None:
            self.leader.send(DiskPlan("unstage", (block_hash,)))


class RankDisk:
    """A follower's disk tier files and payloads; the DiskPayloads of its BlockCopies."""

    def __init__(
        self,
        files: RankFiles,
        copies: PayloadCopies,
        read_errors: tuple[type[BaseException], ...],
    ):
        """files: this rank's (under rank_disk_path); read_errors: what files.read raises for
        a file that must not be loaded."""
        self.files = files
        self.copies = copies
        self.read_errors = read_errors
        self.staged: dict[int, object] = {}  # read for a hit, not taken yet
        self.lent: dict[int, deque[object]] = {}  # taken, their copy back not run yet
        self._copying: dict[int, int] = {}  # device block -> hash, of the copies now run
        copies.disk_payloads = self

    def run(self, plan: DiskPlan) -> bool | None:
        """Run one operation; for "write" and "stage", whether it succeeded (to agree on)."""
        [first, *_] = plan.block_hashes or (0,)
        if plan.op == "write":
            return self._write(first, plan.src, plan.from_host)
        if plan.op == "stage":
            try:
                self.staged[first] = self.files.read(first)
            except self.read_errors:
                return False
            return True
        if plan.op == "take":
            self.lent.setdefault(first, deque()).append(self.staged.pop(first))
        elif plan.op == "unstage":
            self.staged.pop(first, None)
        elif plan.op == "remove":
            self.staged.pop(first, None)
            self.files.remove(first)
        elif plan.op == "keep":
            keep = set(plan.block_hashes)
            for block_hash in self.files.scan().hashes:
                if block_hash not in keep:
                    self.files.remove(block_hash)
        else:
            raise ValueError(f"unknown disk plan op {plan.op!r}")
        return None

    def _write(self, block_hash: int, src: int, from_host: bool) -> bool:
        cache = self.copies.kv_cache
        if cache.is_cuda:  # the offloads that filled a host slot have landed
            torch.cuda.current_stream(cache.device).synchronize()
        if from_host:
            assert self.copies.host is not None
            row = self.copies.host[src]
        else:
            row = cache[src]
        try:
            self.files.write(block_hash, row)
        except OSError:
            return False
        return True

    def expect(self, copies: list[BlockCopy]) -> None:
        """Before a CopyPlan runs: its "from_disk" copies' device blocks and hashes."""
        for copy in copies:
            if copy.kind == "from_disk":
                self._copying[copy.dst_block_id] = copy.src_block_id

    def take_disk_payload(self, block_id: int) -> object:
        block_hash = self._copying.pop(block_id)
        lent = self.lent[block_hash]
        payload = lent.popleft()
        if not lent:
            del self.lent[block_hash]
        return payload

    def num_held(self) -> int:
        """Payloads held for rank 0's staged and lent blocks."""
        return len(self.staged) + sum(len(q) for q in self.lent.values())
