"""How long Python's cyclic garbage collector holds the engine's thread in an offline run, by
generation, with the start-up heap frozen (engine/gc_heap.py) or not. Runs the CPU engine on
the tiny random Llama (the collector's work depends on the heap, not on the device) and times
every collection through gc.callbacks. Owns no state.

    python -m bench.gc_pause_bench [--freeze] [--num-requests 512] [--output-len 300]

--freeze also raises the young generation's threshold, as a GPU engine does (KVRELAY_GC_YOUNG,
default 50,000; KVRELAY_GC_YOUNG=700 keeps Python's). Each setting wants its own process (the
frozen heap is process-wide): run each once.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.lib.engine_config import engine_config
from bench.lib.gc_pauses import GcPauses
from bench.lib.random_models import write_random_model
from engine.engine import Engine
from engine.gc_heap import freeze_now
from engine.sampling_params import SamplingParams


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    folder = Path(tempfile.mkdtemp())
    write_random_model(folder, "tiny-llama")
    config = engine_config(
        str(folder), device="cpu", dtype="float32", num_blocks=args.num_blocks,
        max_num_seqs=args.num_requests, max_num_batched_tokens=8192,
    )  # fmt: skip
    engine = Engine(config)
    frozen = freeze_now() if args.freeze else 0
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    for i in range(args.num_requests):
        engine.add_request(f"r{i}", [rng.randrange(vocab) for _ in range(args.input_len)], params)
    start, steps = time.perf_counter(), 0
    with GcPauses() as pauses:
        while engine.has_unfinished_requests:
            engine.step()
            steps += 1
    wall = time.perf_counter() - start
    engine.assert_no_leaks()
    return {
        "freeze": args.freeze,
        "frozen_objects": frozen,
        "thresholds": gc.get_threshold(),
        "steps": steps,
        "wall_s": wall,
        "by_generation": pauses.summary(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--freeze", action="store_true", help="freeze the heap after start-up")
    p.add_argument("--num-requests", type=int, default=512)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=300)
    p.add_argument("--num-blocks", type=int, default=20000)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    result = run(args)
    print(
        f"freeze={result['freeze']} ({result['frozen_objects']} objects frozen, thresholds "
        f"{result['thresholds']}): "
        f"{result['steps']} steps in {result['wall_s']:.1f} s"
    )
    for g, stats in result["by_generation"].items():
        print(
            f"  generation {g}: {stats['count']} collections, {stats['total_ms']:.1f} ms in "
            f"all, longest {stats['max_ms']:.2f} ms"
        )
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
