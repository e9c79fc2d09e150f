"""Per-key limits on two routers (two HTTP + gRPC servers over real SmolLM2 engines) sharing one
real redis-server, on a clock the test moves (no timing in any assertion): 429 + Retry-After and
RESOURCE_EXHAUSTED + retry-after exactly past the configured rate and none at it, a stream slot
given back when its client cancels, the per-tenant counters in /metrics and in Redis (what
`kvrelay status --keys` reads)."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
import redis

from deploy.ops_cli import format_key_usage, key_usage
from router.access import ApiKeys
from router.pb import kvrelay_pb2 as pb
from router.pb import kvrelay_pb2_grpc as pb_grpc
from router.rate_limit_schema import TenantKeys
from router.rate_limits import RateLimiter
from tests.conftest import build_engine
from tests.manual_clock import ManualClock
from tests.redis_server import RedisServer
from tests.server_harness import ServerHarness

KEY_BURST = "sk-burst-0123456789abcdef01"
KEY_CALM = "sk-calm-0123456789abcdef012"
KEY_ONE = "sk-one-stream-0123456789abcd"
KEYS_FILE = f"""{KEY_BURST} burst rps=3
{KEY_CALM} calm rps=3
{KEY_ONE} one streams=1
"""
RATE = 3  # burst's and calm's requests per second
T0 = 1_800_000_000.0


class Routers:
    """Two ServerHarness (each a router with its own engine) over one Redis and one clock."""

    def __init__(self, smollm_model, smollm_dir, keys: ApiKeys, redis_url: str):
        self.clock = ManualClock(T0)
        self.redis_url = redis_url
        self.routers: list[ServerHarness] = []
        for _ in range(2):
            limiter = RateLimiter(redis_url, keys.limits_by_tenant, clock=self.clock)
            engine = build_engine(smollm_model, num_blocks=32, max_model_len=128)
            self.routers.append(
                ServerHarness(engine, smollm_dir, held=True, api_keys=keys, limiter=limiter)
            )


@pytest.fixture(scope="module")
def routers(smollm_model, smollm_dir, tmp_path_factory) -> Iterator[Routers]:
    path = tmp_path_factory.mktemp("keys") / "api-keys"
    path.write_text(KEYS_FILE)
    path.chmod(0o600)
    with RedisServer() as server:
        pair = Routers(smollm_model, smollm_dir, ApiKeys.load(path), server.url)
        try:
            yield pair
        finally:
            for router in pair.routers:
                router.stop()
                router.engine.assert_no_leaks()


def complete(
    router: ServerHarness, key: str, stream: bool = False
) -> tuple[int, dict[str, str], dict]:
    body = {"model": router.engine.model_id, "prompt": "Hi", "max_tokens": 1, "stream": stream}
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
    request = urllib.request.Request(
        router.base_url + "/v1/completions", json.dumps(body).encode(), headers
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            raw = response.read()
            return response.status, dict(response.headers), {} if stream else json.loads(raw)
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def grpc_request() -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt="Hi", sampling=pb.SamplingParams(max_tokens=1))


def metric(router: ServerHarness, name: str, **labels: str) -> float:
    text = router.metrics.render().decode()
    inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    found = re.search(rf"^{name}{{{inner}}} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def test_429_past_the_rate_across_two_routers_and_none_at_it(routers: Routers) -> None:
    a, b = routers.routers
    statuses: dict[str, list[int]] = {"burst": [], "calm": []}
    for _ in range(2):  # two seconds of the test clock
        for i in range(RATE + 2):  # burst sends 2 a second more than its rate, both routers
            status, headers, reply = complete((a, b)[i % 2], KEY_BURST)
            statuses["burst"].append(status)
            if status == 429:
                assert headers["Retry-After"] == "1"
                error = reply["error"]
                assert error["code"] == "rate_limit_exceeded" and error["param"] == "rps"
                assert "'burst' on requests per second (rps): limit 3" in error["message"]
        for i in range(RATE):  # calm sends at its rate: never refused
            statuses["calm"].append(complete((a, b)[i % 2], KEY_CALM)[0])
        routers.clock.now += 1
    assert statuses["burst"] == ([200] * RATE + [429] * 2) * 2
    assert statuses["calm"] == [200] * RATE * 2
    refused = [
        metric(r, "kvrelay_tenant_refused_requests_total", limit="rps", tenant="burst")
        for r in (a, b)
    ]
    assert sum(refused) == 4 and min(refused) >= 1  # each router counts its own refusals
    served = sum(metric(r, "kvrelay_tenant_requests_total", tenant="calm") for r in (a, b))
    assert served == RATE * 2
    generated = sum(
        metric(r, "kvrelay_tenant_tokens_total", kind="completion", tenant="calm") for r in (a, b)
    )
    assert generated == RATE * 2  # one token each


def test_grpc_is_resource_exhausted_with_retry_after(routers: Routers) -> None:
    a, b = routers.routers
    metadata = (("authorization", f"Bearer {KEY_BURST}"),)
    routers.clock.now += 10  # a full bucket
    with grpc.insecure_channel(b.grpc_target) as channel:
        stub = pb_grpc.KVRelayStub(channel)
        for _ in range(RATE):
            assert list(stub.Generate(grpc_request(), metadata=metadata, timeout=60))
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(grpc_request(), metadata=metadata, timeout=60))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "'burst' on requests per second (rps): limit 3; retry in 1 s" in info.value.details()
    trailing = dict(info.value.trailing_metadata())
    assert trailing["retry-after"] == "1" and trailing["grpc-retry-pushback-ms"] == "1000"
    assert complete(a, KEY_BURST)[0] == 429  # the other router agrees: one shared bucket
    status, headers, reply = complete(a, KEY_BURST, stream=True)  # refused before any event
    assert status == 429 and headers["Retry-After"] == "1" and reply["error"]["param"] == "rps"


def test_a_cancelled_stream_gives_its_slot_back(routers: Routers) -> None:
    a, b = routers.routers
    assert a.held is not None
    streams = TenantKeys.of("one").streams
    store = redis.Redis.from_url(routers.redis_url, decode_responses=True)
    calls_before = a.held.num_calls
    a.run(a.held.hold())
    with grpc.insecure_channel(a.grpc_target) as channel:
        stub = pb_grpc.KVRelayStub(channel)
        metadata = (("x-api-key", KEY_ONE),)
        held = stub.Generate(grpc_request(), metadata=metadata, timeout=120)
        a.held.wait_until(lambda h: h.num_calls == calls_before + 1 and h.num_held == 1)
        status, headers, reply = complete(b, KEY_ONE)  # the other router: one stream at a time
        assert status == 429 and reply["error"]["param"] == "streams"
        assert headers["Retry-After"] == "1"
        held.cancel()
        a.held.wait_until(lambda h: h.num_held == 0)
        a.run(a.frontend.admission.drained())  # the request's cleanup, its release included
        assert store.zcard(streams) == 0
        a.run(a.held.release())
    assert complete(b, KEY_ONE)[0] == 200
    assert store.zcard(streams) == 0
    a.assert_no_leaks()
    b.assert_no_leaks()
    rows = {row.tenant: row for row in key_usage(routers.redis_url)}  # `status --keys`' read
    assert rows["one"].counts["requests"] == 2 and rows["one"].counts["refused_streams"] == 1
    assert rows["one"].limits == "streams=1" and rows["one"].num_streams == 0
    assert rows["calm"].counts["requests"] == RATE * 2 and rows["calm"].counts["refused_rps"] == 0
    assert rows["burst"].counts["refused_rps"] >= 5
    assert "one" in format_key_usage(list(rows.values()))
