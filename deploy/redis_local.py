"""A local, throw-away `redis-server` child process: `kvrelay serve`'s embedded index and tests'.

Owns one redis-server process, its port and its temp dir. No persistence: the KV index is soft
state that workers re-publish in full whenever Redis comes back empty.
"""

from __future__ import annotations

import contextlib
import logging
import re
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType

log = logging.getLogger(__name__)

INSTALL_HINT = (
    "install it with `apt-get update && apt-get install -y redis-server` (Debian/Ubuntu), "
    "`brew install redis` (macOS), or pass --redis-url to use an existing Redis"
)
_PORT_ATTEMPTS = 3


class RedisServerNotFound(RuntimeError):
    """The redis-server binary is not installed (or not on PATH)."""


class RedisStartError(RuntimeError):
    """redis-server exited or did not answer PING in time; the message has its log tail."""


def find_redis_server(binary: str = "redis-server") -> str:
    """Absolute path of the redis-server binary, or RedisServerNotFound saying how to install it."""
    path = shutil.which(binary)
    if path is None:
        raise RedisServerNotFound(f"`{binary}` not found on PATH; {INSTALL_HINT}")
    return path


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the caller retries if it gets taken meanwhile)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def ping(host: str, port: int, timeout_s: float = 0.2) -> bool:
    """True when a Redis server answers PING on host:port (raw RESP, no client library)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def server_pid(host: str, port: int, timeout_s: float = 0.2) -> int | None:
    """The process id of the Redis server answering on host:port, None if none answers."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.sendall(b"INFO server\r\n")
            reply = b""
            while b"process_id:" not in reply or not reply.endswith(b"\r\n"):
                chunk = sock.recv(4096)
                if not chunk:
                    return None
                reply += chunk
    except OSError:
        return None
    match = re.search(rb"process_id:(\d+)", reply)
    return int(match.group(1)) if match else None


class LocalRedis:
    """One redis-server child on `host` (loopback by default): start / stop / restart.

    Invariants: at most one child at a time; once a port is chosen it is kept across restarts,
    so clients holding `url` reconnect to the restarted server; stop() always reaps the child.
    """

    def __init__(
        self,
        port: int | None = None,
        host: str = "127.0.0.1",
        binary: str = "redis-server",
        startup_timeout_s: float = 10.0,
    ) -> None:
        self.host = host
        self.port = port
        self.binary = binary
        self.startup_timeout_s = startup_timeout_s
        self._port_fixed = port is not None
        self._proc: subprocess.Popen[bytes] | None = None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("LocalRedis has no port yet; call start() first")
        return f"redis://{self.host}:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self.running else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> LocalRedis:
        """Start the server and return once it answers PING (reusing the port if it had one)."""
        if self.running:
            return self
        binary = find_redis_server(self.binary)
        if self._tmp is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="kvrelay-redis-")
        for attempt in range(_PORT_ATTEMPTS):
            if self.port is None:
                self.port = free_port(self.host)
            try:
                self._spawn(binary)
                log.info("redis-server pid %d listening on %s", self._proc.pid, self.url)
                return self
            except RedisStartError:
                if self._port_fixed or attempt == _PORT_ATTEMPTS - 1:
                    raise
                self.port = None  # lost a race for the port: pick another one
        raise AssertionError("unreachable")

    def stop(self) -> None:
        """Kill the server and wait for it to exit (the port and temp dir are kept for restart)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
        proc.wait()

    def restart(self) -> LocalRedis:
        """Stop, then start an empty server on the same port (a Redis crash and recovery)."""
        self.stop()
        self._port_fixed = True
        return self.start()

    def close(self) -> None:
        """Stop the server and remove its temp dir."""
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> LocalRedis:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _spawn(self, binary: str) -> None:
        assert self._tmp is not None and self.port is not None
        log_path = Path(self._tmp.name) / "redis.log"
        log_path.unlink(missing_ok=True)
        args = [binary, "--port", str(self.port), "--bind", self.host, "--dir", self._tmp.name]
        args += ["--save", "", "--appendonly", "no", "--daemonize", "no"]
        args += ["--logfile", str(log_path)]
        with log_path.open("ab") as out:  # early errors go to stderr, before --logfile is open
            self._proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=out, stderr=out)
        deadline = time.monotonic() + self.startup_timeout_s
        while server_pid(self.host, self.port) != self._proc.pid:  # not another server's
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RedisStartError(
                    f"redis-server on {self.host}:{self.port} did not start: {_tail(log_path)}"
                )
            time.sleep(0.01)


def _tail(log_path: Path, num_lines: int = 5) -> str:
    with contextlib.suppress(OSError):
        return " | ".join(log_path.read_text().strip().splitlines()[-num_lines:])
    return "(no log)"


@contextlib.contextmanager
def redis_url_or_local(redis_url: str | None) -> Iterator[str]:
    """`kvrelay serve` helper: yield redis_url, or start a LocalRedis for the block's lifetime."""
    if redis_url:
        yield redis_url
        return
    with LocalRedis() as server:
        log.info("no --redis-url given: started a local redis-server at %s", server.url)
        yield server.url
