"""Several models behind one router (router/served_models.py): a request reaches only its own
model's backend, the Frontend picks a model's route (context length, vocabulary, tokenizer)
from the request's `model` and refuses one not served, naming the field; the CLI's model
picking, `--model` repeated and `--served-model-name` on `kvrelay serve`. Fake backends (no
Ray, no worker)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest

from common.messages import GenerateRequest, TokenDelta
from deploy.cli import build_parser
from deploy.local_cluster import controller_names
from deploy.ops_cli import only_model, pick_models
from deploy.serve_flags import spec_from_args
from engine.finish_reason import FinishReason
from engine.sampling.sampling_params import SamplingParams
from router.backend import Backend
from router.errors import InvalidRequest
from router.frontend import Frontend
from router.metrics import RouterMetrics
from router.request_spec import RequestSpec
from router.served_models import ModelsBackend
from router.tokenizer import RouterTokenizer


class Recording(Backend):
    """A backend that answers each request with one token naming itself, and records calls."""

    def __init__(self, model_id: str, token: int, max_model_len: int, ok: bool = True):
        self.model_id, self.token, self.max_model_len, self.ok = model_id, token, max_model_len, ok
        self.vocab_size = 1000
        self.seen: list[GenerateRequest] = []
        self.aborted: list[str] = []
        self.health_details: dict[str, object] = {}

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        self.seen.append(request)
        yield TokenDelta(request.req_id, (self.token,), True, FinishReason.LENGTH)

    async def abort(self, req_id: str) -> None:
        self.aborted.append(req_id)

    async def health(self) -> dict[str, object]:
        return {"ok": self.ok, **self.health_details}


def request(model: str, req_id: str = "r") -> GenerateRequest:
    return GenerateRequest(req_id, (1, 2, 3), SamplingParams(max_tokens=1), model=model)


async def tokens(backend: Backend, req: GenerateRequest) -> list[TokenDelta]:
    return [d async for d in backend.generate(req)]


def serve_spec(*argv: str):
    """`kvrelay serve ARGV`'s cluster spec, as serve reads it."""
    return spec_from_args(build_parser().parse_args(["serve", *argv]))


def test_a_request_reaches_only_its_models_backend() -> None:
    a, b = Recording("a", 7, 64), Recording("b", 9, 128, ok=False)
    both = ModelsBackend({"a": a, "b": b})
    assert (both.model_id, both.max_model_len) == ("a", 64)  # the default answers for the whole
    assert [d.token_ids for d in asyncio.run(tokens(both, request("b")))] == [(9,)]
    assert [d.token_ids for d in asyncio.run(tokens(both, request("")))] == [(7,)]
    assert [r.model for r in a.seen] == [""] and [r.model for r in b.seen] == ["b"]
    stray = asyncio.run(tokens(both, request("c")))
    assert stray[0].finish_reason == FinishReason.ERROR and "'c'" in (stray[0].error or "")
    asyncio.run(both.abort("x"))
    assert a.aborted == ["x"] == b.aborted  # each backend ignores an id it does not know
    health = asyncio.run(both.health())
    assert health == {"ok": False, "reason": "model 'b': cannot serve"}
    a.health_details = {"prefill_workers": 1}
    assert asyncio.run(both.health())["a/prefill_workers"] == 1


def test_the_frontend_routes_by_model_and_refuses_an_unknown_one(smollm_dir) -> None:
    tokenizer = RouterTokenizer(smollm_dir)
    a, b = Recording("a", 7, 64), Recording("b", 9, 128)
    frontend = Frontend(ModelsBackend({"a": a, "b": b}), tokenizer, tokenizers={"b": tokenizer})
    assert frontend.model_ids() == ["a", "b"]
    long_prompt = tuple(range(1, 101))  # fits b's 128-token context, not a's 64

    def spec(model: str | None, prompt: tuple[int, ...] = long_prompt) -> RequestSpec:
        return RequestSpec(model, prompt_token_ids=prompt, sampling=SamplingParams(max_tokens=4))

    prepared = asyncio.run(frontend.prepare(spec("b")))
    assert prepared.request.model == "b"
    with pytest.raises(InvalidRequest, match="context"):  # no model: the default, a
        asyncio.run(frontend.prepare(spec(None)))
    with pytest.raises(InvalidRequest) as unknown:
        asyncio.run(frontend.prepare(spec("c", (1,))))
    assert unknown.value.param == "model" and "'a', 'b'" in unknown.value.message

    async def run() -> list[int]:
        return [t for c in [c async for c in frontend.generate(prepared)] for t in c.token_ids]

    assert asyncio.run(run()) == [9]
    assert [r.req_id for r in b.seen] == [prepared.request.req_id] and not a.seen
    with pytest.raises(ValueError, match="no tokenizer given for model 'b'"):
        Frontend(ModelsBackend({"a": a, "b": b}), tokenizer)


