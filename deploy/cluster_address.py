"""Finding the Ray cluster a command talks to: `--address`, else a local `kvrelay serve` (each
records its name, Ray address and URLs in its own JSON file in the state folder while it runs).
Owns those files: a serve writes and removes only its own; a dead serve's file is removed by
whoever finds it."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import socket
from dataclasses import asdict, dataclass
from pathlib import Path

from common.cluster_state import NAMESPACE
from engine.settings import Settings

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
CHOOSE = "choose one with --name NAME or --address RAY_ADDRESS"
REACH_TIMEOUT_S = 5.0  # a cluster's GCS port answers a TCP connect within this


@dataclass(frozen=True)
class LocalServe:
    """One running `kvrelay serve` on this machine, as its state file says."""

    name: str
    ray_address: str
    pid: int
    started: str  # the process's start time (/proc): a reused pid is not taken for it
    http: str
    grpc: str

    def describe(self) -> str:
        return f"{self.name:<12} http {self.http}  grpc {self.grpc}  (pid {self.pid})"


def state_dir() -> Path:
    """The state folder (KVRELAY_STATE_DIR, default /tmp/kvrelay-<uid>; engine/settings.py)."""
    return Settings.from_env().state_dir


def state_file(name: str) -> Path:
    return state_dir() / f"serve-{name}.json"


def check_name(name: str) -> str:
    """A cluster name usable in a file name; ValueError naming --name otherwise."""
    if not _NAME.fullmatch(name):
        raise ValueError(
            f"--name {name!r}: use 1-64 letters, digits, '.', '_' or '-', beginning with a "
            "letter or digit"
        )
    return name


def check_free(name: str) -> None:
    """ValueError when a live serve on this machine has this name (before a new one starts)."""
    for serve in running():
        if serve.name == name:
            raise _taken(serve)


def record_local(name: str, ray_address: str, http_url: str, grpc_address: str) -> Path:
    """`kvrelay serve` says where its cluster is, for `kvrelay scale|status|router`. ValueError
    when a live serve already has this name (a dead one's file is replaced)."""
    check_name(name)
    path = state_file(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    me = LocalServe(name, ray_address, os.getpid(), _started(os.getpid()), http_url, grpc_address)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(asdict(me)))
    try:
        for _ in range(3):
            with contextlib.suppress(FileExistsError):
                os.link(tmp, path)  # atomic: fails if the name is taken
                return path
            other = _read(path)
            if other is not None and _alive(other):
                raise _taken(other)
            with contextlib.suppress(FileNotFoundError):
                path.unlink()  # a dead serve's (or an unreadable) file
        raise ValueError(f"could not record this serve in {path}")
    finally:
        tmp.unlink(missing_ok=True)


def forget_local(name: str) -> None:
    """On exit: remove this serve's file if it is still its own."""
    path = state_file(name)
    info = _read(path)
    if info is not None and info.pid == os.getpid():
        path.unlink(missing_ok=True)


def running() -> list[LocalServe]:
    """The serves running on this machine, by name; the files of dead ones are removed."""
    live = []
    for path in sorted(state_dir().glob("serve-*.json")):
        info = _read(path)
        if info is None:
            continue
        if _alive(info):
            live.append(info)
        else:
            with contextlib.suppress(OSError):
                if _read(path) == info:  # not replaced meanwhile by a new serve of that name
                    path.unlink()
    return live


def resolve(address: str | None, name: str | None = None) -> str:
    """The Ray address to connect to: `address`, else the local serve named `name`, else the
    only local serve; ValueError saying what to do when there is none or several."""
    if address:
        return address
    live = running()
    listing = "".join(f"\n  {serve.describe()}" for serve in live)
    if name is not None:
        for serve in live:
            if serve.name == name:
                return serve.ray_address
        running_text = f"; running here:{listing}" if live else ""
        raise ValueError(f"no local `kvrelay serve` named {name!r}{running_text}")
    if not live:
        raise ValueError(
            f"no local `kvrelay serve` is running (nothing in {state_dir()}); start one, or "
            "pass --address of a Ray cluster that runs kvrelay"
        )
    if len(live) > 1:
        raise ValueError(f"{len(live)} `kvrelay serve` run on this machine; {CHOOSE}:{listing}")
    return live[0].ray_address


def check_reachable(target: str, timeout_s: float = REACH_TIMEOUT_S) -> None:
    """ValueError unless something accepts a TCP connection at a host:port target (Ray's own
    connect retries for minutes at an address where nothing listens); other forms ("auto",
    ray://) are left to Ray."""
    host, sep, port = target.rpartition(":")
    if not sep or not host or "://" in target or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise ValueError(
            f"nothing answers at {target} ({e.strerror or e}): pass the --address of a running "
            "kvrelay cluster's Ray (its GCS, host:port), or --name of a local serve"
        ) from None


def connect(address: str | None, name: str | None = None) -> None:
    """Join the cluster's Ray as a driver in kvrelay's namespace (quietly)."""
    target = resolve(address, name)  # refused (none, several) before Ray is imported
    import ray

    if ray.is_initialized():
        return
    check_reachable(target)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(
        address=target,
        namespace=NAMESPACE,
        log_to_driver=False,
        logging_level=logging.WARNING,
    )


def process_alive(pid: int) -> bool:
    """Whether a local process runs (a zombie, exited but not yet reaped, counts as gone)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def _taken(serve: LocalServe) -> ValueError:
    return ValueError(
        f"a `kvrelay serve` named {serve.name!r} already runs on this machine: "
        f"{serve.describe()}; give this one another --name (or --http-port)"
    )


def _alive(serve: LocalServe) -> bool:
    return process_alive(serve.pid) and _started(serve.pid) == serve.started


def _started(pid: int) -> str:
    """The process's start time in clock ticks since boot ("" where /proc cannot say)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def _read(path: Path) -> LocalServe | None:
    try:
        return LocalServe(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None
