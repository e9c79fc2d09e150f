"""Stopping `kvrelay serve` with a long stream open (real processes: Ray, workers, redis-server,
router): Ctrl-C (SIGINT to its whole process group, as a terminal sends it) and SIGTERM (to its
pid, as `kill`, Kubernetes and systemd's main-process mode send it) drain it. /ready and new
requests answer 503 (code "shutting_down", no Retry-After; gRPC UNAVAILABLE, no retry pushback)
at once; the open streams end once --drain-seconds pass, an SSE one with finish_reason "abort"
and [DONE], a gRPC one with FINISH_REASON_ABORT; every worker withdraws from Redis before
redis-server stops; serve exits 0 within the deadline plus a few seconds, leaving no process of
its cluster and no redis-server temp dir behind."""

from __future__ import annotations

import json
import os
import signal
import tempfile
from pathlib import Path

import grpc
import psutil
import pytest

from deploy.redis_stale import dir_prefix
from router.pb import kvrelay_pb2 as pb
from router.pb import kvrelay_pb2_grpc as pb_grpc
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
        channel = grpc.insecure_channel(f"127.0.0.1:{serve.grpc_port}")
        stub = pb_grpc.KVRelayStub(channel)
        grpc_stream = stub.Generate(_grpc_request(2000), timeout=300)
        next(grpc_stream)
        processes = serve.cluster_processes()
        assert any("redis-server" in p.name() for p in processes)
        (os.killpg if to_group else os.kill)(serve.proc.pid, signum)

        ready = serve.until_status("/ready", 503, bound_s=DRAIN_S)
        assert ready["reason"] == "the server is shutting down"
        refused = serve.request("POST", "/v1/chat/completions", {**_chat(), "max_tokens": 4})
        assert refused.status == 503 and "shutting down" in refused.body["error"]["message"]
        assert refused.body["error"]["code"] == "shutting_down", refused.body  # not overloaded
        assert "Retry-After" not in refused.headers  # this server will not serve again
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(_grpc_request(4), timeout=30))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value
        assert "shutting down" in info.value.details()
        assert "grpc-retry-pushback-ms" not in dict(info.value.trailing_metadata())

        events = stream.read_to_end()
        assert events[-1] == "[DONE]", events[-3:]
        last = json.loads(events[-2])
        assert last["choices"][0]["finish_reason"] == "abort", last
        assert list(grpc_stream)[-1].finish_reason == pb.FINISH_REASON_ABORT
        channel.close()
        assert serve.wait_exit(EXIT_BOUND_S) == 0
    finally:
        serve.kill()
    output = serve.output()
    assert "ended 2 open request(s) with finish_reason abort" in output
    assert "could not withdraw" not in output, output  # withdrawn before redis-server stopped
    assert "kvrelay: stopped" in output
    left = [p for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, [(p.pid, p.name()) for p in left]
    prefix = dir_prefix(serve.proc.pid)
    assert not list(Path(tempfile.gettempdir()).glob(f"{prefix}*")), "redis temp dir left behind"


def _grpc_request(max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt="Once upon a time",
        sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
    )


def _chat() -> dict:
    return {
        "model": "SmolLM2-135M-Instruct",
        "messages": [{"role": "user", "content": "Hello"}],
    }
