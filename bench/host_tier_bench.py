"""The host tier of the prefix cache on a shared-prefix workload whose working set is several
times the device pool: K system prompts asked in turn, R rounds, one at a time (beside
--background long decodes, if any); the same engine with and without --host-kv-gib, and with
copies back on the step's stream instead of beside the step in flight (--rows).
Prints prompt tokens computed, host hits and TTFT p50 (add to first token, in-process), and
with --profile (CUDA) how much of the copies' time a kernel ran beside; owns no state.

    python -m bench.host_tier_bench [--device cpu] [--json out.json]
    python -m bench.host_tier_bench --device cuda --model FOLDER --load-format dummy
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
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
from engine.sampling_params import SamplingParams


def build(args: argparse.Namespace, host_bytes: int) -> Engine:
    cache = CacheConfig(num_blocks=args.device_blocks, host_kv_cache_bytes=host_bytes)
    # room beside the background decodes: a measured request never waits for a seat
    scheduler = SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=8 + args.background)
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
def profiled(path: str | None, device: str, overlap: dict[str, float]) -> Iterator[None]:
    """With a path: profile the block (CPU and CUDA) and write the top ops by time there;
    `overlap` gets copy_overlap's figures."""
    if path is None:
        yield
        return
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        yield
    overlap.update(copy_overlap(prof.events()))
    table = prof.key_averages()
    with open(path, "w") as f:
        for key in ("self_cuda_time_total", "cpu_time_total"):
            if key.startswith("self_cuda") and device != "cuda":
                continue
            f.write(table.table(sort_by=key, row_limit=25) + "\n")


def copy_overlap(events: Any) -> dict[str, float]:
    """Host-to-device copy time on the GPU, and how much of it some kernel ran beside."""
    copies, kernels = [], []
    for event in events:
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        span = (event.time_range.start, event.time_range.end)
        if event.name.startswith("Memcpy HtoD"):
            copies.append(span)
        elif not event.name.startswith(("Memcpy", "Memset")):
            kernels.append(span)
    merged: list[list[float]] = []
    for start, end in sorted(kernels):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    total = sum(end - start for start, end in copies)
    beside = sum(
        max(0.0, min(end, k_end) - max(start, k_start))
        for start, end in copies
        for k_start, k_end in merged
    )
    return {"htod_ms": round(total / 1000, 2), "htod_beside_a_kernel_ms": round(beside / 1000, 2)}


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


