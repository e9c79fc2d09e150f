"""Stopping `kvrelay serve` with a long stream open (real processes: Ray, workers, redis-server,
router): Ctrl-C (SIGINT to its whole process group, as a terminal sends it) and SIGTERM (to its
pid, as `kill`, Kubernetes and systemd's main-process mode send it) drain it. /ready and new
requests answer 503 at once; the open stream ends with finish_reason "abort" and [DONE] once
--drain-seconds pass; every worker withdraws from Redis before redis-server stops; serve exits 0
within the deadline plus a few seconds, leaving no process of its cluster and no redis-server
temp dir behind."""

from __future__ import annotations

import json
import os
import signal
import tempfile
from pathlib import Path

import psutil
import pytest

from deploy.redis_stale import dir_prefix
from tests.integration.serve_process import ServeProcess, SseStream

DRAIN_S = 5
# A generous bound on the whole stop (measured: about 7 s): the defect it guards took two
# minutes, the stream generating on until its 2,000 tokens were out.
EXIT_BOUND_S = DRAIN_S + 60


@pytest.mark.parametrize(
    "signum, to_group", [(signal.SIGINT, True), (signal.SIGTERM, False)], ids=["ctrl-c", "sigterm"]
)
def test_a_stop_drains_open_streams_within_the_deadline(tmp_path, signum, to_group):
    serve = ServeProcess(tmp_path, "--drain-seconds", str(DRAIN_S))
    try:
        serve.wait_for("Ctrl-C to stop")
        stream = SseStream(serve.http_port, max_tokens=2000)
        stream.read(5)  # generating
        processes = serve.cluster_processes()
        assert any("redis-server" in p.name() for p in processes)
        (os.killpg if to_group else os.kill)(serve.proc.pid, signum)

        ready = serve.until_status("/ready", 503, bound_s=DRAIN_S)
        assert ready["reason"] == "the server is shutting down"
        status, refused = serve.post("/v1/chat/completions", {**_chat(), "max_tokens": 4})
        assert status == 503 and "shutting down" in refused["error"]["message"]

        events = stream.read_to_end()
        assert events[-1] == "[DONE]", events[-3:]
        last = json.loads(events[-2])
        assert last["choices"][0]["finish_reason"] == "abort", last
        assert serve.wait_exit(EXIT_BOUND_S) == 0
    finally:
        serve.kill()
    output = serve.output()
    assert "ended 1 open request(s) with finish_reason abort" in output
    assert "could not withdraw" not in output, output  # withdrawn before redis-server stopped
    assert "kvrelay: stopped" in output
    left = [p for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, [(p.pid, p.name()) for p in left]
    prefix = dir_prefix(serve.proc.pid)
    assert not list(Path(tempfile.gettempdir()).glob(f"{prefix}*")), "redis temp dir left behind"


def _chat() -> dict:
    return {
        "model": "SmolLM2-135M-Instruct",
        "messages": [{"role": "user", "content": "Hello"}],
    }
