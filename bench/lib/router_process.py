"""RouterProcess: one `kvrelay router` in its own process against a running cluster, on free
ports, logging to a file; owns that process until kill()."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


class RouterProcess:
    def __init__(self, ray_address: str, log_path: Path):
        from deploy.redis_local import free_port

        self.http_port, self.grpc_port = free_port(), free_port()
        self.log_path = log_path
        env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_AUTH_MODE": "disabled"}
        command = [
            *(sys.executable, "-m", "deploy.cli", "router"),
            *("--http-port", str(self.http_port), "--grpc-port", str(self.grpc_port)),
            *("--address", ray_address),
        ]
        with log_path.open("w") as log:
            self.proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    async def wait_ready(self, timeout_s: float = 180.0) -> float:
        """Seconds until its /health answered 200 (both pools known)."""
        import aiohttp

        started = time.monotonic()
        async with aiohttp.ClientSession() as session:
            while time.monotonic() - started < timeout_s:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the router exited: {self.log_tail()}")
                try:
                    async with session.get(f"{self.base_url}/health") as reply:
                        if reply.status == 200:
                            return time.monotonic() - started
                except aiohttp.ClientError:
                    pass  # not listening yet
                await asyncio.sleep(0.2)
        raise TimeoutError(f"the router did not come up: {self.log_tail()}")

    def log_tail(self) -> str:
        return self.log_path.read_text()[-2000:] if self.log_path.exists() else ""

    def kill(self) -> None:
        """SIGKILL: the router dies without a word to anyone (workers notice its silence)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)
