"""Mixed-step profile: one fresh prompt of P tokens added beside B decoding requests, and the
engine step that carries its chunk timed against the pure-decode steps around it. Owns no state
but the records of the probe it installs on one engine for the length of a `with` block.

StepProbe wraps, on the engine's own part instances (restored on exit), the calls a step makes
(schedule, build inputs, attention plan, the eager forward or the graph replay, LM head,
sampling, the wait for the sampled tokens, output processing, KV copies) and times each
exclusive of the others it calls: a step() call's host time split, on any device. It also
records what every launched step carried (decode rows, each prompt's chunk tokens) and which
launched step each step() call finished. With overlapped steps (the CUDA default) a call
launches one step and finishes the one before it, so a prompt's chunk shows in two calls: the
one that launches it ("launch_mixed": its eager host work delays the decodes' tokens) and the
one that waits for it ("finish_mixed"); with overlap off ("serial") one call does both
("mixed"). On CUDA the probe also brackets each launched step with CUDA events (its GPU span),
and kernel_window profiles single serial calls (torch.profiler): kernel busy time, the GPU's
idle time inside the call, the kernels by kind. cprofile_window is cProfile's top functions of
one call. Wall times are medians over the repetitions; the first repetition of every (B, P)
cell is reported apart ("first"): it may load kernels.

Reading it: a serial mixed call whose kernel busy time is well under its wall (GPU idle inside
it) with forward_eager / attention_plan / schedule leading its host stages is host-bound (eager
launches, plans, syncs); one whose wait_tokens leads and whose busy time is near its wall is
GPU-bound (then the kernels by kind say which). Overlapped, launch_mixed's wall over decode's is
the host work the mixed step adds in front of the decodes' tokens.
"""

from __future__ import annotations

import cProfile
import pstats
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from bench.lib.gpu_timing import (
    cuda_spans,
    finish_all,
    gaps_by_neighbours,
    idle_gaps,
    kernel_summary,
    random_prompts,
)
from engine.engine import Engine
from engine.sampling.sampling_params import SamplingParams
from engine.step.scheduler import SchedulerOutput

# the host stages of a step() call, in the order a step runs them; "other" is the call's wall
# time none of them covers (the run-ahead bookkeeping, stop checks outside output, ...)
STAGES = (
    "schedule",
    "kv_copies",
    "build_inputs",
    "attention_plan",
    "forward_eager",  # input upload + the eager forward's launches (plan excluded)
    "graph_replay",  # a pure-decode step's graph: its own plan, input writes and replay
    "logits",
    "sample",
    "launch_rest",  # StepLauncher.launch's own work: rows, bitmask, forks
    "wait_tokens",  # the host waits for the step's sampled tokens (the GPU's time shows here)
    "output",  # appending tokens, stop checks, detokenizing
)
# call labels: what the step() call launched and finished (module docstring)
LABELS = ("decode", "mixed", "launch_mixed", "finish_mixed", "other")


@dataclass(frozen=True)
class StepInfo:
    """What one launched step carried."""

    decode_req_ids: tuple[str, ...]  # requests with one new token (a decode row)
    chunk_tokens: dict[str, int]  # request -> tokens of its prefill chunk (more than one)
    prompt_tokens: int  # of those, tokens of the probe's tracked prompts

    @property
    def kind(self) -> str:
        """mixed (a tracked prompt's chunk), decode (only decode rows) or other."""
        if self.prompt_tokens:
            return "mixed"
        return "other" if self.chunk_tokens else "decode"

    @classmethod
    def of(cls, scheduled: SchedulerOutput, prompt_ids: set[str]) -> StepInfo:
        decodes = tuple(
            c.req.req_id
            for c in scheduled.chunks
            if c.num_new_tokens == 1 and not c.draft_token_ids
        )
        chunks = {
            c.req.req_id: c.num_new_tokens
            for c in scheduled.chunks
            if c.num_new_tokens > 1 or c.req.req_id in prompt_ids
        }
        prompt = sum(n for req_id, n in chunks.items() if req_id in prompt_ids)
        return cls(decodes, chunks, prompt)