def test_metrics_count_requests_by_model() -> None:
    metrics = RouterMetrics()
    metrics.observe_finished(FinishReason.STOP, 3, 0, 2, 0.1, "b")
    metrics.observe_finished(FinishReason.STOP, 3, 0, 2, 0.1)  # no model: no per-model series
    text = metrics.render().decode()
    assert 'kvrelay_model_requests_total{finish_reason="stop",model="b"} 1.0' in text
    assert 'kvrelay_model_generation_tokens_total{model="b"} 2.0' in text
    assert 'kvrelay_request_latency_seconds_count{model="b"} 1.0' in text
    assert metrics.recent_of("b") is metrics.recent  # one model: the router's own latencies
    metrics.per_model = True
    assert metrics.recent_of("b") is not metrics.recent


def test_the_cli_acts_on_one_model_or_asks_which() -> None:
    found = {"a": "controller-a", "b": "controller-b"}
    assert pick_models(found, None) == found
    assert pick_models(found, "b") == {"b": "controller-b"}
    with pytest.raises(ValueError, match="--model 'c' is not served by this cluster; it serves"):
        pick_models(found, "c")
    with pytest.raises(ValueError, match=r"serves several models \('a', 'b'\): give --model M"):
        only_model(found)
    assert only_model({"a": "controller-a"}) == "controller-a"


def test_serve_takes_the_model_flag_repeated(tmp_path) -> None:
    spec = serve_spec("--model", str(tmp_path / "x"), "--model", "y.gguf", "--decode", "2")
    assert [m.engine.model for m in spec.models] == [str(tmp_path / "x"), "y.gguf"]
    assert [(m.num_prefill, m.num_decode) for m in spec.models] == [(1, 2), (1, 2)]
    assert spec.num_workers == 6
    with pytest.raises(ValueError, match="--model 'y' is given more than once"):
        serve_spec("--model", "y", "--model", "y")
    with pytest.raises(ValueError, match="two models would both be served as 'y'"):
        serve_spec("--model", str(tmp_path / "y"), "--model", "y.gguf")


def test_served_model_name_names_the_model_clients_ask_for(tmp_path) -> None:
    spec = serve_spec(str(tmp_path / "llama-8b"), "--served-model-name", "meta-llama/Llama-3.1-8B")
    assert spec.engine.model == str(tmp_path / "llama-8b")
    assert spec.engine.model_id == "meta-llama/Llama-3.1-8B"
    assert list(controller_names(spec)) == ["meta-llama/Llama-3.1-8B"]
    assert serve_spec(str(tmp_path / "llama-8b")).engine.model_id == "llama-8b"  # its folder's name
    assert serve_spec("x.gguf", "--served-model-name", "n" * 255).engine.model_id == "n" * 255
    for bad in ("a b", "", "x{y}", "m*", "org/m#v2", "org/m-\ud83d", "n" * 256):
        with pytest.raises(ValueError, match=r"--served-model-name .*: wants non-empty UTF-8"):
            serve_spec("x.gguf", "--served-model-name", bad)
    with pytest.raises(ValueError, match="--served-model-name names one model"):
        serve_spec("--model", "x.gguf", "--model", "y.gguf", "--served-model-name", "z")
    path = tmp_path / "models.yaml"  # with several, each names its own in its flags
    path.write_text(
        "models:\n  - {model: a.gguf, flags: {served-model-name: org/a}}\n  - {model: b.gguf}\n"
    )
    assert [m.engine.model_id for m in serve_spec("--models-file", str(path)).models] == [
        "org/a",
        "b",
    ]
    with pytest.raises(ValueError, match=r"--served-model-name names one model: .* in "):
        serve_spec("--models-file", str(path), "--served-model-name", "z")  # not both entries' name
    path.write_text("models: [{model: a.gguf, flags: {served-model-name: b}}, {model: b.gguf}]")
    with pytest.raises(ValueError, match="two models would both be served as 'b': name one"):
        serve_spec("--models-file", str(path))
    path.write_text("models: [{model: a.gguf, flags: {served-model-name: '-x'}}]")
    assert serve_spec("--models-file", str(path)).engine.model_id == "-x"  # a value, not a flag
    assert (
        serve_spec("--models-file", str(path), "--served-model-name", "z").engine.model_id == "-x"
    )
    # JSON as json.dumps writes it: a character past U+FFFF escaped as a surrogate pair
    path.write_text(
        json.dumps(
            {"models": [{"model": "a.gguf", "flags": {"served-model-name": "org/m-\U0001f600"}}]}
        )
    )
    assert "\\ud83d\\ude00" in path.read_text()
    assert serve_spec("--models-file", str(path)).engine.model_id == "org/m-\U0001f600"


