"""Timing primitives for one engine on a GPU: device copy bandwidth, wall time of decode steps,
CUDA-graph replay time, kernel time by kind inside a replay and one layer's kernel timeline,
and host + device time of decode steps mid-run. Stateless: the requests live in the caller's engine.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from engine.engine import Engine
from engine.sampling.sampling_params import SamplingParams

GiB = 1 << 30


def copy_bandwidth(device: torch.device, nbytes: int = 4 * GiB, iters: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting the bytes read and written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / statistics.median(times)


def random_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (num, length), generator=gen).tolist()


def decode_step_times(
    engine: Engine, batch: int, prompt_len: int, num_steps: int, seed: int = 0
) -> list[float]:
    """Wall time of num_steps pure-decode engine steps at a batch of `batch` sequences."""
    params = SamplingParams(max_tokens=num_steps + 8, temperature=0, ignore_eos=True)
    prompts = random_prompts(batch, prompt_len, engine.model_config.vocab_size, seed)
    req_ids = [f"d{seed}-{i}" for i in range(batch)]
    for req_id, prompt in zip(req_ids, prompts, strict=True):
        engine.add_request(req_id, prompt, params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running) or (
        engine.scheduler.waiting
    ):
        engine.step()
    for _ in range(3):  # warm-up decode steps
        engine.step()
    times = []
    for _ in range(num_steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times


def finish_all(engine: Engine) -> None:
    for req_id in list(engine.scheduler.requests):
        engine.abort(req_id)
    engine.assert_no_leaks()


@torch.inference_mode()  # the graph's static buffers are inference tensors
def graph_replay_time(
    engine: Engine, batch_size: int, iters: int = 100, *, with_head: bool = False
) -> float:
    """Seconds per replay of the last-planned graph (device time, no host work); with_head:
    each replay followed by the LM head over its hidden states, as a decode step runs them
    (the graph stops at the final norm)."""
    graph = engine.runner.graphs._graphs[batch_size]
    hidden = engine.runner.graphs._hidden[:batch_size]
    model = engine.runner.model

    def once() -> None:
        graph.replay()
        if with_head:
            model.compute_logits(hidden)

    return event_ms(once, iters) / 1e3


def event_ms(work: Callable[[], Any], repeats: int) -> float:
    """Milliseconds of GPU time per call of work (e.g. a graph's replay): one call to warm up,
    then `repeats` timed back to back with CUDA events."""
    work()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        work()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats


def cuda_spans(prof: Any) -> list[tuple[float, float, str]]:
    """A profile's GPU kernels and copies as (start, end, name), in us."""
    return [
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    ]


# kernel names that are matrix products (dot_rows: the FP8 few-row products, gemv: the fused
# few-row GEMVs)
MATMUL_KERNELS = (
    "gemm",
    "gemv",
    "nvjet",
    "cutlass",
    "xmma",
    "cublas",
    "splitk",
    "dot_rows",
)
# kernel_mha: XQA's decode kernel
ATTENTION_KERNELS = ("prefill", "decode", "merge_state", "attention", "kernel_mha")


def kernel_kind(name: str) -> str:
    """matmul, attention, copy or elementwise/other, by a GPU kernel's name."""
    low = name.lower()
    if any(k in low for k in MATMUL_KERNELS):
        return "matmul"
    if any(k in low for k in ATTENTION_KERNELS):
        return "attention"
    if "memcpy" in low or "memset" in low:
        return "copy"
    return "elementwise/other"


def kernel_summary(prof: Any, iters: int, top: int = 12) -> dict[str, Any]:
    """GPU kernel time by kind (matmul, attention, copy, other) per iteration of a profiled
    region, with the top kernels by time."""
    kinds: dict[str, float] = {}
    kernels: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = event.name
        kind = kernel_kind(name)
        us = event.device_time_total if hasattr(event, "device_time_total") else event.cuda_time
        kinds[kind] = kinds.get(kind, 0.0) + us / iters / 1e3
        kernels.setdefault(name[:90], []).append(us)
    ranked = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:top]
    return {
        "kernel_ms_by_kind": kinds,
        "kernel_ms_total": sum(kinds.values()),
        "kernels_per_iter": sum(len(v) for v in kernels.values()) / iters,
        "top_kernels_ms": {name: sum(v) / iters / 1e3 for name, v in ranked},
    }


