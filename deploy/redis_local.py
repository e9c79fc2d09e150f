"""A local, throw-away `redis-server` child process: `kvrelay serve`'s embedded index and tests'.

Owns one redis-server process, its port, its temp dir (log, config) and, optionally, its password
and TLS files. No persistence: the KV index is soft state that workers re-publish in full
whenever Redis comes back empty. The server runs in a session of its own, so a Ctrl-C meant for
its owner does not stop it before the owner's workers have withdrawn from it; what an owner
killed outright leaves behind is removed by the next LocalRedis (deploy/redis_stale.py).
"""

from __future__ import annotations

import contextlib
import logging
import re
import shutil
import socket
import ssl
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from urllib.parse import quote

from common.redis_url import redact
from deploy.redis_stale import clean_stale, dir_prefix

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


@dataclass(frozen=True)
class RedisTLS:
    """PEM files of a TLS-only redis-server: its certificate and key, and the CA that signed the
    certificate (what clients verify it with). Clients need no certificate of their own."""

    cert_file: str
    key_file: str
    ca_file: str


def ping(
    host: str,
    port: int,
    timeout_s: float = 0.2,
    password: str | None = None,
    tls: RedisTLS | None = None,
) -> bool:
    """True when a Redis server answers PING on host:port (raw RESP, no client library)."""
    try:
        with _connect(host, port, timeout_s, tls) as sock:
            sock.sendall(_auth(password) + _resp("PING"))
            reply = sock.recv(64)
            if password is not None and reply.startswith(b"+OK\r\n"):
                reply = reply[5:] or sock.recv(64)
            return reply.startswith(b"+PONG")
    except OSError:
        return False


def server_pid(
    host: str,
    port: int,
    timeout_s: float = 0.2,
    password: str | None = None,
    tls: RedisTLS | None = None,
) -> int | None:
    """The process id of the Redis server answering on host:port, None if none answers."""
    try:
        with _connect(host, port, timeout_s, tls) as sock:
            sock.sendall(_auth(password) + _resp("INFO", "server"))
            reply = b""
            while b"process_id:" not in reply or not reply.endswith(b"\r\n"):
                chunk = sock.recv(4096)
                reply += chunk
                if not chunk or reply.startswith(b"-"):  # closed, or an error (NOAUTH, ...)
                    return None
    except OSError:
        return None
    match = re.search(rb"process_id:(\d+)", reply)
    return int(match.group(1)) if match else None


def _connect(host: str, port: int, timeout_s: float, tls: RedisTLS | None) -> socket.socket:
    sock = socket.create_connection((host, port), timeout=timeout_s)
    if tls is None:
        return sock
    try:
        context = ssl.create_default_context(cafile=tls.ca_file)
        return context.wrap_socket(sock, server_hostname=host)
    except BaseException:
        sock.close()
        raise


def _resp(*args: str) -> bytes:
    """One command in RESP (binary-safe, so a password may hold any character)."""
    parts = [f"*{len(args)}\r\n".encode()]
    for arg in args:
        data = arg.encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(parts)


def _auth(password: str | None) -> bytes:
    return b"" if password is None else _resp("AUTH", password)


class LocalRedis:
    """One redis-server child on `host` (loopback by default): start / stop / restart.

    With `password` it requires it (`requirepass`, written to a config file in its temp dir, not
    on the command line); with `tls` it listens for TLS only, on the same `port`. `url` carries
    both (`rediss://:PASSWORD@host:port/0?ssl_ca_certs=CA`).
    Invariants: at most one child at a time; once a port is chosen it is kept across restarts,
    so clients holding `url` reconnect to the restarted server; stop() always reaps the child.
    """

    def __init__(
        self,
        port: int | None = None,
        host: str = "127.0.0.1",
        binary: str = "redis-server",
        startup_timeout_s: float = 10.0,
        password: str | None = None,
        tls: RedisTLS | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self.binary = binary
        self.startup_timeout_s = startup_timeout_s
        self.password = password
        self.tls = tls
        self._port_fixed = port is not None
        self._proc: subprocess.Popen[bytes] | None = None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("LocalRedis has no port yet; call start() first")
        auth = "" if self.password is None else f":{quote(self.password, safe='')}@"
        if self.tls is None:
            return f"redis://{auth}{self.host}:{self.port}/0"
        return f"rediss://{auth}{self.host}:{self.port}/0?ssl_ca_certs={quote(self.tls.ca_file)}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self.running else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def exit_status(self) -> int | None:
        """The child's exit status once it exited by itself (None: running, or never started)."""
        return None if self._proc is None else self._proc.poll()

    def start(self) -> LocalRedis:
        """Start the server and return once it answers PING (reusing the port if it had one)."""
        if self.running:
            return self
        binary = find_redis_server(self.binary)
        if self._tmp is None:
            clean_stale()
            self._tmp = tempfile.TemporaryDirectory(prefix=dir_prefix())
        for attempt in range(_PORT_ATTEMPTS):
            if self.port is None:
                self.port = free_port(self.host)
            try:
                self._spawn(binary)
                log.info("redis-server pid %d listening on %s", self._proc.pid, redact(self.url))
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
        args = [binary, self._write_config(), "--bind", self.host, "--dir", self._tmp.name]
        if self.tls is None:
            args += ["--port", str(self.port)]
        else:  # TLS only: no plain-text port
            args += ["--port", "0", "--tls-port", str(self.port), "--tls-auth-clients", "no"]
            args += ["--tls-cert-file", self.tls.cert_file, "--tls-key-file", self.tls.key_file]
            args += ["--tls-ca-cert-file", self.tls.ca_file]
        args += ["--save", "", "--appendonly", "no", "--daemonize", "no"]
        args += ["--logfile", str(log_path)]
        with log_path.open("ab") as out:  # early errors go to stderr, before --logfile is open
            self._proc = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True
            )
        deadline = time.monotonic() + self.startup_timeout_s
        # until it answers as this child (not another server on the port), with password / TLS
        while server_pid(self.host, self.port, 0.2, self.password, self.tls) != self._proc.pid:
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RedisStartError(
                    f"redis-server on {self.host}:{self.port} did not start: {_tail(log_path)}"
                )
            time.sleep(0.01)

    def _write_config(self) -> str:
        """The config file redis-server starts from: the password, if any (kept off `ps`; the
        temp dir is the owner's alone)."""
        assert self._tmp is not None
        path = Path(self._tmp.name) / "redis.conf"
        lines = [] if self.password is None else [f"requirepass {_conf_string(self.password)}"]
        path.write_text("".join(line + "\n" for line in lines))
        return str(path)


def _conf_string(value: str) -> str:
    """`value` as a double-quoted redis.conf string (any character survives)."""
    escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


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
        log.info("no --redis-url given: started a local redis-server at %s", redact(server.url))
        yield server.url
