"""Runs one serve_bench workload against the router: warmup, then each conversation (one
request, or multi-turn's turns one after the other) started at its arrival offset through one
client, and the per-request records for the JSON report. Owns the client (its connection) for
the length of one run.
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
    SpreadClient,
    grpc_model_id,
    served_model_id,
)
from bench.lib.serve_stats import Slo, summarize
from bench.lib.serve_workload import (
    Conversation,
    TextEncoder,
    arrival_offsets,
    text_encoder,
    warmup_requests,
    with_chat_text,
)


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
    client: Client | SpreadClient,
    conversations: Sequence[Conversation],
    offsets: Sequence[float],
    concurrency: int,
    max_duration_s: float,
    think_time_s: float = 0.0,
    encode: TextEncoder | None = None,
) -> tuple[list[RequestResult], float, float]:
    """Start each conversation at its offset; within one, each turn is sent when the one before
    it finishes (after think_time_s), its prompt holding what the one before generated (its
    output ids, or with `encode` its output text encoded: Conversation.next_request). At most
    `concurrency` requests in flight when > 0. A failed turn stops its conversation (its later
    turns fail unsent); what has not finished within max_duration_s is cancelled and fails.
    Returns (one result per turn, in index order; t0; duration from t0 to the last
    completion)."""
    semaphore = asyncio.Semaphore(concurrency) if concurrency > 0 else None
    progress = Progress(sum(len(c.turns) for c in conversations))
    done: dict[int, RequestResult] = {}  # request index -> its result
    t0 = time.perf_counter()

    async def one(conversation: Conversation, offset: float) -> None:
        delay = t0 + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        request: BenchRequest | None = conversation.first_request()
        while request is not None:
            async with semaphore or contextlib.nullcontext():
                result = await client.send(request)
            done[request.index] = result
            progress.update(result)
            if not result.ok:
                return
            request = conversation.next_request(request, result, encode)
            if request is not None and think_time_s > 0:
                await asyncio.sleep(think_time_s)

    tasks = [asyncio.create_task(one(c, o)) for c, o in zip(conversations, offsets, strict=True)]
    try:
        _, pending = await asyncio.wait(tasks, timeout=max_duration_s)
    finally:  # past the deadline, or interrupted: no request outlives this call
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    results = []
    for conversation, task in zip(conversations, tasks, strict=True):
        for turn in conversation.turns:
            if turn.index in done:
                results.append(done[turn.index])
            elif task in pending:
                results.append(RequestResult.unsent(turn, "unfinished at --max-duration"))
            elif not task.cancelled() and task.exception() is not None:
                results.append(RequestResult.unsent(turn, repr(task.exception())))
            else:
                results.append(RequestResult.unsent(turn, "not sent: an earlier turn failed"))
    ends = [r.start + r.e2e_s for r in results if r.ok]
    return results, t0, (max(ends) - t0) if ends else 0.0


def make_client(
    args: argparse.Namespace, url: str, target: str, model: str
) -> Client | SpreadClient:
    """A client of the server at url / target, or of several (comma-separated, in the same
    order) spread by conversation."""
    sampling = Sampling(args.temperature, not args.no_ignore_eos, args.sampling_seed)
    if args.transport == "grpc":
        clients: list[Client] = [
            GrpcClient(t, sampling, args.request_timeout) for t in target.split(",")
        ]
    else:
        chat = args.endpoint == "chat"
        clients = [
            HttpClient(u, model, sampling, args.request_timeout, chat=chat) for u in url.split(",")
        ]
    return clients[0] if len(clients) == 1 else SpreadClient(clients)


class BenchRun(NamedTuple):
    """One run: its report (model, summary, per-request records) and the results behind it."""

    report: dict[str, Any]
    results: list[RequestResult]


async def run_conversations(
    args: argparse.Namespace, conversations: Sequence[Conversation], url: str, target: str
) -> BenchRun:
    """Warmup requests, then each conversation started at its args.rate arrival time."""
    model = args.model
    if not model:
        first_url, first_target = url.split(",")[0], target.split(",")[0]
        model = await (
            served_model_id(first_url) if args.transport == "http" else grpc_model_id(first_target)
        )
    encode = None  # gRPC streams carry the generated ids; HTTP streams text (text_encoder)
    if args.workload == "multi-turn" and args.transport == "http":
        encode = text_encoder(args.tokenizer)
    client = make_client(args, url, target, model)
    try:
        warmups = warmup_requests(args)
        if args.endpoint == "chat":
            warmups = with_chat_text(warmups, args.tokenizer)
        for request in warmups:
            result = await client.send(request)
            if not result.ok:
                raise RuntimeError(f"warmup request failed: {result.error}")
        num_requests = sum(len(c.turns) for c in conversations)
        log(f"warmup: {len(warmups)} request(s) done; sending {num_requests} requests")
        results, t0, duration = await run_timed(
            client,
            conversations,
            arrival_offsets(args),
            args.concurrency,
            args.max_duration,
            args.think_time_s,
            encode,
        )
    finally:
        await client.close()
    slo = Slo(args.slo_ttft_ms, args.slo_tpot_ms)
    report = {
        "model": model,
        "summary": summarize(results, duration, slo),
        "requests": [request_record(r, t0) for r in results],
    }
    return BenchRun(report, results)


def request_record(r: RequestResult, t0: float) -> dict[str, Any]:
    record: dict[str, Any] = {
        "index": r.index,
        "group": r.group,
        "conversation": r.conversation,
        "turn": r.turn,
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
    if r.conversation >= 0 and r.output_text:  # multi-turn over HTTP: what the next turn resent
        record["output_text"] = r.output_text
    return record
