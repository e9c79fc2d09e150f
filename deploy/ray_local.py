"""The processes of an embedded Ray (the one `ray.init(address="local")` started in this process),
read from /proc; holds no state. Its raylet and GCS server tell whether the cluster is lost;
every process it started (those two, its monitors and agents, and each worker its raylet
started) is waited for, then killed, so that none outlives `kvrelay serve`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from pathlib import Path
from typing import NamedTuple

from deploy.cluster_address import process_alive

logger = logging.getLogger(__name__)
PROC = Path("/proc")


class EmbeddedRay(NamedTuple):
    """The daemons of the Ray this process started: process type -> pid (gcs_server, raylet,
    monitor, dashboard, log_monitor, ...)."""

    daemons: dict[str, int]

    @property
    def raylet_pid(self) -> int:
        return self.daemons.get("raylet", 0)

    def lost(self) -> str | None:
        """Why the cluster is lost (its raylet or GCS server exited), None while both run."""
        for kind, name in (("raylet", "raylet"), ("gcs_server", "GCS server")):
            pid = self.daemons.get(kind, 0)
            if pid and not process_alive(pid):
                return f"its {name} (pid {pid}) exited"
        return None


class ProcessId(NamedTuple):
    """A process as of when it was seen: its pid and start time, so that a pid the kernel gave
    to another process since is never taken for it."""

    pid: int
    started: str


def embedded_ray() -> EmbeddedRay | None:
    """The Ray this process started, None when it joined one it did not start (or has none)."""
    import ray

    node = getattr(ray._private.worker, "_global_node", None)
    processes = getattr(node, "all_processes", None) or {}
    daemons = {kind: infos[0].process.pid for kind, infos in processes.items() if infos}
    return EmbeddedRay(daemons) if "raylet" in daemons else None


def cluster_processes(ray: EmbeddedRay) -> list[ProcessId]:
    """Every live process of that Ray: its daemons and their descendants, and each worker its
    raylet started (found by the RAY_RAYLET_PID in its environment: a worker whose raylet died
    is nobody's child of ours any more)."""
    parents: dict[int, int] = {}
    marked: set[int] = set()
    needle = f"RAY_RAYLET_PID={ray.raylet_pid}".encode()
    for entry in _pids():
        parent = _parent(entry)
        if parent is not None:
            parents[entry] = parent
        with contextlib.suppress(OSError):
            if needle in (PROC / str(entry) / "environ").read_bytes().split(b"\0"):
                marked.add(entry)
    found = set(ray.daemons.values()) | marked
    grew = True
    while grew:  # descendants of any process found
        more = {pid for pid, parent in parents.items() if parent in found} - found
        found |= more
        grew = bool(more)
    ids = [ProcessId(pid, _started(pid)) for pid in sorted(found)]
    return [p for p in ids if p.started and process_alive(p.pid)]


async def reap(processes: list[ProcessId], grace_s: float = 10.0) -> list[int]:
    """Wait (at most grace_s) for the processes to exit, then SIGKILL the ones still there;
    returns their pids."""
    deadline = time.monotonic() + grace_s
    alive = [p for p in processes if _same(p)]
    while alive and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        alive = [p for p in alive if _same(p)]
    for process in alive:
        logger.warning("Ray process %d did not exit with the cluster; killing it", process.pid)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(process.pid, signal.SIGKILL)
    return [p.pid for p in alive]


def _same(process: ProcessId) -> bool:
    return process_alive(process.pid) and _started(process.pid) == process.started


def _pids() -> list[int]:
    try:
        return [int(entry.name) for entry in os.scandir(PROC) if entry.name.isdigit()]
    except OSError:  # no /proc (not Linux): only the daemons Ray lists are known
        return []


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command name (state first), None when it is gone."""
    try:
        return (PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _parent(pid: int) -> int | None:
    fields = _stat(pid)
    return int(fields[1]) if fields else None


def _started(pid: int) -> str:
    """Start time in clock ticks since boot ("" when the process is gone)."""
    fields = _stat(pid)
    return fields[19] if fields else ""