@dataclass
class CallRecord:
    """One engine.step() call the probe ran."""

    wall_s: float
    stages_s: dict[str, float]
    launched: list[int]  # indices into StepProbe.steps
    finished: int | None  # the launched step whose tokens it read (None: none, or unknown)
    label: str = "other"
    extra: dict[str, Any] = field(default_factory=dict)  # a profile of the call, if taken


class StepProbe:
    """Times and labels engine.step() calls (module docstring); use as a context manager."""

    def __init__(self, engine: Engine, *, cuda_events: bool = False):
        self.engine = engine
        self.cuda_events = cuda_events
        self.prompt_ids: set[str] = set()  # requests whose chunks make a step "mixed"
        self.steps: list[StepInfo] = []
        self.spans: list[tuple[Any, Any] | None] = []  # CUDA events around each launch
        self._in_flight: dict[int, tuple[Any, int]] = {}  # id(InFlightStep) -> (it, index)
        self._stack: list[float] = []
        self._stages: dict[str, float] | None = None  # the running call's, else None
        self._launched: list[int] = []
        self._finished: int | None = None
        self._saved: list[tuple[object, str, object | None]] = []

    # ---- installing and removing the wrappers -----------------------------------------------
    def __enter__(self) -> StepProbe:
        e = self.engine
        runner = e.runner
        ahead = e.run_ahead.in_flight  # launched before the probe: known by what it carries
        if ahead is not None:
            self._in_flight[id(ahead)] = (ahead, len(self.steps))
            self.steps.append(StepInfo.of(ahead.scheduled, self.prompt_ids))
            self.spans.append(None)
        self._wrap(e.scheduler, "schedule", "schedule")
        self._wrap(e.copies, "run_owed", "kv_copies")
        self._wrap(e.copies, "offload_owed", "kv_copies")
        self._wrap(runner, "build_inputs", "build_inputs")
        self._wrap(runner.attention, "plan", "attention_plan")
        self._wrap(runner, "_forward_eager", "forward_eager")
        if runner.graphs is not None:
            self._wrap(runner.graphs, "run", "graph_replay")
        if runner.mixed is not None:  # the mixed-step graphs: the pieces and eager attention
            self._wrap(runner.mixed, "run", "mixed_replay")
        self._wrap(runner.model, "compute_logits", "logits")
        self._wrap(e.sampler, "sample", "sample")
        self._wrap(e.output, "process", "output", before=self._finishing)
        launch = self._timed(e.launcher.launch, "launch_rest")
        self._install(e.launcher, "launch", self._launch_wrapper(launch))
        return self

    def __exit__(self, *exc: object) -> None:
        for obj, name, previous in reversed(self._saved):
            if previous is None:
                delattr(obj, name)  # the class's method shows again
            else:
                setattr(obj, name, previous)
        self._saved.clear()

    def _install(self, obj: object, name: str, fn: Callable[..., Any]) -> None:
        self._saved.append((obj, name, vars(obj).get(name)))
        setattr(obj, name, fn)

    def _wrap(
        self,
        obj: object,
        name: str,
        stage: str,
        before: Callable[..., None] | None = None,
    ) -> None:
        timed = self._timed(getattr(obj, name), stage)
        if before is None:
            self._install(obj, name, timed)
            return

        def called(*args: Any, **kwargs: Any) -> Any:
            before(*args, **kwargs)
            return timed(*args, **kwargs)

        self._install(obj, name, called)

    def _timed(self, fn: Callable[..., Any], stage: str) -> Callable[..., Any]:
        """fn, its time exclusive of the wrapped calls inside it added to stage's."""

        def timed(*args: Any, **kwargs: Any) -> Any:
            self._stack.append(0.0)  # the time of the wrapped calls inside this one
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds = time.perf_counter() - start
                inner = self._stack.pop()
                if self._stack:
                    self._stack[-1] += seconds
                if self._stages is not None:
                    self._stages[stage] = self._stages.get(stage, 0.0) + seconds - inner

        return timed

    def _launch_wrapper(self, launch: Callable[..., Any]) -> Callable[..., Any]:
        def launched(scheduled: SchedulerOutput, after: Any, started_s: float) -> Any:
            index = len(self.steps)
            self.steps.append(StepInfo.of(scheduled, self.prompt_ids))
            events = None
            if self.cuda_events:
                events = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                events[0].record()
            step = launch(scheduled, after, started_s)
            if events is not None:
                events[1].record()
            self.spans.append(events)
            self._in_flight[id(step)] = (step, index)
            step.sample.result = self._timed(step.sample.result, "wait_tokens")
            if self._stages is not None:
                self._launched.append(index)
            return step

        return launched

    def _finishing(self, step: Any) -> None:
        _, index = self._in_flight.pop(id(step), (None, None))
        if self._stages is not None:
            self._finished = index

    # ---- calls ----------------------------------------------------------------------------
    def call(self) -> CallRecord:
        """One engine.step(), timed and labelled."""
        self._stages, self._launched, self._finished = {}, [], None
        start = time.perf_counter()
        try:
            self.engine.step()
        finally:
            wall = time.perf_counter() - start
            stages, self._stages = self._stages, None
        stages["other"] = wall - sum(stages.values())
        record = CallRecord(wall, stages, self._launched, self._finished)
        record.label = self.label(record)
        return record

    def label(self, record: CallRecord) -> str:
        launched = {self.steps[i].kind for i in record.launched}
        finished = None if record.finished is None else self.steps[record.finished].kind
        if finished == "mixed":
            return "mixed" if "mixed" in launched else "finish_mixed"
        if finished == "decode":
            if "mixed" in launched:
                return "launch_mixed"
            return "decode" if launched <= {"decode"} else "other"
        return "other"

    def gpu_span_ms(self, index: int) -> float | None:
        """A launched step's GPU span (CUDA events around its launch: from when the GPU reached
        its first kernel to its last one's end); None without CUDA events. Synchronizes."""
        events = self.spans[index]
        if events is None:
            return None
        events[1].synchronize()
        return events[0].elapsed_time(events[1])


