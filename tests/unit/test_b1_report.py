"""bench.b1_report over b1-variants' JSON files written here (no GPU)."""

from __future__ import annotations

import json
from pathlib import Path

from bench.b1_report import load_runs, report


def write_run(folder: Path, name: str, replay: float, roofline: float, timeline: list) -> None:
    b1 = {
        "graph_replay_ms": replay,
        "graph_roofline_ms": roofline,
        "engine_step_ms_median": replay + 0.3,
        "profile": {"kernels_per_iter": 227.0, "layer_timeline": timeline},
    }
    (folder / f"b1_{name}.json").write_text(json.dumps({"decode_b1": b1}))


def test_report_gives_each_setting_its_ratio_and_kernel_shares(tmp_path: Path) -> None:
    qkv = {"kernel": "fused_gemv", "us": 15.0, "gap_after_us": 0.1, "share_us": 15.0}
    fa2 = {"kernel": "BatchPrefillWithPagedKV", "us": 6.8, "gap_after_us": 0.1, "share_us": 6.8}
    ours = {"kernel": "split_kv_decode", "us": 3.0, "gap_after_us": 0.1, "share_us": 3.0}
    write_run(tmp_path, "bf16_defaults", 4.136, 3.338, [qkv, fa2])
    write_run(tmp_path, "bf16_KVRELAY_DECODE_KERNEL_triton", 3.9, 3.338, [qkv, ours])
    write_run(tmp_path, "fp8w_defaults", 2.791, 1.657, [])
    (tmp_path / "b1_bf16_broken.json").write_text("{}")  # a run that timed out: skipped

    runs = load_runs([tmp_path])
    text = report(runs)

    assert [(r["row"], r["setting"]) for r in runs] == [
        ("bf16", "defaults"),
        ("bf16", "KVRELAY_DECODE_KERNEL_triton"),
        ("fp8w", "defaults"),
    ]
    assert "1.239x misses 1.2x by 0.130 ms" in text
    assert "1.168x meets" in text
    assert "1.684x misses 1.3x by 0.637 ms" in text
    fa2_line = next(line for line in text.splitlines() if line.startswith("BatchPrefill"))
    assert fa2_line.split() == ["BatchPrefillWithPagedKV", "6.8"]  # blank for the triton run
    layer = next(line for line in text.splitlines() if line.startswith("layer total"))
    assert layer.split()[2:] == ["21.8", "18.0"]
