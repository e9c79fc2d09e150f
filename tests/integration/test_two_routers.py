"""Two `kvrelay router` processes on the same pools and Redis: both route KV-aware from the same
index, and killing one leaves the other serving; SIGTERM drains a router as it drains serve: /ready
and new requests answer 503 "shutting_down" at once, its open stream ends with finish_reason
"abort" once --drain-seconds pass, and it exits 0; one client's gRPC request id sent to both
at once runs twice, each stream whole (real Ray, Redis, NIXL, SmolLM2, openai client, grpc)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import openai
import pytest
import ray

from common.cluster_state import ClusterStatus
from deploy.local_cluster import LocalCluster
from deploy.redis_local import free_port
from router.pb import kvrelay_pb2 as pb
from router.pb import kvrelay_pb2_grpc as pb_grpc
from tests.integration.cluster_support import cluster_spec, wait_until_no_leaks

REPO = Path(__file__).resolve().parents[2]
MODEL = "SmolLM2-135M-Instruct"
NUM_PREFIXES = 4
DRAIN_S = 3  # each router's --drain-seconds


class RouterProcess:
    """`kvrelay router` in its own process, on free ports, until kill()."""

    def __init__(self, log_path: Path):
        self.http_port, self.grpc_port = free_port(), free_port()
        env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_AUTH_MODE": "disabled"}
        self.log = log_path.open("w")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "deploy.cli",
                "router",
                "--http-port",
                str(self.http_port),
                "--grpc-port",
                str(self.grpc_port),
                "--address",
                ray.get_runtime_context().gcs_address,
                "--drain-seconds",
                str(DRAIN_S),
            ],
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self.client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{self.http_port}/v1", api_key="unused", max_retries=0
        )

    def wait_ready(self, timeout_s: float = 180) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "the router exited: " + self.log_text()
            try:
                self.health()
                return
            except OSError:  # not listening yet (URLError is an OSError)
                pass
            time.sleep(0.2)
        raise AssertionError("the router did not come up: " + self.log_text())

    def health(self) -> dict:
        url = f"http://127.0.0.1:{self.http_port}/health"
        with urllib.request.urlopen(url, timeout=2) as reply:
            return json.loads(reply.read())

    def call(self, path: str, body: dict | None = None) -> tuple[int, dict, dict[str, str]]:
        """GET path (POST body as JSON when given): status, JSON body, headers; 4xx/5xx too."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.http_port}{path}", data, {"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as reply:
                return reply.status, json.loads(reply.read()), dict(reply.headers)
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read()), dict(e.headers)

    def log_text(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()[-3000:]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)
        self.log.close()


@pytest.fixture(scope="module")
def cluster(loop):
    cluster = loop.run_until_complete(
        LocalCluster(cluster_spec(num_prefill=2, num_decode=1)).start(progress=lambda m: None)
    )
    yield cluster
    loop.run_until_complete(cluster.close())


@pytest.fixture(scope="module")
def routers(cluster, tmp_path_factory) -> Iterator[tuple[RouterProcess, RouterProcess]]:
    logs = tmp_path_factory.mktemp("routers")
    pair = (RouterProcess(logs / "a.log"), RouterProcess(logs / "b.log"))
    try:
        for router in pair:
            router.wait_ready()
        yield pair
    finally:
        for router in pair:
            router.kill()


def ask(router: RouterProcess, document: int) -> tuple[str, int, int]:
    """A long, document-specific prompt: (reply, prompt tokens, cached prompt tokens)."""
    lines = (f"Line {k} of document {document} says the sky is colour {k}." for k in range(12))
    text = " ".join(lines)
    reply = router.client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": f"{text}\nSummarise document {document}."}],
        max_tokens=8,
        temperature=0,
    )
    usage = reply.usage
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return reply.choices[0].message.content or "", usage.prompt_tokens, cached or 0


async def index_loads(cluster) -> dict[str, int]:
    """Queued tokens of each prefill worker as the index holds them (what routers weigh)."""
    workers = await cluster.backend.index.live_workers("prefill")
    return {w.worker_id: w.load.queued_tokens for w in workers}


async def wait_until_index_idle(cluster, timeout_s: float = 30.0) -> None:
    """Until every prefill worker's load in the index is idle again. A worker writes its load
    with its KV events and in heartbeats (about a second apart), so for a moment after a burst
    the index may still show tokens queued on the worker that holds a prefix, and a router
    rightly weighs that against the cache hit."""
    deadline = time.monotonic() + timeout_s
    while True:
        loads = await index_loads(cluster)
        if len(loads) == 2 and not any(loads.values()):
            return
        assert time.monotonic() < deadline, f"prefill load in the index: {loads}"
        await asyncio.sleep(0.1)


