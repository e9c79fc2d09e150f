"""FlashInfer backend and CUDA-graph decode against the torch reference, on a tiny random Llama.

Logits are compared on one token trajectory (the reference's greedy tokens are forced into the
other engine), so every step has identical inputs. Free-running greedy tokens must match up to
the first near-tie: a divergence is accepted only where the reference's top-2 margin is within
the bf16 tolerance, and it is reported.
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.attention import flashinfer_backend
from engine.engine import Engine
from engine.sampling.sampler import PendingSample
from engine.sampling.sampling_params import SamplingParams
from tests.conftest import build_engine
from tests.factories import make_tiny_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

NUM_NEW_TOKENS = 24


def decode_on_fa2(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode rows on FlashInfer's fa2 kernel whatever the cache and GPU (the engine picks XQA
    for an fp8 cache on Hopper: xqa_decode.use_xqa), to compare the two."""
    monkeypatch.setattr(flashinfer_backend, "use_xqa", lambda *args: False)


def ragged_prompts(monkeypatch: pytest.MonkeyPatch, on: bool) -> None:
    """Whole prompts on the ragged wrapper (fa3 on Hopper, else fa2) whatever the cache, or
    through the paged cache (the engine's choice: ragged_backend), to compare the two."""

    def backend(capability: tuple[int, int], kv_dtype: torch.dtype, head_dim: int) -> str | None:
        return ("fa3" if capability == flashinfer_backend.HOPPER else "fa2") if on else None

    monkeypatch.setattr(flashinfer_backend, "ragged_backend", backend)


# small, with the 8B's head_dim and GQA
GPU_SHAPE = dict(
    hidden_size=256,
    intermediate_size=512,
    head_dim=128,
    max_position_embeddings=2048,
    init_std=0.1,
    dtype=torch.bfloat16,
)


def gpu_checkpoint(tmp_path_factory: pytest.TempPathFactory, name: str, **fields: Any) -> Path:
    """A tiny random checkpoint of GPU_SHAPE (fields override or add) in a fresh folder name;
    skips the test where flashinfer is not installed."""
    pytest.importorskip("flashinfer")
    return make_tiny_checkpoint(tmp_path_factory.mktemp(name), **{**GPU_SHAPE, **fields})


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return gpu_checkpoint(tmp_path_factory, "tiny-llama", rms_norm_eps=1e-5)


def build(
    folder: Path,
    dtype: str,
    backend: str,
    cuda_graph: bool = False,
    kv_cache_dtype: str = "auto",
    async_scheduling: bool = False,  # the Recorder reads each step's logits as it is launched
) -> Engine:
    return build_engine(
        model_path=str(folder),
        device="cuda",
        dtype=dtype,
        attention_backend=backend,
        cuda_graph=cuda_graph,
        async_scheduling=async_scheduling,
        num_blocks=128,
        kv_cache_dtype=kv_cache_dtype,
        max_num_batched_tokens=64,
        max_num_seqs=8,
    )


def build_serving(folder: Path, **overrides: Any) -> Engine:
    """An engine on the serving paths' defaults (FlashInfer, CUDA graphs, overlapped steps) with
    room for a few dozen requests of a few hundred tokens."""
    shape = {"num_blocks": 256, "max_num_batched_tokens": 256, "max_num_seqs": 16}
    return build_engine(
        model_path=str(folder), device="cuda", dtype="bfloat16", **{**shape, **overrides}
    )


class Recorder:
    """Records each request's logits rows; with `forced`, samples those tokens instead."""

    def __init__(self, engine: Engine, forced: dict[str, list[int]] | None = None):
        self.logits: dict[str, list[torch.Tensor]] = defaultdict(list)
        self.forced = forced
        self._req_ids: list[str] = []
        execute, sample = engine.runner.execute, engine.sampler.sample

        def recording_execute(output, fill=None):
            step = execute(output, fill)
            self._req_ids = [output.chunks[i].req.req_id for i in step.chunk_index]
            for req_id, row in zip(self._req_ids, step.logits, strict=True):
                self.logits[req_id].append(row.float().cpu())
            return step

        def forcing_sample(logits, rows, bitmask=None):
            if self.forced is None:
                return sample(logits, rows, bitmask)
            tokens = [self.forced[r][len(self.logits[r]) - 1] for r in self._req_ids]
            return PendingSample(torch.tensor(tokens, device=logits.device), None)

        engine.runner.execute = recording_execute
        engine.sampler.sample = forcing_sample


