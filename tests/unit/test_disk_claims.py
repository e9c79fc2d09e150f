"""kvtransfer/disk_claims.py: workers given one --disk-kv-path each hold a folder of their own,
and a restarted worker takes over the folder a dead one left (real processes, real flocks)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kvtransfer.disk_claims import claim_folder, claimed_folder

HOLDER = """
import sys
from kvtransfer.disk_claims import claim_folder
print(claim_folder(sys.argv[1]), flush=True)
sys.stdin.readline()  # holds its claim until told to end
"""


def holder(root: Path) -> tuple[subprocess.Popen[str], int]:
    """A process that claims a folder under root and holds it: the process and its index."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(root)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


def end(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None
    proc.stdin.close()
    assert proc.wait(timeout=30) == 0


def test_live_workers_on_one_path_each_hold_their_own_folder(tmp_path):
    root = tmp_path / "disk"
    first, a = holder(root)
    second, b = holder(root)
    try:
        assert (a, b) == (0, 1)
        assert claimed_folder(root, 0) == root and claimed_folder(root, 1) == root / "worker1"
        assert claim_folder(root) == 2  # this process: the next free one
        assert claim_folder(root) == 2  # claimed again: the folder it holds
    finally:
        end(first)
        end(second)


def test_a_restarted_worker_takes_over_the_folder_a_dead_one_left(tmp_path):
    root = tmp_path / "disk"
    first, a = holder(root)
    second, b = holder(root)
    (claimed_folder(root, b) / "left.kvb").write_bytes(b"blocks")
    second.kill()  # dies holding its claim: the OS drops it
    second.wait(timeout=30)
    restarted, c = holder(root)
    try:
        assert (a, b, c) == (0, 1, 1)
        assert (claimed_folder(root, c) / "left.kvb").read_bytes() == b"blocks"
    finally:
        end(first)
        end(restarted)
