"""Resizing under load: an embedded cluster serves a steady request rate while the decode pool
goes 1 -> 2 -> 1 and the prefill pool 1 -> 2 -> 1 through the controller (what `kvrelay scale`
calls). Reports the time from `scale` to the new worker ready and serving, the drain time, and
the request latency percentiles during and outside the resizes. Owns nothing beyond one run.

    python -m bench.scale_bench --rate 2 --json scale.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from datetime import UTC, datetime
from typing import Any

from bench.lib.cluster_watch import settle
from bench.lib.steady_load import BackendClient, RequestRecord, SteadyLoad
from common.cluster_state import ClusterStatus, ScaleRequest, WorkerState, WorkerStatus
from engine.config import CacheConfig, EngineConfig
from engine.sampling_params import SamplingParams

HANG_BOUND_S = 600.0  # a request still running this long after its start is cancelled


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


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from deploy.local_cluster import ClusterSpec, LocalCluster
    from engine.tokenizer import Tokenizer

    os.environ.setdefault("RAY_worker_niceness", "0")  # Ray's 15 starves workers on 2 cores
    spec = ClusterSpec(
        engine=EngineConfig(cache=CacheConfig(num_blocks=512)),
        threads_per_worker=1,
        drain_grace_s=args.drain_grace,
    )
    cluster = await LocalCluster(spec).start(progress=log)
    tokenizer = Tokenizer(cluster.model.checkpoint_dir)
    prompts = [
        tuple(tokenizer.apply_chat_template([{"role": "user", "content": f"Fact {i} please."}]))
        for i in range(32)
    ]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    load = SteadyLoad(BackendClient(cluster.backend, prompts, params), len(prompts), args.rate, "b")
    runner = asyncio.create_task(load.run())
    resizes = []
    try:
        await asyncio.sleep(args.quiet_s)
        for role, size in (("decode", 2), ("decode", 1), ("prefill", 2), ("prefill", 1)):
            log(f"scale {role} -> {size}")
            called = time.time()
            await cluster.controller.scale.remote(ScaleRequest(**{role: size}))
            await settle(cluster.controller)
            status: ClusterStatus = await cluster.controller.status.remote()
            settled = time.time()
            worker = status.pool(role).workers[-1] if size == 2 else None
            entry: dict[str, Any] = {"role": role, "to": size, "start": called, "end": settled}
            if size == 2 and worker is not None:
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
        await cluster.close()

    def during(sample: RequestRecord) -> bool:
        end = sample.end or time.time()
        return any(sample.start < r["end"] and end > r["start"] for r in resizes)

    inside = [s for s in load.records if during(s)]
    outside = [s for s in load.records if not during(s)]
    return {
        "command": "python -m bench.scale_bench " + " ".join(sys.argv[1:]),
        "machine": f"{platform.node()} {os.cpu_count()} cores, {platform.processor() or 'cpu'}",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "rate": args.rate,
        "max_tokens": args.max_tokens,
        "num_requests": len(load.records),
        "num_failed": sum(not s.completed for s in load.records),
        "resizes": resizes,
        "latency_during_resize": {
            "e2e_s": percentiles([s.end - s.start for s in inside if s.end]),
            "ttft_s": percentiles([ttft(s) for s in inside]),
        },
        "latency_outside_resize": {
            "e2e_s": percentiles([s.end - s.start for s in outside if s.end]),
            "ttft_s": percentiles([ttft(s) for s in outside]),
        },
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=2.0, help="requests per second")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--quiet-s", type=float, default=10.0, help="steady load between resizes")
    parser.add_argument("--drain-grace", type=float, default=2.0)
    parser.add_argument("--json", default=None, help="write the results here too")
    args = parser.parse_args()
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
