"""bench.scale_bench on CPU (issue 17 runs it on GPUs): a decode worker added and removed under a
steady load of random-id prompts; no request fails, nothing is stranded, every block is free at
the end, and latency (TTFT, TPOT) is reported before, during and after the resizes."""

from __future__ import annotations

import json

import pytest

from bench.scale_bench import main, parse_resizes


def test_a_decode_worker_added_and_removed_under_load(tmp_path):
    out = tmp_path / "scale.json"
    argv = [
        *("--resizes", "decode:2 decode:1", "--quiet-s", "3", "--rate", "2"),
        *("--input-len", "40", "--max-tokens", "8", "--json", str(out)),
    ]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    grow, shrink = result["resizes"]
    assert (grow["role"], grow["to"], shrink["to"]) == ("decode", 2, 1)
    assert grow["scale_to_ready_s"] > 0 and "drain_s" in shrink and shrink["exit_check_clean"]
    assert result["num_requests"] > 0 and result["num_failed"] == 0
    assert result["max_stranded_blocks"] == 0 and result["all_blocks_free_at_end"]
    for phase in ("latency_before_resizes", "latency_after_resizes"):
        assert result[phase]["ttft_s"]["n"] > 0, phase
        assert result[phase]["tpot_s"]["p50"] > 0, phase
    assert result["cluster"]["input_len"] == 40


def test_resizes_that_are_not_pool_sizes_are_refused():
    assert parse_resizes("decode:2 prefill:3") == [("decode", 2), ("prefill", 3)]
    for bad in ("decode:0", "router:2", "decode", "decode:x"):
        with pytest.raises(ValueError, match="prefill:N or decode:N"):
            parse_resizes(bad)