# ---- measurements of one call (measure= of sweep) -----------------------------------------------
def kernel_window(probe: StepProbe) -> CallRecord:
    """One call profiled alone (CUDA; overlap off: the call runs its one step to the end): its
    kernels' busy time (their spans merged), their sum, the GPU's idle time inside the call
    (wall - busy), by kind, the top kernels and the idle gaps by the kernels around them."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        record = probe.call()
        torch.cuda.synchronize()
    spans = cuda_spans(prof)
    summary = kernel_summary(prof, 1, top=10) if spans else {}
    record.extra = window_fields(spans, record.wall_s * 1e3) | {
        "kernel_sum_ms": summary.get("kernel_ms_total", 0.0),
        "kernel_ms_by_kind": summary.get("kernel_ms_by_kind", {}),
        "top_kernels_ms": summary.get("top_kernels_ms", {}),
    }
    return record


def window_fields(spans: list[tuple[float, float, str]], wall_ms: float) -> dict[str, Any]:
    """What one call's (start, end, name) kernel spans in us say against its wall ms: their
    count, busy time (merged), span (first start to last end), the idle gaps inside the span,
    the GPU's idle time inside the call (wall - busy) and the gaps by their neighbours."""
    if not spans:
        return {"num_kernels": 0, "kernel_busy_ms": 0.0, "gpu_idle_in_call_ms": wall_ms}
    first = min(start for start, _, _ in spans)
    last = max(end for _, end, _ in spans)
    idle_us = sum(idle_gaps([(start, end) for start, end, _ in spans]))
    busy_ms = (last - first - idle_us) / 1e3
    return {
        "num_kernels": len(spans),
        "kernel_busy_ms": busy_ms,
        "gpu_span_ms": (last - first) / 1e3,
        "gpu_idle_in_span_ms": idle_us / 1e3,
        "gpu_idle_in_call_ms": wall_ms - busy_ms,
        "gaps_by_neighbours": gaps_by_neighbours(spans, 1, top=6),
    }


def cprofile_window(probe: StepProbe, top: int = 15) -> CallRecord:
    """One call under cProfile: its top functions by own time (ms, calls, cumulative ms)."""
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        record = probe.call()
    finally:
        profiler.disable()
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    ranked = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    record.extra = {
        "cprofile_top": [
            {
                "function": f"{func} ({file.rsplit('/', 2)[-1] if '/' in file else file}:{line})",
                "calls": ncalls,
                "tottime_ms": tottime * 1e3,
                "cumtime_ms": cumtime * 1e3,
            }
            for (file, line, func), (_, ncalls, tottime, cumtime, _) in ranked
        ]
    }
    return record