def logit_scale(rec: Recorder) -> float:
    """The largest |logit| a Recorder saw: the yardstick of logit errors."""
    return max(float(row.abs().max()) for rows in rec.logits.values() for row in rows)


def run_workload(engine: Engine) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Chunked prefills next to decodes, and a prompt whose first two blocks are cached."""
    gen = torch.Generator().manual_seed(7)
    prompts = {
        n: torch.randint(0, 512, (length,), generator=gen).tolist()
        for n, length in (("a", 40), ("c", 100), ("d", 5))
    }
    prompts["b"] = prompts["a"][:32] + torch.randint(0, 512, (30,), generator=gen).tolist()
    params = [
        SamplingParams(max_tokens=NUM_NEW_TOKENS - k, temperature=0, ignore_eos=True)
        for k in range(4)
    ]
    tokens: dict[str, list[int]] = defaultdict(list)
    cached: dict[str, int] = {}

    def step() -> None:
        for out in engine.step():
            tokens[out.req_id].extend(out.new_token_ids)
            cached[out.req_id] = out.num_cached_tokens

    engine.add_request("a", prompts["a"], params[0])
    engine.add_request("c", prompts["c"], params[1])
    step()  # a: 40-token prefill; c: its first 24-token chunk
    engine.add_request("b", prompts["b"], params[2])
    engine.add_request("d", prompts["d"], params[3])
    while engine.has_unfinished_requests:
        step()
    engine.assert_no_leaks()
    return dict(tokens), cached


def top2_margin(row: torch.Tensor) -> float:
    top = row.topk(2).values
    return float(top[0] - top[1])


def max_logit_error(
    ref: dict[str, list[torch.Tensor]], got: dict[str, list[torch.Tensor]]
) -> float:
    assert ref.keys() == got.keys()
    errors = [float((a - b).abs().max()) for r in ref for a, b in zip(ref[r], got[r], strict=True)]
    return max(errors)


def float32_reference(path: Path) -> tuple[Engine, Recorder, dict[str, list[int]]]:
    """The torch backend in float32 on the workload, its shared prefix served from the cache:
    the engine, its Recorder and its greedy tokens (the reference of the bf16 paths)."""
    fp32 = build(path, "float32", "torch")
    rec32 = Recorder(fp32)
    ref_tokens, cached = run_workload(fp32)
    assert cached["b"] == 32, "the shared prefix was not served from the cache"
    return fp32, rec32, ref_tokens


def step_errors(
    engine: Engine, reference: Recorder, ref_tokens: dict[str, list[int]]
) -> list[float]:
    """engine's logit error against the reference's at each step, the reference's tokens forced."""
    rec = Recorder(engine, forced=ref_tokens)
    assert run_workload(engine)[0] == ref_tokens  # forced: same trajectory
    assert reference.logits.keys() == rec.logits.keys()
    pairs = (
        (a, b)
        for r in reference.logits
        for a, b in zip(reference.logits[r], rec.logits[r], strict=True)
    )
    return [float((a - b).abs().max()) for a, b in pairs]


def forced_error(engine: Engine, reference: Recorder, ref_tokens: dict[str, list[int]]) -> float:
    """engine's largest logit error against the reference's, on the reference's tokens forced."""
    return max(step_errors(engine, reference, ref_tokens))


def assert_bf16_tolerance(error: float, torch_error: float, scale: float, what: Any = "") -> None:
    """bf16 tolerance of a logit error against float32's: no worse than the torch backend's in
    bf16 (2x slack), and small absolutely (scale: logit_scale of the reference)."""
    assert error <= max(2 * torch_error, 0.02 * scale), what
    assert error <= 0.1 * scale, what


def first_divergence(
    ref_tokens: dict[str, list[int]],
    ref_logits: dict[str, list[torch.Tensor]],
    got_tokens: dict[str, list[int]],
    tolerance: float,
) -> list[str]:
    """Greedy tokens equal, or they part first where the reference had a near-tie."""
    notes = []
    for r, expected in ref_tokens.items():
        got = got_tokens[r]
        assert len(got) == len(expected)
        i = next((i for i, (x, y) in enumerate(zip(expected, got, strict=True)) if x != y), None)
        if i is None:
            continue
        margin = top2_margin(ref_logits[r][i])
        note = f"{r}: first divergence at token {i}, reference top-2 margin {margin:.4f}"
        assert margin <= tolerance, f"{note} > tolerance {tolerance:.4f}"
        notes.append(note)
    return notes


