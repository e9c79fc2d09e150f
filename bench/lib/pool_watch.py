"""serve_bench --watch-pools: the pools' sizes over a run, as `kvrelay status` sees them. Owns one
child process (`python -m bench.lib.pool_watch`: joins the running serve's Ray once, like
`kvrelay status`, and prints one JSON line per poll) and the thread collecting its samples.
Never fails the benchmark: a watch that finds nothing records nothing and says why once.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, NamedTuple

FIND_TIMEOUT_S = 30.0  # the child waits this long for the serve's state file and controller


class PoolSample(NamedTuple):
    """One poll: seconds since the watch started, ready and wanted workers per pool."""

    t_s: float
    prefill_ready: int
    decode_ready: int
    prefill_desired: int
    decode_desired: int


def parse_line(line: str, t_s: float) -> PoolSample | str:
    """A child's line: a sample, or the error it reports (a str)."""
    try:
        data = json.loads(line)
        if "error" in data:
            return str(data["error"])
        pools = data["pools"]
        return PoolSample(
            t_s,
            pools["prefill"]["ready"],
            pools["decode"]["ready"],
            pools["prefill"]["desired"],
            pools["decode"]["desired"],
        )
    except (ValueError, KeyError, TypeError) as e:
        return f"unreadable line {line[:80]!r}: {e}"


class PoolWatch:
    """`with PoolWatch(state_dir) as watch:` polls every interval_s; watch.samples after.
    state_dir: where the serve records its Ray address (KVRELAY_STATE_DIR; None: the default,
    the `kvrelay serve` running on this machine)."""

    def __init__(
        self,
        state_dir: Path | None = None,
        interval_s: float = 1.0,
        log: Callable[[str], None] = lambda m: print(m, file=sys.stderr, flush=True),
    ):
        self.state_dir, self.interval_s, self.log = state_dir, interval_s, log
        self.samples: list[PoolSample] = []
        self.errors: list[str] = []
        self.origin = time.monotonic()
        self.proc: subprocess.Popen[str] | None = None
        self.thread: threading.Thread | None = None
        self.log_path = Path(tempfile.gettempdir()) / f"serve_bench_pool_watch_{os.getpid()}.log"

    def now(self) -> float:
        """Seconds since the watch started (the samples' clock)."""
        return time.monotonic() - self.origin

    def __enter__(self) -> PoolWatch:
        env = dict(os.environ)
        if self.state_dir is not None:
            env["KVRELAY_STATE_DIR"] = str(self.state_dir)
        command = [sys.executable, "-m", "bench.lib.pool_watch", "--interval", str(self.interval_s)]
        try:
            with open(self.log_path, "w") as stderr:
                self.proc = subprocess.Popen(
                    command,
                    stdout=subprocess.PIPE,
                    stderr=stderr,
                    stdin=subprocess.DEVNULL,
                    env=env,
                    text=True,
                    cwd=Path(__file__).resolve().parents[2],
                )
        except OSError as e:
            self.log(f"pool watch: not started: {e}")
            return self
        self.thread = threading.Thread(target=self._read, name="pool-watch", daemon=True)
        self.thread.start()
        return self

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            parsed = parse_line(line, self.now())
            if isinstance(parsed, PoolSample):
                self.samples.append(parsed)
            elif not self.errors or self.errors[-1] != parsed:
                self.errors.append(parsed)
                self.log(f"pool watch: {parsed}")

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if self.thread is not None:
            self.thread.join(timeout=5)
        if not self.samples:
            self.log(f"pool watch: no samples (its log: {self.log_path})")

    def to_json(self) -> list[dict[str, float]]:
        return [sample._asdict() for sample in self.samples]


# ---- the child ------------------------------------------------------------------------------
def _emit(data: dict[str, object]) -> None:
    print(json.dumps(data), flush=True)


def _find_controller(deadline: float) -> Any:
    """The serve's controller (retrying while the serve has not recorded its address yet)."""
    from deploy import cluster_address
    from deploy.controller import find_controller

    while True:
        try:
            cluster_address.connect(None)
            return find_controller()
        except (ValueError, ConnectionError) as e:
            if time.monotonic() > deadline:
                raise ValueError(str(e)) from None
            time.sleep(1.0)


def watch(interval_s: float) -> int:
    """Print {"pools": {role: {"ready": n, "desired": m}}} every interval_s until killed or
    orphaned."""
    import ray

    try:
        controller = _find_controller(time.monotonic() + FIND_TIMEOUT_S)
    except Exception as e:  # nothing to watch: say why once, then exit
        _emit({"error": f"no cluster found: {e}"})
        return 0
    parent = os.getppid()
    while os.getppid() == parent:  # the benchmark gone: stop
        started = time.monotonic()
        try:
            status = ray.get(controller.status.remote(with_stats=False), timeout=10)
            pools = {p.role: {"ready": p.num_ready, "desired": p.desired} for p in status.pools}
            _emit({"pools": pools})
        except Exception as e:  # the serve stopping, a slow controller: try again
            _emit({"error": f"status failed: {type(e).__name__}: {e}"})
        time.sleep(max(0.0, interval_s - (time.monotonic() - started)))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="print the pools' sizes every interval")
    parser.add_argument("--interval", type=float, default=1.0)
    with contextlib.suppress(KeyboardInterrupt):
        return watch(parser.parse_args(argv).interval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
