"""API keys on real servers over a real SmolLM2 engine: the openai client with api_key, bearer
and x-api-key on HTTP and gRPC, 401 / UNAUTHENTICATED for a missing or wrong key, open probes,
keys never logged, and tenants kept apart in the prefix cache whatever cache_salt they send.
"""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from collections.abc import Iterator

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from router.access import ApiKeys, tenant_cache_salt
from router.pb import kvrelay_pb2 as pb
from router.pb import kvrelay_pb2_grpc as pb_grpc
from tests.conftest import build_engine
from tests.server_harness import ServerHarness, serving

KEY_A1 = "sk-team-a-0123456789abcdef0123"
KEY_A2 = "sk-team-a-fedcba9876543210fedc"  # a second key of the same tenant (rotation)
KEY_B = "sk-team-b-00112233445566778899"
WRONG = "sk-nobody-99999999999999999999"
KEYS_FILE = f"""# kvrelay API keys: KEY TENANT
{KEY_A1}  team-a
{KEY_A2}  team-a

{KEY_B}\tteam-b
"""
MAX_TOKENS = 2
CHAT = [{"role": "user", "content": "Say hello."}]
# Two full blocks of 16 tokens at least, so a repeat can hit the prefix cache.
SHARED_PROMPT = "In a quiet village by the sea, the old lighthouse keeper counted ships " * 2


@pytest.fixture(scope="module")
def harness(smollm_model, smollm_dir, tmp_path_factory) -> Iterator[ServerHarness]:
    path = tmp_path_factory.mktemp("keys") / "api-keys"
    path.write_text(KEYS_FILE)
    path.chmod(0o600)
    engine = build_engine(smollm_model, num_blocks=64, max_model_len=256)
    with serving(engine, smollm_dir, held=True, api_keys=ApiKeys.load(path)) as harness:
        yield harness


@pytest.fixture(autouse=True)
def no_leaks(harness: ServerHarness) -> Iterator[None]:
    yield
    harness.assert_no_leaks()


