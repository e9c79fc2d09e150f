"""The host tier of the prefix cache on a shared-prefix workload whose working set is several
times the device pool: K system prompts asked in turn, R rounds, one at a time; the same engine
without and with --host-kv-gib. Prints prompt tokens computed, host hits, TTFT p50 (add to first
token, in-process) and the tier's copy rates; --profile: the top ops of the last host hit. Owns
no state.

    python -m bench.host_tier_bench [--device cpu] [--json out.json]
    python -m bench.host_tier_bench --device cuda --model FOLDER --load-format dummy
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from bench.lib.run_report import report_header, write_report
from engine.config import DEFAULT_MODEL, CacheConfig, EngineConfig, SchedulerConfig
from engine.engine import Engine
from engine.kv_cache.manager import BlockCopy
from engine.sampling.sampling_params import SamplingParams


def build(args: argparse.Namespace, host_bytes: int, **tiers: Any) -> Engine:
    """tiers: more CacheConfig fields (the disk tier, the shared store: bench/kv_tiers_bench)."""
    cache = CacheConfig(num_blocks=args.device_blocks, host_kv_cache_bytes=host_bytes, **tiers)
    scheduler = SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=8)
    config = EngineConfig(
        args.model, cache, scheduler, device=args.device, load_format=args.load_format
    )
    return Engine(config)


def workload(engine: Engine, args: argparse.Namespace) -> list[list[int]]:
    assert engine.tokenizer is not None
    systems = [
        " ".join(f"Set {s} rule {j}: answer well and briefly." for j in range(args.system_rules))
        for s in range(args.num_systems)
    ]
    return [
        engine.tokenizer.apply_chat_template(
            [{"role": "system", "content": system}, {"role": "user", "content": f"Q{r}?"}]
        )
        for r in range(args.rounds)
        for system in systems
    ]


@contextlib.contextmanager
def profiled(path: str | None, device: str) -> Iterator[None]:
    """With a path: profile the block (CPU and CUDA) and write the top ops by time there."""
    if path is None:
        yield
        return
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        yield
    table = prof.key_averages()
    with open(path, "w") as f:
        for key in ("self_cuda_time_total", "cpu_time_total"):
            if key.startswith("self_cuda") and device != "cuda":
                continue
            f.write(table.table(sort_by=key, row_limit=25) + "\n")


def copy_rates_gb_s(engine: Engine, num_blocks: int) -> dict[str, float]:
    """The tier's copies of one prompt's worth of blocks, timed alone: the engine's per-block
    loop each way, against one copy of the same bytes (the link's rate). Run after the
    workload: it overwrites blocks' KV."""
    copies, sync = engine.copies, getattr(torch, engine.config.device).synchronize
    host = copies.host
    assert host is not None
    num_blocks = min(num_blocks, host.shape[0], copies.kv_cache.shape[0])
    ids = list(range(num_blocks))
    gigabytes = num_blocks * copies.kv_cache[0].nbytes / 1e9

    def timed(fn: Callable[[], object]) -> float:
        fn()
        sync()
        start = time.perf_counter()
        fn()
        sync()
        return round(gigabytes / (time.perf_counter() - start), 1)

    def loop(kind: str) -> None:
        copies.run([BlockCopy(i, i, kind) for i in ids])

    return {
        "to_host_per_block": timed(lambda: loop("to_host")),
        "from_host_per_block": timed(lambda: loop("from_host")),
        "from_host_one_copy": timed(
            lambda: copies.kv_cache[:num_blocks].copy_(host[:num_blocks], non_blocking=True)
        ),
        "to_host_one_copy": timed(
            lambda: host[:num_blocks].copy_(copies.kv_cache[:num_blocks], non_blocking=True)
        ),
        "blocks": num_blocks,
    }


def run(
    args: argparse.Namespace, host_bytes: int, copy_rates: bool = True, **tiers: Any
) -> dict[str, Any]:
    """One row: the workload on an engine with a host tier of host_bytes (and tiers: more
    CacheConfig fields); copy_rates: also measure the tier's copy rates."""
    engine = build(args, host_bytes, **tiers)
    prompts = workload(engine, args)
    if args.prompts_json:
        with open(args.prompts_json, "w") as f:
            json.dump(prompts, f)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    ttfts, computed = [], 0
    for i, prompt in enumerate(prompts):
        last_hit = args.profile and host_bytes and i == len(prompts) - 1
        with profiled(args.profile if last_hit else None, args.device):
            req_id, first, cached = f"r{i}", None, 0
            start = time.perf_counter()
            engine.add_request(req_id, prompt, params)
            while engine.is_unfinished(req_id):
                for out in engine.step():
                    if out.req_id == req_id:
                        first = first or time.perf_counter() - start
                        cached = out.num_cached_tokens
        ttfts.append(1000 * (first or 0.0))
        computed += len(prompt) - cached
    engine.assert_no_leaks()
    snapshot = engine.snapshot()
    if tiers:
        engine.shutdown()  # a clean stop: the disk tier (and the shared store) keep every block
    rates = {}
    if host_bytes and copy_rates:
        rates = copy_rates_gb_s(engine, -(-len(prompts[-1]) // 16))
    tier = engine.kv.host_tier
    return {
        "host_kv_bytes": host_bytes,
        "host_slots": 0 if tier is None else tier.num_slots,
        "prompt_tokens": sum(len(p) for p in prompts),
        "prompt_tokens_computed": computed,
        "host_hit_blocks": engine.kv.num_host_hit_blocks,
        "offloaded_blocks": 0 if tier is None else tier.num_stored,
        "ttft_p50_ms": round(statistics.median(ttfts), 1),
        "ttft_ms": [round(t, 1) for t in ttfts],
        "copy_gb_s": rates,
        "working_set_blocks": sum(-(-len(p) // 16) for p in prompts[: args.num_systems]),
        "device_blocks": args.device_blocks,
        "tiers": [t._asdict() for t in snapshot.tiers],
    }


def add_workload_flags(
    p: argparse.ArgumentParser, rounds: int, host_kv_gib: float, host_help: str | None = None
) -> None:
    """The shared-prefix workload's flags and the engine's pools (run() reads them)."""
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--device", default="cpu")
    p.add_argument("--num-systems", type=int, default=6)
    p.add_argument("--system-rules", type=int, default=45, help="~11 tokens each")
    p.add_argument("--rounds", type=int, default=rounds)
    p.add_argument("--device-blocks", type=int, default=64, help="the device pool (16 tokens)")
    p.add_argument("--host-kv-gib", type=float, default=host_kv_gib, help=host_help)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--json")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_flags(p, rounds=3, host_kv_gib=1.0)
    p.add_argument("--profile", help="profile the last request with the tier; top ops here")
    p.add_argument("--prompts-json", help="also write the prompts' token ids (for a vLLM peer)")
    args = p.parse_args()
    host_bytes = int(args.host_kv_gib * (1 << 30))
    rows = []
    for row_bytes in (0, host_bytes):
        rows.append(run(args, row_bytes))
        print(json.dumps(rows[-1]), flush=True)
    without, tiered = rows
    ratio = tiered["prompt_tokens_computed"] / max(1, without["prompt_tokens_computed"])
    print(f"prompt tokens computed with the host tier / without: {ratio:.2f}")
    report = report_header("python -m bench.host_tier_bench " + json.dumps(vars(args)))
    write_report(args.json, {**report, "rows": rows, "computed_ratio": ratio})


if __name__ == "__main__":
    main()
