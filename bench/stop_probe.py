"""How `kvrelay serve` stops (issue 46, defects 2 and 4): starts a real serve (SmolLM2, one prefill
and one decode worker, its own Ray and redis-server), then either signals it with a long stream
open or kills its raylet, and prints what a client and an operator see, with the seconds each took
from the signal or the kill. Owns nothing beyond one run.

    python -m bench.stop_probe --signal SIGINT     # Ctrl-C (to serve's process group)
    python -m bench.stop_probe --signal SIGTERM    # `kill PID`, systemd, Kubernetes
    python -m bench.stop_probe --kill-raylet       # its Ray cluster lost

--signal: a 2,000-token SSE stream (--max-tokens) is open and generating when the signal goes;
prints the seconds to /ready 503, a new request's answer, when and how the stream ended (its
last finish_reason, [DONE]) and when serve exited (status, processes of its cluster left).
--kill-raylet: prints the seconds to /ready 503 and its reason, a new request's answer, and when
serve exited (status 1 expected after --drain-seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile
import time
from pathlib import Path

import psutil

from tests.integration.serve_process import CHAT, ServeProcess, SseStream

NUM_EVENTS_BEFORE = 20  # stream events read before the signal: it is generating
BOUND_S = 300  # a bound on each wait only


def _refused(serve: ServeProcess) -> str:
    """A new request's answer: status, error code, Retry-After."""
    reply = serve.request("POST", "/v1/chat/completions", {**CHAT, "max_tokens": 4})
    error = reply.body.get("error", {})
    retry = reply.headers.get("Retry-After", "none")
    return f"{reply.status} code={error.get('code')} Retry-After={retry}: {error.get('message')}"


def _until_ready_503(serve: ServeProcess, since: float) -> tuple[float, str]:
    body = serve.until_status("/ready", 503, bound_s=BOUND_S)
    return time.monotonic() - since, str(body.get("reason"))


def _left(processes: list[psutil.Process]) -> list[str]:
    alive = []
    for p in processes:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(f"{p.pid} {p.name()}")
        except psutil.NoSuchProcess:
            continue
    return alive


def probe_signal(serve: ServeProcess, signum: signal.Signals, max_tokens: int) -> list[str]:
    stream = SseStream(serve.http_port, max_tokens=max_tokens)
    stream.read(NUM_EVENTS_BEFORE)
    processes = serve.cluster_processes()
    sent = time.monotonic()
    if signum == signal.SIGINT:
        os.killpg(serve.proc.pid, signum)  # as a terminal's Ctrl-C
    else:
        os.kill(serve.proc.pid, signum)
    ready_s, reason = _until_ready_503(serve, sent)
    refused = _refused(serve)
    events = stream.read_to_end()
    stream_s = time.monotonic() - sent
    rc = serve.wait_exit(BOUND_S)
    exit_s = time.monotonic() - sent
    last = [e for e in events if e != "[DONE]"][-1]
    finish = json.loads(last)["choices"][0].get("finish_reason") if last.startswith("{") else last
    num_withdraw_failures = serve.output().count("could not withdraw")
    return [
        f"signal              {signum.name} with a {max_tokens}-token stream open "
        f"({NUM_EVENTS_BEFORE} events read)",
        f"/ready 503 after    {ready_s:.3f} s ({reason})",
        f"new request         {refused}",
        f"stream ended after  {stream_s:.2f} s: {len(events)} events, last finish_reason "
        f"{finish!r}, [DONE] {'sent' if events[-1] == '[DONE]' else 'MISSING'}",
        f"serve exited after  {exit_s:.2f} s with status {rc}",
        f"withdraw failures   {num_withdraw_failures}",
        f"processes left      {_left(processes) or 'none'}",
    ]


def probe_lost_ray(serve: ServeProcess) -> list[str]:
    assert serve.get("/ready")[0] == 200
    processes = serve.cluster_processes()
    raylet = serve.raylet()
    killed = time.monotonic()
    raylet.kill()
    ready_s, reason = _until_ready_503(serve, killed)
    refused = _refused(serve)
    rc = serve.wait_exit(BOUND_S)
    exit_s = time.monotonic() - killed
    return [
        f"raylet killed       pid {raylet.pid} (SIGKILL)",
        f"/ready 503 after    {ready_s:.3f} s ({reason})",
        f"new request         {refused}",
        f"serve exited after  {exit_s:.2f} s with status {rc}",
        f"tracebacks in log   {serve.output().count('Traceback')}",
        f"processes left      {_left(processes) or 'none'}",
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--signal", choices=["SIGINT", "SIGTERM"], help="stop it with this signal")
    what.add_argument("--kill-raylet", action="store_true", help="kill its raylet instead")
    p.add_argument("--drain-seconds", type=float, default=5.0, help="serve's (default 5)")
    p.add_argument("--max-tokens", type=int, default=2000, help="the open stream's (default 2000)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvrelay-stop-probe-") as state_dir:
        serve = ServeProcess(Path(state_dir), "--drain-seconds", f"{args.drain_seconds:g}")
        try:
            started = time.monotonic()
            serve.wait_for("Ctrl-C to stop")
            print(f"serve ready after   {time.monotonic() - started:.1f} s", flush=True)
            if args.kill_raylet:
                lines = probe_lost_ray(serve)
            else:
                lines = probe_signal(serve, signal.Signals[args.signal], args.max_tokens)
        finally:
            serve.kill()
    print(f"--drain-seconds     {args.drain_seconds:g}")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