def client(harness: ServerHarness, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{harness.base_url}/v1", api_key=key, max_retries=0)


def http(
    harness: ServerHarness, path: str, body: dict | None = None, headers: dict | None = None
) -> tuple[int, dict[str, str], dict]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        harness.base_url + path, data, {"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            raw = response.read()
            status, response_headers = response.status, dict(response.headers)
    except urllib.error.HTTPError as e:
        raw, status, response_headers = e.read(), e.code, dict(e.headers)
    try:
        return status, response_headers, json.loads(raw)
    except json.JSONDecodeError:
        return status, response_headers, {"text": raw.decode()}


def cached_tokens(harness: ServerHarness, key: str, cache_salt: str | None = None) -> int:
    extra = {} if cache_salt is None else {"cache_salt": cache_salt}
    reply = client(harness, key).completions.create(
        model=harness.engine.model_id,
        prompt=SHARED_PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body=extra,
    )
    return reply.usage.prompt_tokens_details.cached_tokens


def last_salt(harness: ServerHarness) -> str | None:
    assert harness.held is not None
    return harness.held.requests[-1].cache_salt


# ---- HTTP ---------------------------------------------------------------------------------
def test_the_openai_client_works_with_its_api_key(harness: ServerHarness) -> None:
    for key in (KEY_A1, KEY_B):
        reply = client(harness, key).chat.completions.create(
            model=harness.engine.model_id, messages=CHAT, max_tokens=MAX_TOKENS
        )
        assert reply.usage.completion_tokens == MAX_TOKENS
    assert [m.id for m in client(harness, KEY_A2).models.list()] == [harness.engine.model_id]


def test_a_missing_or_wrong_key_is_401_in_openais_error_shape(harness: ServerHarness) -> None:
    body = {"model": harness.engine.model_id, "messages": CHAT, "max_tokens": 1}
    assert harness.held is not None
    calls = harness.held.num_calls
    for headers, message in [
        ({}, "missing API key"),
        ({"Authorization": f"Bearer {WRONG}"}, "invalid API key"),
        ({"Authorization": f"Basic {KEY_A1}"}, "is not `Bearer KEY`"),  # only Bearer carries it
        ({"Authorization": KEY_A1}, "is not `Bearer KEY`"),
        ({"x-api-key": WRONG}, "invalid API key"),
    ]:
        status, response_headers, reply = http(harness, "/v1/chat/completions", body, headers)
        assert status == 401, (headers, reply)
        assert response_headers["WWW-Authenticate"].startswith("Bearer")
        error = reply["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key"
        assert message in error["message"] and WRONG not in error["message"]
        assert KEY_A1 not in error["message"]
    status, _, _ = http(harness, "/v1/models")
    assert status == 401
    with pytest.raises(openai.AuthenticationError) as info:
        client(harness, WRONG).chat.completions.create(model=harness.engine.model_id, messages=CHAT)
    assert info.value.status_code == 401
    assert harness.held.num_calls == calls  # no refused request reached the backend


def test_x_api_key_header_is_accepted(harness: ServerHarness) -> None:
    body = {"model": harness.engine.model_id, "prompt": "Hi", "max_tokens": 1}
    status, _, reply = http(harness, "/v1/completions", body, {"x-api-key": KEY_B})
    assert status == 200, reply
    assert last_salt(harness) == tenant_cache_salt("team-b", None)


def test_health_ready_and_metrics_stay_open(harness: ServerHarness) -> None:
    for path in ("/health", "/ready"):
        status, _, reply = http(harness, path)
        assert status == 200, (path, reply)
    status, _, reply = http(harness, "/metrics")
    assert status == 200 and "kvrelay_unauthenticated_requests_total" in reply["text"]


# ---- gRPC ---------------------------------------------------------------------------------
def grpc_generate(
    harness: ServerHarness, metadata: tuple[tuple[str, str], ...], salt: str | None = None
) -> list[pb.GenerateResponse]:
    request = pb.GenerateRequest(prompt="Hi", sampling=pb.SamplingParams(max_tokens=1))
    if salt is not None:
        request.cache_salt = salt
    with grpc.insecure_channel(harness.grpc_target) as channel:
        return list(pb_grpc.KVRelayStub(channel).Generate(request, metadata=metadata, timeout=60))


def test_grpc_takes_the_key_as_bearer_or_x_api_key_metadata(harness: ServerHarness) -> None:
    assert grpc_generate(harness, (("authorization", f"Bearer {KEY_A1}"),))[-1].HasField("usage")
    assert last_salt(harness) == tenant_cache_salt("team-a", None)
    grpc_generate(harness, (("x-api-key", KEY_B),), salt="my-salt")
    assert last_salt(harness) == tenant_cache_salt("team-b", "my-salt")
    with grpc.insecure_channel(harness.grpc_target) as channel:
        stub = pb_grpc.KVRelayStub(channel)
        models = stub.ListModels(pb.ListModelsRequest(), metadata=(("x-api-key", KEY_A2),))
        assert [m.id for m in models.models] == [harness.engine.model_id]
        with pytest.raises(grpc.RpcError) as info:
            stub.ListModels(pb.ListModelsRequest(), timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # Health probes need no key.
        assert stub.Health(pb.HealthRequest(), timeout=10).ok
        check = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
        assert check.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize(
    "metadata",
    [(), (("authorization", f"Bearer {WRONG}"),), (("x-api-key", WRONG),)],
    ids=["missing", "wrong-bearer", "wrong-x-api-key"],
)
def test_grpc_without_a_valid_key_is_unauthenticated(
    harness: ServerHarness, metadata: tuple[tuple[str, str], ...]
) -> None:
    with pytest.raises(grpc.RpcError) as info:
        grpc_generate(harness, metadata)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "API key" in info.value.details() and WRONG not in info.value.details()


def test_keys_are_never_logged(harness: ServerHarness, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG):
        cached_tokens(harness, KEY_A1)
        with pytest.raises(openai.AuthenticationError):
            cached_tokens(harness, WRONG)
        with pytest.raises(grpc.RpcError):
            grpc_generate(harness, (("authorization", f"Bearer {WRONG}"),))
    assert "refused a request" in caplog.text  # the refusals were logged, without the keys
    for key in (KEY_A1, WRONG):
        assert key not in caplog.text


# ---- tenants ------------------------------------------------------------------------------
def test_tenants_do_not_share_the_prefix_cache_whatever_salt_they_send(
    harness: ServerHarness,
) -> None:
    cached_tokens(harness, KEY_A1)  # warms team-a's prefix (a hit if an earlier test warmed it)
    assert cached_tokens(harness, KEY_A1) >= 16
    assert cached_tokens(harness, KEY_A2) >= 16  # the same tenant, another key: shared
    a_salt = last_salt(harness)
    assert a_salt == tenant_cache_salt("team-a", None)
    # team-b, with no salt, team-a's name, or team-a's derived salt: never team-a's blocks.
    for salt in (None, "team-a", a_salt):
        assert cached_tokens(harness, KEY_B, cache_salt=salt) == 0, salt
        assert last_salt(harness) != a_salt
    assert cached_tokens(harness, KEY_B) >= 16  # team-b's own prefix, warmed just above
    # A client salt splits a tenant's cache too, as without keys.
    assert cached_tokens(harness, KEY_A1, cache_salt="private") == 0
