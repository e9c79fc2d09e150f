"""The disk tier of a tensor-parallel engine (engine/parallel/disk_ranks.py) without processes:
rank 0's DiskTier over RankedBlockFiles, its messages run at once by a follower's RankDisk
(the group stands in as an in-process relay). Real block files (NIXL's POSIX backend) on both
ranks: a write lands on both, a hit copies each rank's own heads back, a follower's bad file
fails the hit on both and is removed everywhere, and the follower ends holding nothing."""

from __future__ import annotations

import torch

from engine.execution.block_copies import BlockCopies
from engine.kv_cache.block_copy import BlockCopy
from engine.kv_cache.disk_tier import DiskTier, Spill
from engine.parallel.disk_ranks import RankDisk, RankedBlockFiles, SpillRow, rank_disk_path
from engine.parallel.step_plan import DiskPlan, Message
from kvtransfer.disk_blocks import BlockFileError, DiskBlockFiles, DiskLayout

ERRORS = (BlockFileError, OSError)


class InProcessGroup:
    """Rank 0's side of a group of one follower whose messages run here, at once."""

    def __init__(self, follower: RankDisk):
        self.follower = follower
        self.lost: object = None
        self.ops: list[str] = []
        self._answer: bool | None = None

    def send(self, message: Message) -> None:
        assert isinstance(message, DiskPlan)
        self.ops.append(message.op)
        self._answer = self.follower.run(message)

    def agree(self, ok: bool) -> bool:
        assert self._answer is not None, "agree() after a message the follower answers"
        answer, self._answer = self._answer, None
        return ok and answer


def test_a_followers_files_and_payloads_mirror_rank_0s_disk_tier(tmp_path) -> None:
    shape = (4, 2, 2, 1, 4, 8)  # blocks x layers x k|v x one KV head a rank x positions x dim
    cache0, cache1 = torch.randn(shape), torch.randn(shape)  # each rank's heads differ
    layout = DiskLayout.of("tiny", cache0)
    files0 = DiskBlockFiles(rank_disk_path(str(tmp_path), 0), layout, torch.float32)
    files1 = DiskBlockFiles(rank_disk_path(str(tmp_path), 1), layout, torch.float32)
    copies1 = BlockCopies(cache1, 0)
    follower = RankDisk(files1, copies1, ERRORS)
    group = InProcessGroup(follower)
    ranked = RankedBlockFiles(files0, group, BlockFileError)
    tier = DiskTier(8, ranked, read_errors=ERRORS, block_bytes=files0.payload_bytes)
    tier.listener = ranked

    for block, block_hash in enumerate((11, 12, 13)):
        spill = Spill(block_hash, block, False, 0)
        assert tier.put(spill, SpillRow(spill, cache0[block]))
    assert files1.dir == tmp_path / "rank1" / layout.key
    assert sorted(files0.scan().hashes) == sorted(files1.scan().hashes) == [11, 12, 13]

    # a hit: each rank's own heads of block 0 come back into block 3
    assert tier.stage(11)
    cache0[3].copy_(tier.take(11))
    copy = BlockCopy(11, 3, "from_disk")
    follower.expect([copy])
    copies1.run([copy])
    assert torch.equal(cache0[3], cache0[0]) and torch.equal(cache1[3], cache1[0])

    # rank 1's file of block 12 is bad: no rank loads it, and it is gone on both
    raw = bytearray(files1.path(12).read_bytes())
    raw[-7] ^= 0x40
    files1.path(12).write_bytes(bytes(raw))
    assert not tier.stage(12) and not tier.has(12) and tier.num_bad_files == 1
    assert not files0.path(12).exists() and not files1.path(12).exists()

    # a block staged, then dropped by the staging bound: the follower drops it too
    assert tier.stage(13) and follower.num_held() == 1
    tier.max_staged = 0
    tier.trim_staged()
    assert follower.num_held() == 0
    assert group.ops == ["write"] * 3 + ["stage", "take", "stage", "remove", "stage", "unstage"]
    tier.check_integrity()


def test_a_write_a_follower_cannot_make_is_removed_on_every_rank(tmp_path) -> None:
    cache0, cache1 = torch.randn(2, 1, 2, 1, 4, 8), torch.randn(2, 1, 2, 1, 4, 8)
    layout = DiskLayout.of("tiny", cache0)
    files0 = DiskBlockFiles(rank_disk_path(str(tmp_path), 0), layout, torch.float32)
    files1 = DiskBlockFiles(rank_disk_path(str(tmp_path), 1), layout, torch.float32)
    follower = RankDisk(files1, BlockCopies(cache1, 0), ERRORS)
    ranked = RankedBlockFiles(files0, InProcessGroup(follower), BlockFileError)
    tier = DiskTier(4, ranked, read_errors=ERRORS, block_bytes=files0.payload_bytes)
    files1.dir.rmdir()  # the follower's directory is gone: its write fails
    spill = Spill(21, 0, False, 0)
    assert not tier.put(spill, SpillRow(spill, cache0[0]))
    assert tier.num_write_failures == 1 and not tier.has(21)
    assert not files0.path(21).exists() and not files1.path(21).exists()
