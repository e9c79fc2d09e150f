"""Faults under load: an embedded cluster (2 prefill + 2 decode workers) serves a steady load
while one fault at a time is injected (workers killed at chosen moments, Redis down, a router
killed, workers frozen, an abort storm, malformed requests), with steady load before and
after each. For each: requests completed, migrated, failed with a clear error, hung (not ended
within a bound), blocks still in use on every live worker once the load drained and the
controller replaced what died, and whether every completed greedy output equals the
undisturbed engine's. Prints a markdown table, writes JSON. Owns nothing beyond one run.

    python -m bench.faults --json faults.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.lib.fault_injections import FAULTS
from bench.lib.fault_run import FaultRun, FaultSettings, Reference
from bench.lib.fault_table import markdown


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def chat_prompts(llm: Any, num: int) -> list[list[int]]:
    return [
        llm.chat_prompt([{"role": "user", "content": f"Tell me fact number {i} about rivers."}])
        for i in range(num)
    ]


def references(num_prompts: int, params: Any) -> tuple[list[list[int]], list[Reference]]:
    """The prompts and the undisturbed engine's greedy outputs (one Engine, this process)."""
    from engine.config import EngineConfig
    from engine.llm import LLM

    llm = LLM(EngineConfig())
    prompts = chat_prompts(llm, num_prompts)
    outputs = llm.generate(prompts, params)
    return prompts, [Reference(tuple(o.token_ids), o.text) for o in outputs]


async def serve_http(cluster: Any) -> Any:
    """The router's HTTP and gRPC servers over the cluster's in-process backend, as `kvrelay
    serve` runs them."""
    from router.frontend import Frontend
    from router.metrics import RouterMetrics
    from router.serve import RouterServers
    from router.tokenizer import RouterTokenizer

    metrics = RouterMetrics()
    cluster.backend.metrics = metrics
    tokenizer = RouterTokenizer(cluster.model.checkpoint_dir)
    servers = RouterServers(Frontend(cluster.backend, tokenizer, metrics))
    await servers.start("127.0.0.1", 0, 0)
    return servers


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from deploy.local_cluster import ClusterSpec, LocalCluster
    from engine.config import CacheConfig, EngineConfig
    from engine.sampling.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    log("computing the undisturbed engine's outputs")
    prompts, refs = references(args.num_prompts, params)
    spec = ClusterSpec(
        engine=EngineConfig(cache=CacheConfig(num_blocks=args.num_blocks)),
        num_prefill=2,
        num_decode=2,
        threads_per_worker=1,
        lease_s=args.lease_s,
    )
    report: dict[str, Any] = {
        "command": "python -m bench.faults " + " ".join(sys.argv[1:]),
        "machine": f"{platform.node()}, {os.cpu_count()} cores, {platform.processor() or 'cpu'}",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": _commit(),
        "load_average_before": os.getloadavg(),
        "setup": {
            "prefill": 2,
            "decode": 2,
            "rate": args.rate,
            "max_tokens": args.max_tokens,
            "num_prompts": args.num_prompts,
            "pre_s": args.pre_s,
            "post_s": args.post_s,
            "hang_bound_s": args.hang_bound_s,
            "lease_s": args.lease_s,
        },
        "faults": [],
    }
    started = time.monotonic()
    cluster = await LocalCluster(spec).start(progress=log)
    report["startup_s"] = round(time.monotonic() - started, 1)
    servers = await serve_http(cluster)
    settings = FaultSettings(
        args.rate, args.pre_s, args.post_s, args.hang_bound_s, args.lease_s + 30.0
    )
    log_dir = Path(tempfile.mkdtemp(prefix="kvrelay-faults-"))
    faults = FAULTS if not args.only else [f for f in FAULTS if f.key in args.only]
    http_base = servers.http_url("127.0.0.1").removesuffix("/v1")
    fault_run = FaultRun(cluster, http_base, prompts, refs, params, settings, log_dir)
    try:
        for fault in faults:
            log(f"fault: {fault.title}")
            phase = await fault_run.phase(fault)
            log(json.dumps(phase))
            report["faults"].append(phase)
            _save(args.json, report)
    finally:
        await servers.stop(0)
        await cluster.close()
    report["load_average_after"] = os.getloadavg()
    report["duration_s"] = round(time.monotonic() - started, 1)
    return report


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True)
        return out.stdout.decode().strip()
    except OSError:
        return ""


def _save(path: str | None, report: dict[str, Any]) -> None:
    if path:
        Path(path).write_text(json.dumps(report, indent=2, default=str))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=1.0, help="requests per second")
    parser.add_argument("--max-tokens", type=int, default=20)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--num-blocks", type=int, default=512, help="KV blocks per worker")
    parser.add_argument("--pre-s", type=float, default=10.0, help="steady load before a fault")
    parser.add_argument("--post-s", type=float, default=15.0, help="steady load after it")
    parser.add_argument("--hang-bound-s", type=float, default=120.0)
    parser.add_argument("--lease-s", type=float, default=30.0, help="prefill lease")
    parser.add_argument("--only", nargs="*", help=f"faults to run: {[f.key for f in FAULTS]}")
    parser.add_argument("--json", default=None, help="write the results here too")
    args = parser.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_worker_niceness", "0")  # Ray's 15 starves workers on 2 cores
    logging.basicConfig(level=logging.WARNING)
    report = asyncio.run(run(args))
    _save(args.json, report)
    print(markdown(report["faults"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