def kernel_profile(engine: Engine, batch_size: int, iters: int = 5) -> dict[str, Any]:
    """GPU kernel time by kind inside replays of the last-planned graph (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    graph = engine.runner.graphs._graphs[batch_size]
    torch.cuda.synchronize()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            graph.replay()
        torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / iters
    spans = cuda_spans(prof)
    return kernel_summary(prof, iters) | {
        "replay_wall_ms_profiled": wall * 1e3,
        "layer_timeline": layer_timeline(spans, iters),
    }


def layer_timeline(spans: list[tuple[float, float, str]], iters: int) -> list[dict[str, Any]]:
    """One layer's kernels as the replays ran them, from (start, end, name) spans in us of
    `iters` identical replays: the shortest period of kernel names that repeats over the middle
    half of a replay, and for each kernel of one period (starting at the middle) its median
    time, the median gap from its end to the next kernel's start (negative: they overlap) and
    its share, the median time from the previous kernel's end to its own (what it adds to the
    replay where kernels overlap under PDL; the shares of a layer sum to its time), over every
    repeat in the middle half of every replay. [] when no period is found, and when the spans
    are not `iters` replays of one sequence of kernels (too few, or a replay that differs)."""
    ordered = sorted(spans)
    per_iter = len(ordered) // iters if iters > 0 else 0
    if per_iter < 4 or per_iter * iters != len(ordered):
        return []
    names = [name for _, _, name in ordered[:per_iter]]
    replay_names = (ordered[r * per_iter : (r + 1) * per_iter] for r in range(iters))
    if any([name for _, _, name in replay] != names for replay in replay_names):
        return []
    middle = range(per_iter // 4, 3 * per_iter // 4)
    period = next(
        (
            p
            for p in range(1, len(middle) // 2 + 1)
            if all(names[j] == names[j + p] for j in middle)
        ),
        0,
    )
    if not period:
        return []
    times: list[list[float]] = [[] for _ in range(period)]
    gaps: list[list[float]] = [[] for _ in range(period)]
    shares: list[list[float]] = [[] for _ in range(period)]
    for replay in range(iters):
        base = replay * per_iter
        for j in range(per_iter // 4, 3 * per_iter // 4 - 1):
            start, end, _ = ordered[base + j]
            slot = (j - per_iter // 2) % period
            times[slot].append(end - start)
            gaps[slot].append(ordered[base + j + 1][0] - end)
            shares[slot].append(end - ordered[base + j - 1][1])
    first = per_iter // 2
    return [
        {
            "kernel": names[first + slot][:60],
            "us": statistics.median(times[slot]),
            "gap_after_us": statistics.median(gaps[slot]),
            "share_us": statistics.median(shares[slot]),
        }
        for slot in range(period)
    ]


def profile_prefill_steps(engine: Engine, num_steps: int = 3) -> dict[str, Any]:
    """GPU kernel time by kind over the engine's next steps, taken while prompts still wait
    (steps that carry prefill chunks beside the decodes) and queued as in steady running
    (profiled_steps): their wall time and the GPU's idle time, per step."""
    start = time.perf_counter()
    running = len(engine.scheduler.running)
    prof, wall = profiled_steps(engine, num_steps)
    idle = gpu_idle(prof, num_steps)
    return kernel_summary(prof, num_steps, top=20) | {
        "steps": num_steps,
        "running_before": running,
        "max_num_batched_tokens": engine.config.scheduler.max_num_batched_tokens,
        "step_wall_ms_profiled": wall / num_steps * 1e3,
        "gpu_idle_ms_per_step": idle["idle"],
        "gpu_idle_gaps_by_neighbours": idle["gaps_by_neighbours"],
        "seconds": time.perf_counter() - start,
    }


def idle_gaps(spans: list[tuple[float, float]]) -> list[float]:
    """The gaps (same unit as spans) in which none of the (start, end) spans runs, in time
    order, between the first start and the last end."""
    gaps: list[float] = []
    ordered = sorted(spans)
    reach = ordered[0][1]
    for start, end in ordered[1:]:
        if start > reach:
            gaps.append(start - reach)
        reach = max(reach, end)
    return gaps


def gaps_by_neighbours(
    spans: list[tuple[float, float, str]], num_steps: int, top: int = 8
) -> list[dict[str, Any]]:
    """The idle gaps between (start, end, name) spans summed by what ran last before each gap
    and what ran first after it: the top pairs by total, in ms per step, with their counts."""
    ordered = sorted(spans)
    totals: dict[tuple[str, str], list[float]] = {}
    reach, last = ordered[0][1], ordered[0][2]
    for start, end, name in ordered[1:]:
        if start > reach:
            totals.setdefault((last[:70], name[:70]), []).append(start - reach)
        if end > reach:
            reach, last = end, name
    ranked = sorted(totals.items(), key=lambda kv: -sum(kv[1]))[:top]
    return [
        {
            "before": before,
            "after": after,
            "ms_per_step": sum(gaps) / num_steps / 1e3,
            "count": len(gaps),
            "largest_us": max(gaps),
        }
        for (before, after), gaps in ranked
    ]


