"""AggregatedEngines: N `engine.engine.Engine`s, each in its own spawned child process on its own
GPU (CUDA_VISIBLE_DEVICES set before torch loads), each doing its own prefill and decode. Each
child drives its engine open-loop: a request is added once its arrival time (seconds after a
start shared by all children) has passed, then engine.step() runs; traces become serve_bench
RequestResults. Owns those processes and the pipes to them; the parent side imports no torch.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import time
import traceback
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.lib.serve_client import RequestResult
from engine.config import EngineConfig


@dataclass(frozen=True)
class EngineSpec:
    """What each child builds: the engine's config (torch-free, so it pickles) and how many
    torch threads it runs."""

    config: EngineConfig
    torch_threads: int = 1


@dataclass(frozen=True)
class TimedRequest:
    """One request of the workload: prompt ids, tokens to generate, arrival after the start."""

    index: int
    prompt_ids: tuple[int, ...]
    max_tokens: int
    arrival_s: float


@dataclass(frozen=True)
class RunPlan:
    label: str  # unique per run: request ids are f"{label}-{index}"
    start_monotonic: float  # time.monotonic() of the shared start (one clock for all children)
    max_duration_s: float  # after the start: requests still unfinished then are aborted
    requests: tuple[TimedRequest, ...]


@dataclass
class RequestTrace:
    """What a child saw of one request; times in seconds after the shared start. One chunk per
    engine step that gave the request tokens (one token per step)."""

    index: int
    arrival_s: float
    added_s: float | None = None
    chunk_times_s: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    finish_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    finish_reason: str | None = None
    error: str = ""


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


# ---- results in serve_bench's form ---------------------------------------------------------------
def trace_result(trace: RequestTrace, expected_tokens: int) -> RequestResult:
    """serve_bench's record of one request, from the driver's trace: start is the arrival time
    (not when the driver got to add it), so waiting for a running step counts in TTFT."""
    result = RequestResult(
        trace.index, -1, start=trace.arrival_s, expected_output_tokens=expected_tokens
    )
    result.error = trace.error
    result.token_times = [t - trace.arrival_s for t in trace.chunk_times_s]
    result.chunk_tokens = list(trace.chunk_tokens)
    result.prompt_tokens = trace.prompt_tokens
    result.cached_tokens = trace.cached_tokens
    result.output_tokens = trace.output_tokens
    result.finish_reason = trace.finish_reason
    if trace.finish_s is not None and not trace.error:
        result.e2e_s = trace.finish_s - trace.arrival_s
        result.ok = trace.output_tokens > 0
    return result


def trace_extras(trace: RequestTrace, engine_index: int) -> dict[str, Any]:
    lag = None if trace.added_s is None else trace.added_s - trace.arrival_s
    return {"engine": engine_index, "send_s": trace.arrival_s, "add_lag_s": lag}


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


def greedy_params(max_tokens: int) -> Any:
    from engine.sampling_params import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def warm_up(engine: Any, prompts: Sequence[Sequence[int]], max_tokens: int) -> None:
    """Untimed: the first prompt alone, then the others at once while it decodes, so prefill,
    mixed and decode steps (and FlashInfer's JIT) have all run once before any timing."""
    params = greedy_params(max_tokens)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"warmup-{i}", list(prompt), params)
        if i == 0:
            for _ in range(2):
                engine.step()
    for _ in range(100 * max_tokens + 100):
        if not engine.has_unfinished_requests:
            break
        engine.step()
    engine.assert_no_leaks()


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


def drive_open_loop(engine: Any, plan: RunPlan) -> list[RequestTrace]:
    """Add each request once its arrival time has passed and step the engine; a token's time is
    when the step that made it returned. Aborts what is left at plan.max_duration_s."""
    traces = {f"{plan.label}-{r.index}": RequestTrace(r.index, r.arrival_s) for r in plan.requests}
    pending = deque(sorted(plan.requests, key=lambda r: r.arrival_s))

    def clock() -> float:
        return time.monotonic() - plan.start_monotonic

    while pending or engine.has_unfinished_requests:
        now = clock()
        if now > plan.max_duration_s:
            abort_unfinished(engine, plan.label, traces, pending)
            break
        while pending and pending[0].arrival_s <= now:
            request = pending.popleft()
            req_id = f"{plan.label}-{request.index}"
            engine.add_request(req_id, list(request.prompt_ids), greedy_params(request.max_tokens))
            traces[req_id].added_s = clock()
        if not engine.has_unfinished_requests:  # idle until the next arrival
            time.sleep(max(0.0, min(pending[0].arrival_s, plan.max_duration_s) - clock()))
            continue
        outputs = engine.step()
        step_end = clock()
        for out in outputs:
            record_output(traces[out.req_id], out, step_end)
    return list(traces.values())


def record_output(trace: RequestTrace, out: Any, step_end_s: float) -> None:
    if out.new_token_ids:
        trace.chunk_times_s.append(step_end_s)
        trace.chunk_tokens.append(len(out.new_token_ids))
        trace.output_tokens += len(out.new_token_ids)
    trace.prompt_tokens = out.num_prompt_tokens
    trace.cached_tokens = out.num_cached_tokens
    if out.finished:
        trace.finish_s = step_end_s
        trace.finish_reason = out.finish_reason


def abort_unfinished(
    engine: Any, label: str, traces: dict[str, RequestTrace], pending: deque[TimedRequest]
) -> None:
    for req_id, trace in traces.items():
        if trace.finish_s is None and trace.added_s is not None:
            engine.abort(req_id)
            trace.error = "unfinished at max duration (aborted)"
    for request in pending:
        traces[f"{label}-{request.index}"].error = "not yet arrived at max duration"
    pending.clear()
