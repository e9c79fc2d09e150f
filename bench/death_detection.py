"""Death detection: how long after a decode worker's process is SIGKILLed, or its whole node is
lost (raylet SIGKILLed), the GCS, the controller, Redis and an idle router stop counting it.

A real multi-node Ray cluster on this machine (`ray.cluster_utils.Cluster`, one raylet per
node, health checks as deploy/cluster.yaml sets them), a tiny random model, the controller
with 1 prefill + 2 decode workers and one router (its membership sync only: no stream runs,
so this is the slow path; a router streaming from the worker learns at its next long-poll).
Each trial waits for the replacement to be ready before the next; a lost node is replaced by
a fresh one. Prints a markdown table, writes JSON. Owns nothing beyond one run.

    python -m bench.death_detection --trials 5 --json death.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from typing import Any

HEALTH_CHECKS = {  # as deploy/cluster.yaml sets them
    "health_check_period_ms": 500,
    "health_check_timeout_ms": 1000,
    "health_check_failure_threshold": 3,
}
POLL_S = 0.02
OBSERVERS = ("gcs", "controller", "redis", "router")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


async def watch(
    controller: Any, backend: Any, worker_id: str, node_id: str, t0: float, node_lost: bool
) -> dict:
    """Seconds from t0 until each observer no longer counts the worker (node lost: GCS too)."""
    import ray

    seen: dict[str, float] = {}
    observers = OBSERVERS if node_lost else tuple(o for o in OBSERVERS if o != "gcs")
    while len(seen) < len(observers) and time.monotonic() - t0 < 60:
        now = time.monotonic() - t0
        status = await controller.status.remote(with_stats=False)
        [record] = [w for w in status.pool("decode").workers if w.worker_id == worker_id]
        if record.state == "gone":
            seen.setdefault("controller", now)
        if worker_id not in {w.worker_id for w in await backend.index.live_workers("decode")}:
            seen.setdefault("redis", now)
        if worker_id not in {w.worker_id for w in backend.workers.known("decode")}:
            seen.setdefault("router", now)
        if node_lost and not any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes()):
            seen.setdefault("gcs", now)
        await asyncio.sleep(POLL_S)
    return seen


async def settled(controller: Any, backend: Any, num_decode: int) -> dict[str, str]:
    """Wait until the decode pool is back to `num_decode` ready workers the router knows;
    returns worker id -> node id."""
    deadline = time.monotonic() + 300
    while True:
        status = await controller.status.remote(with_stats=False)
        ready = {
            w.worker_id: w.node_id for w in status.pool("decode").workers if w.state == "ready"
        }
        known = {w.worker_id for w in backend.workers.known("decode")}
        if len(ready) == num_decode and set(ready) == known:
            return ready
        if time.monotonic() > deadline:
            raise TimeoutError(f"the decode pool did not settle: {status.pool('decode')}")
        await asyncio.sleep(0.2)


async def run(trials: int) -> list[dict]:
    import ray
    from ray.cluster_utils import Cluster

    from deploy.controller import ControllerConfig, start_controller
    from deploy.progress import follow
    from deploy.redis_local import LocalRedis
    from deploy.router_launch import build_backend
    from deploy.worker_launch import WorkerTemplate
    from engine.config import CacheConfig, EngineConfig
    from tests.factories import make_tiny_checkpoint

    head = {"num_cpus": 2, "resources": {"prefill_pool": 1}, "_system_config": HEALTH_CHECKS}
    cluster = Cluster(initialize_head=True, head_node_args=head)
    decode_nodes = {}
    for _ in range(2):
        node = cluster.add_node(num_cpus=1, resources={"decode_pool": 1})
        decode_nodes[node.node_id] = node
    ray.init(address=cluster.address, namespace="kvrelay", log_to_driver=False)
    checkpoint = make_tiny_checkpoint(tempfile.mkdtemp(prefix="kvrelay-death-"))
    engine = EngineConfig(model=str(checkpoint), cache=CacheConfig(num_blocks=64))
    rows: list[dict] = []
    try:
        with LocalRedis() as redis:
            config = ControllerConfig(WorkerTemplate(engine, redis.url, threads_per_worker=1))
            controller = await start_controller(config, {"prefill": 1, "decode": 2})
            await follow(controller, lambda m: None, timeout_s=300)
            backend, _ = await build_backend(controller)
            try:
                for trial in range(trials):
                    for fault in ("process killed", "node lost"):
                        placed = await settled(controller, backend, 2)
                        worker_id, node_id = sorted(placed.items())[0]
                        status = await controller.status.remote(with_stats=False)
                        [record] = [
                            w for w in status.pool("decode").workers if w.worker_id == worker_id
                        ]
                        t0 = time.monotonic()
                        if fault == "process killed":
                            os.kill(record.pid, signal.SIGKILL)
                        else:
                            cluster.remove_node(decode_nodes.pop(node_id), allow_graceful=False)
                        seen = await watch(
                            controller, backend, worker_id, node_id, t0, fault == "node lost"
                        )
                        if fault == "node lost":
                            node = cluster.add_node(num_cpus=1, resources={"decode_pool": 1})
                            decode_nodes[node.node_id] = node
                        row = {"trial": trial, "fault": fault, "worker": worker_id, **seen}
                        log(
                            f"{fault:15s} {worker_id}: "
                            + ", ".join(f"{k} {v:.2f} s" for k, v in seen.items())
                        )
                        rows.append(row)
                await settled(controller, backend, 2)
            finally:
                await backend.close()
                await controller.shutdown.remote()
    finally:
        ray.shutdown()
        cluster.shutdown()
    return rows


def markdown(rows: list[dict]) -> str:
    lines = [
        "| fault | trials | " + " | ".join(f"{o} median / max (s)" for o in OBSERVERS) + " |",
        "|---|---|" + "---|" * len(OBSERVERS),
    ]
    for fault in ("process killed", "node lost"):
        mine = [r for r in rows if r["fault"] == fault]
        cells = []
        for observer in OBSERVERS:
            values = [r[observer] for r in mine if observer in r]
            if observer == "gcs" and fault == "process killed":
                cells.append("(node stays)")
            elif len(values) < len(mine):
                cells.append(f"missed in {len(mine) - len(values)} of {len(mine)}")
            else:
                cells.append(f"{statistics.median(values):.2f} / {max(values):.2f}")
        lines.append(f"| {fault} | {len(mine)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=5, help="of each fault")
    parser.add_argument("--json", default="", help="write the rows and the machine here")
    args = parser.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    rows = asyncio.run(run(args.trials))
    table = markdown(rows)
    print(table)
    if args.json:
        record = {
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "machine": f"{platform.node()} {os.cpu_count()} cores",
            "health_checks": HEALTH_CHECKS,
            "rows": rows,
            "table": table,
        }
        with open(args.json, "w") as f:
            json.dump(record, f, indent=2)


if __name__ == "__main__":
    main()
