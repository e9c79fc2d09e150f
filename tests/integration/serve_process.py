"""Test support: a real `kvrelay serve` in a session of its own (its output collected as it
comes), stopped by Ctrl-C or killed, plain HTTP calls to it, an SSE stream read event by event,
and the processes of its cluster (found from its raylet: its descendants, and every worker that
raylet started)."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import NamedTuple

import psutil

from deploy.redis_local import free_port

REPO = Path(__file__).resolve().parents[2]
START_BOUND_S = 400  # a slow, shared CPU machine: Ray, two workers loading SmolLM2, warm-up
CHAT = {
    "model": "SmolLM2-135M-Instruct",
    "messages": [{"role": "user", "content": "Tell me a long story about a lighthouse."}],
    "temperature": 0,
}


def serve_env(state_dir: Path) -> dict[str, str]:
    """The environment of a test's kvrelay commands: Ray without auth, unbuffered output, and
    the local serves' state files in `state_dir` (that test's serves only)."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
    env["KVRELAY_STATE_DIR"] = str(state_dir)
    return env


class Reply(NamedTuple):
    status: int
    body: dict
    headers: dict[str, str]


class ServeProcess:
    """`kvrelay serve --http-port P --grpc-port Q ARGS` on free ports, a small KV pool
    (`kv_cache_gib`), one thread a worker."""

    def __init__(self, state_dir: Path, *args: str, kv_cache_gib: float = 0.2):
        self.http_port, self.grpc_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.http_port}/v1"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "deploy.cli", "serve", "--http-port", str(self.http_port),
             "--grpc-port", str(self.grpc_port), "--kv-cache-gib", str(kv_cache_gib),
             "--threads-per-worker", "1", *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env=serve_env(state_dir), cwd=REPO, start_new_session=True,
        )  # fmt: skip
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._changed:
                self.lines.append(line)
                self._changed.notify_all()
        with self._changed:
            self.lines.append("")  # EOF
            self._changed.notify_all()

    def output(self) -> str:
        with self._changed:
            return "".join(self.lines)

    def wait_for(self, text: str, timeout_s: float = START_BOUND_S) -> str:
        """The first output line containing `text` (AssertionError on exit or timeout)."""

        def found() -> str | None:
            hits = [line for line in self.lines if text in line]
            if hits or (self.lines and self.lines[-1] == ""):
                return hits[0] if hits else "EOF"
            return None

        with self._changed:
            line = self._changed.wait_for(found, timeout_s)
        assert line and line != "EOF", f"no {text!r} in:\n" + "".join(self.lines)
        return line

    def wait_exit(self, timeout_s: float) -> int:
        """Its exit status, once its output is read to the end too."""
        rc = self.proc.wait(timeout_s)
        self._reader.join(10)
        return rc

    def raylet(self) -> psutil.Process:
        [raylet] = [p for p in self.descendants() if p.name() == "raylet"]
        return raylet

    def descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def cluster_processes(self) -> list[psutil.Process]:
        """Every process of this serve's cluster: its descendants (Ray's daemons,
        redis-server) and each worker its raylet started (no child of ours once that raylet
        is gone)."""
        raylet = str(self.raylet().pid)
        workers = []
        for process in psutil.process_iter():
            try:
                if process.environ().get("RAY_RAYLET_PID") == raylet:
                    workers.append(process)
            except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
                continue
        return list({p.pid: p for p in [*self.descendants(), *workers]}.values())

    def stop(self, timeout_s: float = 120) -> int:
        """Ctrl-C to serve alone; its exit status (its whole session is killed if it does not
        exit within timeout_s, and the TimeoutExpired raised)."""
        self.proc.send_signal(signal.SIGINT)
        try:
            return self.wait_exit(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self) -> None:
        """Whatever a test left running: its whole session, at once."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)

    # ---- HTTP ------------------------------------------------------------------------------
    def request(self, method: str, path: str, body: dict | None = None) -> Reply:
        conn = http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=120)
        try:
            if body is None:
                conn.request(method, path)
            else:
                headers = {"Content-Type": "application/json"}
                conn.request(method, path, json.dumps(body), headers)
            response = conn.getresponse()
            data = json.loads(response.read() or b"{}")
            return Reply(response.status, data, dict(response.getheaders()))
        finally:
            conn.close()

    def get(self, path: str) -> tuple[int, dict]:
        reply = self.request("GET", path)
        return reply.status, reply.body

    def post(self, path: str, body: dict) -> tuple[int, dict]:
        reply = self.request("POST", path, body)
        return reply.status, reply.body

    def until_status(self, path: str, status: int, bound_s: float) -> dict:
        """Poll GET path until it answers `status`; its body."""
        deadline = time.monotonic() + bound_s
        while True:
            got, body = self.get(path)
            if got == status:
                return body
            assert time.monotonic() < deadline, f"{path} still {got} {body} after {bound_s} s"
            time.sleep(0.05)


class SseStream:
    """A streamed chat completion, read one `data:` event at a time."""

    def __init__(self, port: int, max_tokens: int):
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        body = {**CHAT, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        self.conn.request(
            "POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        self.response = self.conn.getresponse()
        assert self.response.status == 200, self.response.read()
        self.events: list[str] = []

    def next_event(self) -> str | None:
        """The next event's data ("[DONE]" or JSON text), None when the connection ended."""
        while True:
            line = self.response.fp.readline()
            if not line:
                return None
            if line.startswith(b"data: "):
                data = line[len(b"data: ") :].decode().strip()
                self.events.append(data)
                return data

    def read(self, num_events: int) -> None:
        for _ in range(num_events):
            assert self.next_event() is not None, self.events

    def read_to_end(self) -> list[str]:
        while self.next_event() is not None:
            pass
        self.conn.close()
        return self.events