# ---- driving the engine -------------------------------------------------------------------------
def set_overlap(engine: Engine, on: bool) -> None:
    """Turn overlapped steps on or off between steps: off first runs the step in flight to its
    end with none launched after it (RunAhead.between_steps)."""
    ahead = engine.run_ahead
    if not on:
        while ahead.in_flight is not None:
            ahead.between_steps()
            engine.step()
    ahead.enabled = on


def start_decodes(engine: Engine, batch: int, context_len: int, seed: int) -> list[str]:
    """Add `batch` requests of context_len random tokens and step until each one decodes;
    they decode until aborted (ignore_eos, max_tokens as the model's length allows)."""
    max_tokens = engine.max_model_len - context_len
    if max_tokens < 64:
        raise ValueError(f"context_len {context_len} leaves under 64 tokens to decode")
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    req_ids = [f"mixdec{seed}-{i}" for i in range(batch)]
    prompts = random_prompts(batch, context_len, engine.model_config.vocab_size, seed)
    for req_id, prompt in zip(req_ids, prompts, strict=True):
        engine.add_request(req_id, prompt, params)
    sched = engine.scheduler
    while sched.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running):
        engine.step()
    for _ in range(3):  # every decode row in the next steps
        engine.step()
    return req_ids


def sweep(
    engine: Engine,
    probe: StepProbe,
    prompt_len: int,
    reps: int,
    seed: int,
    *,
    neighbours: int = 2,
    measure: Callable[[StepProbe], CallRecord] | None = None,
) -> list[list[CallRecord]]:
    """reps repetitions, each: `neighbours` pure-decode calls, a fresh prompt of prompt_len
    random tokens (max_tokens 1: it ends with the step that samples it, so the decode batch
    stays the same) added, the calls until it is done, `neighbours` calls after. measure: how
    each call runs (kernel_window, cprofile_window; None: probe.call). Returns each
    repetition's calls."""
    run = measure or StepProbe.call
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    vocab = engine.model_config.vocab_size
    reps_calls = []
    for rep in range(reps):
        calls = [run(probe) for _ in range(neighbours)]
        req_id = f"mixprompt{seed}-{rep}"
        probe.prompt_ids.add(req_id)
        engine.add_request(
            req_id, random_prompts(1, prompt_len, vocab, seed * 1000 + rep)[0], params
        )
        while engine.is_unfinished(req_id):
            calls.append(run(probe))
        calls.extend(run(probe) for _ in range(neighbours))
        reps_calls.append(calls)
    return reps_calls


