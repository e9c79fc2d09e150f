"""What a LocalRedis leaves behind when its owner dies without stopping it (SIGKILL): its temp dir,
named after the owner's pid, and the redis-server still running in it. Holds no state: the next
LocalRedis to start on this machine removes them."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import tempfile
from pathlib import Path

from deploy.cluster_address import process_alive

logger = logging.getLogger(__name__)
DIR_PREFIX = "kvrelay-redis-"
_OWNED = re.compile(rf"{re.escape(DIR_PREFIX)}(\d+)-")


def dir_prefix(owner_pid: int | None = None) -> str:
    """The temp dir prefix of a LocalRedis owned by this process (or owner_pid)."""
    return f"{DIR_PREFIX}{os.getpid() if owner_pid is None else owner_pid}-"


def clean_stale(base: str | None = None) -> list[Path]:
    """Remove the temp dirs (under `base`, default the system temp dir) of LocalRedis servers
    whose owner process is gone, killing the redis-server still running in one; returns the
    dirs removed. A dir whose owner runs, or that was not named by dir_prefix(), is left alone."""
    removed = []
    for path in Path(base or tempfile.gettempdir()).glob(f"{DIR_PREFIX}*"):
        match = _OWNED.match(path.name)
        if match is None or process_alive(int(match.group(1))) or not path.is_dir():
            continue
        for pid in _servers_in(path):
            logger.warning("killing redis-server %d left running by a dead owner in %s", pid, path)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            removed.append(path)
            logger.info("removed %s (its owner, pid %s, is gone)", path, match.group(1))
    return removed


def _servers_in(path: Path) -> list[int]:
    """Processes named redis-server working in `path` (redis-server --dir chdirs there)."""
    found = []
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            with contextlib.suppress(OSError):
                proc = Path(entry.path)
                if (proc / "comm").read_text().strip() != "redis-server":
                    continue
                if os.readlink(proc / "cwd") == str(path.resolve()):
                    found.append(int(entry.name))
    return found
