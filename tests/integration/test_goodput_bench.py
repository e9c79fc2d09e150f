"""bench.gpu_goodput_bench's several-GPU layout on CPU (issue 17's runs need the GPUs): with
--gpus 2, "aggregated" is two `kvrelay serve` processes and each conversation goes to one of
them, all its turns to the same one; every turn completes, and each server prefilled its own
conversations' prompts itself."""

from __future__ import annotations

import json

from bench.gpu_goodput_bench import main


def test_two_aggregated_servers_each_serve_their_conversations(tmp_path):
    argv = [
        *("--device", "cpu", "--gpus", "2", "--setups", "aggregated"),
        *("--workloads", "multi-turn", "--shape", "tiny-llama", "--rate", "4"),
        *("--num-conversations", "3", "--turns", "3", "--max-num-seqs", "8"),
        *("--server-args", "--kv-cache-gib 0.1 --threads-per-worker 1"),
        *("--json-dir", str(tmp_path), "--model-dir", str(tmp_path / "model")),
    ]
    assert main(argv) == 0
    entry = json.loads((tmp_path / "goodput.json").read_text())["setups"]["aggregated"]
    assert "error" not in entry
    assert len(entry["commands"]) == 2
    run = entry["multi-turn"]
    (row,) = run["rows"]
    assert (row["completed"], row["failed"]) == (9, 0)
    # Conversations 0 and 2 (3 turns each) on the first server, 1 on the second, and one
    # warm-up each; routing each turn by its own number would give 6 and 5.
    per_server = [sum(counts.values()) for counts in run["prefills_by_server"]]
    assert per_server == [7, 4]
    assert all(counts.get("remote", 0.0) == 0.0 for counts in run["prefills_by_server"])
    assert sum(row["prefills_by_where"].values()) == 11  # serve_bench's sum over both
