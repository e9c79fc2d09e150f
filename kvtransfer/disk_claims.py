"""The disk-tier folders this process has claimed: a folder holds one worker's block files, so
workers given the same --disk-kv-path (every worker of a `kvrelay serve` is) each take a folder
of their own under it, and a restarted worker takes over a free one and the files it holds.

A claim is an exclusive flock on the folder's lock file, held until the worker releases it
(its tier closes) or its process ends (the OS drops it however a worker dies); a process that
claims again gets the folder it already holds (counted: released when every claim is). Folder
0 is the path itself (where a lone worker's files always were), folder k its subfolder
worker<k>.
"""

from __future__ import annotations

import fcntl
import os
import threading
from pathlib import Path

LOCK_NAME = ".kvrelay-worker.lock"
MAX_FOLDERS = 4096  # every pool of every model on one node sharing the path (1,024 a pool)

_held: dict[Path, list[int]] = {}  # a root (resolved) -> [its folder held here, lock fd, claims]
_claiming = threading.Lock()


def claimed_folder(root: str | os.PathLike[str], index: int) -> Path:
    """Where the folder of that index lies under root (0: root itself)."""
    return Path(root) if index == 0 else Path(root) / f"worker{index}"


def claim_folder(root: str | os.PathLike[str]) -> int:
    """The index of the first folder under root that no other live process holds, now held by
    this one (creating it). Raises OSError when root cannot be made or written, RuntimeError
    when every folder is held."""
    with _claiming:
        Path(root).mkdir(parents=True, exist_ok=True)
        key = Path(root).resolve()
        if key in _held:
            _held[key][2] += 1
            return _held[key][0]
        for index in range(MAX_FOLDERS):
            folder = claimed_folder(root, index)
            folder.mkdir(exist_ok=True)
            fd = os.open(folder / LOCK_NAME, os.O_CREAT | os.O_RDWR, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            _held[key] = [index, fd, 1]
            return index
    raise RuntimeError(f"{root}: all {MAX_FOLDERS} workers' folders are held by live workers")


def release_folder(root: str | os.PathLike[str]) -> None:
    """One claim of root's folder by this process ends; the last one unlocks it."""
    with _claiming:
        key = Path(root).resolve()
        held = _held.get(key)
        if held is None:
            return
        held[2] -= 1
        if held[2] <= 0:
            del _held[key]
            os.close(held[1])  # closing the descriptor drops the flock
