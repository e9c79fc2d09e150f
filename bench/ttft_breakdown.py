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
                        event, stamped as the step's outputs come, less that step's wall time
                        kvrelay.step_ms): the engine thread's tick (transfers, the Redis index
                        upkeep) while the actor's loop answers the prefill_here call
  engine: step          that step (engine.step(): the prompt computed, the first token sampled)
  worker -> router      the step's end (first_step) until the router's stream yields the first
                        chunk (the root span's first_token event): the deltas built and put in
                        the mailbox, the long-poll's Ray reply, the router's streams and
                        detokenizing
  router -> client      first_token until the client has read that SSE chunk
  TTFT                  the client's send until that chunk

and, for reference, the engine's own step for the same prompts in this process (an Engine of
the same model on as many threads as the worker, add_request + step() alone). Prints the
median of each stage over the requests (the first `--warm-up` requests not counted), and with
--json the per-request rows too. Medians of stages need not add up to the median TTFT; means
do (a few slow requests, a GC pause or a span export beside them, weigh on the means).

On a CPU, SmolLM2's step is compute (torch releases the GIL); `--cut-layers 2` serves its first
two layers instead (same tokenizer, random-looking text), whose step, like a GPU's, is mostly
the host's Python: the engine thread then holds the GIL while the actor's loop answers.

    python -m bench.ttft_breakdown            # 40 requests, ~60-200 token prompts, max_tokens 1
    python -m bench.ttft_breakdown -n 60 --server-root /tmp/base   # another checkout's server
    python -m bench.ttft_breakdown --cut-layers 2 --max-tokens 4
    python -m bench.ttft_breakdown --cut-layers 2 --background 8   # beside 8 decoding streams

