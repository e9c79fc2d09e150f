"""Runs one serve_bench workload against the router: warmup, then each request sent at its
arrival offset through one client, and the per-request records for the JSON report. Owns the
client (its connection) for the length of one run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

from bench.lib.serve_client import (
    BenchRequest,
    Client,
    GrpcClient,
    HttpClient,
    RequestResult,
    Sampling,
    grpc_model_id,
    served_model_id,
)
from bench.lib.serve_stats import summarize
from bench.lib.serve_workload import arrival_offsets, warmup_requests, with_chat_text


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class Progress:
    """Completion counts on stderr, every tenth of the run or every 10 s."""

    def __init__(self, total: int):
        self.total, self.done, self.failed = total, 0, 0
        self.started = self.last = time.monotonic()
        self.step = max(1, total // 10)

    def update(self, result: RequestResult) -> None:
        self.done += 1
        self.failed += not result.ok
        now = time.monotonic()
        if self.done % self.step == 0 or self.done == self.total or now - self.last > 10:
            self.last = now
            log(
                f"  {self.done}/{self.total} done ({self.failed} failed),"
                f" {now - self.started:.1f} s"
            )


async def run_timed(
    client: Client,
    requests: Sequence[BenchRequest],
    offsets: Sequence[float],
    concurrency: int,
    max_duration_s: float,
) -> tuple[list[RequestResult], float, float]:
    """Send each request at its offset (at most `concurrency` in flight when > 0); requests
    not finished within max_duration_s are cancelled and count as failed.
    Returns (results, t0, duration from t0 to the last completion)."""
    semaphore = asyncio.Semaphore(concurrency) if concurrency > 0 else None
    progress = Progress(len(requests))
    t0 = time.perf_counter()

    async def one(request: BenchRequest, offset: float) -> RequestResult:
        delay = t0 + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        async with semaphore or contextlib.nullcontext():
            result = await client.send(request)
        progress.update(result)
        return result

    tasks = [asyncio.create_task(one(r, o)) for r, o in zip(requests, offsets, strict=True)]
    try:
        done, pending = await asyncio.wait(tasks, timeout=max_duration_s)
    finally:  # past the deadline, or interrupted: no request outlives this call
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    results = []
    for request, task in zip(requests, tasks, strict=True):
        if task in done and task.exception() is None:
            results.append(task.result())
        else:
            error = "unfinished at --max-duration" if task in pending else repr(task.exception())
            results.append(RequestResult(request.index, request.group, error=error))
    ends = [r.start + r.e2e_s for r in results if r.ok]
    return results, t0, (max(ends) - t0) if ends else 0.0


def make_client(args: argparse.Namespace, url: str, target: str, model: str) -> Client:
    sampling = Sampling(args.temperature, not args.no_ignore_eos, args.sampling_seed)
    if args.transport == "grpc":
        return GrpcClient(target, sampling, args.request_timeout)
    return HttpClient(url, model, sampling, args.request_timeout, chat=args.endpoint == "chat")


class BenchRun(NamedTuple):
    """One run: its report (model, summary, per-request records) and the results behind it."""

    report: dict[str, Any]
    results: list[RequestResult]


async def run_bench(
    args: argparse.Namespace, requests: list[BenchRequest], url: str, target: str
) -> BenchRun:
    """Warmup requests, then `requests` at args.rate (a scalar: one of serve_args.rate_runs)."""
    model = args.model
    if not model:
        model = await (served_model_id(url) if args.transport == "http" else grpc_model_id(target))
    client = make_client(args, url, target, model)
    try:
        warmups = warmup_requests(args)
        if args.endpoint == "chat":
            warmups = with_chat_text(warmups, args.tokenizer)
        for request in warmups:
            result = await client.send(request)
            if not result.ok:
                raise RuntimeError(f"warmup request failed: {result.error}")
        log(f"warmup: {len(warmups)} request(s) done; sending {len(requests)} requests")
        offsets = arrival_offsets(args)
        results, t0, duration = await run_timed(
            client, requests, offsets, args.concurrency, args.max_duration
        )
    finally:
        await client.close()
    report = {
        "model": model,
        "summary": summarize(results, duration),
        "requests": [request_record(r, t0) for r in results],
    }
    return BenchRun(report, results)


def request_record(r: RequestResult, t0: float) -> dict[str, Any]:
    return {
        "index": r.index,
        "group": r.group,
        "ok": r.ok,
        "error": r.error,
        "send_s": r.start - t0 if r.start else None,
        "ttft_s": r.ttft_s,
        "tpot_s": r.tpot_s,
        "e2e_s": r.e2e_s,
        "prompt_tokens": r.prompt_tokens,
        "cached_tokens": r.cached_tokens,
        "output_tokens": r.output_tokens,
        "num_chunks": len(r.token_times),
        "finish_reason": r.finish_reason,
    }
