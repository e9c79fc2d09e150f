"""TLS, standard gRPC health checking, reflection and /ready on real servers over a real SmolLM2
engine: the openai client over HTTPS (verify=the test CA), a gRPC secure channel, the
grpc.health.v1 stub (Check and Watch) following the backend's readiness, and reflection listing
the services.
"""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from router.pb import kvrelay_pb2 as pb
from router.pb import kvrelay_pb2_grpc as pb_grpc
from router.tls import ServerTLS
from tests.conftest import build_engine
from tests.held_backend import HeldBackend
from tests.server_harness import ServerHarness, serving
from tests.tls_certs import TLSToolsMissing, make_server_certs

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
NO_DECODE = {"ok": False, "prefill_workers": 1, "decode_workers": 0}
CHAT = [{"role": "user", "content": "Say hello."}]


class Served:
    def __init__(self, harness: ServerHarness, ca_file: str):
        self.harness = harness
        self.ca_file = ca_file
        self.ca_pem = Path(ca_file).read_bytes()

    @property
    def backend(self) -> HeldBackend:
        assert self.harness.held is not None
        return self.harness.held

    def ssl_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=self.ca_file)

    def channel(self) -> grpc.Channel:
        credentials = grpc.ssl_channel_credentials(root_certificates=self.ca_pem)
        return grpc.secure_channel(self.harness.grpc_target, credentials)

    def get(self, path: str) -> tuple[int, dict]:
        url = self.harness.base_url + path
        try:
            with urllib.request.urlopen(url, timeout=10, context=self.ssl_context()) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def served(smollm_model, smollm_dir, tmp_path_factory) -> Iterator[Served]:
    try:
        certs = make_server_certs(tmp_path_factory.mktemp("tls"))
    except TLSToolsMissing as e:
        pytest.skip(str(e))
    tls = ServerTLS.load(certs.cert_file, certs.key_file)
    engine = build_engine(smollm_model, num_blocks=64, max_model_len=256)
    with serving(engine, smollm_dir, held=True, tls=tls) as harness:
        yield Served(harness, certs.ca_file)


@pytest.fixture(autouse=True)
def no_leaks(served: Served) -> Iterator[None]:
    yield
    served.backend.health_override = None
    served.harness.assert_no_leaks()


# ---- TLS ----------------------------------------------------------------------------------
def test_the_openai_client_over_https_trusting_the_ca(served: Served) -> None:
    assert served.harness.base_url.startswith("https://127.0.0.1:")
    client = openai.OpenAI(
        base_url=f"{served.harness.base_url}/v1",
        api_key="unused",
        max_retries=0,
        http_client=openai.DefaultHttpxClient(verify=served.ssl_context()),
    )
    reply = client.chat.completions.create(
        model=served.harness.engine.model_id, messages=CHAT, max_tokens=3
    )
    assert reply.usage.completion_tokens == 3
    stream = client.completions.create(
        model=served.harness.engine.model_id, prompt="Hi", max_tokens=3, stream=True
    )
    assert list(stream)[-1].choices[0].finish_reason is not None


def test_a_client_that_does_not_trust_the_ca_or_speaks_plain_http_is_refused(
    served: Served,
) -> None:
    untrusting = openai.OpenAI(
        base_url=f"{served.harness.base_url}/v1", api_key="unused", max_retries=0
    )
    with pytest.raises(openai.APIConnectionError):
        untrusting.models.list()
    plain = served.harness.base_url.replace("https://", "http://") + "/health"
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(plain, timeout=10).read()


def test_grpc_over_a_secure_channel(served: Served) -> None:
    request = pb.GenerateRequest(prompt="Hi", sampling=pb.SamplingParams(max_tokens=3))
    with served.channel() as channel:
        responses = list(pb_grpc.KVRelayStub(channel).Generate(request, timeout=60))
    assert sum(len(r.token_ids) for r in responses) == 3
    plain = grpc.insecure_channel(served.harness.grpc_target)
    with plain, pytest.raises(grpc.RpcError) as info:
        pb_grpc.KVRelayStub(plain).Health(pb.HealthRequest(), timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


# ---- readiness ----------------------------------------------------------------------------
def check(channel: grpc.Channel, service: str) -> int:
    request = health_pb2.HealthCheckRequest(service=service)
    return health_pb2_grpc.HealthStub(channel).Check(request, timeout=10).status


def test_grpc_health_follows_the_backends_readiness(served: Served) -> None:
    with served.channel() as channel:
        assert check(channel, "") == SERVING
        assert check(channel, "kvrelay.v1.KVRelay") == SERVING
        with pytest.raises(grpc.RpcError) as info:
            check(channel, "no.such.Service")
        assert info.value.code() == grpc.StatusCode.NOT_FOUND

        served.backend.health_override = NO_DECODE
        assert check(channel, "") == NOT_SERVING
        assert check(channel, "kvrelay.v1.KVRelay") == NOT_SERVING
        served.backend.health_override = None
        assert check(channel, "kvrelay.v1.KVRelay") == SERVING


def test_grpc_health_watch_sees_a_change_without_a_check(served: Served) -> None:
    request = health_pb2.HealthCheckRequest(service="kvrelay.v1.KVRelay")
    with served.channel() as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(request, timeout=60)
        assert next(watch).status == SERVING
        served.backend.health_override = NO_DECODE  # seen by the servicer's refresh task
        assert next(watch).status == NOT_SERVING
        served.backend.health_override = None
        assert next(watch).status == SERVING
        watch.cancel()


def test_http_ready_is_200_only_when_every_pool_has_a_ready_worker(served: Served) -> None:
    status, body = served.get("/ready")
    assert status == 200 and body["ready"] is True
    served.backend.health_override = NO_DECODE
    status, body = served.get("/ready")
    assert status == 503
    assert body == {
        "ready": False,
        "reason": "no ready worker in the decode pool",
        "prefill_workers": 1,
        "decode_workers": 0,
    }
    served.backend.health_override = {"ok": False, "prefill_workers": 0, "decode_workers": 0}
    assert served.get("/ready")[1]["reason"] == "no ready worker in the prefill and decode pools"
    served.backend.health_override = None
    assert served.get("/ready")[0] == 200


# ---- reflection ---------------------------------------------------------------------------
def test_reflection_lists_the_services_and_describes_kvrelay(served: Served) -> None:
    with served.channel() as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        services = set(database.get_services())
        assert {"kvrelay.v1.KVRelay", "grpc.health.v1.Health"} <= services
        proto = database.FindFileContainingSymbol("kvrelay.v1.KVRelay")
    [service] = [s for s in proto.service if s.name == "KVRelay"]
    assert {m.name for m in service.method} == {
        "Generate", "Health", "ListModels", "Tokenize", "Detokenize",
    }  # fmt: skip
