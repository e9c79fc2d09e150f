"""AggregatedEngines: N `engine.engine.Engine`s, each in its own spawned child process on its own
GPU (CUDA_VISIBLE_DEVICES set before torch loads), each doing its own prefill and decode and
driven open-loop from one shared start (bench/lib/open_loop.py). Owns those processes and the
pipes to them; the parent side imports no torch.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import time
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from bench.lib.open_loop import RequestTrace, RunPlan, TimedRequest, drive_open_loop, warm_up
from engine.config import EngineConfig


@dataclass(frozen=True)
class EngineSpec:
    """What each child builds: the engine's config (torch-free, so it pickles) and how many
    torch threads it runs."""

    config: EngineConfig
    torch_threads: int = 1


@dataclass(frozen=True)
class ChildFailure:
    message: str


# ---- parent side ----------------------------------------------------------------------------
@contextlib.contextmanager
def visible_devices(device_ids: str | None) -> Iterator[None]:
    """CUDA_VISIBLE_DEVICES for a child spawned inside the block (None: leave it as it is)."""
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    if device_ids is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = device_ids
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved


class AggregatedEngines:
    """`with AggregatedEngines(spec, ["0", "1"], warmup_prompts) as engines:` one child per
    entry of gpu_ids (None entries: no CUDA_VISIBLE_DEVICES, e.g. for CPU smoke runs)."""

    def __init__(
        self,
        spec: EngineSpec,
        gpu_ids: Sequence[str | None],
        warmup_prompts: Sequence[Sequence[int]],
        warmup_max_tokens: int = 16,
    ):
        ctx = multiprocessing.get_context("spawn")
        self.conns: list[Any] = []
        self.procs: list[Any] = []
        warmup = tuple(tuple(p) for p in warmup_prompts)
        for gpu_id in gpu_ids:
            conn, child_conn = ctx.Pipe()
            proc = ctx.Process(
                target=_engine_main,
                args=(child_conn, gpu_id, spec, warmup, warmup_max_tokens),
                daemon=True,
            )
            with visible_devices(gpu_id):
                proc.start()
            child_conn.close()
            self.conns.append(conn)
            self.procs.append(proc)

    def __enter__(self) -> AggregatedEngines:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _recv(self, conn: Any, deadline: float, what: str) -> Any:
        if not conn.poll(max(0.0, deadline - time.monotonic())):
            raise TimeoutError(f"an engine process did not {what} in time")
        message = conn.recv()
        if isinstance(message, ChildFailure):
            raise RuntimeError(f"engine process failed:\n{message.message}")
        return message

    def wait_ready(self, timeout_s: float) -> list[dict[str, Any]]:
        """Each engine's build and warmup report, once all are built and warmed up."""
        deadline = time.monotonic() + timeout_s
        return [self._recv(conn, deadline, "build and warm up") for conn in self.conns]

    def run(
        self,
        label: str,
        requests_per_engine: Sequence[Sequence[TimedRequest]],
        max_duration_s: float,
        lead_s: float = 1.0,
        grace_s: float = 30.0,
    ) -> list[list[RequestTrace]]:
        """Run every engine's share of the workload from one shared start (lead_s from now)."""
        start = time.monotonic() + lead_s
        for conn, requests in zip(self.conns, requests_per_engine, strict=True):
            conn.send(RunPlan(label, start, max_duration_s, tuple(requests)))
        deadline = start + max_duration_s + grace_s
        return [self._recv(conn, deadline, f"finish run {label}") for conn in self.conns]

    def close(self, timeout_s: float = 15.0) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for conn in self.conns:
            conn.close()
        self.conns, self.procs = [], []


# ---- child side -----------------------------------------------------------------------------
def _engine_main(
    conn: Any,
    gpu_id: str | None,
    spec: EngineSpec,
    warmup_prompts: tuple[tuple[int, ...], ...],
    warmup_max_tokens: int,
) -> None:
    """Child process: build and warm up the engine, report, then run each RunPlan until None."""
    try:
        if gpu_id is not None:  # already inherited from the parent; set again before torch
            os.environ["CUDA_VISIBLE_DEVICES"] = gpu_id
        import torch

        from engine.engine import Engine

        torch.set_num_threads(max(1, spec.torch_threads))
        started = time.monotonic()
        engine = Engine(spec.config)
        built = time.monotonic()
        warm_up(engine, warmup_prompts, warmup_max_tokens)
        info = engine_info(engine, gpu_id)
        info |= {"build_s": built - started, "warmup_s": time.monotonic() - built}
        conn.send(info)
        while (plan := conn.recv()) is not None:
            conn.send(drive_open_loop(engine, plan))
        engine.assert_no_leaks()
    except BaseException:
        with contextlib.suppress(OSError):
            conn.send(ChildFailure(traceback.format_exc()))


def engine_info(engine: Any, gpu_id: str | None) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "cuda_visible_devices": gpu_id,
        "device": str(engine.device),
        "torch": torch.__version__,
        "attention_backend": engine.attention_backend,
        "num_kv_blocks": engine.kv.num_blocks,
        "max_model_len": engine.max_model_len,
        "cuda_graph_steps_in_warmup": engine.runner.num_graph_steps,
    }
    if engine.device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(engine.device)
        info["cuda"] = torch.version.cuda
        info["gpu_memory_allocated_gib"] = torch.cuda.memory_allocated(engine.device) / (1 << 30)
    try:
        import flashinfer

        info["flashinfer"] = flashinfer.__version__
    except Exception as e:  # reported: the engine then runs the torch backend
        info["flashinfer"] = f"unavailable: {type(e).__name__}: {e}"
    return info
