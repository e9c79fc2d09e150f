"""RunAhead without a model: which steps run ahead, the pending tokens they leave, and how the
step ahead is settled once the step before it is read (a recording launcher stands in)."""

from __future__ import annotations

import torch

from engine.config import SchedulerConfig, SpeculativeConfig
from engine.kv_cache.manager import KVCacheManager
from engine.sampling.sampler import PendingSample
from engine.sampling.sampling_params import SamplingParams
from engine.speculation.speculative import Speculator
from engine.step.fork import ChoiceForks
from engine.step.overlap import RunAhead
from engine.step.request import FinishReason, Request
from engine.step.scheduler import Scheduler, SchedulerOutput
from engine.step.step_types import EngineStats, InFlightStep


class RecordingLauncher:
    """Launches nothing: each step it is asked for is returned in flight, and recorded."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self.launched: list[InFlightStep] = []

    def launch_scheduled(self) -> InFlightStep | None:
        scheduled = self.scheduler.schedule()
        return self.launch(scheduled, None, 0.0) if scheduled.chunks else None

    def launch(
        self, scheduled: SchedulerOutput, after: InFlightStep | None, started_s: float
    ) -> InFlightStep:
        if after is None:
            self.scheduler.update(scheduled)
        reqs = [chunk.req for chunk in scheduled.chunks if chunk.samples]
        sample = PendingSample(torch.zeros(len(reqs), dtype=torch.long), None)
        step = InFlightStep(scheduled, reqs, sample, after is not None, started_s=started_s)
        self.launched.append(step)
        return step


def make_run_ahead(enabled: bool = True) -> RunAhead:
    kv = KVCacheManager(64, 4, "m")
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8), kv, 128)
    launcher = RecordingLauncher(scheduler)
    speculator = Speculator(SpeculativeConfig(), 128, kv)
    forks = ChoiceForks(scheduler, kv)
    return RunAhead(enabled, launcher, scheduler, speculator, forks, EngineStats())  # type: ignore[arg-type]


def add(run_ahead: RunAhead, req_id: str, **params: object) -> Request:
    req = Request(req_id, [1, 2, 3, 4, 5], SamplingParams(temperature=0, **params))  # type: ignore[arg-type]
    run_ahead.scheduler.add(req)
    return req


def test_the_next_step_is_launched_ahead_with_a_pending_token_each() -> None:
    run_ahead = make_run_ahead()
    req = add(run_ahead, "r")
    current = run_ahead.next_step()
    assert current is not None and current.reqs == [req]
    run_ahead.launch_ahead(current)
    ahead = run_ahead.in_flight
    assert ahead is not None and ahead.update_pending and run_ahead.stats.num_steps_ahead == 1
    assert req.num_pending_tokens == 1 and current.pending_reqs == [req]
    assert run_ahead.next_step() is ahead and run_ahead.in_flight is None  # finished next


def test_settle_records_the_step_ahead_and_drops_it_once_its_requests_ended() -> None:
    run_ahead = make_run_ahead()
    req = add(run_ahead, "r")
    current = run_ahead.next_step()
    assert current is not None
    run_ahead.launch_ahead(current)
    computed = req.num_computed_tokens
    req.num_pending_tokens -= 1  # current's token read (the output processor's part)
    req.append_token(9)
    run_ahead.settle()
    ahead = run_ahead.in_flight
    assert ahead is not None and not ahead.update_pending
    assert req.num_computed_tokens == computed + 1
    run_ahead.scheduler.finish(req, FinishReason.ABORT)
    run_ahead.settle()
    assert run_ahead.in_flight is None


def test_nothing_runs_ahead_of_penalties_grammars_or_when_disabled() -> None:
    for enabled, params in (
        (False, {}),
        (True, {"repetition_penalty": 1.2}),
        (True, {"presence_penalty": 0.5}),
    ):
        run_ahead = make_run_ahead(enabled)
        req = add(run_ahead, "r", **params)
        current = run_ahead.next_step()
        assert current is not None
        run_ahead.launch_ahead(current)
        assert run_ahead.in_flight is None and not req.num_pending_tokens, params
