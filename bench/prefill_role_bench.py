"""Prefill-role throughput with overlapped steps and without: --num-prompts random prompts of
--input-len tokens added with hold_kv (a prefill worker's requests: each ends with its first
token and leaves its blocks under a lease), every lease released as its output arrives (as the
decode side's read would), on one engine built with async_scheduling on and one with it off.
Overlapped, the next step is queued while the host finishes the step before it. Owns no state;
prints one line per setting and writes the JSON to --json.

    python -m bench.prefill_role_bench --json $OUT/prefill_role.json        # GPU, 8B shape
    python -m bench.prefill_role_bench --device cpu --shape tiny-llama --num-prompts 6 \\
        --input-len 40 --max-num-batched-tokens 64
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from bench.lib.engine_config import engine_config, gib
from bench.lib.gpu_timing import random_prompts
from bench.lib.random_models import write_random_model
from engine.engine import Engine
from engine.loader import random_model, read_model_config
from engine.sampling_params import SamplingParams

WARMUP_PROMPTS = 2


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", default="llama-3.1-8b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--input-len", type=int, default=3000)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--kv-gib", type=float, default=16.0, help="KV pool of each engine")
    p.add_argument("--json", type=Path, default=None)
    return p


def prefill_all(engine: Engine, prompts: Sequence[list[int]], tag: str) -> dict[str, float]:
    """Add every prompt as a held request, step until all are out, releasing each lease as its
    output arrives; the run's seconds and step counts."""
    params = SamplingParams(max_tokens=1, temperature=0)
    stats = engine.stats
    steps_before, ahead_before = stats.num_steps, stats.num_steps_ahead
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params, hold_kv=True)
    leased = 0
    while engine.has_unfinished_requests:
        for out in engine.step():
            if out.finished:
                if not out.held_block_ids:
                    raise RuntimeError(f"{out.req_id} ended without a lease ({out.finish_reason})")
                engine.release_kv(out.req_id)
                leased += 1
    seconds = time.perf_counter() - start
    if leased != len(prompts):
        raise RuntimeError(f"{leased} of {len(prompts)} prompts were leased")
    return {
        "seconds": seconds,
        "steps": stats.num_steps - steps_before,
        "steps_ahead": stats.num_steps_ahead - ahead_before,
    }


def measure(args: argparse.Namespace, folder: Path, model: torch.nn.Module, overlap: bool) -> dict:
    """One engine with async_scheduling `overlap`: a warm-up pass, then the timed prompts."""
    config = engine_config(
        str(folder),
        device=args.device,
        dtype=str(next(model.parameters()).dtype).removeprefix("torch."),  # the model's
        cuda_graph=args.device.startswith("cuda"),
        async_scheduling=overlap,
        kv_cache_memory_bytes=gib(args.kv_gib),
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    engine = Engine(config, model=model)
    vocab = engine.model_config.vocab_size
    prefill_all(engine, random_prompts(WARMUP_PROMPTS, args.input_len, vocab, seed=1), "warm")
    run = prefill_all(engine, random_prompts(args.num_prompts, args.input_len, vocab, 0), "p")
    engine.assert_no_leaks()
    tokens = args.num_prompts * args.input_len
    run |= {
        "overlap_steps": engine.overlap_steps,
        "prompts_per_s": args.num_prompts / run["seconds"],
        "prefill_tokens_per_s": tokens / run["seconds"],
    }
    log(
        f"async_scheduling={overlap}: {args.num_prompts} x {args.input_len} tokens in "
        f"{run['seconds']:.2f} s ({run['prefill_tokens_per_s']:,.0f} tok/s), {run['steps']} "
        f"steps, {run['steps_ahead']} run ahead"
    )
    return run


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    folder = write_random_model(tempfile.mkdtemp(prefix="kvrelay-"), args.shape, weights=False)
    config = read_model_config(folder)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    model = random_model(config, config.max_position_embeddings, torch.device(args.device), dtype)
    result: dict[str, Any] = {"args": {**vars(args), "json": str(args.json)}, "runs": {}}
    for overlap in (True, False):
        result["runs"]["overlapped" if overlap else "plain"] = measure(args, folder, model, overlap)
    runs = result["runs"]
    result["overlapped_over_plain"] = runs["plain"]["seconds"] / runs["overlapped"]["seconds"]
    print(f"prefill role: overlapped steps {result['overlapped_over_plain']:.3f}x plain steps")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
