"""DirectEngine: an `engine.engine.Engine(EngineConfig())` in a child process, timing one
request at a time from add_request to the first token and to the finish. Owns that process
(its own session, so its own scheduler autogroup like a launched server) and the pipe to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Timing:
    ttft_s: float
    e2e_s: float
    num_tokens: int


class DirectEngine:
    """The engine in a child process with `threads` torch threads at niceness `nice` (pass the
    cluster workers' values so both compete alike with other jobs); one request at a time."""

    def __init__(self, threads: int, nice: int, output_len: int, timeout_s: float, code_root: Path):
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.timeout_s = timeout_s
        self.proc = ctx.Process(
            target=_direct_main,
            args=(child, threads, nice, output_len, str(code_root)),
            daemon=True,
        )
        self.proc.start()
        child.close()

    def _recv(self, timeout_s: float) -> Any:
        if not self.conn.poll(timeout_s):
            raise RuntimeError(f"the direct engine did not answer within {timeout_s:.0f} s")
        message = self.conn.recv()
        if isinstance(message, str):
            raise RuntimeError(f"direct engine: {message}")
        return message

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        self._recv(timeout_s)

    async def run(self, req_id: str, prompt: Sequence[int]) -> Timing:
        self.conn.send((req_id, list(prompt)))
        return await asyncio.to_thread(self._recv, self.timeout_s)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.send(None)
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(10)
        self.conn.close()


def _direct_main(conn: Any, threads: int, nice: int, output_len: int, code_root: str) -> None:
    """Child process: load the engine (from code_root), then time each (req_id, prompt) until
    None."""
    try:
        os.setsid()  # its own scheduler autogroup, like the server (LaunchedServer)
        os.nice(nice)
        sys.path.insert(0, code_root)
        import torch

        from engine.engine import Engine, EngineConfig
        from engine.sampling_params import SamplingParams

        torch.set_num_threads(threads)
        engine = Engine(EngineConfig())
        params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
        conn.send(Timing(0.0, 0.0, 0))
        while (message := conn.recv()) is not None:
            req_id, prompt = message
            conn.send(_direct_one(engine, req_id, prompt, params, 4 * output_len + 64))
        engine.assert_no_leaks()
    except Exception as e:
        conn.send(f"{type(e).__name__}: {e}")


def _direct_one(
    engine: Any, req_id: str, prompt: Sequence[int], params: Any, max_steps: int
) -> Timing:
    start = time.perf_counter()
    engine.add_request(req_id, list(prompt), params)
    first, num_tokens = None, 0
    for _ in range(max_steps):
        for out in engine.step():
            if out.req_id != req_id:
                continue
            now = time.perf_counter()
            num_tokens += len(out.new_token_ids)
            if first is None and out.new_token_ids:
                first = now
            if out.finished:
                return Timing((first or now) - start, now - start, num_tokens)
    raise RuntimeError(f"{req_id} did not finish within {max_steps} engine steps")
