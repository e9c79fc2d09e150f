"""bench.prefill_role_bench on CPU with a tiny random model: both settings lease every prompt
and leave nothing behind, and the overlapped engine runs ahead of every step but the first."""

from __future__ import annotations

import json

from bench.prefill_role_bench import main


def test_prefill_role_bench_runs_ahead_only_when_overlapped(tmp_path):
    out = tmp_path / "prefill_role.json"
    argv = ["--device", "cpu", "--shape", "tiny-llama", "--num-prompts", "6", "--input-len", "40"]
    result = main([*argv, "--max-num-batched-tokens", "64", "--kv-gib", "0.05", "--json", str(out)])
    assert json.loads(out.read_text())["runs"] == result["runs"]
    overlapped, plain = result["runs"]["overlapped"], result["runs"]["plain"]
    assert overlapped["overlap_steps"] and not plain["overlap_steps"]
    assert overlapped["steps"] == plain["steps"] >= 4  # 240 tokens in 64-token steps
    assert overlapped["steps_ahead"] == overlapped["steps"] - 1 and plain["steps_ahead"] == 0
