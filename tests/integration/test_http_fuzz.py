"""Fuzzing the HTTP API from the OpenAPI document the server publishes (/openapi.json), with
schemathesis's generators driven by hypothesis: bodies that fit the schema and bodies that break
it, sent to the router's real servers over a real engine. Every answer must be no 5xx and no hang
(a bounded timeout a request), every refusal a 4xx in OpenAI's error shape whose message names
the field (`param`), every stream free of internal errors; afterwards the server still serves.

The engine runs a tiny random Llama with SmolLM2's tokenizer and chat template (tests/factories.py):
the router and engine code paths are the same as with SmolLM2's weights, its random output
exercises the detokenizer on any token, and its steps are ~10x faster, so several hundred
requests fit the budget. Examples are derandomized: each run sends the same inputs."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import Case, GenerationMode

from engine.models.loader import resolve_model
from tests.conftest import build_engine
from tests.factories import make_tiny_checkpoint
from tests.server_harness import ServerHarness, serving

MAX_MODEL_LEN = 64  # bounds every generation the fuzz asks for
MAX_EXAMPLES = 300  # per generation mode
TIMEOUT_S = 30.0  # a request that takes longer counts as a hang
POSTS = ("/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize")
# Refusals about the body as a whole name no field.
WHOLE_BODY_CODES = frozenset({"invalid_json", "request_too_large", "invalid_body"})
TRIED: Counter[str] = Counter()  # requests sent, by mode and status (the report below)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama beside SmolLM2's tokenizer, vocabulary and chat template."""
    smollm = Path(resolve_model("default"))
    folder = tmp_path_factory.mktemp("fuzz-model")
    make_tiny_checkpoint(folder, vocab_size=49152, max_position_embeddings=MAX_MODEL_LEN)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(smollm / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def harness(checkpoint: Path) -> Iterator[ServerHarness]:
    engine = build_engine(None, str(checkpoint), num_blocks=128, max_model_len=MAX_MODEL_LEN)
    with serving(engine, checkpoint) as h:
        yield h


@pytest.fixture(scope="module")
def api(harness: ServerHarness) -> schemathesis.BaseSchema:
    document = requests.get(harness.base_url + "/openapi.json", timeout=TIMEOUT_S).json()
    return schemathesis.openapi.from_dict(document)


def _cases(api: schemathesis.BaseSchema, mode: GenerationMode) -> st.SearchStrategy[Case]:
    return st.one_of([api[path]["POST"].as_strategy(generation_mode=mode) for path in POSTS])


def check_answer(case: Case, response: requests.Response) -> None:
    """No 5xx; a 4xx names the field; a 200 holds no error (nor does any event of a stream)."""
    sent = f"{case.method} {case.path} {case.body!r:.300}"
    assert response.status_code < 500, f"{response.status_code} for {sent}: {response.text:.500}"
    if response.status_code >= 400:
        error = response.json()["error"]
        message, param = error["message"], error["param"]
        assert isinstance(message, str) and message and error["type"], (sent, error)
        if response.status_code == 400 and error["code"] not in WHOLE_BODY_CODES:
            assert param and param in message, f"the refusal names no field: {error} ({sent})"
        return
    if response.headers["Content-Type"].startswith("text/event-stream"):
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", (sent, response.text[-300:])
        for event in events[:-1]:
            assert "error" not in json.loads(event), (sent, event)
    else:
        assert "error" not in response.json(), (sent, response.text[:500])


def _fuzz(harness: ServerHarness, case: Case, served_model: bool, mode: str) -> None:
    if served_model and isinstance(case.body, dict) and case.path.startswith("/v1/"):
        case.body["model"] = harness.engine.model_id  # reach past the model check
    request = case.as_transport_kwargs(base_url=harness.base_url)
    response = requests.request(**request, timeout=TIMEOUT_S)  # read whole, streams included
    TRIED[f"{mode} {response.status_code}"] += 1
    check_answer(case, response)


FUZZ = settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    derandomize=True,  # the same inputs on every run
    database=None,  # nothing written into the checkout
    suppress_health_check=list(HealthCheck),
)


def test_fuzz_bodies_that_fit_the_schema(harness: ServerHarness, api) -> None:
    @FUZZ
    @given(case=_cases(api, GenerationMode.POSITIVE), served_model=st.booleans())
    def run(case: Case, served_model: bool) -> None:
        _fuzz(harness, case, served_model, "positive")

    run()
    harness.assert_no_leaks()


def test_fuzz_bodies_that_break_the_schema(harness: ServerHarness, api) -> None:
    @FUZZ
    @given(case=_cases(api, GenerationMode.NEGATIVE), served_model=st.booleans())
    def run(case: Case, served_model: bool) -> None:
        _fuzz(harness, case, served_model, "negative")

    run()
    harness.assert_no_leaks()


# JSON cut short, bytes that are not UTF-8, deep nesting, bare values: never JSON bodies at all.
_RAW = st.one_of(
    st.binary(max_size=200),
    st.text(max_size=200).map(str.encode),
    st.integers(1, 5000).map(lambda depth: b"[" * depth + b"]" * depth),
    st.sampled_from([b"", b"{", b'{"model": "m", "messages": [', b"null", b"\xff\xfe{}"]),
)


def test_fuzz_bodies_that_are_not_json(harness: ServerHarness) -> None:
    @settings(FUZZ, max_examples=MAX_EXAMPLES // 2)
    @given(path=st.sampled_from(POSTS), body=_RAW)
    def run(path: str, body: bytes) -> None:
        headers = {"Content-Type": "application/json"}
        url = harness.base_url + path
        response = requests.post(url, data=body, headers=headers, timeout=TIMEOUT_S)
        TRIED[f"raw {response.status_code}"] += 1
        assert response.status_code == 400, (path, body[:100], response.text[:300])
        error = response.json()["error"]
        assert error["code"] in WHOLE_BODY_CODES or error["param"] in error["message"], error

    run()


def test_the_server_still_serves_after_the_fuzz(harness: ServerHarness) -> None:
    body = {"model": harness.engine.model_id, "prompt": "Hi", "max_tokens": 4}
    reply = requests.post(harness.base_url + "/v1/completions", json=body, timeout=TIMEOUT_S)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4
    assert requests.get(harness.base_url + "/health", timeout=TIMEOUT_S).status_code == 200
    harness.assert_no_leaks()
    print(
        f"\nfuzz: {sum(TRIED.values())} requests; by mode and status: {dict(sorted(TRIED.items()))}"
    )
