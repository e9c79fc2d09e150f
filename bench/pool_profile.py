"""Measures a pool profile (the format of deploy/profile.py) for `kvrelay plan`: one engine in
this process, the time of lone prefills of several prompt lengths, and decode step times at
several batch sizes and context lengths. Owns the engine for the run; progress goes to stderr,
the profile to --out (or stdout).

    python -m bench.pool_profile --threads 1 --out profile.json     # CPU, default model: ~1 min
    python -m bench.pool_profile --device cuda --shape llama-3.1-8b \\
        --kv-cache-gib 60 --max-num-seqs 128 --prompt-lens 128 512 2048 8192 \\
        --batch-sizes 1 8 32 64 128 --context-lens 512 2048 8192 --out h200-8b.json

--shape writes a random-weight checkpoint of that shape (bench/lib/random_models.py) and loads
it with --load-format dummy. Pass the decode workers' own --kv-cache-gib and --max-num-seqs:
the profile's KV capacity and largest batch are this engine's.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import torch

from bench.lib.engine_config import engine_config, gib
from bench.lib.gpu_timing import decode_step_times, finish_all, random_prompts
from bench.lib.random_models import SHAPES, write_random_model
from deploy.profile import VERSION, parse_profile
from engine.config import DEFAULT_MODEL
from engine.engine import Engine
from engine.execution.backend_builder import resolve_dtype
from engine.sampling.sampling_params import SamplingParams


def log(message: str) -> None:
    print(f"[pool_profile {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help="model name, .gguf file or HF folder")
    p.add_argument("--shape", choices=sorted(SHAPES), default=None, help="random weights")
    p.add_argument("--load-format", choices=["auto", "dummy"], default="auto")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto")
    p.add_argument("--dtype", default="auto", help="auto: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (1 on a busy CPU)")
    p.add_argument("--kv-cache-gib", type=float, default=1.0, help="KV pool (as the workers')")
    p.add_argument("--max-num-seqs", type=int, default=64, help="largest batch (as the workers')")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--prompt-lens", type=int, nargs="+", default=[32, 128, 512])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--context-lens", type=int, nargs="+", default=[64, 256])
    p.add_argument("--repeats", type=int, default=2, help="lone prefills per prompt length")
    p.add_argument("--decode-steps", type=int, default=4, help="timed steps per decode point")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the profile here (default: stdout)")
    return p.parse_args(argv)


def build_engine(args: argparse.Namespace, scratch: str) -> Engine:
    """The engine to measure; a --shape's config.json is written into `scratch`."""
    model, load_format = args.model, args.load_format
    if args.shape is not None:
        model, load_format = str(write_random_model(scratch, args.shape, weights=False)), "dummy"
    config = engine_config(
        model,
        device=args.device,
        dtype=args.dtype,
        load_format=load_format,
        kv_cache_memory_bytes=gib(args.kv_cache_gib),
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
    )
    return Engine(config)


def check_fits(engine: Engine, args: argparse.Namespace) -> None:
    """Refuse, before any timing, a point this engine cannot run."""
    kv_tokens = engine.kv.num_blocks * engine.kv.block_size
    longest = max(max(args.prompt_lens), max(args.context_lens) + args.decode_steps + 16)
    if longest > engine.max_model_len:
        raise ValueError(f"{longest} tokens is more than max_model_len {engine.max_model_len}")
    if max(args.batch_sizes) > args.max_num_seqs:
        raise ValueError(f"--batch-sizes go past --max-num-seqs {args.max_num_seqs}")
    if len(set(args.prompt_lens)) < 2 or len(set(args.batch_sizes)) < 2:
        raise ValueError("give at least 2 --prompt-lens and 2 --batch-sizes")
    for batch in args.batch_sizes:
        for context in args.context_lens:
            needed = batch * (context + args.decode_steps + 16 + engine.kv.block_size)
            if needed > kv_tokens:
                raise ValueError(
                    f"batch {batch} x context {context} needs ~{needed} KV tokens, the engine "
                    f"has {kv_tokens}: raise --kv-cache-gib or lower the point"
                )


def lone_prefill_s(engine: Engine, prompt: list[int], req_id: str) -> float:
    """Seconds from add_request to the first (and only) token of one prompt alone."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(req_id, prompt, params)
    while engine.has_unfinished_requests:
        engine.step()
    return time.perf_counter() - start


def measure_prefill(engine: Engine, args: argparse.Namespace) -> list[dict[str, Any]]:
    vocab = engine.model_config.vocab_size
    points = []
    for length in sorted(set(args.prompt_lens)):
        prompts = random_prompts(args.repeats, length, vocab, args.seed + length)
        times = [lone_prefill_s(engine, p, f"p{length}-{i}") for i, p in enumerate(prompts)]
        seconds = statistics.median(times)
        points.append({"prompt_len": length, "tokens_per_s": round(length / seconds, 1)})
        log(f"prefill {length:>6} tokens: {1000 * seconds:8.1f} ms ({length / seconds:.0f} tok/s)")
    return points


def measure_decode(engine: Engine, args: argparse.Namespace) -> list[dict[str, Any]]:
    points = []
    for i, batch in enumerate(sorted(set(args.batch_sizes))):
        for j, context in enumerate(sorted(set(args.context_lens))):
            seed = args.seed + 1000 * (i + 1) + j
            times = decode_step_times(engine, batch, context, args.decode_steps, seed)
            finish_all(engine)
            step_ms = round(1000 * statistics.median(times), 3)
            points.append({"batch": batch, "context": context, "step_ms": step_ms})
            log(f"decode batch {batch:>4} context {context:>6}: {step_ms:8.2f} ms/step")
    return points


def device_name(engine: Engine) -> str:
    if engine.device.type == "cuda":
        return torch.cuda.get_device_name(engine.device)
    return f"cpu, {torch.get_num_threads()} torch threads"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvrelay-profile-") as scratch:
        engine = build_engine(args, scratch)
    try:
        check_fits(engine, args)
    except ValueError as e:
        log(f"error: {e}")
        return 2
    log(f"engine ready ({engine.model_id}, {device_name(engine)}); warm-up")
    lone_prefill_s(engine, random_prompts(1, 32, engine.model_config.vocab_size, 7)[0], "warm")
    finish_all(engine)
    profile = {
        "version": VERSION,
        "model": f"{args.shape} (random weights)" if args.shape else engine.model_id,
        "device": device_name(engine),
        "prefill": {"points": measure_prefill(engine, args)},
        "decode": {
            "points": measure_decode(engine, args),
            "max_batch": args.max_num_seqs,
            "kv_capacity_tokens": engine.kv.num_blocks * engine.kv.block_size,
        },
        "measured": {
            "date_utc": datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S"),
            "command": shlex.join(["python", "-m", "bench.pool_profile", *(argv or sys.argv[1:])]),
            "torch": torch.__version__,
            "dtype": str(resolve_dtype(args.dtype, engine.device)).removeprefix("torch."),
            "seconds": round(time.perf_counter() - started, 1),
        },
    }
    parse_profile(profile)  # what it writes, `kvrelay plan` reads
    text = json.dumps(profile, indent=2) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
        log(f"wrote {args.out} in {time.perf_counter() - started:.0f} s")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
