"""Two `kvrelay serve` side by side on one machine (real processes: Ray, workers, router each):
`kvrelay status` refuses to guess between them and lists both, finds each by --name (the
unnamed one by its HTTP port), and when one stops it removes only its own state, so the other
is found with no flag. On the way: `kvrelay bench` loads one of them, and that serve logs its
periodic stats line; the other serves two (tiny) models, and lists and answers both."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.lib.served_shape import write_served_shape
from tests.integration.serve_process import ServeProcess, serve_env

# The cheapest cluster that is still a real one: no Redis, smaller KV pools (ServeProcess runs
# one thread a worker).
CHEAP = ("--no-redis",)
CHEAP_KV_GIB = 0.05
START_S = 420  # two serves start at once on a shared CPU machine


def serve(state_dir: Path, *args: str) -> ServeProcess:
    return ServeProcess(state_dir, *CHEAP, *args, kv_cache_gib=CHEAP_KV_GIB)


def kvrelay(env: dict[str, str], *argv: str, timeout_s: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "deploy.cli", *argv],
        capture_output=True, text=True, env=env, timeout=timeout_s,
    )  # fmt: skip


def router_urls(status: subprocess.CompletedProcess) -> list[str]:
    """The routers `status --json` lists (several models': a status a model, each listing the
    one router)."""
    assert status.returncode == 0, status.stderr
    got = json.loads(status.stdout)
    models = got if isinstance(got, list) else [got]
    return sorted({router["http_url"] for model in models for router in model["routers"]})


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return serve_env(tmp_path)  # this test's serves only


def tiny_models(folder: Path) -> list[str]:
    """`--model` flags of two tiny random-weight models (`--load-format dummy`)."""
    flags = []
    for name in ("tiny-a", "tiny-b"):
        write_served_shape(folder / name, "tiny-llama", lambda _: None)
        flags += ["--model", str(folder / name)]
    return [*flags, "--load-format", "dummy", "--max-model-len", "256"]


def test_two_clusters_side_by_side_are_each_found_by_name(env, tmp_path):
    alpha = serve(tmp_path, "--name", "alpha", "--log-stats-interval", "1")
    unnamed = serve(tmp_path, *tiny_models(tmp_path / "models"), "--log-stats-interval", "1")
    serves = [alpha, unnamed]
    port_name = str(unnamed.http_port)
    try:
        for each in serves:
            each.wait_for("Ctrl-C to stop", timeout_s=START_S)
        assert "name           alpha" in alpha.output()
        assert f"name           {port_name}" in unnamed.output()
        assert {p.name for p in tmp_path.glob("serve-*.json")} == {
            "serve-alpha.json",
            f"serve-{port_name}.json",
        }

        guessed = kvrelay(env, "status")
        assert guessed.returncode != 0
        assert "2 `kvrelay serve` run on this machine" in guessed.stderr
        assert "--name NAME or --address" in guessed.stderr
        for name, each in (("alpha", alpha), (port_name, unnamed)):
            assert name in guessed.stderr and each.url in guessed.stderr
            assert router_urls(kvrelay(env, "status", "--json", "--name", name)) == [each.url]

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
        assert "stats: prompt" not in unnamed.output(), "idle: no stats line"
        # the serve of two models lists them, answers each, and counts both models' workers
        assert "serving tiny-a, tiny-b" in unnamed.output()
        status, listed = unnamed.get("/v1/models")
        assert status == 200 and sorted(m["id"] for m in listed["data"]) == ["tiny-a", "tiny-b"]
        for model in ("tiny-a", "tiny-b"):
            body = {"model": model, "prompt": "hi", "max_tokens": 2, "ignore_eos": True}
            status, reply = unnamed.post("/v1/completions", body)
            assert status == 200, reply
            assert reply["model"] == model and reply["usage"]["completion_tokens"] == 2
        line = unnamed.wait_for("router.stats_log INFO stats: prompt", timeout_s=60)
        assert "prefill (2 workers): running" in line and "decode (2 workers): running" in line

        assert unnamed.stop() == 0
        assert not (tmp_path / f"serve-{port_name}.json").exists()
        assert (tmp_path / "serve-alpha.json").exists(), "a serve removes only its own state"
        assert router_urls(kvrelay(env, "status", "--json")) == [alpha.url]  # the only one
    finally:
        try:
            for each in serves:
                if each.proc.poll() is None:
                    each.stop()
        finally:
            for each in serves:
                each.kill()  # only one that did not stop
    assert alpha.proc.returncode == 0
    assert not list(tmp_path.glob("serve-*.json"))
