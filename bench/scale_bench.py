"""Resizing under load: an embedded cluster serves a steady request rate while its pools are
resized through the controller (what `kvrelay scale` calls; by default the decode pool goes
1 -> 2 -> 1, then the prefill pool 1 -> 2 -> 1). Reports the time from `scale` to the new
worker ready and serving, the drain time, failed requests, the largest stranded-block figure
seen and whether every worker's blocks were free at the end, and TTFT / TPOT / e2e percentiles
before, during and after the resizes. Owns nothing beyond one run.

    python -m bench.scale_bench --rate 2 --json scale.json
    python -m bench.scale_bench --device cuda --model /tmp/served-8b --load-format dummy \\
        --prefill 2 --decode 1 --resizes decode:2 --input-len 3000 --max-tokens 150 --rate 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from bench.lib.cluster_watch import settle, wait_all_free
from bench.lib.engine_config import engine_config, gib
from bench.lib.gpu_timing import random_prompts
from bench.lib.steady_load import BackendClient, RequestRecord, SteadyLoad
from bench.lib.stranded_watch import StrandedWatch
from common.cluster_state import ClusterStatus, ScaleRequest, WorkerState, WorkerStatus
from common.messages import ServedModel
from engine.config import EngineConfig
from engine.sampling.sampling_params import SamplingParams

HANG_BOUND_S = 600.0  # a request still running this long after its start is cancelled
FREE_TIMEOUT_S = 60.0  # after the load: how long every worker's blocks may take to come free


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def at(worker: WorkerStatus, state: WorkerState) -> float:
    return next(t.at for t in worker.transitions if t.state == state)


def ttft(sample: RequestRecord) -> float:
    return (sample.first or sample.end or time.time()) - sample.start


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "n": len(ordered)}


def parse_resizes(text: str) -> list[tuple[str, int]]:
    """The --resizes plan, "decode:2 decode:1" -> [("decode", 2), ("decode", 1)]; a word that
    is not role:size is refused by name."""
    steps = []
    for word in text.split():
        role, _, size = word.partition(":")
        if role not in ("prefill", "decode") or not size.isdigit() or int(size) < 1:
            raise ValueError(f"--resizes: {word!r} is not prefill:N or decode:N with N >= 1")
        steps.append((role, int(size)))
    return steps


def cluster_engine(args: argparse.Namespace) -> EngineConfig:
    """CPU: a fixed 512-block pool; a GPU: the pool sized by memory unless --kv-cache-gib."""
    return engine_config(
        args.model,
        device=args.device,
        load_format=args.load_format,
        num_blocks=512 if args.device == "cpu" and args.kv_cache_gib <= 0 else None,
        kv_cache_memory_bytes=gib(args.kv_cache_gib) if args.kv_cache_gib > 0 else None,
    )


def load_prompts(args: argparse.Namespace, model: ServedModel) -> list[tuple[int, ...]]:
    """--input-len 0: 32 short chat prompts; else --num-prompts prompts of that many random
    token ids (the load cycles through them: as many as it sends keeps the prefix cache cold)."""
    if args.input_len > 0:
        prompts = random_prompts(args.num_prompts, args.input_len, model.vocab_size, seed=0)
        return [tuple(prompt) for prompt in prompts]
    from engine.tokenizer import Tokenizer

    tokenizer = Tokenizer(model.checkpoint_dir)
    return [
        tuple(tokenizer.apply_chat_template([{"role": "user", "content": f"Fact {i} please."}]))
        for i in range(32)
    ]


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from deploy.local_cluster import ClusterSpec, LocalCluster

    os.environ.setdefault("RAY_worker_niceness", "0")  # Ray's 15 starves workers on 2 cores
    spec = ClusterSpec(
        engine=cluster_engine(args),
        num_prefill=args.prefill,
        num_decode=args.decode,
        threads_per_worker=1 if args.device == "cpu" else None,
        drain_grace_s=args.drain_grace,
        gpus_per_worker=args.gpus_per_worker,
    )
    cluster = await LocalCluster(spec).start(progress=log)
    prompts = load_prompts(args, cluster.model)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    load = SteadyLoad(BackendClient(cluster.backend, prompts, params), len(prompts), args.rate, "b")
    runner = asyncio.create_task(load.run())
    stranded = StrandedWatch(cluster)
    stranded.start()
    resizes = []
    accounts: dict[str, Any] = {}
    free_after_s = 0.0
    try:
        await asyncio.sleep(args.quiet_s)
        for role, size in parse_resizes(args.resizes):
            log(f"scale {role} -> {size}")
            status: ClusterStatus = await cluster.controller.status.remote()
            grows = size > status.pool(role).desired
            called = time.time()
            await cluster.controller.scale.remote(ScaleRequest(**{role: size}))
            await settle(cluster.controller)
            status = await cluster.controller.status.remote()
            settled = time.time()
            worker = status.pool(role).workers[-1] if grows else None
            entry: dict[str, Any] = {"role": role, "to": size, "start": called, "end": settled}
            if grows and worker is not None:
                entry["scale_to_ready_s"] = at(worker, WorkerState.READY) - called
                await until_served(cluster.controller, worker.worker_id)
                status = await cluster.controller.status.remote()
                served = next(
                    w for w in status.pool(role).workers if w.worker_id == worker.worker_id
                )
                if served.stats and served.stats.first_request_at:
                    entry["scale_to_serving_s"] = served.stats.first_request_at - called
            else:
                gone = [w for w in status.pool(role).workers if w.state == WorkerState.GONE][-1]
                entry["drain_s"] = at(gone, WorkerState.GONE) - at(gone, WorkerState.DRAINING)
                entry["exit_check_clean"] = bool(gone.exit_check and gone.exit_check.clean)
            resizes.append(entry)
            log(json.dumps(entry))
            await asyncio.sleep(args.quiet_s)
    finally:
        load.stop()
        await runner
        await load.drain(HANG_BOUND_S)
        await stranded.stop()
        try:
            accounts, free_after_s = await wait_all_free(cluster, FREE_TIMEOUT_S)
        finally:
            await cluster.close()

    def during(sample: RequestRecord) -> bool:
        end = sample.end or time.time()
        return any(sample.start < r["end"] and end > r["start"] for r in resizes)

    inside = [s for s in load.records if during(s)]
    outside = [s for s in load.records if not during(s)]
    first = min((r["start"] for r in resizes), default=time.time())
    last = max((r["end"] for r in resizes), default=time.time())
    before = [s for s in outside if (s.end or time.time()) <= first]
    after = [s for s in outside if s.start >= last]
    return {
        "command": "python -m bench.scale_bench " + " ".join(sys.argv[1:]),
        "machine": f"{platform.node()} {os.cpu_count()} cores, {platform.processor() or 'cpu'}",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "rate": args.rate,
        "max_tokens": args.max_tokens,
        "num_requests": len(load.records),
        "num_failed": sum(not s.completed for s in load.records),
        "resizes": resizes,
        "cluster": {
            "device": args.device,
            "model": args.model,
            "prefill": args.prefill,
            "decode": args.decode,
            "input_len": args.input_len or "short chat prompts",
        },
        "max_stranded_blocks": stranded.max_stranded,
        "all_blocks_free_at_end": bool(accounts) and all(a.clean for a in accounts.values()),
        "all_free_after_s": round(free_after_s, 1),
        "latency_during_resize": latency(inside),
        "latency_outside_resize": latency(outside),
        "latency_before_resizes": latency(before),
        "latency_after_resizes": latency(after),
    }


def tpot(sample: RequestRecord) -> float | None:
    """Seconds a token after the first, for a request that ended with more than one."""
    if sample.end is None or sample.first is None or len(sample.token_ids) < 2:
        return None
    return (sample.end - sample.first) / (len(sample.token_ids) - 1)


def latency(samples: list[RequestRecord]) -> dict[str, dict[str, float]]:
    return {
        "e2e_s": percentiles([s.end - s.start for s in samples if s.end]),
        "ttft_s": percentiles([ttft(s) for s in samples]),
        "tpot_s": percentiles([t for s in samples if (t := tpot(s)) is not None]),
    }


async def until_served(controller: Any, worker_id: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status: ClusterStatus = await controller.status.remote()
        for pool in status.pools:
            for worker in pool.workers:
                if worker.worker_id == worker_id and worker.stats and worker.stats.num_requests:
                    return
        await asyncio.sleep(0.1)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=2.0, help="requests per second")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--quiet-s", type=float, default=10.0, help="steady load between resizes")
    parser.add_argument("--drain-grace", type=float, default=2.0)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--model", default="default", help="a model folder, or 'default'")
    parser.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    parser.add_argument("--prefill", type=int, default=1, help="prefill workers at the start")
    parser.add_argument("--decode", type=int, default=1, help="decode workers at the start")
    parser.add_argument(
        "--resizes",
        default="decode:2 decode:1 prefill:2 prefill:1",
        help="the pool sizes to scale to, in order, each after --quiet-s of steady load",
    )
    parser.add_argument("--input-len", type=int, default=0, help="0: short chat prompts")
    parser.add_argument("--num-prompts", type=int, default=32, help="with --input-len")
    parser.add_argument("--kv-cache-gib", type=float, default=0.0, help="0: the default pool")
    parser.add_argument("--gpus-per-worker", type=float, default=None)
    parser.add_argument("--json", default=None, help="write the results here too")
    args = parser.parse_args(argv)
    try:
        parse_resizes(args.resizes)
    except ValueError as e:
        parser.error(str(e))
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    results = asyncio.run(run(args))
    text = json.dumps(results, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
