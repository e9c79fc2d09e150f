"""engine/execution/mixed_graphs.py off the GPU: its token buckets, the static-buffer helpers on
both kinds of qkv (plain rows, ScaledRows with per-row or broadcast row scales), which models
it refuses and why, and that an engine without CUDA graphs has none (the capture and replay run
in tests/gpu/test_mixed_graphs_cuda.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.execution.mixed_graphs import (
    copy_rows,
    first_rows,
    mixed_graphs_for,
    qkv_kind,
    static_like,
    token_buckets,
)
from engine.models.loader import random_model, read_model_config
from engine.quant.fp8_types import ScaledRows
from engine.sampling.sampling_params import SamplingParams
from tests.conftest import build_engine, run_to_completion
from tests.factories import make_tiny_checkpoint


def test_token_buckets() -> None:
    assert token_buckets(512)[:6] == [16, 32, 48, 64, 96, 128]
    assert token_buckets(512)[-1] == 512 and len(token_buckets(512)) == 18
    assert token_buckets(64) == [16, 32, 48, 64]
    assert token_buckets(100) == [16, 32, 48, 64, 96, 100]  # the budget itself is a bucket
    assert token_buckets(8) == [8]


def test_plain_rows_through_the_static_buffer() -> None:
    x = torch.arange(12.0).reshape(4, 3)
    buffer = static_like(x, 8)
    assert isinstance(buffer, torch.Tensor) and buffer.shape == (8, 3)
    copy_rows(buffer, x)
    assert torch.equal(first_rows(buffer, 4), x)
    assert torch.equal(buffer[4:], torch.zeros(4, 3))


@pytest.mark.parametrize("per_row", [True, False])
def test_scaled_rows_through_the_static_buffer(per_row: bool) -> None:
    rows = 4
    row_scale = torch.arange(1.0, rows + 1).reshape(rows, 1) if per_row else torch.ones(1, 1)
    x = ScaledRows(torch.randn(rows, 6), row_scale, torch.full((1, 6), 0.5))
    buffer = static_like(x, 16)
    assert isinstance(buffer, ScaledRows)
    assert buffer.raw.shape == (16, 6) and buffer.col_scale is not x.col_scale
    assert buffer.row_scale.shape == ((16, 1) if per_row else (1, 1))
    copy_rows(buffer, x)
    got = first_rows(buffer, rows)
    assert isinstance(got, ScaledRows)
    assert torch.equal(got.materialize(), x.materialize())
    # the next layer's rows (its own column scales) replace them in the same buffer
    y = ScaledRows(torch.randn(rows, 6), row_scale * 2, torch.full((1, 6), 0.25))
    copy_rows(buffer, y)
    assert torch.equal(first_rows(buffer, rows).materialize(), y.materialize())


def test_each_kind_of_qkv_gets_its_own_buffer() -> None:
    """FP8 weights defer their scales for some row counts only: a 16-token bucket's qkv may be
    plain rows where a 512-token one's is ScaledRows, so the buffers are kept by kind."""
    plain = torch.zeros(16, 6)
    per_row = ScaledRows(torch.zeros(32, 6), torch.ones(32, 1), torch.ones(1, 6))
    broadcast = ScaledRows(torch.zeros(32, 6), torch.ones(1, 1), torch.ones(1, 6))
    kinds = {qkv_kind(plain), qkv_kind(per_row), qkv_kind(broadcast)}
    assert kinds == {(False, False), (True, True), (True, False)}


def test_models_it_refuses_say_why(tmp_path: Path) -> None:
    dense = make_tiny_checkpoint(tmp_path / "dense")
    moe = make_tiny_checkpoint(tmp_path / "moe", architecture="mixtral")
    for folder, expected in ((dense, None), (moe, "MoE")):
        config = read_model_config(folder)
        model = random_model(config, 64, torch.device("cpu"), torch.float32)
        why = mixed_graphs_for(model)
        assert why is None if expected is None else expected in why


def test_an_engine_without_cuda_graphs_runs_its_mixed_steps_eager(tmp_path: Path) -> None:
    folder = make_tiny_checkpoint(tmp_path / "tiny")
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    engine = build_engine(model_path=str(folder))
    assert engine.runner.mixed is None  # CPU: no CUDA graphs to replay
    engine.add_request("a", list(range(1, 30)), params)
    engine.add_request("b", list(range(3, 20)), params)
    outputs = run_to_completion(engine)
    assert sorted(outputs) == ["a", "b"] and all(len(o) == 6 for o in outputs.values())
    engine.assert_no_leaks()