def run(args: argparse.Namespace, host_bytes: int, ahead: bool = True) -> dict[str, Any]:
    engine = build(args, host_bytes)
    engine.copies.copy_back_ahead = ahead
    prompts = workload(engine, args)
    if args.prompts_json:
        with open(args.prompts_json, "w") as f:
            json.dump(prompts, f)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    background = Background(engine, args.background)
    ttfts, computed, overlap = [], 0, {}
    for i, prompt in enumerate(prompts):
        profile = None
        if args.profile and host_bytes and i == len(prompts) - 1:
            profile = args.profile if ahead else f"{args.profile}.in_step"
        with profiled(profile, args.device, overlap):
            req_id, first, cached = f"r{i}", None, 0
            background.top_up()
            for _ in range(args.background and 2):  # arrive while a decode step is in flight
                background.seen(engine.step())
            start = time.perf_counter()
            engine.add_request(req_id, prompt, params)
            while engine.is_unfinished(req_id):
                for out in background.seen(engine.step()):
                    if out.req_id == req_id:
                        first = first or time.perf_counter() - start
                        cached = out.num_cached_tokens
        ttfts.append(1000 * (first or 0.0))
        computed += len(prompt) - cached
    background.stop()
    engine.assert_no_leaks()
    copy_rates = copy_rates_gb_s(engine, -(-len(prompts[-1]) // 16)) if host_bytes else {}
    tier = engine.kv.host_tier
    return {
        "host_kv_bytes": host_bytes,
        "copy_back": None if not host_bytes else "beside the step" if ahead else "in the step",
        "host_slots": 0 if tier is None else tier.num_slots,
        "prompt_tokens": sum(len(p) for p in prompts),
        "prompt_tokens_computed": computed,
        "host_hit_blocks": engine.kv.num_host_hit_blocks,
        "offloaded_blocks": 0 if tier is None else tier.num_stored,
        "copies_beside_step": engine.copies.num_copies_ahead,
        "copies_in_step": engine.copies.num_copies_in_step,
        "ttft_p50_ms": round(statistics.median(ttfts), 1),
        "ttft_ms": [round(t, 1) for t in ttfts],
        "background_decodes": args.background,
        "background_tokens": background.num_tokens,
        "profiled_last_request": overlap,
        "copy_gb_s": copy_rates,
        "working_set_blocks": sum(-(-len(p) // 16) for p in prompts[: args.num_systems]),
        "device_blocks": args.device_blocks,
    }


class Background:
    """N long greedy decodes of unrelated prompts kept running beside the measured requests
    (so a step is in flight when a host hit arrives), replaced as they end."""

    def __init__(self, engine: Engine, num: int):
        self.engine, self.num, self.num_tokens = engine, num, 0
        self.live: set[str] = set()
        self._ids = itertools.count()
        self._params = SamplingParams(max_tokens=192, temperature=0.0, ignore_eos=True)

    def top_up(self) -> None:
        while len(self.live) < self.num:
            k = next(self._ids)
            prompt = [100 + (k * 7919 + j * 104729) % 20000 for j in range(32)]
            self.engine.add_request(f"bg{k}", prompt, self._params)
            self.live.add(f"bg{k}")

    def seen(self, outputs: list[Any]) -> list[Any]:
        for out in outputs:
            if out.req_id in self.live:
                self.num_tokens += len(out.new_token_ids)
                if out.finished:
                    self.live.discard(out.req_id)
        return outputs

    def stop(self) -> None:
        for req_id in self.live:
            self.engine.abort(req_id)
        while self.engine.has_unfinished_requests:
            self.engine.step()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--device", default="cpu")
    p.add_argument("--num-systems", type=int, default=6)
    p.add_argument("--system-rules", type=int, default=45, help="~11 tokens each")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device-blocks", type=int, default=64, help="the device pool (16 tokens)")
    p.add_argument("--host-kv-gib", type=float, default=1.0)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--background", type=int, default=0, help="long decodes run beside")
    p.add_argument(
        "--rows",
        default="none,ahead",
        help="engines to run in this order: none (no tier), ahead (copies back beside the step"
        " in flight), in-step (on the step's stream); comma-separated, repeats allowed",
    )
    p.add_argument("--json")
    p.add_argument("--profile", help="profile the last request with the tier; top ops here")
    p.add_argument("--prompts-json", help="also write the prompts' token ids (for a vLLM peer)")
    args = p.parse_args()
    host_bytes = int(args.host_kv_gib * (1 << 30))
    modes = args.rows.split(",")
    if "none" not in modes or not set(modes) <= {"none", "ahead", "in-step"}:
        p.error(f"--rows {args.rows!r}: none, ahead or in-step, comma-separated, with none")
    rows = []
    for mode in modes:
        rows.append(run(args, 0 if mode == "none" else host_bytes, ahead=mode != "in-step"))
        print(json.dumps(rows[-1]), flush=True)
    without = next(row for row in rows if not row["host_kv_bytes"])
    tiered = next((row for row in rows if row["host_kv_bytes"]), without)
    ratio = tiered["prompt_tokens_computed"] / max(1, without["prompt_tokens_computed"])
    print(f"prompt tokens computed with the host tier / without: {ratio:.2f}")
    report = report_header("python -m bench.host_tier_bench " + json.dumps(vars(args)))
    write_report(args.json, {**report, "rows": rows, "computed_ratio": ratio})


if __name__ == "__main__":
    main()