--background N keeps N streams decoding beside the measured requests (each sent again when it
ends), as a served worker decodes while prompts arrive: where the stages grow against the same
run without it, the engine thread's steps hold up the actor's loop (or the router's).
"""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.lib.otlp_receiver import OtlpReceiver, any_value
from bench.lib.serve_launch import ROOT, LaunchedServer, machine_info
from bench.lib.text_prompts import _random_text
from common.tracing import EXPORT_DELAY_MS

MODEL = "SmolLM2-135M-Instruct"
CONVERTED = "kvrelay_source.json"  # the GGUF conversion's marker: not copied to a cut
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


class SpanSink(OtlpReceiver):
    """The spans a server exports during the run, decoded after it (bench/lib/otlp_receiver.py)."""

    def spans(self) -> dict[int, dict[str, dict[str, Any]]]:
        """Trace id -> span name -> its start and end (ns since the epoch), its events' times
        and attributes, of every span received so far."""
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
        )

        bodies = self.bodies()
        traces: dict[int, dict[str, dict[str, Any]]] = {}
        for body in bodies:
            for resource in ExportTraceServiceRequest.FromString(body).resource_spans:
                for scope in resource.scope_spans:
                    for span in scope.spans:
                        trace_id = int.from_bytes(span.trace_id, "big")
                        traces.setdefault(trace_id, {})[span.name] = {
                            "name": span.name,
                            "start": span.start_time_unix_nano,
                            "end": span.end_time_unix_nano,
                            "events": {e.name: e.time_unix_nano for e in span.events},
                            "event_attributes": {
                                e.name: {a.key: any_value(a.value) for a in e.attributes}
                                for e in span.events
                            },
                        }
        return traces


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


class Background:
    """`num` streams decoding `max_tokens` tokens each (EOS ignored), each sent again when it
    ends, until stop(); their text is read and dropped."""

    def __init__(self, port: int, num: int, max_tokens: int, model: str):
        self.port, self.max_tokens, self.model = port, max_tokens, model
        self.num_done = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(num)
        ]
        for thread in self._threads:
            thread.start()

    def _run(self, index: int) -> None:
        rng = random.Random(10_000 + index)
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        while not self._stop.is_set():
            body = {
                "model": self.model,
                "prompt": f"[bg-{index}] " + _random_text(rng, 40),
                "max_tokens": self.max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
            try:
                conn.request("POST", "/v1/completions", json.dumps(body), {
                    "Content-Type": "application/json"})  # fmt: skip
                response = conn.getresponse()
                response.read()  # the whole stream
                if response.status != 200:
                    self.errors.append(f"HTTP {response.status}")
                    return
                self.num_done += 1
            except OSError as e:
                self.errors.append(repr(e))
                return
        conn.close()

    def wait_decoding(self, timeout_s: float = 120.0) -> None:
        """Give the streams time to reach the engine (a prompt step each) before measuring."""
        time.sleep(min(timeout_s, 2.0))
        if self.errors:
            raise RuntimeError(f"background streams failed: {self.errors[:3]}")

    def stop(self) -> None:
        """No stream is sent again; those running end on their own (bounded by max_tokens)."""
        self._stop.set()
        for thread in self._threads:
            thread.join(600)


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


def cut_checkpoint(num_layers: int) -> Path:
    """SmolLM2's checkpoint with its first `num_layers` layers alone, in a new temp folder."""
    import re

    from safetensors.torch import load_file, save_file

    from engine.models.loader import resolve_model

    src = resolve_model(MODEL)
    dst = Path(tempfile.mkdtemp(prefix=f"smollm2_{num_layers}layers_"))
    for file in src.iterdir():
        if file.suffix != ".safetensors" and file.name not in ("config.json", CONVERTED):
            (dst / file.name).write_bytes(file.read_bytes())
    config = json.loads((src / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    (dst / "config.json").write_text(json.dumps(config))
    layer = re.compile(r"layers\.(\d+)\.")
    tensors = {
        name: t
        for name, t in load_file(src / "model.safetensors").items()
        if (m := layer.search(name)) is None or int(m.group(1)) < num_layers
    }
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def engine_steps(
    texts: list[str], threads: int, model: str | None, dummy_cuda: bool = False
) -> list[float]:
    """ms of add_request + the first step() of each prompt alone on an Engine in this process."""
    import torch

    from engine.engine import Engine, EngineConfig
    from engine.sampling.sampling_params import SamplingParams

    torch.set_num_threads(threads)
    config = EngineConfig() if model is None else EngineConfig(model=model)
    if dummy_cuda:
        config = dataclasses.replace(config, load_format="dummy", device="cuda")
    engine = Engine(config)
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
        help="serve this checkpoint folder instead of SmolLM2",
    )
    p.add_argument(
        "--cut-layers",
        type=int,
        default=None,
        help="serve SmolLM2's first N layers alone (a checkpoint written to a temp folder)",
    )
    p.add_argument(
        "--dummy-cuda",
        action="store_true",
        help="--model's folder has no weights: serve and step it with random ones on the GPU "
        "(--load-format dummy --device cuda, as bench/served_goodput.sh serves it)",
    )
    p.add_argument(
        "--background",
        type=int,
        default=0,
        help="streams decoding beside the measured requests (each sent again when it ends)",
    )
    p.add_argument(
        "--background-tokens", type=int, default=256, help="each background stream's max_tokens"
    )
    p.add_argument("--server-root", type=Path, default=ROOT, help="the checkout to serve")
    p.add_argument("--no-engine", action="store_true", help="skip the in-process engine steps")
    p.add_argument("--json", type=Path, default=None, help="write every row here")
    args = p.parse_args(argv)
    if args.dummy_cuda and args.model is None:
        p.error("--dummy-cuda needs --model (a folder with config.json and a tokenizer)")
    if args.num_requests <= args.warm_up:
        p.error(f"-n {args.num_requests}: more than --warm-up {args.warm_up} requests are needed")

    if args.cut_layers is not None:
        args.model = str(cut_checkpoint(args.cut_layers))
    texts = prompts(args.num_requests, args.seed, args.min_words, args.max_words)
    sink = SpanSink()
    rows: list[dict[str, float]] = []
    sent: list[tuple[int, dict[str, Any]]] = []
    extra = ["--threads-per-worker", str(args.threads), "--otlp-endpoint", sink.url]
    model = MODEL if args.model is None else ""  # "": the server's default model
    if args.model is not None:
        extra += ["--model", args.model]
    if args.dummy_cuda:
        extra += ["--load-format", "dummy", "--device", "cuda"]
    try:
        with LaunchedServer(
            prefill=0,
            decode=1,
            extra_args=extra,
            worker_niceness=0,
            server_root=args.server_root,
        ) as server:
            background = None
            if args.background:
                background = Background(
                    server.http_port, args.background, args.background_tokens, model
                )
                background.wait_decoding()
            conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
            try:
                for text in texts:
                    trace_id = random.getrandbits(128) or 1
                    req = one_request(conn, text, trace_id, args.max_tokens, model)
                    sent.append((trace_id, req))
            finally:
                conn.close()
                if background is not None:
                    background.stop()
            if background is not None and background.errors:
                raise RuntimeError(f"background streams failed: {background.errors[:3]}")
            time.sleep(3 * EXPORT_DELAY_MS / 1000)  # every span exported
        traces = sink.spans()
    finally:
        sink.close()
    for trace_id, req in sent[args.warm_up :]:
        spans = traces.get(trace_id, {})
        if not {"kvrelay.request", "router.route", "decode"} <= set(spans):
            raise RuntimeError(f"trace {trace_id:032x}: only spans {sorted(spans)} arrived")
        rows.append(breakdown(req, spans))
    steps = (
        []
        if args.no_engine
        else engine_steps(texts[args.warm_up :], args.threads, args.model, args.dummy_cuda)
    )

    beside = (
        f", beside {args.background} streams decoding {args.background_tokens} tokens each"
        if args.background
        else ""
    )
    print(
        f"# {len(rows)} requests, one at a time, max_tokens {args.max_tokens}{beside}; "
        f"{args.server_root}"
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
