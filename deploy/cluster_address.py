"""Finding the Ray cluster a command talks to: `--address`, else the one a local `kvrelay serve`
started (it records its Ray address in a small JSON file while it runs). Owns that file."""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path

from common.cluster_state import NAMESPACE


def state_file() -> Path:
    base = os.environ.get("KVRELAY_STATE_DIR") or f"/tmp/kvrelay-{os.getuid()}"
    return Path(base) / "serve.json"


def record_local(ray_address: str, http_url: str, grpc_address: str) -> None:
    """`kvrelay serve` says where its cluster is, for `kvrelay scale|status|router`."""
    path = state_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    info = {"ray_address": ray_address, "pid": os.getpid(), "http": http_url, "grpc": grpc_address}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(info))
    tmp.replace(path)


def forget_local() -> None:
    """On exit: remove the file if it is still ours."""
    path = state_file()
    with contextlib.suppress(OSError, ValueError):
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()


def resolve(address: str | None) -> str:
    """The Ray address to connect to; ValueError saying what to do when there is none."""
    if address:
        return address
    path = state_file()
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError):
        raise ValueError(
            "no local `kvrelay serve` is running (nothing at "
            f"{path}); start one, or pass --address of a Ray cluster that runs kvrelay"
        ) from None
    if not process_alive(int(info.get("pid", 0))):
        raise ValueError(
            f"the local `kvrelay serve` recorded in {path} (pid {info.get('pid')}) has exited; "
            "start one, or pass --address"
        )
    return str(info["ray_address"])


def connect(address: str | None) -> None:
    """Join the cluster's Ray as a driver in kvrelay's namespace (quietly)."""
    import ray

    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(
        address=resolve(address),
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
