"""Where a served request's first token spends its time, stage by stage (issue 52, item 1).

Starts one aggregated `kvrelay serve --prefill 0 --decode 1` (RAY_worker_niceness 0, as the
serve benches run it) that exports its traces (`--otlp-endpoint`) to a small OTLP/HTTP receiver
in this process, then sends N streaming /v1/completions requests one at a time (no queueing:
each waits for the previous one's end), short prompts of distinct text (no prefix-cache hit),
max_tokens 1. Each request carries a W3C traceparent of its own, so its spans (router and decode
worker) are found by trace id. Per request, on one wall clock (every process is on this host):

  client -> router      the client sends until the router's handler starts (kvrelay.request)
  prepare               parse, validate, tokenize, the fair queue, until router.route starts
  route                 router.route: placement (the Redis index lookups)
  submit -> engine      router.route ends until the decode span starts: the prefill_here Ray
                        call and the engine thread taking its command
  engine: before step   the decode span's start until its first step starts (the first_step
                        event less that step's wall time, kvrelay.step_ms): the engine thread's
                        other commands and its tick (transfers, the Redis index upkeep)
  engine: step          that step (engine.step(): the prompt computed, the first token sampled)
  worker -> router      the step's end (first_step) until the router's stream yields the first
                        chunk (the root span's first_token event): the mailbox, the long-poll's
                        Ray reply, the router's streams and detokenizing
  router -> client      first_token until the client has read that SSE chunk
  TTFT                  the client's send until that chunk

and, for reference, the engine's own step for the same prompts in this process (an Engine of
the same model on as many threads as the worker, add_request + step() alone). Prints the
median of each stage over the requests (the first `--warm-up` requests not counted), and with
--json the per-request rows too.

    python -m bench.ttft_breakdown            # 40 requests, ~60-200 token prompts, max_tokens 1
    python -m bench.ttft_breakdown -n 60 --server-root /tmp/base   # another checkout's server
"""

from __future__ import annotations

import argparse
import gzip
import http.client
import json
import os
import random
import statistics
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from bench.lib.serve_launch import ROOT, LaunchedServer, machine_info
from bench.lib.text_prompts import _random_text

MODEL = "SmolLM2-135M-Instruct"
STAGES = (
    "client -> router",
    "prepare",
    "route",
    "submit -> engine",
    "engine: before step",
    "engine: step",
    "worker -> router",
    "router -> client",
)