def median_of(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per key, the median of the records' numbers (nested dicts key by key); other values
    (lists, text) from the last record."""
    out: dict[str, Any] = {}
    for key in dict.fromkeys(k for r in records for k in r):
        values = [r[key] for r in records if key in r]
        if all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
            out[key] = statistics.median(values)
        elif all(isinstance(v, dict) for v in values):
            out[key] = median_of(values)
        else:
            out[key] = values[-1]
    return out


def summarize(
    probe: StepProbe, reps_calls: list[list[CallRecord]], *, first_apart: bool = True
) -> dict[str, Any]:
    """By call label: count, wall ms, the host stages ms and (CUDA) the GPU spans of the steps
    it launched and of the one it finished, medians over the calls; a profile's fields
    (CallRecord.extra) too. The first repetition under "first" when first_apart."""

    def group(calls: list[CallRecord]) -> dict[str, Any]:
        by_label: dict[str, list[dict[str, Any]]] = {}
        for c in calls:
            row: dict[str, Any] = {
                "wall_ms": c.wall_s * 1e3,
                "host_ms": {k: v * 1e3 for k, v in c.stages_s.items()},
            }
            spans = [probe.gpu_span_ms(i) for i in c.launched]
            if spans and None not in spans:
                row["launched_gpu_span_ms"] = sum(spans)
            if c.finished is not None and (span := probe.gpu_span_ms(c.finished)) is not None:
                row["finished_gpu_span_ms"] = span  # against the wall: did the call wait on it?
            by_label.setdefault(c.label, []).append(row | c.extra)
        return {
            label: {"calls": len(rows)} | median_of(rows)
            for label, rows in sorted(by_label.items(), key=lambda kv: LABELS.index(kv[0]))
        }

    later = reps_calls[1:] if first_apart and len(reps_calls) > 1 else reps_calls
    result = {"groups": group([c for calls in later for c in calls])}
    if first_apart and len(reps_calls) > 1:
        result["first"] = group(reps_calls[0])
    return result


@contextmanager
def decoding(engine: Engine, batch: int, context_len: int, seed: int) -> Iterator[list[str]]:
    """`batch` requests decoding for the block (start_decodes); aborted after it, with the
    leak check (finish_all)."""
    try:
        yield start_decodes(engine, batch, context_len, seed)
    finally:
        finish_all(engine)


def mixed_cell(
    engine: Engine,
    batch: int,
    prompt_len: int,
    *,
    reps: int = 5,
    context_len: int = 256,
    cuda: bool = False,
    seed: int = 0,
    probe_out: list[StepProbe] | None = None,
) -> dict[str, Any]:
    """One (B, P) cell, B requests decoding: with overlapped steps if the engine overlaps
        (reps + 1 repetitions, the first apart), then with overlap off ("serial": the same, then
        on CUDA 2 repetitions each call under kernel_window, then one under cprofile_window, those
    with one decode call either side).
        probe_out: gets the probe (its steps, for tests)."""
    overlapped = engine.overlap_steps
    result: dict[str, Any] = {"batch": batch, "prompt_len": prompt_len, "context_len": context_len}
    result["reps"] = reps
    with decoding(engine, batch, context_len, seed) as decode_ids:
        with StepProbe(engine, cuda_events=cuda) as probe:
            if probe_out is not None:
                probe_out.append(probe)
            if overlapped:
                calls = sweep(engine, probe, prompt_len, reps + 1, seed * 10 + 1)
                result["overlapped"] = summarize(probe, calls)
            set_overlap(engine, False)
            try:
                calls = sweep(engine, probe, prompt_len, reps + 1, seed * 10 + 2)
                result["serial"] = summarize(probe, calls)
                if cuda:
                    calls = sweep(
                        engine, probe, prompt_len, 2, seed * 10 + 3, neighbours=1,
                        measure=kernel_window,
                    )  # fmt: skip
                    result["serial_kernels"] = summarize(probe, calls, first_apart=False)
                calls = sweep(
                    engine, probe, prompt_len, 1, seed * 10 + 4, neighbours=1,
                    measure=cprofile_window,
                )  # fmt: skip
                result["serial_cprofile"] = {
                    c.label: c.extra["cprofile_top"]
                    for c in reversed(calls[0])
                    if c.label in ("decode", "mixed")
                }
            finally:
                set_overlap(engine, overlapped)
        running = {r.req_id for r in engine.scheduler.running}
        if not set(decode_ids) <= running:
            raise RuntimeError("a decode request ended inside the cell: lower context_len")
    return result


def mixed_steps(
    engine: Engine,
    batches: list[int],
    prompt_lens: list[int],
    *,
    reps: int = 5,
    context_len: int = 256,
    cuda: bool = False,
) -> dict[str, Any]:
    """Every (B, P) cell (mixed_cell) the engine can hold: B + 1 sequences at once, the prompt
    and B decodes in one step's token budget; the others listed under "skipped"."""
    sched = engine.config.scheduler
    cells, skipped = [], []
    for batch in batches:
        for prompt_len in prompt_lens:
            if sched.max_num_seqs is not None and batch + 1 > sched.max_num_seqs:
                skipped.append({"batch": batch, "prompt_len": prompt_len, "why": "max_num_seqs"})
                continue
            why = None
            if prompt_len + batch > sched.max_num_batched_tokens:
                why = "max_num_batched_tokens"
            elif prompt_len >= engine.max_model_len:
                why = "max_model_len"
            if why is not None:
                skipped.append({"batch": batch, "prompt_len": prompt_len, "why": why})
                continue
            start = time.perf_counter()
            cell = mixed_cell(
                engine,
                batch,
                prompt_len,
                reps=reps,
                context_len=context_len,
                cuda=cuda,
                seed=len(cells) + 1,
            )
            cell["seconds"] = time.perf_counter() - start
            cells.append(cell)
    return {"cells": cells, "skipped": skipped}
