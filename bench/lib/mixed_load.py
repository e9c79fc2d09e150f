"""serve_bench --mix: an interactive tenant's requests (the --workload at --rate) beside a batch
tenant's flood (--mix-batch-requests sent at once), on one launched server with API keys and a
running bound, run twice: the batch key of class batch (priorities on: its requests run at -1,
after the interactive ones, in the router's queue and on the workers) and a batch key of no
class (priorities off: both tenants at 0, shared by the router's deficit round robin alone).
Holds no state beyond one run."""

from __future__ import annotations

import argparse
import asyncio
import copy
import shlex
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.lib.serve_client import (
    BenchRequest,
    HttpClient,
    RequestResult,
    Sampling,
    served_model_id,
)
from bench.lib.serve_launch import LaunchedServer
from bench.lib.serve_stats import Slo, format_table, summarize
from bench.lib.serve_workload import arrival_offsets, build_requests, warmup_requests

CHAT_KEY = "sk-bench-interactive-0123456789"
BATCH_KEY = "sk-bench-batch-class-0123456789"
PLAIN_KEY = "sk-bench-batch-plain-0123456789"
KEYS_FILE = f"{CHAT_KEY} chat\n{BATCH_KEY} jobs class=batch\n{PLAIN_KEY} jobs-plain\n"
MODES = {"priorities": BATCH_KEY, "no priorities": PLAIN_KEY}


def batch_requests(args: argparse.Namespace) -> list[BenchRequest]:
    """The flood: random prompts of --input-len from another seed, --mix-batch-output-len out."""
    flood = copy.copy(args)
    flood.workload, flood.seed = "random", args.seed + 500_009
    flood.num_requests, flood.output_len = args.mix_batch_requests, args.mix_batch_output_len
    return [
        BenchRequest(100_000 + r.index, r.prompt_ids, r.max_tokens) for r in build_requests(flood)
    ]


async def run_once(args: argparse.Namespace, url: str, batch_key: str) -> dict[str, Any]:
    model = args.model or await served_model_id(url, CHAT_KEY)
    sampling = Sampling(args.temperature, not args.no_ignore_eos, args.sampling_seed)
    chat = HttpClient(url, model, sampling, args.request_timeout, api_key=CHAT_KEY)
    batch = HttpClient(url, model, sampling, args.request_timeout, api_key=batch_key)
    tasks: list[asyncio.Task[RequestResult]] = []
    try:
        for request in warmup_requests(args):
            if not (await chat.send(request)).ok:
                raise RuntimeError("warmup request failed")
        t0 = time.perf_counter()

        async def at(offset: float, request: BenchRequest) -> RequestResult:
            await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
            return await chat.send(request)

        flood = [asyncio.create_task(batch.send(r)) for r in batch_requests(args)]
        pairs = zip(arrival_offsets(args), build_requests(args), strict=True)
        chats = [asyncio.create_task(at(offset, request)) for offset, request in pairs]
        tasks = flood + chats
        chat_results = await asyncio.gather(*chats)
        batch_results = await asyncio.gather(*flood)
    finally:  # one failed: the others are cancelled before their clients close
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await chat.close()
        await batch.close()
    slo = Slo(args.slo_ttft_ms, args.slo_tpot_ms)
    return {
        "interactive": summarize(chat_results, _span(chat_results, t0), slo),
        "batch": summarize(batch_results, _span(batch_results, t0), slo),
    }


def _span(results: list[RequestResult], t0: float) -> float:
    ends = [r.start + r.e2e_s for r in results if r.ok]
    return max(ends) - t0 if ends else 0.0


def run_mix(args: argparse.Namespace) -> dict[str, Any]:
    """Both modes on one launched server; prints each table, returns the report's "mix"."""
    with tempfile.TemporaryDirectory("serve_bench_mix") as tmp:
        keys = Path(tmp) / "keys"
        keys.write_text(KEYS_FILE)
        keys.chmod(0o600)
        extra = ["--api-keys", str(keys), "--max-running-requests", str(args.mix_max_running)]
        server = LaunchedServer(
            args.prefill,
            args.decode,
            args.policy,
            [*shlex.split(args.server_args), *extra],
            args.startup_timeout,
            worker_niceness=args.worker_niceness,
            server_root=args.server_root,
        )
        report: dict[str, Any] = {}
        with server:
            for k, (mode, key) in enumerate(MODES.items()):
                drawn = copy.copy(args)  # other prompts each mode: no prefix hit on the last's
                drawn.seed = args.seed + 10_007 * k
                report[mode] = asyncio.run(run_once(drawn, server.http_url, key))
                for side in ("interactive", "batch"):
                    print(format_table(report[mode][side], f"--mix {mode}: {side}"))
        report["server"] = server.describe()
    return report