class SpanSink:
    """An OTLP/HTTP receiver (protobuf) on a free loopback port; keeps, by trace id, each span's
    name, start and end (ns since the epoch) and its events' names and times."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
            ExportTraceServiceResponse,
        )

        self.spans: dict[int, list[dict[str, Any]]] = {}
        self._lock = threading.Lock()
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                sink.receive(ExportTraceServiceRequest.FromString(body))
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def receive(self, request: Any) -> None:
        with self._lock:
            for resource in request.resource_spans:
                for scope in resource.scope_spans:
                    for span in scope.spans:
                        trace_id = int.from_bytes(span.trace_id, "big")
                        self.spans.setdefault(trace_id, []).append(
                            {
                                "name": span.name,
                                "start": span.start_time_unix_nano,
                                "end": span.end_time_unix_nano,
                                "events": {e.name: e.time_unix_nano for e in span.events},
                                "event_attributes": {
                                    e.name: {a.key: _value(a.value) for a in e.attributes}
                                    for e in span.events
                                },
                            }
                        )

    def wait_for(self, trace_id: int, names: set[str], timeout_s: float = 10.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                found = {s["name"]: s for s in self.spans.get(trace_id, [])}
            if names <= set(found):
                return found
            time.sleep(0.05)
        raise RuntimeError(f"trace {trace_id:032x}: spans {names - set(found)} never arrived")

    def close(self) -> None:
        self.server.shutdown()


def _value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    return None if kind is None else getattr(value, kind)


def prompts(num: int, seed: int, min_words: int, max_words: int) -> list[str]:
    rng = random.Random(seed)
    return [
        f"[{seed}-{i}] " + _random_text(rng, rng.randint(min_words, max_words)) for i in range(num)
    ]


def one_request(
    conn: http.client.HTTPConnection,
    prompt: str,
    trace_id: int,
    max_tokens: int = 1,
    model: str = MODEL,
) -> dict[str, Any]:
    """Send one streaming completion; wall-clock ns of the send and of the first text chunk."""
    body = json.dumps(
        {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
        }
    )
    headers = {
        "Content-Type": "application/json",
        "traceparent": f"00-{trace_id:032x}-{random.getrandbits(64) or 1:016x}-01",
    }
    sent = time.time_ns()
    conn.request("POST", "/v1/completions", body, headers)
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {response.read()[:500]!r}")
    first = None
    while True:
        line = response.readline()
        if not line:
            break
        if not line.startswith(b"data: "):
            continue
        data = line[6:].strip()
        if data == b"[DONE]":
            break
        chunk = json.loads(data)
        if first is None and chunk.get("choices") and "text" in chunk["choices"][0]:
            first = time.time_ns()
    response.read()
    if first is None:
        raise RuntimeError("no text chunk in the stream")
    return {"sent": sent, "first": first, "num_prompt_chars": len(prompt)}


def breakdown(req: dict[str, Any], spans: dict[str, Any]) -> dict[str, float]:
    """Stage -> ms for one request, from its client stamps and its spans."""
    root, route, decode = spans["kvrelay.request"], spans["router.route"], spans["decode"]
    first_step = decode["events"]["first_step"]
    step_ms = decode["event_attributes"]["first_step"].get("kvrelay.step_ms", 0.0)
    first_token = root["events"]["first_token"]
    ms = 1e-6
    return {
        "client -> router": (root["start"] - req["sent"]) * ms,
        "prepare": (route["start"] - root["start"]) * ms,
        "route": (route["end"] - route["start"]) * ms,
        "submit -> engine": (decode["start"] - route["end"]) * ms,
        "engine: before step": (first_step - decode["start"]) * ms - step_ms,
        "engine: step": step_ms,
        "worker -> router": (first_token - first_step) * ms,
        "router -> client": (req["first"] - first_token) * ms,
        "TTFT": (req["first"] - req["sent"]) * ms,
    }


def engine_steps(texts: list[str], threads: int, model: str | None) -> list[float]:
    """ms of add_request + the first step() of each prompt alone on an Engine in this process."""
    import torch

    from engine.engine import Engine, EngineConfig
    from engine.sampling.sampling_params import SamplingParams

    torch.set_num_threads(threads)
    engine = Engine(EngineConfig() if model is None else EngineConfig(model=model))
    params = SamplingParams(max_tokens=1, temperature=0.0)
    times = []
    for i, text in enumerate(texts):
        started = time.perf_counter()
        engine.add_request(f"ref-{i}", text, params)
        while engine.has_unfinished_requests:
            engine.step()
        times.append((time.perf_counter() - started) * 1000)
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("-n", "--num-requests", type=int, default=40)
    p.add_argument("--warm-up", type=int, default=5, help="first requests not counted")
    p.add_argument("--min-words", type=int, default=40, help="prompt length (words; ~1.3 tokens)")
    p.add_argument("--max-words", type=int, default=150)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--max-tokens",
        type=int,
        default=1,
        help="2: the engine steps on while the first token goes out",
    )
    p.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                   help="the worker's threads (serve's default: half the cores)")  # fmt: skip
    p.add_argument(
        "--model",
        default=None,
        help="serve this checkpoint instead of SmolLM2 (e.g. a 2-layer cut of it: a step then "
        "costs the host's Python more than its compute, as on a GPU)",
    )
    p.add_argument("--server-root", type=Path, default=ROOT, help="the checkout to serve")
    p.add_argument("--no-engine", action="store_true", help="skip the in-process engine steps")
    p.add_argument("--json", type=Path, default=None, help="write every row here")
    args = p.parse_args(argv)

    texts = prompts(args.num_requests, args.seed, args.min_words, args.max_words)
    sink = SpanSink()
    rows: list[dict[str, float]] = []
    extra = ["--threads-per-worker", str(args.threads), "--otlp-endpoint", sink.url]
    model = MODEL if args.model is None else ""  # "": the server's default model
    if args.model is not None:
        extra += ["--model", args.model]
    try:
        with LaunchedServer(
            prefill=0, decode=1, extra_args=extra, worker_niceness=0, server_root=args.server_root
        ) as server:
            conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
            for i, text in enumerate(texts):
                trace_id = random.getrandbits(128) or 1
                req = one_request(conn, text, trace_id, args.max_tokens, model)
                spans = sink.wait_for(trace_id, {"kvrelay.request", "router.route", "decode"})
                if i >= args.warm_up:
                    rows.append(breakdown(req, spans))
            conn.close()
    finally:
        sink.close()
    steps = [] if args.no_engine else engine_steps(texts[args.warm_up :], args.threads, args.model)

    print(
        f"# {len(rows)} requests, one at a time, max_tokens {args.max_tokens}; {args.server_root}"
    )
    print(f"# machine: {json.dumps(machine_info())}")
    print(f"{'stage':<24}{'p50 ms':>9}{'mean ms':>9}")
    table = {stage: [r[stage] for r in rows] for stage in (*STAGES, "TTFT")}
    if steps:
        table["engine alone (ref)"] = steps
    for stage, values in table.items():
        print(f"{stage:<24}{statistics.median(values):>9.2f}{statistics.mean(values):>9.2f}")
    if steps:
        outside = statistics.median([r["TTFT"] for r in rows]) - statistics.median(steps)
        print(f"{'TTFT - engine alone':<24}{outside:>9.2f}")
    if args.json is not None:
        args.json.write_text(json.dumps({"rows": rows, "engine_ms": steps}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