def grpc_tokens(router: RouterProcess, request_id: str, prompt: str) -> tuple[set[str], list[int]]:
    """(the request ids its responses carried, its tokens) of one gRPC Generate."""
    request = pb.GenerateRequest(
        request_id=request_id,
        model=MODEL,
        prompt=prompt,
        sampling=pb.SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
    )
    with grpc.insecure_channel(f"127.0.0.1:{router.grpc_port}") as channel:
        responses = list(pb_grpc.KVRelayStub(channel).Generate(request, timeout=120))
    return {r.request_id for r in responses}, [t for r in responses for t in r.token_ids]


def test_one_request_id_through_both_routers_at_once_runs_twice(cluster, loop, routers):
    """Clients choose their ids without knowing of each other. The same id in flight through
    two routers on one decode worker (which refuses an id it already runs) gets two ids inside
    the cluster: both streams are whole and alike, each says the client's id."""
    prompt = "Name the planets of the solar system, one a line."
    with ThreadPoolExecutor(2) as pool:
        both = list(pool.map(lambda r: grpc_tokens(r, "client-7", prompt), routers))
    (ids_a, tokens_a), (ids_b, tokens_b) = both
    assert len(tokens_a) == 24 and tokens_a == tokens_b
    assert ids_a == ids_b == {"client-7"}
    loop.run_until_complete(wait_until_no_leaks(cluster, timeout_s=60))


def test_two_routers_share_the_index_and_survive_each_other(cluster, loop, routers):
    first, second = routers
    # Warm NUM_PREFIXES prompts through the first router at once: its placement spreads them
    # over both prefill workers.
    with ThreadPoolExecutor(NUM_PREFIXES) as pool:
        warmed = list(pool.map(lambda d: ask(first, d), range(NUM_PREFIXES)))
    status: ClusterStatus = loop.run_until_complete(cluster.controller.status.remote())
    served = [w.stats.num_requests for w in status.pool("prefill").workers if w.stats]
    assert len(served) == 2 and all(served), f"both prefill workers got prompts: {served}"
    assert len(status.routers) >= 3  # the two processes and the test's in-process router

    # Through the second router, each prompt finds the worker that holds its prefix.
    loop.run_until_complete(wait_until_index_idle(cluster))
    for document, (reply, num_prompt, _) in enumerate(warmed):
        again, num_prompt_again, cached = ask(second, document)
        assert num_prompt_again == num_prompt
        assert cached >= num_prompt - 16 - (num_prompt % 16), (  # the loads read on failure
            document,
            cached,
            num_prompt,
            loop.run_until_complete(index_loads(cluster)),
        )
        assert again == reply, "greedy output does not depend on the router"

    # Killing the first router mid-stream leaves the second serving, and the decode worker
    # aborts the dead router's request once it stops polling (its blocks are freed).
    stream = first.client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell me a very long story."}],
        max_tokens=2000,  # far longer than the decode worker waits for a silent router
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    texts = (c for c in stream if c.choices and c.choices[0].delta.content)
    for _ in range(3):  # decoded tokens arrive: the request is on the decode worker
        next(texts)
    first.kill()
    reply, _, cached = ask(second, 0)
    assert reply == warmed[0][0] and cached > 0
    health = second.health()
    assert health["ok"], health
    loop.run_until_complete(wait_until_no_leaks(cluster, timeout_s=60))
    decode = next(iter(cluster.decode_actors.values()))
    assert ray.get(decode.stats.remote()).num_orphans_aborted == 1


def test_sigterm_drains_a_router(cluster, loop, routers):
    router = routers[1]
    stream = router.client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell me a very long story."}],
        max_tokens=2000,  # far longer than the drain
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = iter(stream)
    while not (chunk := next(chunks)).choices or not chunk.choices[0].delta.content:
        pass  # until decoded tokens arrive
    router.proc.send_signal(signal.SIGTERM)

    deadline = time.monotonic() + 30  # a bound on the poll only
    while (ready := router.call("/ready"))[0] != 503:
        assert time.monotonic() < deadline, ready
        time.sleep(0.05)
    assert ready[1]["reason"] == "the server is shutting down", ready
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    status, body, headers = router.call("/v1/chat/completions", chat)
    assert status == 503 and body["error"]["code"] == "shutting_down", body
    assert "Retry-After" not in headers

    rest = list(chunks)
    assert rest[-1].choices[0].finish_reason == "abort", rest[-3:]
    assert router.proc.wait(DRAIN_S + 60) == 0
    log = Path(router.log.name).read_text()
    assert "kvrelay: shutting down: new requests get 503; 1 open request(s)" in log, log
    assert "kvrelay: ended 1 open request(s) with finish_reason abort" in log, log
    assert "kvrelay: router stopped" in log, log
    loop.run_until_complete(wait_until_no_leaks(cluster, timeout_s=60))
