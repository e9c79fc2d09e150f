"""Does one large request stall everyone else? (issue 46, defect 1.) While one client sends a big
chat body to /v1/chat/completions, another polls /health every 50 ms; prints the big request's
status and time, and the slowest /health answer while it was in flight. Owns nothing beyond one
run.

    python -m bench.http_stall --url http://127.0.0.1:8000        # any running router
    python -m bench.http_stall --launch [--max-body-mib 64]         # a router of its own

--launch serves the router's HTTP front end over a SmolLM2 engine (tests/server_harness.py) in
a child process, so the client's threads never share the server's interpreter.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Any, NamedTuple

POLL_S = 0.05


class Stall(NamedTuple):
    body_mib: float
    status: int
    request_s: float
    num_polls: int
    worst_health_s: float


def _post(url: str, body: bytes) -> int:
    request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            response.read()
            return response.status
    except urllib.error.HTTPError as e:
        e.read()
        return e.code


def _health_s(url: str) -> float:
    start = time.perf_counter()
    with urllib.request.urlopen(url + "/health", timeout=600) as response:
        response.read()
    return time.perf_counter() - start


def measure(url: str, model: str, body_mib: float) -> Stall:
    words = "hello world " * int(body_mib * 2**20 / 12)
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": words}]})
    data = body.encode()
    result: dict[str, Any] = {}

    def send() -> None:
        start = time.perf_counter()
        result["status"] = _post(url + "/v1/chat/completions", data)
        result["seconds"] = time.perf_counter() - start

    _health_s(url)  # warm
    sender = threading.Thread(target=send)
    sender.start()
    polls = []
    while sender.is_alive():
        polls.append(_health_s(url))
        time.sleep(POLL_S)
    sender.join()
    worst = max(polls, default=0.0)
    return Stall(len(data) / 2**20, result["status"], result["seconds"], len(polls), worst)


def _serve(max_body_mib: float | None) -> None:
    """The child of --launch: a router over a SmolLM2 engine; prints its URL, serves until
    stdin closes."""
    from engine.models.loader import resolve_model
    from tests.conftest import build_engine
    from tests.server_harness import ServerHarness

    checkpoint = resolve_model("default")
    options = {} if max_body_mib is None else {"max_body_mib": max_body_mib}
    harness = ServerHarness(build_engine(model_path=str(checkpoint)), checkpoint, **options)
    print(json.dumps({"url": harness.base_url, "model": harness.engine.model_id}), flush=True)
    sys.stdin.read()
    harness.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", help="a running router's base URL (no /v1)")
    p.add_argument("--model", default="", help="the model name to send (default: the served)")
    p.add_argument("--launch", action="store_true", help="start a router of its own")
    p.add_argument("--max-body-mib", type=float, default=None, help="the launched router's")
    p.add_argument("--body-mib", type=float, nargs="+", default=[16.0], help="sizes to send")
    p.add_argument("--serve-child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve_child:
        _serve(args.max_body_mib)
        return 0
    child = None
    url, model = args.url, args.model
    if args.launch:
        command = [sys.executable, "-m", "bench.http_stall", "--serve-child"]
        if args.max_body_mib is not None:
            command += ["--max-body-mib", str(args.max_body_mib)]
        child = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert child.stdout is not None
        served = json.loads(child.stdout.readline())
        url, model = served["url"], model or served["model"]
    if not url:
        p.error("give --url or --launch")
    try:
        print("| body MiB | status | request s | /health polls | slowest /health s |")
        print("|---|---|---|---|---|")
        for size in args.body_mib:
            s = measure(url, model, size)
            print(f"| {s.body_mib:.1f} | {s.status} | {s.request_s:.2f} | {s.num_polls} | "
                  f"{s.worst_health_s:.3f} |")  # fmt: skip
    finally:
        if child is not None:
            child.communicate("", timeout=60)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
