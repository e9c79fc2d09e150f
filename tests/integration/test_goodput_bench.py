"""The served goodput benchmarks on CPU against real `kvrelay serve` processes:
bench.gpu_goodput_bench's several-GPU layout (issue 17's runs need the GPUs): with --gpus 2,
"aggregated" is two `kvrelay serve` processes and each conversation goes to one of them, all its
turns to the same one; every turn completes, and each server prefilled its own conversations'
prompts itself. serve_bench's multi-turn chat over HTTP (issue 52: the client it drives vLLM's
OpenAI server with): each turn resends the previous turn's prompt and streamed output."""

from __future__ import annotations

import json

from tokenizers import Tokenizer

from bench import serve_bench
from bench.gpu_goodput_bench import main
from bench.lib.served_shape import write_served_shape


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


def test_multi_turn_over_http_resends_each_turns_output_text(tmp_path):
    """serve_bench's multi-turn chat over HTTP (as against vLLM's OpenAI server) against a real
    kvrelay server: turn 1's prompt is turn 0's prompt + turn 0's streamed text re-tokenized
    + the fresh user tokens, as the server counted it."""
    folder = tmp_path / "model"
    write_served_shape(folder, "tiny-llama", lambda _: None)
    tokenizer = folder / "tokenizer.json"
    path = tmp_path / "multi_turn.json"
    server_args = (
        f"--model {folder} --load-format dummy --device cpu --max-num-seqs 4 "
        "--max-model-len 512 --kv-cache-gib 0.05 --threads-per-worker 1 "
        "--local-prefill-max-tokens 1000000"
    )
    argv = [
        *("--launch", "--transport", "http", "--server-args", server_args),
        *("--workload", "multi-turn", "--tokenizer", str(tokenizer), "--rate", "inf"),
        *("--num-conversations", "2", "--turns", "2", "--input-len", "24"),
        *("--turn-input-len", "6", "--output-len", "8", "--json", str(path)),
    ]
    assert serve_bench.main(argv) == 0
    report = json.loads(path.read_text())
    assert (report["summary"]["completed"], report["summary"]["failed"]) == (4, 0)
    rows = {(r["conversation"], r["turn"]): r for r in report["requests"]}
    assert sorted(rows) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    encode = Tokenizer.from_file(str(tokenizer)).encode
    for c in range(2):
        first, second = rows[c, 0], rows[c, 1]
        assert (first["prompt_tokens"], first["output_tokens"]) == (24, 8)
        resent = len(encode(first["output_text"], add_special_tokens=False).ids)
        assert resent > 0
        assert second["prompt_tokens"] == 24 + resent + 6
