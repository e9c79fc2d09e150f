"""gpu_engine_bench's "mixed" section driven on a CPU engine (tiny random checkpoint, torch
backend, no profiler): the call it labels mixed carried the fresh prompt's tokens beside every
decode row, the pure-decode neighbours carried the decode rows only, overlapped steps split a
prompt's step into a launching and a finishing call, and no block leaks after."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.lib.gpu_engine_report import print_mixed
from bench.lib.mixed_steps import (
    STAGES,
    StepProbe,
    cprofile_window,
    decoding,
    mixed_steps,
    set_overlap,
    sweep,
    window_fields,
)
from engine.engine import Engine
from tests.conftest import build_engine
from tests.factories import make_tiny_checkpoint

BATCH, CONTEXT = 3, 20


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-mixed"), seed=3)


@pytest.fixture(scope="module")
def engines(checkpoint: Path) -> Iterator[dict[str, Engine]]:
    built = {
        "serial": build_engine(model_path=str(checkpoint), num_blocks=64, max_num_seqs=8),
        "overlapped": build_engine(
            model_path=str(checkpoint), num_blocks=64, max_num_seqs=8, async_scheduling=True
        ),
    }
    yield built
    for engine in built.values():
        engine.assert_no_leaks()


def test_the_mixed_call_carries_the_prompt_beside_every_decode(engines) -> None:
    engine = engines["serial"]
    assert not engine.overlap_steps
    with decoding(engine, BATCH, CONTEXT, seed=5) as decode_ids, StepProbe(engine) as probe:
        reps = sweep(engine, probe, 24, 2, seed=6)
        assert engine.kv.num_free_blocks < engine.kv.num_blocks  # the decodes hold blocks
    assert engine.kv.num_free_blocks == engine.kv.num_blocks  # decoding() freed them all
    assert len(reps) == 2
    for calls in reps:
        assert [c.label for c in calls] == ["decode", "decode", "mixed", "decode", "decode"]
        for call in calls:
            assert call.launched == [call.finished]  # serial: one step, launched and read
            step = probe.steps[call.finished]
            assert sorted(step.decode_req_ids) == sorted(decode_ids)  # every decode row
            if call.label == "mixed":
                assert step.prompt_tokens == 24 and len(step.chunk_tokens) == 1
            else:
                assert step.prompt_tokens == 0 and not step.chunk_tokens
            assert set(call.stages_s) <= {*STAGES, "other"}
            assert call.stages_s["build_inputs"] > 0 and call.stages_s["sample"] > 0
            assert call.stages_s["wait_tokens"] > 0
    # a fresh prompt each repetition, none left behind
    assert len(probe.prompt_ids) == 2 and not engine.has_unfinished_requests


def test_overlapped_steps_split_the_prompts_step_over_two_calls(engines) -> None:
    engine = engines["overlapped"]
    assert engine.overlap_steps
    with decoding(engine, BATCH, CONTEXT, seed=7) as decode_ids, StepProbe(engine) as probe:
        (calls,) = sweep(engine, probe, 16, 1, seed=8)
        labels = [c.label for c in calls]
        assert labels == ["decode", "decode", "launch_mixed", "finish_mixed", "decode", "decode"]
        launch, finish = calls[2], calls[3]
        (mixed,) = launch.launched
        assert finish.finished == mixed and launch.finished != mixed
        assert probe.steps[mixed].prompt_tokens == 16
        for call in calls:
            assert sorted(probe.steps[call.finished].decode_req_ids) == sorted(decode_ids)
        assert engine.stats.num_steps_ahead > 0
        set_overlap(engine, False)  # the step in flight runs out: one step per call after it
        assert engine.run_ahead.in_flight is None
        call = probe.call()
        assert call.launched == [call.finished] and call.label == "decode"
        set_overlap(engine, True)
        assert engine.run_ahead.enabled
    # the probe's wrappers are gone: the engine's parts call their own methods again
    assert "launch" not in vars(engine.launcher) and "schedule" not in vars(engine.scheduler)


def test_the_section_reports_every_cell_and_skips_what_cannot_fit(engines, capsys) -> None:
    engine = engines["overlapped"]
    result = mixed_steps(engine, [2, 8], [8], reps=1, context_len=CONTEXT)
    (cell,) = result["cells"]
    assert result["skipped"] == [{"batch": 8, "prompt_len": 8, "why": "max_num_seqs"}]
    assert (cell["batch"], cell["prompt_len"]) == (2, 8)
    overlapped = cell["overlapped"]["groups"]
    assert overlapped["launch_mixed"]["calls"] == overlapped["finish_mixed"]["calls"] == 1
    assert overlapped["decode"]["calls"] == 4  # 2 neighbours before, 2 after
    assert cell["overlapped"]["first"]["launch_mixed"]["calls"] == 1
    serial = cell["serial"]["groups"]
    assert serial["mixed"]["calls"] == 1 and serial["decode"]["calls"] == 4
    assert set(serial["mixed"]["host_ms"]) >= {"schedule", "build_inputs", "forward_eager"}
    assert "serial_kernels" not in cell  # CUDA only
    assert {"mixed", "decode"} <= set(cell["serial_cprofile"])
    assert engine.overlap_steps  # restored
    engine.assert_no_leaks()
    print_mixed(result)
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("  B=2   P=8     overlapped: decode ")
    assert "launch_mixed" in lines[1] and "serial mixed" in lines[2]


def test_cprofile_window_names_the_engine_step(engines) -> None:
    engine = engines["serial"]
    with decoding(engine, 1, CONTEXT, seed=9), StepProbe(engine) as probe:
        record = cprofile_window(probe)
    names = [row["function"] for row in record.extra["cprofile_top"]]
    assert record.label == "decode" and len(names) == 15
    assert all(row["calls"] >= 1 for row in record.extra["cprofile_top"])


def test_window_fields_merge_overlapping_kernels() -> None:
    # us: two overlapping kernels (busy 0-30), a 20 us gap, one more (50-60)
    spans = [(0.0, 20.0, "gemm"), (10.0, 30.0, "rope"), (50.0, 60.0, "sample")]
    fields = window_fields(spans, wall_ms=0.1)
    assert fields["num_kernels"] == 3
    assert fields["kernel_busy_ms"] == pytest.approx(0.04)
    assert fields["gpu_span_ms"] == pytest.approx(0.06)
    assert fields["gpu_idle_in_span_ms"] == pytest.approx(0.02)
    assert fields["gpu_idle_in_call_ms"] == pytest.approx(0.06)
    (gap,) = fields["gaps_by_neighbours"]
    assert (gap["before"], gap["after"], gap["count"]) == ("rope", "sample", 1)
    assert window_fields([], wall_ms=2.0)["gpu_idle_in_call_ms"] == 2.0


def test_the_report_prints_a_cell_and_a_kernel_profile(engines, capsys) -> None:
    result = mixed_steps(engines["serial"], [1], [8, 1100], reps=1, context_len=CONTEXT)
    cell = result["cells"][0]
    # what kernel_window adds on CUDA, in the shape summarize gives it
    kernels = {"num_kernels": 40, "kernel_busy_ms": 3.0, "wall_ms": 5.0}
    kernels |= {"gpu_idle_in_call_ms": 2.0, "kernel_ms_by_kind": {"matmul": 2.5}}
    cell["serial_kernels"] = {"groups": {"mixed": kernels}}
    print_mixed(result)
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("  B=1   P=8     serial mixed")
    assert any(
        "GPU mixed  busy 3.00 of 5.00 (idle 2.00), 40 kernels: matmul 2.50" in ln for ln in lines
    )
    assert lines[-1] == "  B=1 P=1100: skipped (max_num_batched_tokens)"