def test_a_models_file_gives_each_model_its_pools_and_engine_flags(tmp_path) -> None:
    path = tmp_path / "models.yaml"
    path.write_text(
        "models:\n"
        "  - model: a.gguf\n"
        "    decode: 2\n"
        "    flags: {max-model-len: 512, kv_cache_gib: 0.5}\n"
        "  - {model: b.gguf, prefill: 3}\n"
    )
    spec = serve_spec("--models-file", str(path), "--max-model-len", "1024", "--decode", "1")
    a, b = spec.models
    assert (a.engine.model, a.num_prefill, a.num_decode) == ("a.gguf", 1, 2)
    assert a.engine.scheduler.max_model_len == 512
    assert a.engine.cache.kv_cache_memory_bytes == 1 << 29
    assert (b.engine.model, b.num_prefill, b.num_decode) == ("b.gguf", 3, 1)
    assert b.engine.scheduler.max_model_len == 1024 and b.engine.cache.kv_cache_memory_bytes is None
    path.write_text('{"models": [{"model": "json.gguf"}]}')  # JSON is YAML too
    assert serve_spec("--models-file", str(path)).engine.model == "json.gguf"
    for text, error in (
        ("models: []", "wants `models:`, a list"),
        ("models: [{model: a.gguf, decode: 0}]", r"models\[0\].decode: wants a whole number"),
        ("models: [{model: a.gguf, prefill: 5000}]", r"prefill: wants .* in \[1, 1024\]"),
        ("models: [{model: a.gguf, tp: 2}]", r"models\[0\]: unknown field 'tp'"),
        ("models: [{model: a.gguf, flags: {tp: 2}}]", "'--tp' is not an engine flag"),
        ("models: [{model: a.gguf, flags: {block-size: x}}]", "block-size"),
    ):
        path.write_text(text)
        with pytest.raises(ValueError, match=error):
            serve_spec("--models-file", str(path))
    with pytest.raises(ValueError, match="either as MODEL / --model or in --models-file"):
        serve_spec("--models-file", str(path), "--model", "a.gguf")
    path.write_text("models: [{model: a.gguf}, {model: b.gguf, prefill: 0}]")
    aggregated = serve_spec("--models-file", str(path), "--prefill", "0")  # every model's
    assert [m.num_prefill for m in aggregated.models] == [0, 0]
    with pytest.raises(ValueError, match=r"models\[1\].prefill: .*--prefill 0 for every model"):
        serve_spec("--models-file", str(path))
    path.write_text("models: [{model: a.gguf, prefill: 2}]")
    with pytest.raises(ValueError, match=r"models\[0\].prefill: --prefill 0 .* every model's"):
        serve_spec("--models-file", str(path), "--prefill", "0")


def test_a_models_file_gives_each_model_its_autoscale_bounds(tmp_path) -> None:
    """An entry's `autoscale` bounds its pools; a role it leaves out takes the command line's
    --autoscale-*; a model with none keeps its sizes (each controller autoscales its own)."""

    path = tmp_path / "models.yaml"
    path.write_text(
        "models:\n"
        "  - {model: a.gguf, decode: 2, autoscale: {decode: '1:4'}}\n"
        "  - {model: b.gguf}\n"
        "  - {model: c.gguf, autoscale: {prefill: '1:2', decode: null}}\n"
    )
    a, b, c = serve_spec("--models-file", str(path)).models
    assert a.autoscale is not None and a.autoscale.autoscaled == ("decode",)
    assert (a.autoscale.min_size, a.autoscale.max_size) == (
        {"prefill": 1, "decode": 1},
        {"prefill": 1, "decode": 4},
    )
    assert b.autoscale is None
    assert c.autoscale is not None and c.autoscale.autoscaled == ("prefill",)
    a, b, c = serve_spec("--models-file", str(path), "--autoscale-decode", "1:3").models
    assert a.autoscale is not None and a.autoscale.max_size["decode"] == 4  # its own
    assert b.autoscale is not None and b.autoscale.max_size["decode"] == 3  # the command line's
    assert c.autoscale is not None and c.autoscale.autoscaled == ("prefill",)  # decode: none
    for text, error in (
        ("models: [{model: a.gguf, autoscale: {decode: '4:1'}}]", r"models\[0\].autoscale: "),
        ("models: [{model: a.gguf, decode: 5, autoscale: {decode: '1:4'}}]", "outside"),
        ("models: [{model: a.gguf, autoscale: {tp: '1:2'}}]", "prefill and/or decode"),
        ("models: [{model: a.gguf, autoscale: '1:2'}]", "prefill and/or decode"),
        ("models: [{model: a.gguf, autoscale: {decode: 1:4}}]", r"autoscale.decode: .* in quotes"),
    ):
        path.write_text(text)
        with pytest.raises(ValueError, match=error):
            serve_spec("--models-file", str(path))