def test_flashinfer_matches_torch_backend(tiny_llama: Path) -> None:
    _, rec32, ref_tokens = float32_reference(tiny_llama)
    errors = {}
    for name, backend in (("torch", "torch"), ("flashinfer", "flashinfer")):
        engine = build(tiny_llama, "bfloat16", backend)
        assert engine.attention_backend == backend
        errors[name] = forced_error(engine, rec32, ref_tokens)
    scale = logit_scale(rec32)
    print(f"max |logit| {scale:.3f}; max error vs fp32: {errors}")
    assert_bf16_tolerance(errors["flashinfer"], errors["torch"], scale)

    # Free-running greedy: FlashInfer (bf16) against the torch backend (bf16).
    torch_bf16 = build(tiny_llama, "bfloat16", "torch")
    rec_t = Recorder(torch_bf16)
    torch_tokens, _ = run_workload(torch_bf16)
    fi_tokens, _ = run_workload(build(tiny_llama, "bfloat16", "flashinfer"))
    tolerance = 3 * (errors["flashinfer"] + errors["torch"])
    print("greedy:", first_divergence(torch_tokens, rec_t.logits, fi_tokens, tolerance) or "equal")


def test_overlapped_steps_on_graphs_equal_plain_steps(tiny_llama: Path) -> None:
    """Steps launched ahead (tokens gathered on the device, pinned non-blocking token copies,
    plan uploads fenced) give the plain engine's tokens."""
    plain_tokens, _ = run_workload(build(tiny_llama, "bfloat16", "flashinfer", True))
    overlapped = build(tiny_llama, "bfloat16", "flashinfer", True, async_scheduling=True)
    tokens, _ = run_workload(overlapped)
    assert overlapped.stats.num_steps_ahead >= NUM_NEW_TOKENS // 2
    assert tokens == plain_tokens


def test_cuda_graph_decode_equals_eager(tiny_llama: Path) -> None:
    eager = build(tiny_llama, "bfloat16", "flashinfer", cuda_graph=False)
    graph = build(tiny_llama, "bfloat16", "flashinfer", cuda_graph=True)
    assert eager.runner.graphs is None and graph.runner.graphs is not None
    assert graph.runner.graphs.sizes == [1, 2, 4, 8]
    rec_e = Recorder(eager)
    eager_tokens, _ = run_workload(eager)
    graph_tokens, _ = run_workload(graph)
    assert eager.runner.num_graph_steps == 0
    assert graph.runner.num_graph_steps >= NUM_NEW_TOKENS - 4  # decode steps of 1..3 seqs
    # Same trajectory forced into the graph engine: logits agree to bf16 noise.
    forced = build(tiny_llama, "bfloat16", "flashinfer", cuda_graph=True)
    rec_f = Recorder(forced, forced=eager_tokens)
    run_workload(forced)
    error = max_logit_error(rec_e.logits, rec_f.logits)
    scale = logit_scale(rec_e)
    print(f"graph vs eager: max logit error {error:.5f} (max |logit| {scale:.3f})")
    assert error <= 0.05 * scale
    notes = first_divergence(eager_tokens, rec_e.logits, graph_tokens, max(2 * error, 1e-3))
    print("graph vs eager greedy:", notes or "equal token for token")
    assert math.isfinite(error)


def fp8_rounded_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make a bf16 cache hold exactly the values an fp8 (e4m3) cache would: every layer write
    is followed by rounding that layer's cache through e4m3 (idempotent on rounded values)."""
    write = flashinfer_backend.rope_and_write_kv

    def write_and_round(*args, **kwargs):
        q = write(*args, **kwargs)
        layer_cache = args[3]
        layer_cache.copy_(layer_cache.to(torch.float8_e4m3fn).to(layer_cache.dtype))
        return q

    monkeypatch.setattr(flashinfer_backend, "rope_and_write_kv", write_and_round)


