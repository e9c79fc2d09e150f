"""The C++ CPU paged-decode kernel (csrc/paged_decode.cpp), built once per machine on first use.

Owns the process-wide build result: the loaded op, or the reason it is unavailable. The build
goes through torch's JIT extension loader (g++ and ninja) into torch's extensions folder;
later processes load the cached library in well under a second. Without it, decode attention
falls back to the slower torch gather path, with a warning that says why. An engine whose
settings turn it off (KVRELAY_CPU_KERNEL=0, Settings.cpu_kernel) never asks for it.
"""

from __future__ import annotations

import hashlib
import logging
import platform
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from engine.settings import Settings

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_decode.cpp"

_lock = threading.Lock()
_op: Callable[..., torch.Tensor] | None = None
_unavailable: str | None = None
_tried = False
STALE_LOCK_S = 900.0  # a real build takes ~30 s (minutes on a loaded machine)


def _cpu_tag() -> str:
    """Short id of this CPU's model and flags: the library is built with -march=native."""
    info = platform.processor()
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        info += "".join(x for x in lines if x.startswith(("model name", "flags")))[:4096]
    except OSError:
        pass
    return hashlib.sha256(info.encode()).hexdigest()[:8]


def _build() -> Callable[..., torch.Tensor]:
    from torch.utils.cpp_extension import _get_build_directory, load

    # One build folder per CPU and per checkout: two checkouts on one machine (worktrees, a CI
    # clone) would otherwise rebuild over each other and share one build lock.
    checkout = hashlib.sha256(str(SOURCE.resolve()).encode()).hexdigest()[:6]
    name = f"kvrelay_paged_decode_{_cpu_tag()}_{checkout}"
    build_dir = Path(_get_build_directory(name, verbose=False))
    _remove_stale_lock(build_dir / "lock")
    built = any(build_dir.glob(f"{name}*.so"))
    if not built:
        logger.info("building the CPU paged-decode kernel (once per machine, ~30 s)")
    start = time.monotonic()
    load(
        name=name,
        sources=[str(SOURCE)],
        extra_cflags=["-O3", "-march=native", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
        is_python_module=False,
        verbose=False,
    )
    if not built:
        logger.info("built the CPU paged-decode kernel in %.1f s", time.monotonic() - start)
    return torch.ops.kvrelay.paged_decode


def _remove_stale_lock(lock: Path, max_age_s: float = STALE_LOCK_S) -> None:
    """torch waits forever on a build lock; one left by a killed build would hang every start.
    The lock names no holder, so only one far older than any real build is taken as stale."""
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > max_age_s:
        logger.warning("removing a stale kernel build lock %s (%.0f s old)", lock, age)
        lock.unlink(missing_ok=True)


def paged_decode_op() -> Callable[..., torch.Tensor] | None:
    """torch.ops.kvrelay.paged_decode, building it on first call; None if it cannot be had."""
    global _op, _unavailable, _tried
    with _lock:
        if not _tried:
            _tried = True
            try:
                _op = _build()
            except Exception as e:  # no compiler, no ninja, build error
                _unavailable = f"{type(e).__name__}: {str(e).strip()[-500:]}"
            if _unavailable:
                logger.warning(
                    "CPU paged-decode kernel unavailable (%s); decode attention uses the "
                    "slower torch gather path",
                    _unavailable,
                )
        return _op


def unavailable_reason() -> str | None:
    """Why paged_decode_op() returned None (after it was called), else None."""
    return _unavailable


def main() -> int:
    """`python -m engine.attention.cpu_kernels` (make's deps step): build or load the kernel now,
    once, instead of inside the first workers; say whether it is there. Never fails: without the
    kernel, decode attention still runs (slower), and the warning says why. With
    KVRELAY_CPU_KERNEL=0 it builds nothing."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not Settings.from_env().cpu_kernel:
        print("CPU paged-decode kernel: off (KVRELAY_CPU_KERNEL=0)")
        return 0
    ready = paged_decode_op() is not None
    print(
        "CPU paged-decode kernel: "
        + ("ready" if ready else f"unavailable ({unavailable_reason()})")
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
