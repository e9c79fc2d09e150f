"""GPU engine bench on a random-weight model of a real shape (default Llama-3.1-8B, bf16;
--quantization fp8: FP8 weights, the roofline then counts their bytes; --shape qwen3-30b-a3b: the
sparse-MoE shape, whose batch-1 roofline counts the top-k experts a layer reads).

Measures, in one process: the device-copy bandwidth; the decode step time at batch 1 with CUDA
graphs against the HBM roofline (bytes read / that bandwidth): the graph replay against the
bytes the graph reads (every weight but the LM head's, and the KV), the replay plus the LM
head and the whole engine step against all the step's bytes ("b1"); and offline throughput
(ignore_eos) on a workload of --num-requests x (--input-len in, --output-len out), with kernel
profiles of three steps that carry prefill chunks and of decode replays at the first and the
last wave's batch (their steps' time and tokens left out of the throughput) ("offline"); on a
MoE shape first one MoE layer's CUDA-graph time against the weight bytes it reads at several
token counts (bench/lib/moe_timing.py) ("moe"); and mixed steps ("mixed", bench/lib/mixed_steps.py):
with B requests decoding (--mixed-batches) one fresh prompt of P tokens (--mixed-prompt-lens)
is added, --mixed-reps times per (B, P), and the step() calls that carry its chunk are timed
against the pure-decode calls around them, with overlapped steps (the engine's default: one call
launches the mixed step, the next waits for it) and without (one call does both): each call's
wall time, its host time by stage (schedule, inputs, attention plan, eager forward / graph
replay, LM head, sampling, the wait for the tokens, output), the GPU span of what it launched,
and for serial calls profiled alone the kernels' busy time against the call's wall (the GPU's
idle time inside it: host-bound or GPU-bound), the kernels by kind and cProfile's top functions;
the first repetition of each cell apart (kernel loading). With --tp N > 1 the engine splits the
model over N GPUs (ranks 1..N-1 in local processes, NCCL; each rank draws the random weights
and keeps its slices): "b1" and "offline" run as above, their weight bytes and roofline rank
0's (each GPU reads its own slices); "moe" and "mixed" are left out (they time one process's
whole model). The timing primitives are in bench/lib/gpu_timing.py. Owns no state; prints a
table last and writes full JSON to --json (rewritten after every section).

    python -m bench.gpu_engine_bench --json $OUT/gpu_engine_bench.json
    python -m bench.gpu_engine_bench --skip offline mixed --kv-gib 8 --max-num-seqs 8  # batch 1
    python -m bench.gpu_engine_bench --skip b1 offline --kv-gib 16 --max-num-seqs 128  # mixed
    python -m bench.gpu_engine_bench --shape qwen3-30b-a3b --tp 2 --kv-gib 0  # two GPUs
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.lib.engine_config import engine_config
from bench.lib.gpu_engine_report import environment, print_table
from bench.lib.gpu_timing import (
    GiB,
    copy_bandwidth,
    decode_step_times,
    finish_all,
    graph_replay_time,
    kernel_profile,
    profile_decode_steps,
    profile_prefill_steps,
    random_prompts,
)
from bench.lib.mixed_steps import mixed_steps
from bench.lib.moe_timing import moe_layer_times
from bench.lib.random_models import head_bytes, weight_bytes, write_random_model
from engine.engine import Engine
from engine.models.loader import random_model, read_model_config
from engine.quant.config import (
    QUANTIZATION_FLAGS,
    QUANTIZATION_HELP,
    quantization_from_flag,
    resolve_quantization,
)
from engine.sampling.sampling_params import SamplingParams


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def build_engine(
    folder: Path,
    model: torch.nn.Module | None,
    *,
    max_num_seqs: int | None,
    kv_bytes: int | None,
    kv_cache_dtype: str = "auto",
    max_num_batched_tokens: int = 8192,
    host_kv_bytes: int = 0,
    tp: int = 1,
) -> Engine:
    """model None: every rank draws its random weights (load_format "dummy"; --tp > 1)."""
    config = engine_config(
        str(folder),
        device="cuda",
        dtype="bfloat16",
        load_format="auto" if model is not None else "dummy",
        cuda_graph=True,
        kv_cache_memory_bytes=kv_bytes,
        kv_cache_dtype=kv_cache_dtype,
        host_kv_cache_bytes=host_kv_bytes,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        tensor_parallel_size=tp,
    )
    start = time.perf_counter()
    engine = Engine(config, model=model)
    log(
        f"engine (max_num_seqs={max_num_seqs}, KV {kv_cache_dtype}, TP {tp}) "
        f"built in {time.perf_counter() - start:.1f} s, backend {engine.attention_backend}"
    )
    return engine


def diagnosis(profiler: Any, engine: Engine) -> dict[str, Any]:
    """profiler(engine)'s result, or its error: a profile is diagnosis, not a result. Either
    way "seconds" says how long it took (the offline run leaves that time out)."""
    start = time.perf_counter()
    try:
        return profiler(engine)
    except Exception as exc:
        return {"error": repr(exc), "seconds": time.perf_counter() - start}


def decode_roofline(args: argparse.Namespace, engine: Engine, bandwidth: float) -> dict[str, Any]:
    """Batch-1 decode against the HBM roofline. The decode graph stops at the final norm (the
    LM head runs after it), so its replay is held to the bytes it reads (the LM head's weight
    left out); the replay plus the LM head and the engine step to all the step's bytes."""
    prompt_len = 512
    times = decode_step_times(engine, 1, prompt_len, args.decode_steps)
    replay = graph_replay_time(engine, 1)
    replay_and_head = graph_replay_time(engine, 1, with_head=True)
    profile = diagnosis(lambda engine: kernel_profile(engine, 1), engine)
    finish_all(engine)
    model = engine.runner.model
    weights = weight_bytes(model, read_per_decode_step=True)
    head = head_bytes(model)
    kv_itemsize = engine.kv_cache.element_size()
    kv = engine.model_config.kv_bytes_per_token(kv_itemsize) * (prompt_len + args.decode_steps // 2)
    tp = engine.config.tensor_parallel_size
    if tp > 1 and engine.model_config.num_kv_heads % tp == 0:  # each rank reads its KV heads
        kv //= tp
    roofline = (weights + kv) / bandwidth
    graph_roofline = (weights - head + kv) / bandwidth
    step = statistics.median(times)
    return {
        "batch": 1,
        "context_tokens": prompt_len,
        "weight_bytes_read_per_step": weights,
        "lm_head_bytes": head,
        "kv_bytes_read_per_step": kv,
        "roofline_ms": roofline * 1e3,
        "graph_roofline_ms": graph_roofline * 1e3,
        "engine_step_ms_median": step * 1e3,
        "engine_step_ms_p90": sorted(times)[int(0.9 * len(times))] * 1e3,
        "graph_replay_ms": replay * 1e3,
        "replay_and_head_ms": replay_and_head * 1e3,
        "engine_step_over_roofline": step / roofline,
        "graph_replay_over_graph_roofline": replay / graph_roofline,
        "replay_and_head_over_roofline": replay_and_head / roofline,
        "profile": profile,
    }


def offline_throughput(args: argparse.Namespace, engine: Engine) -> dict[str, Any]:
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    prompts = random_prompts(args.num_requests, args.input_len, engine.model_config.vocab_size, 99)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"t{i}", prompt, params)
    graph_steps_before = engine.runner.num_graph_steps
    preemptions_before = engine.scheduler.num_preemptions
    num_output = num_tail_steps = 0
    calls = {"graph": 0, "eager": 0}  # step() calls by the step they launched
    seconds = {"graph": 0.0, "eager": 0.0}
    start = time.perf_counter()
    truncated = False
    host_profile: dict[str, Any] = {}  # the last wave, halfway through its decodes
    first_wave_profile: dict[str, Any] = {}  # decodes after 400 graph steps, at full batch
    prefill_profile: dict[str, Any] = {}  # after 20 steps with prompts still waiting

    def profiled_seconds() -> float:  # left out of the elapsed time, as are their tokens
        profiles = (host_profile, first_wave_profile, prefill_profile)
        return sum(profile.get("seconds", 0.0) for profile in profiles)

    while engine.has_unfinished_requests:
        if time.perf_counter() - start - profiled_seconds() > args.time_budget:
            truncated = True
            break
        if num_tail_steps == args.output_len // 2 and not host_profile:
            host_profile = diagnosis(profile_decode_steps, engine)
            continue
        if calls["eager"] == 20 and not prefill_profile and engine.scheduler.waiting:
            prefill_profile = diagnosis(profile_prefill_steps, engine)
            continue
        if calls["graph"] == 400 and not first_wave_profile:
            first_wave_profile = diagnosis(profile_decode_steps, engine)
            continue
        if not engine.scheduler.waiting:  # the last wave: nothing left to admit
            num_tail_steps += 1
        graph_steps = engine.runner.num_graph_steps
        t0 = time.perf_counter()
        outputs = engine.step()
        kind = "graph" if engine.runner.num_graph_steps > graph_steps else "eager"
        calls[kind] += 1
        seconds[kind] += time.perf_counter() - t0
        num_output += sum(len(o.new_token_ids) for o in outputs)
    elapsed = time.perf_counter() - start - profiled_seconds()
    finish_all(engine)
    return {
        "host_profile_mid_decode": {k: v for k, v in host_profile.items() if k != "seconds"},
        "profile_first_wave_decode": {
            k: v for k, v in first_wave_profile.items() if k != "seconds"
        },
        "kernel_profile_prefill_steps": {
            k: v for k, v in prefill_profile.items() if k != "seconds"
        },
        "num_requests": args.num_requests,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "max_num_seqs": engine.config.scheduler.max_num_seqs,
        "kv_cache_dtype": str(engine.kv_cache.dtype).removeprefix("torch."),
        "kv_cache_tokens": engine.kv.num_blocks * engine.kv.block_size,
        "truncated_at_time_budget": truncated,
        "elapsed_s": elapsed,
        "output_tokens": num_output,
        "output_tokens_per_s": num_output / elapsed,
        "total_tokens_per_s": (num_output + args.num_requests * args.input_len) / elapsed
        if not truncated
        else None,
        "graph_step_calls": calls["graph"],
        "graph_time_s": seconds["graph"],
        "graph_step_ms_mean": seconds["graph"] / max(calls["graph"], 1) * 1e3,
        # steps with prefill chunks (with or without decodes): eager
        "eager_step_calls": calls["eager"],
        "eager_time_s": seconds["eager"],
        "graph_steps": engine.runner.num_graph_steps - graph_steps_before,
        "num_preemptions": engine.scheduler.num_preemptions - preemptions_before,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="llama-3.1-8b")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument(
        "--kv-gib",
        type=float,
        default=72.0,
        help="KV pool of the graph engine; 0: sized by GPU memory (--gpu-memory-utilization 0.9)",
    )
    p.add_argument(
        "--max-num-seqs", type=int, default=256, help="0: the engine's default for its pool"
    )
    p.add_argument(
        "--host-kv-gib",
        type=float,
        default=0.0,
        help="a host tier of the prefix cache: a preempted request's evicted blocks come back "
        "from it instead of being recomputed",
    )
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel size: the model split over this many GPUs (skips moe and mixed)",
    )
    p.add_argument(
        "--quantization", default="none", choices=QUANTIZATION_FLAGS, help=QUANTIZATION_HELP
    )
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=8192, help="the graph engine's step budget"
    )
    p.add_argument("--decode-steps", type=int, default=200)
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--input-len", type=int, default=1000)
    p.add_argument("--output-len", type=int, default=1000)
    p.add_argument("--time-budget", type=float, default=120.0, help="seconds, offline run")
    p.add_argument("--mixed-batches", type=int, nargs="+", default=[16, 64])
    p.add_argument("--mixed-prompt-lens", type=int, nargs="+", default=[64, 256, 1024])
    p.add_argument("--mixed-reps", type=int, default=5, help="per (B, P), besides the first")
    p.add_argument(
        "--mixed-context", type=int, default=256, help="prompt tokens of each decoding request"
    )
    p.add_argument(
        "--skip",
        nargs="*",
        action="extend",
        default=[],
        choices=["b1", "offline", "moe", "mixed"],
        help="sections left out (repeatable: the lists add up)",
    )
    args = p.parse_args()
    if args.tp < 1 or args.tp > torch.cuda.device_count():
        p.error(f"--tp {args.tp}: this machine has {torch.cuda.device_count()} GPUs")
    if args.tp > 1:
        if args.quantization != "none":  # the ranks draw bf16 weights
            p.error(f"--tp {args.tp}: bf16 weights only, not --quantization {args.quantization}")
        args.skip = sorted({*args.skip, "moe", "mixed"})
    device = torch.device("cuda")
    result: dict[str, Any] = {"env": environment(), "shape": args.shape}
    result["args"] = {**vars(args), "json": str(args.json)}

    def save() -> None:
        if args.json:
            args.json.write_text(json.dumps(result, indent=2))

    bandwidth = copy_bandwidth(device)
    result["copy_bandwidth_GBps"] = bandwidth / 1e9
    log(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    folder = write_random_model(tempfile.mkdtemp(prefix="kvrelay-"), args.shape, weights=False)
    config = read_model_config(folder)
    model = None
    if args.tp == 1:  # else each rank draws its own, in the engine
        start = time.perf_counter()
        quant = resolve_quantization(quantization_from_flag(args.quantization), None)
        model = random_model(
            config, config.max_position_embeddings, device, torch.bfloat16, quant=quant
        )
        elapsed = time.perf_counter() - start
        log(f"random {args.shape} ({args.quantization}) built in {elapsed:.1f} s")
        result["weight_bytes"] = weight_bytes(model)
    if model is not None and config.moe_layers and "moe" not in args.skip:
        result["moe_layer"] = moe_layer_times(model, bandwidth)
        log(json.dumps(result["moe_layer"]))
        save()
    graph = build_engine(
        folder,
        model,
        max_num_seqs=args.max_num_seqs or None,
        kv_bytes=int(args.kv_gib * GiB) or None,
        kv_cache_dtype=args.kv_cache_dtype,
        max_num_batched_tokens=args.max_num_batched_tokens,
        host_kv_bytes=int(args.host_kv_gib * GiB),
        tp=args.tp,
    )
    if model is None:  # rank 0's slices (what one GPU reads)
        result["weight_bytes"] = weight_bytes(graph.runner.model)
    if "b1" not in args.skip:
        result["decode_b1"] = decode_roofline(args, graph, bandwidth)
        log(json.dumps(result["decode_b1"]))
        save()
    if "mixed" not in args.skip:
        start = time.perf_counter()
        result["mixed"] = mixed_steps(
            graph,
            args.mixed_batches,
            args.mixed_prompt_lens,
            reps=args.mixed_reps,
            context_len=args.mixed_context,
            cuda=True,
        )
        log(f"mixed steps in {time.perf_counter() - start:.1f} s")
        save()
    if "offline" not in args.skip:
        result["offline"] = offline_throughput(args, graph)
        log(json.dumps(result["offline"]))
    save()
    print_table(result)


if __name__ == "__main__":
    main()
