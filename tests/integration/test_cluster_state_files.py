"""Two `kvrelay serve` side by side on one machine (real processes: Ray, workers, router each):
`kvrelay status` refuses to guess between them and lists both, finds each by --name (the
unnamed one by its HTTP port), and when one stops it removes only its own state, so the other
is found with no flag. On the way: `kvrelay bench` loads one of them, and that serve logs its
periodic stats line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from deploy.redis_local import free_port

# The cheapest cluster that is still a real one: no Redis, small KV pools, one thread a worker.
CHEAP = ["--no-redis", "--kv-cache-gib", "0.05", "--threads-per-worker", "1"]


class Serve:
    """`kvrelay serve ARGS` in its own session; its output lines are collected as they come."""

    def __init__(self, env: dict[str, str], *args: str):
        self.http_port, self.grpc_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.http_port}/v1"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "deploy.cli", "serve", "--http-port", str(self.http_port),
             "--grpc-port", str(self.grpc_port), *CHEAP, *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
            start_new_session=True,
        )  # fmt: skip
        self.lines: list[str] = []
        self._changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._changed:
                self.lines.append(line)
                self._changed.notify_all()
        with self._changed:
            self.lines.append("")  # EOF
            self._changed.notify_all()

    def wait_for(self, text: str, timeout_s: float) -> str:
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

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            raise


def kvrelay(env: dict[str, str], *argv: str, timeout_s: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "deploy.cli", *argv],
        capture_output=True, text=True, env=env, timeout=timeout_s,
    )  # fmt: skip


def router_urls(status: subprocess.CompletedProcess) -> list[str]:
    assert status.returncode == 0, status.stderr
    return [router["http_url"] for router in json.loads(status.stdout)["routers"]]


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
    env["KVRELAY_STATE_DIR"] = str(tmp_path)  # this test's serves only
    return env


def test_two_clusters_side_by_side_are_each_found_by_name(env, tmp_path):
    alpha = Serve(env, "--name", "alpha", "--log-stats-interval", "1")
    unnamed = Serve(env)
    serves = [alpha, unnamed]
    port_name = str(unnamed.http_port)
    try:
        for serve in serves:
            serve.wait_for("Ctrl-C to stop", timeout_s=420)
        assert "name           alpha" in "".join(alpha.lines)
        assert f"name           {port_name}" in "".join(unnamed.lines)
        assert {p.name for p in tmp_path.glob("serve-*.json")} == {
            "serve-alpha.json",
            f"serve-{port_name}.json",
        }

        guessed = kvrelay(env, "status")
        assert guessed.returncode != 0
        assert "2 `kvrelay serve` run on this machine" in guessed.stderr
        assert "--name NAME or --address" in guessed.stderr
        for name, serve in (("alpha", alpha), (port_name, unnamed)):
            assert name in guessed.stderr and serve.url in guessed.stderr
            assert router_urls(kvrelay(env, "status", "--json", "--name", name)) == [serve.url]

        # kvrelay bench drives a few requests into alpha; alpha logs what it served.
        bench = kvrelay(
            env, "bench", "--url", alpha.url.removesuffix("/v1"), "--num-requests", "4",
            "--input-len", "16", "--output-len", "8", "--warmup", "0", "--rate", "inf",
        )  # fmt: skip
        assert bench.returncode == 0, bench.stdout + bench.stderr
        assert "goodput" in bench.stdout.lower()
        line = alpha.wait_for("router.stats_log INFO stats: prompt", timeout_s=60)
        assert "tok/s" in line and "req/s" in line
        assert "prefill (1 worker): running" in line and "decode (1 worker): running" in line
        assert not [x for x in unnamed.lines if "stats: prompt" in x], "idle: no stats line"

        assert unnamed.stop() == 0
        assert not (tmp_path / f"serve-{port_name}.json").exists()
        assert (tmp_path / "serve-alpha.json").exists(), "a serve removes only its own state"
        assert router_urls(kvrelay(env, "status", "--json")) == [alpha.url]  # the only one
    finally:
        for serve in serves:
            if serve.proc.poll() is None:
                serve.stop()
    assert alpha.proc.returncode == 0
    assert not list(tmp_path.glob("serve-*.json"))
