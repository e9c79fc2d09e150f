"""RunAhead (overlapped steps): owns the step launched ahead, queued on the device before the
tokens of the step in front of it were read. It decides whether a step may run ahead, marks the
pending tokens, and settles the step ahead once the one before it is read.

While step N's kernels run, the host schedules step N + 1, builds its inputs and plans its
attention; step N + 1 reads N's sampled tokens on the device (step_inputs.TokenFill).
"""

from __future__ import annotations

import time

from engine.speculation.speculative import Speculator
from engine.step.fork import ChoiceForks
from engine.step.request import Request
from engine.step.scheduler import Scheduler
from engine.step.step_launcher import StepLauncher
from engine.step.step_types import EngineStats, InFlightStep


class RunAhead:
    """Invariants: in_flight is None unless enabled; a request has a pending token only while
    the step that samples it is in flight and the step after it is launched."""

    def __init__(
        self,
        enabled: bool,
        launcher: StepLauncher,
        scheduler: Scheduler,
        speculator: Speculator,
        forks: ChoiceForks,
        stats: EngineStats,
    ):
        self.enabled = enabled
        self.launcher = launcher
        self.scheduler = scheduler
        self.kv = scheduler.kv
        self.speculator = speculator
        self.forks = forks
        self.stats = stats
        self.in_flight: InFlightStep | None = None  # the step launched ahead, if any
        self.pause = False  # the next launch_ahead launches nothing (between_steps asked)

    def between_steps(self) -> bool:
        """True when no step is in flight (a running request may be preempted outside the
        scheduler now); else the next step runs with none ahead of it, so that after it none
        is in flight."""
        if self.in_flight is None:
            return True
        self.pause = True
        return False

    def next_step(self) -> InFlightStep | None:
        """The step to finish now: the one launched ahead, else one scheduled and launched now
        (None when nothing is left to compute). A step ahead whose requests were all aborted
        since is dropped unread, as settle drops one (its GPU work just runs out): read, it
        would be timed across the idle time after the aborts."""
        step, self.in_flight = self.in_flight, None
        if step is not None and all(c.req.is_finished for c in step.scheduled.chunks):
            step = None
        return step or self.launcher.launch_scheduled()

    def launch_ahead(self, current: InFlightStep) -> None:
        """Schedule and queue the next step before `current`'s tokens are known: each request
        that samples in `current` gets a pending token, which the device fills in.

        A request whose pending token ends it (its length limit; a keep_blocks request's first
        token) is not in the next step (the scheduler sees it has nothing left to compute, and
        preempts nothing while its blocks are about to be freed or kept: Scheduler.schedule).
        A step where nothing samples runs ahead too. One that stops on a stop token or string
        is found a step late, its extra row is dropped and its blocks are freed then (queued
        work that writes them runs before any new owner's).
        """
        if not self.enabled or self.pause:
            self.pause = False
            return
        live = [req for req in current.reqs if not req.is_finished]
        if current.drafts or any(self._cannot_run_ahead_of(req) for req in live):
            return
        started = time.perf_counter()
        for req in live:
            req.num_pending_tokens += 1
        current.pending_reqs = live
        scheduled = self.scheduler.schedule()
        if scheduled.chunks:
            self.stats.num_steps_ahead += 1
            self.in_flight = self.launcher.launch(scheduled, current, started)

    def _cannot_run_ahead_of(self, req: Request) -> bool:
        """req's next draw reads its token history (penalties) or grammar state (structured
        outputs), which would miss the pending token, or it speculates (drafts need every
        token), or (keep_blocks) the host copies it keeps or its forks' first draws would queue
        behind the step run ahead: do not run ahead of it. (Kept KV is whole once read.)"""
        return (
            (req.keep_blocks and (self.kv.keep_on_host or self.forks.owes_choices(req)))
            or self.speculator.wants(req, len(self.scheduler.running))
            or req.sampling.has_penalties
            or req.sampling.structured is not None
        )

    def drop(self) -> InFlightStep | None:
        """After a step raised: the step launched ahead of it, no longer in flight (its
        requests are ended; its queued device work writes only their blocks, before any new
        owner's work on the same stream)."""
        ahead, self.in_flight, self.pause = self.in_flight, None, False
        return ahead

    def settle(self) -> None:
        """The step before the one ahead was read: the step ahead records its computed tokens,
        and is dropped when none of its requests is left (its GPU work just runs out)."""
        ahead = self.in_flight
        if ahead is None:
            return
        if ahead.update_pending:
            self.scheduler.update(ahead.scheduled, skip_finished=True)
            ahead.update_pending = False
        if all(req.is_finished for req in ahead.reqs):
            self.in_flight = None