def split_idle(gaps: list[float], num_steps: int) -> dict[str, float]:
    """Idle time per step, in total and split: the num_steps - 1 longest gaps are taken as the
    boundaries between steps (host work the overlap did not hide), the rest as gaps inside a
    step (between a graph's kernels, and around the work outside it). An estimate: it assumes
    no gap inside a step outlasts a boundary's."""
    boundaries = sorted(gaps, reverse=True)[: max(0, num_steps - 1)]
    total = sum(gaps)
    return {
        "idle": total / num_steps,
        "between_steps": sum(boundaries) / num_steps,
        "within_steps": (total - sum(boundaries)) / num_steps,
    }


def profiled_steps(engine: Engine, num_steps: int) -> tuple[Any, float]:
    """Profile (CUDA activity) num_steps engine steps queued as in steady running; returns the
    profiler and those steps' wall seconds. The GPU is drained first, then one warm-up step,
    with the profiler already on but not recording, queues a step ahead again: right after a
    drain, a step's host work (planning, uploading its inputs) would show as GPU time lost,
    which in steady steps runs while the step before is on the GPU. In GPU-bound steps each
    step() returns when the step before it has run, so the wall is num_steps steps' GPU time."""
    from torch.profiler import ProfilerActivity, profile, schedule

    torch.cuda.synchronize()
    plan = schedule(wait=0, warmup=1, active=num_steps, repeat=1)
    with profile(activities=[ProfilerActivity.CUDA], schedule=plan) as prof:
        engine.step()
        prof.step()
        start = time.perf_counter()
        for _ in range(num_steps - 1):
            engine.step()
            prof.step()
        engine.step()
        wall = time.perf_counter() - start  # before the last prof.step(): it builds the trace
        prof.step()
    return prof, wall


def gpu_idle(prof: Any, num_steps: int) -> dict[str, Any]:
    """A profile's GPU idle time in ms per step (CUPTI's kernel and copy spans, merged): in
    total, between steps and inside them (split_idle), and by the kernels on either side of
    the gaps (gaps_by_neighbours)."""
    spans = cuda_spans(prof)
    us = split_idle(idle_gaps([(start, end) for start, end, _ in spans]), num_steps)
    idle: dict[str, Any] = {name: value / 1e3 for name, value in us.items()}
    return idle | {"gaps_by_neighbours": gaps_by_neighbours(spans, num_steps)}


def gpu_idle_per_step(engine: Engine, num_steps: int) -> dict[str, Any]:
    """gpu_idle over num_steps steady engine steps (profiled_steps)."""
    prof, _ = profiled_steps(engine, num_steps)
    return gpu_idle(prof, num_steps)


def profile_decode_steps(engine: Engine, num_steps: int = 10) -> dict[str, Any]:
    """Host (cProfile) and device (graph replay) time of decode steps at the current batch."""
    import cProfile
    import io
    import pstats

    start = time.perf_counter()
    batch = len(engine.scheduler.running)
    plain = []
    for _ in range(num_steps):
        t0 = time.perf_counter()
        engine.step()
        plain.append(time.perf_counter() - t0)
    padded = engine.runner.graphs.padded_size(batch) if engine.runner.graphs else None
    replay = graph_replay_time(engine, padded, iters=10) if padded else None
    kernels = kernel_profile(engine, padded, iters=3) if padded else None
    idle = gpu_idle_per_step(engine, num_steps=10)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(num_steps):
        engine.step()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(15)
    return {
        "batch": batch,
        "engine_step_ms": statistics.median(plain) * 1e3,
        "graph_replay_ms": None if replay is None else replay * 1e3,
        "graph_kernels": kernels,
        "gpu_idle_ms_per_step": idle["idle"],
        "gpu_idle_ms_between_steps": idle["between_steps"],
        "gpu_idle_ms_within_steps": idle["within_steps"],
        "gpu_idle_gaps_by_neighbours": idle["gaps_by_neighbours"],
        "cprofile_tottime_top15": text.getvalue()[-4000:],
        "seconds": time.perf_counter() - start,
    }
