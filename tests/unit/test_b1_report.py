"""bench.b1_report over b1-variants' JSON files written here (no GPU)."""

from __future__ import annotations

import json
from pathlib import Path

from bench.b1_report import load_runs, report


def step(kernel: str, share_us: float) -> dict:
    return {"kernel": kernel, "us": share_us, "gap_after_us": 0.1, "share_us": share_us}


def write_run(folder: Path, name: str, replay: float, roofline: float, timeline: list) -> None:
    b1 = {
        "graph_replay_ms": replay,
        "graph_roofline_ms": roofline,
        "engine_step_ms_median": replay + 0.3,
        "profile": {"kernels_per_iter": 227.0, "layer_timeline": timeline},
    }
    (folder / f"b1_{name}.json").write_text(json.dumps({"decode_b1": b1}))


def test_report_gives_each_setting_its_ratio_and_layer(tmp_path: Path) -> None:
    # one kernel serving two projections (fused_gemv: qkv, then o) must stay two lines
    # and each layer lines up from RoPE, wherever its profile's period began
    fa2 = [
        step("fused_gemv", 15.0),
        step("rope_write_kv", 1.6),
        step("BatchPrefillWithPagedKV", 6.8),
    ]
    fa2.append(step("fused_gemv", 10.8))
    ours = [step("rope_write_kv", 1.5), step("split_kv_decode", 3.0), step("fused_gemv", 10.2)]
    ours.append(step("fused_gemv", 15.0))
    write_run(tmp_path, "bf16_defaults", 4.136, 3.338, fa2)
    write_run(tmp_path, "bf16_KVRELAY_DECODE_KERNEL_triton", 3.9, 3.338, ours)
    write_run(tmp_path, "fp8w_defaults", 2.791, 1.657, [])
    (tmp_path / "b1_bf16_broken.json").write_text("{}")  # a run that timed out: left out
    write_run(tmp_path, "lock0", 2.8, 1.657, [])  # an older bench's file: left out

    runs = load_runs([tmp_path])
    text = report(runs)
    lines = text.splitlines()

    assert [(r["row"], r["setting"]) for r in runs] == [
        ("bf16", "defaults"),
        ("bf16", "KVRELAY_DECODE_KERNEL_triton"),
        ("fp8w", "defaults"),
    ]
    assert "1.239x misses 1.2x by 0.130 ms" in text
    assert "1.168x meets" in text
    assert "1.684x misses 1.3x by 0.637 ms" in text
    by_position = {line.split()[0]: line.split()[1:] for line in lines if line[:1].isdigit()}
    assert by_position["1"] == ["rope_write_kv", "1.6", "rope_write_kv", "1.5"]
    assert by_position["2"] == ["BatchPrefillWithPagedKV", "6.8", "split_kv_decode", "3.0"]
    assert by_position["3"] == ["fused_gemv", "10.8", "fused_gemv", "10.2"]
    assert by_position["4"] == ["fused_gemv", "15.0", "fused_gemv", "15.0"]
    layer = next(line for line in lines if line.startswith("layer "))
    assert layer.split() == ["layer", "34.2", "29.7"]
