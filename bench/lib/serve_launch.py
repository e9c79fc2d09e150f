"""Starts `python -m deploy.cli serve` on free loopback ports for a benchmark and stops it again
(SIGINT, then SIGTERM / SIGKILL to its process group if it hangs); owns that one process and
its log file. Also describes the machine and the command line for reports.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

ROOT = Path(__file__).resolve().parents[2]  # the kvrelay checkout this bench/ is in
HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def interrupt_on_signal(signum: int, frame: object) -> None:
    """A signal handler (SIGTERM, e.g. from `timeout`) that stops a bench as Ctrl-C does, so
    its `finally` and `with` blocks stop the servers it launched."""
    raise KeyboardInterrupt(f"signal {signum}")


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class LaunchedServer:
    """`with LaunchedServer(...) as server:` -> server.http_url / server.grpc_target, ready."""

    def __init__(
        self,
        prefill: int = 1,
        decode: int = 1,
        policy: str = "kv_aware",
        extra_args: Sequence[str] = (),
        startup_timeout_s: float = 240.0,
        stop_timeout_s: float = 90.0,
        worker_niceness: int | None = None,
        server_root: Path = ROOT,
        log: Callable[[str], None] = _stderr,
        state_dir: Path | None = None,
        env: Mapping[str, str] | None = None,
        name: str = "",
    ):
        """worker_niceness: RAY_worker_niceness for the server (None: Ray's default, 15).
        server_root: the kvrelay checkout to run (cwd and PYTHONPATH of the server; e.g. a
        `git archive` snapshot, so edits in progress in this tree do not reach the run).
        state_dir: where the server records its Ray address (KVRELAY_STATE_DIR; None: the
        default, shared with any other `kvrelay serve` of this user). env: more environment
        for the server (e.g. CUDA_VISIBLE_DEVICES). name: tells its log file apart from those
        of other servers this process launches."""
        self.args = [
            *("--prefill", str(prefill), "--decode", str(decode), "--policy", policy),
            *extra_args,
        ]
        self.startup_timeout_s = startup_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.log = log
        self.http_port = self.grpc_port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        suffix = f"_{name}" if name else ""
        self.log_path = (
            Path(tempfile.gettempdir()) / f"serve_bench_server_{os.getpid()}{suffix}.log"
        )
        self.startup_s = 0.0
        self.server_root = Path(server_root).resolve()
        self.env = {"RAY_AUTH_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false"}
        if self.server_root != ROOT:
            self.env["PYTHONPATH"] = str(self.server_root)
        if worker_niceness is not None:
            self.env["RAY_worker_niceness"] = str(worker_niceness)
        if state_dir is not None:
            self.env["KVRELAY_STATE_DIR"] = str(state_dir)
        self.env.update(env or {})

    @property
    def http_url(self) -> str:
        return f"http://{HOST}:{self.http_port}"

    @property
    def grpc_target(self) -> str:
        return f"{HOST}:{self.grpc_port}"

    def command(self) -> list[str]:
        ports = ["--http-port", str(self.http_port), "--grpc-port", str(self.grpc_port)]
        return [sys.executable, "-m", "deploy.cli", "serve", "--host", HOST, *ports, *self.args]

    def describe(self) -> str:
        """The command as a shell line, with the environment it sets."""
        settings = [f"{k}={v}" for k, v in self.env.items() if k != "TOKENIZERS_PARALLELISM"]
        line = shlex.join([*settings, "python", *self.command()[1:]])
        return line if self.server_root == ROOT else f"cd {self.server_root} && {line}"

    def __enter__(self) -> LaunchedServer:
        self.http_port, self.grpc_port = free_port(), free_port()
        while self.grpc_port == self.http_port:
            self.grpc_port = free_port()
        env = {**os.environ, **self.env}
        if "PYTHONPATH" in self.env and os.environ.get("PYTHONPATH"):
            env["PYTHONPATH"] += os.pathsep + os.environ["PYTHONPATH"]
        self.log(f"launch: {self.describe()} (log: {self.log_path})")
        started = time.monotonic()
        with open(self.log_path, "wb") as log_file:
            self.proc = subprocess.Popen(
                self.command(),
                cwd=self.server_root,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # our Ctrl-C does not reach it; we stop it ourselves
            )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - started
        self.log(f"launch: ready in {self.startup_s:.1f} s at {self.http_url}, {self.grpc_target}")
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _wait_ready(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"the server exited with {self.proc.returncode} during startup:\n"
                    + self.log_tail()
                )
            if self.healthy():
                return
            time.sleep(0.5)
        raise RuntimeError(
            f"the server was not healthy after {self.startup_timeout_s:.0f} s:\n" + self.log_tail()
        )

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.http_url}/health", timeout=2) as resp:
                return resp.status == 200 and bool(json.loads(resp.read()).get("ok"))
        except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException):
            return False  # HTTPException: another server took the port first (HTTP/2 framing)

    def stop(self) -> None:
        """SIGINT and wait; escalate to the process group if it does not exit in time."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is not None:
            self._reap_session(proc.pid)
            return
        self.log("launch: stopping the server (SIGINT)")
        proc.send_signal(signal.SIGINT)
        for sig, wait_s in (
            (None, self.stop_timeout_s),
            (signal.SIGTERM, 15.0),
            (signal.SIGKILL, 15.0),
        ):
            if sig is not None:
                self.log(f"launch: server still running; sending {sig.name} to its group")
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, sig)
            try:
                proc.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        self.log(f"launch: server exited with {proc.returncode}")
        self._reap_session(proc.pid)

    def _reap_session(self, sid: int, wait_s: float = 30.0) -> None:
        """Wait for the server's descendants (Ray workers, redis-server: same session id) to
        exit; SIGKILL, one pid at a time, whatever is left after wait_s."""
        deadline = time.monotonic() + wait_s
        while (left := session_pids(sid)) and time.monotonic() < deadline:
            time.sleep(0.5)
        for pid in left:
            self.log(f"launch: killing leftover process {pid}")
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)

    def log_tail(self, num_lines: int = 30) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-num_lines:])


def session_pids(sid: int) -> list[int]:
    """Live processes whose session id is sid (Linux /proc; [] elsewhere)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) == sid and fields[0] != "Z":
                pids.append(int(stat.parent.name))
    return pids


def command_line(module: str, argv: Sequence[str] | None = None) -> str:
    """How this run was started, for reports: `python -m MODULE ARGS`."""
    return shlex.join(["python", "-m", module, *(sys.argv[1:] if argv is None else argv)])


def machine_info() -> dict[str, Any]:
    """nproc, CPU model, RAM and load average, for reports."""
    cpu_model = platform.processor() or ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    ram_gib = 0.0
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                ram_gib = int(line.split()[1]) / (1 << 20)
                break
    load = os.getloadavg() if hasattr(os, "getloadavg") else (0.0, 0.0, 0.0)
    return {
        "nproc": os.cpu_count(),
        "cpu_model": cpu_model,
        "ram_gib": round(ram_gib, 1),
        "loadavg_1_5_15": [round(x, 2) for x in load],
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def nvidia_gpus() -> list[dict[str, str]]:
    """The GPUs nvidia-smi lists (no CUDA context in this process); [] without nvidia-smi."""
    query = "index,name,memory.total,driver_version"
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    keys = query.split(",")
    return [
        dict(zip(keys, (f.strip() for f in line.split(",")), strict=False))
        for line in out.splitlines()
        if line.strip()
    ]
