"""DirectEngine: an `engine.engine.Engine` of the default config in a child process, timing one
request at a time from add_request to the first token and to the finish. Owns that process
(`python -m bench.lib.direct_engine` in the kvrelay checkout it is given, in its own session so
its own scheduler autogroup, like a launched server) and the two pipes to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Timing:
    ttft_s: float
    e2e_s: float
    num_tokens: int


class DirectEngine:
    """The engine in a child process with `threads` torch threads at niceness `nice` (pass the
    cluster workers' values so both compete alike with other jobs); one request at a time.
    code_root: the kvrelay checkout (this one, or a snapshot of a commit that has this module)
    whose engine the child runs: its working directory, so first on its import path."""

    def __init__(self, threads: int, nice: int, output_len: int, timeout_s: float, code_root: Path):
        if not (Path(code_root) / "bench" / "lib" / "direct_engine.py").is_file():
            raise ValueError(f"{code_root} has no bench/lib/direct_engine.py to run the engine")
        self.timeout_s = timeout_s
        from_child, to_parent = os.pipe()
        from_parent, to_child = os.pipe()
        child_fds = (from_parent, to_parent)
        settings = (*child_fds, threads, nice, output_len)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.lib.direct_engine", *map(str, settings)],
            cwd=code_root,
            stdin=subprocess.DEVNULL,
            pass_fds=child_fds,
            start_new_session=True,  # its own scheduler autogroup, like the server
        )
        for fd in child_fds:
            os.close(fd)
        self.conn_in = Connection(from_child, writable=False)
        self.conn_out = Connection(to_child, readable=False)

    def _recv(self, timeout_s: float) -> Any:
        if not self.conn_in.poll(timeout_s):
            raise RuntimeError(f"the direct engine did not answer within {timeout_s:.0f} s")
        try:
            message = self.conn_in.recv()
        except EOFError:
            raise RuntimeError(f"the direct engine exited ({self.proc.poll()})") from None
        if isinstance(message, str):
            raise RuntimeError(f"direct engine: {message}")
        return message

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        self._recv(timeout_s)

    async def run(self, req_id: str, prompt: Sequence[int]) -> Timing:
        self.conn_out.send((req_id, list(prompt)))
        return await asyncio.to_thread(self._recv, self.timeout_s)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.conn_out.send(None)
        for stop, wait_s in ((None, 30.0), (self.proc.terminate, 10.0), (self.proc.kill, 5.0)):
            if stop is not None:
                stop()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(wait_s)
                break
        self.conn_in.close()
        self.conn_out.close()


def child_main(argv: Sequence[str]) -> None:
    """Child process: load the engine, then time each (req_id, prompt) until None."""
    from_parent, to_parent, threads, nice, output_len = (int(arg) for arg in argv)
    conn_in = Connection(from_parent, writable=False)
    conn_out = Connection(to_parent, readable=False)
    try:
        os.nice(nice)
        import torch

        from bench.lib.engine_config import engine_config
        from engine.engine import Engine
        from engine.sampling_params import SamplingParams

        torch.set_num_threads(threads)
        engine = Engine(engine_config())
        params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
        conn_out.send(Timing(0.0, 0.0, 0))
        while (message := conn_in.recv()) is not None:
            req_id, prompt = message
            conn_out.send(_direct_one(engine, req_id, prompt, params, 4 * output_len + 64))
        engine.assert_no_leaks()
    except Exception as e:
        conn_out.send(f"{type(e).__name__}: {e}")


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


if __name__ == "__main__":  # as `bench.lib.direct_engine`, so what it pickles unpickles there
    from bench.lib import direct_engine

    direct_engine.child_main(sys.argv[1:])