def test_fp8_kv_cache(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An fp8 (e4m3) cache moves logits about as much as rounding K/V through e4m3 does (a
    wrong layout or scale would move them by the logits' own size); graphs equal eager. The
    fa2 kernels here; test_xqa_decode_on_the_fp8_cache checks XQA against them.

    FlashInfer's fp8 kernel is not bit-equivalent to attention over rounded K/V (it rounds
    inside the attention too), so the emulation bounds the error instead of matching it."""
    decode_on_fa2(monkeypatch)
    bf16 = build(tiny_llama, "bfloat16", "flashinfer")
    rec_bf16 = Recorder(bf16)
    ref_tokens, _ = run_workload(bf16)
    with monkeypatch.context() as patch:
        fp8_rounded_writes(patch)
        emulated = build(tiny_llama, "bfloat16", "flashinfer")
        rec_emulated = Recorder(emulated, forced=ref_tokens)
        run_workload(emulated)
    fp8 = build(tiny_llama, "bfloat16", "flashinfer", kv_cache_dtype="fp8")
    assert fp8.kv_cache.dtype == torch.float8_e4m3fn and fp8.kv_cache.element_size() == 1
    rec_fp8 = Recorder(fp8, forced=ref_tokens)
    run_workload(fp8)
    scale = logit_scale(rec_bf16)
    rounding = max_logit_error(rec_bf16.logits, rec_emulated.logits)
    error = max_logit_error(rec_bf16.logits, rec_fp8.logits)
    to_emulation = max_logit_error(rec_emulated.logits, rec_fp8.logits)
    print(
        f"max logit error against the bf16 cache: fp8 cache {error:.4f}, e4m3-rounded bf16 "
        f"cache {rounding:.4f}; fp8 against the rounded one {to_emulation:.4f} "
        f"(max |logit| {scale:.3f})"
    )
    assert rounding > 0 and error > 0  # both did round
    assert error <= 2 * rounding
    assert to_emulation <= rounding
    eager = build(tiny_llama, "bfloat16", "flashinfer", False, "fp8")
    rec_eager = Recorder(eager)
    eager_tokens, _ = run_workload(eager)
    graph = build(tiny_llama, "bfloat16", "flashinfer", True, "fp8")
    graph_tokens, _ = run_workload(graph)
    assert graph.runner.num_graph_steps > 0
    notes = first_divergence(eager_tokens, rec_eager.logits, graph_tokens, 0.01 * scale)
    print("fp8 graph vs eager greedy:", notes or "equal token for token")


def fp8_run(
    folder: Path, kernel: str, monkeypatch: pytest.MonkeyPatch, forced: dict[str, list[int]]
) -> Recorder:
    """The workload on an fp8 cache with decode rows on `kernel` (fa2, or xqa: the engine's
    choice on Hopper), forced to `forced`."""
    with monkeypatch.context() as patch:
        if kernel == "fa2":
            decode_on_fa2(patch)
        engine = build(folder, "bfloat16", "flashinfer", kv_cache_dtype="fp8")
    assert engine.runner.attention.decode_kernel == kernel
    rec = Recorder(engine, forced=forced)
    run_workload(engine)
    return rec


@pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.get_device_capability()[0] != 9,
    reason="XQA's fp8 kernel is Hopper's",
)
def test_xqa_decode_on_the_fp8_cache(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """XQA (the engine's choice for an fp8 cache on Hopper; it multiplies q and the
    probabilities in e4m3 too) against fa2 on the same cache, in pure-decode and mixed steps
    (the workload's chunked prefills beside decodes split into XQA rows and prefill rows);
    graphs equal eager."""
    bf16 = build(tiny_llama, "bfloat16", "flashinfer")
    rec_bf16 = Recorder(bf16)
    ref_tokens, _ = run_workload(bf16)
    scale = logit_scale(rec_bf16)
    rec_fa2 = fp8_run(tiny_llama, "fa2", monkeypatch, ref_tokens)
    rec_xqa = fp8_run(tiny_llama, "xqa", monkeypatch, ref_tokens)
    fa2_error = max_logit_error(rec_bf16.logits, rec_fa2.logits)
    xqa_error = max_logit_error(rec_bf16.logits, rec_xqa.logits)
    between = max_logit_error(rec_fa2.logits, rec_xqa.logits)
    print(
        f"max logit error against the bf16 cache: fa2 {fa2_error:.4f}, xqa {xqa_error:.4f}; "
        f"xqa against fa2 {between:.4f} (max |logit| {scale:.3f})"
    )
    assert 0 < xqa_error <= 2 * fa2_error  # a wrong page, scale or row would be ~scale
    eager = build(tiny_llama, "bfloat16", "flashinfer", False, "fp8")
    rec_eager = Recorder(eager)
    eager_tokens, _ = run_workload(eager)
    graph = build(tiny_llama, "bfloat16", "flashinfer", True, "fp8")
    assert graph.runner.attention.decode_kernel == "xqa"
    graph_tokens, _ = run_workload(graph)
    assert graph.runner.num_graph_steps > 0
    notes = first_divergence(eager_tokens, rec_eager.logits, graph_tokens, 0.01 * scale)
    print("xqa graph vs eager greedy:", notes or "equal token for token")


@pytest.mark.parametrize("kernel", ["fa2", "xqa"])
def test_checkpoint_kv_scales_are_applied(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kernel: str
) -> None:
    """A checkpoint's per-layer k_scale / v_scale: the cache holds K / k_scale and V / v_scale
    and attention multiplies them back, so logits stay within the fp8 cache's own error of the
    bf16 cache (forgetting either side would scale attention scores or outputs by 2-4x)."""
    if kernel == "xqa" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("XQA's fp8 kernel is Hopper's")
    from safetensors.torch import load_file, save_file

    scaled = tmp_path / "scaled"
    scaled.mkdir()
    for file in tiny_llama.iterdir():
        if file.suffix != ".safetensors":
            (scaled / file.name).write_bytes(file.read_bytes())
    tensors = load_file(tiny_llama / "model.safetensors")
    num_layers = sum(1 for name in tensors if name.endswith("input_layernorm.weight"))
    for layer in range(num_layers):
        attn = f"model.layers.{layer}.self_attn."
        tensors[attn + "k_scale"] = torch.tensor([2.0])
        tensors[attn + "v_scale"] = torch.tensor([0.25])
    save_file(tensors, scaled / "model.safetensors", metadata={"format": "pt"})
    bf16 = build(tiny_llama, "bfloat16", "flashinfer")
    rec_bf16 = Recorder(bf16)
    ref_tokens, _ = run_workload(bf16)
    unscaled = fp8_run(tiny_llama, kernel, monkeypatch, ref_tokens)
    rec_scaled = fp8_run(scaled, kernel, monkeypatch, ref_tokens)
    error = max_logit_error(rec_bf16.logits, unscaled.logits)
    scaled_error = max_logit_error(rec_bf16.logits, rec_scaled.logits)
    print(f"{kernel}: fp8 cache error {error:.4f} unscaled, {scaled_error:.4f} with scales")
    assert scaled_error <= 2 * error + 1e-3


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_whole_prompts_on_the_ragged_wrapper_against_the_paged_one(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch, kv_cache_dtype: str
) -> None:
    """Whole prompts attending over their own K/V (the ragged wrapper, on here whatever the
    cache) against the same rows through the paged cache (the reference is bf16 paged too),
    on one token trajectory: whole
    prompts beside decode rows, continued chunks and a cached prefix in the paged wrapper's
    part of the same steps. Over bf16 both compute the same attention; over fp8 the ragged
    rows read the unquantized K/V, so they may only be closer to bf16."""
    ragged_prompts(monkeypatch, False)
    bf16 = build(tiny_llama, "bfloat16", "flashinfer")
    rec_bf16 = Recorder(bf16)
    ref_tokens, _ = run_workload(bf16)
    scale = logit_scale(rec_bf16)
    recs, ragged_calls = {}, []
    for ragged in (False, True):
        ragged_prompts(monkeypatch, ragged)
        engine = build(tiny_llama, "bfloat16", "flashinfer", kv_cache_dtype=kv_cache_dtype)
        attention = engine.runner.attention
        assert (attention.ragged_kernel is not None) == ragged
        if ragged:

            def counted_run(*args, run=attention._ragged.run, **kwargs):
                ragged_calls.append(args[0].shape[0])  # the whole prompts' rows
                return run(*args, **kwargs)

            monkeypatch.setattr(attention._ragged, "run", counted_run)
        recs[ragged] = Recorder(engine, forced=ref_tokens)
        run_workload(engine)
    assert max(ragged_calls) == 64  # the first step: prompt a's 40 rows and c's first 24
    assert 5 in ragged_calls  # prompt d behind paged rows (a decode, c's next chunk, b)
    paged_error = max_logit_error(rec_bf16.logits, recs[False].logits)
    ragged_error = max_logit_error(rec_bf16.logits, recs[True].logits)
    between = max_logit_error(recs[False].logits, recs[True].logits)
    print(
        f"{kv_cache_dtype} cache: max logit error against bf16 paged: paged {paged_error:.4f}, "
        f"ragged {ragged_error:.4f}; ragged against paged {between:.4f} (max |logit| "
        f"{scale:.3f}; {len(ragged_calls)} ragged calls)"
    )
    if kv_cache_dtype == "fp8":
        assert ragged_error <= 1.25 * paged_error  # a wrong row or prompt would be ~scale
    else:
        assert between <= 0.02 * scale
