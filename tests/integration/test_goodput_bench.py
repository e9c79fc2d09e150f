"""bench.gpu_goodput_bench's several-GPU layout on CPU (issue 17's runs need the GPUs): with
--gpus 2, "aggregated" is two `kvrelay serve` processes and each conversation goes to one of
them; every turn completes, and each server prefilled its own share of the prompts itself."""

from __future__ import annotations

import json

from bench.gpu_goodput_bench import main


def test_two_aggregated_servers_each_serve_their_conversations(tmp_path):
    argv = [
        *("--device", "cpu", "--gpus", "2", "--setups", "aggregated"),
        *("--workloads", "multi-turn", "--shape", "tiny-llama", "--rate", "4"),
        *("--num-conversations", "4", "--turns", "2", "--max-num-seqs", "8"),
        *("--server-args", "--kv-cache-gib 0.1 --threads-per-worker 1"),
        *("--json-dir", str(tmp_path), "--model-dir", str(tmp_path / "model")),
    ]
    assert main(argv) == 0
    entry = json.loads((tmp_path / "goodput.json").read_text())["setups"]["aggregated"]
    assert len(entry["commands"]) == 2 and "error" not in entry
    (row,) = entry["multi-turn"]["rows"]
    assert (row["completed"], row["failed"]) == (8, 0)
    per_server = entry["multi-turn"]["prefills_by_server"]
    assert len(per_server) == 2
    for counts in per_server:  # 2 conversations x 2 turns (and a warm-up), none sent away
        assert counts.get("remote", 0.0) == 0.0
        assert sum(counts.values()) >= 4
    assert sum(sum(c.values()) for c in per_server) == 8 + 2  # the warm-ups: one each
