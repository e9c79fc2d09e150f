"""StepLauncher: queues one step on the device (the KV copies it reads, the forward pass, the
grammars' bitmask and sampling) and returns it in flight, with the logits row each n > 1 request
forks its choices from (InFlightStep.fork_logits). Owns no state but the step counters it adds
to.
"""

from __future__ import annotations

import time

from engine.execution.block_copies import BlockCopies
from engine.execution.runner import ModelRunner
from engine.execution.step_inputs import TokenFill
from engine.sampling.sample_row import sample_row
from engine.sampling.sampler import Sampler
from engine.sampling.structured import Grammars
from engine.speculation.speculative import Speculator
from engine.step.fork import ChoiceForks
from engine.step.request import Request
from engine.step.scheduler import Scheduler, SchedulerOutput
from engine.step.step_types import EngineStats, InFlightStep


class StepLauncher:
    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunner,
        sampler: Sampler,
        copies: BlockCopies,
        speculator: Speculator,
        forks: ChoiceForks,
        grammars: Grammars | None,
        stats: EngineStats,
    ):
        self.scheduler = scheduler
        self.kv = scheduler.kv
        self.runner = runner
        self.sampler = sampler
        self.copies = copies
        self.speculator = speculator
        self.forks = forks
        self.grammars = grammars
        self.stats = stats

    def launch_scheduled(self) -> InFlightStep | None:
        """Draft, schedule and queue the next step; None when nothing is left to compute."""
        started = time.perf_counter()
        self.speculator.propose(self.scheduler.running)  # drafts verified by this step
        scheduled = self.scheduler.schedule()
        return self.launch(scheduled, None, started) if scheduled.chunks else None

    def launch(
        self, scheduled: SchedulerOutput, after: InFlightStep | None, started_s: float
    ) -> InFlightStep:
        """Queue a step's forward pass and sampling. `after`: the step still in flight whose
        sampled tokens are this step's pending input tokens (gathered on the device).
        started_s: perf_counter when its scheduling began."""
        self.copies.run_owed(self.kv)  # the KV this step reads or completes
        fill = None
        if after is not None:
            rows = {req.req_id: row for row, req in enumerate(after.reqs) if req.num_pending_tokens}
            fill = TokenFill(rows, after.sample.tokens)
        step_logits = self.runner.execute(scheduled, fill)
        if after is None:  # else once the pending tokens are real: full blocks get hashed
            self.scheduler.update(scheduled)
        self.stats.num_steps += 1
        self.stats.num_computed_tokens += scheduled.num_batched_tokens
        reqs = [scheduled.chunks[i].req for i in step_logits.chunk_index]
        rows = [sample_row(req, j) for req, j in zip(reqs, row_offsets(reqs), strict=True)]
        bitmask = None if self.grammars is None else self.grammars.bitmask(reqs)
        forks = {  # copied before sampling, which may change the logits in place
            req.req_id: step_logits.logits[i : i + 1].clone()
            for i, req in enumerate(reqs)
            if self.forks.owes_choices(req)
        }
        sample = self.sampler.sample(step_logits.logits, rows, bitmask)
        drafts = {c.req.req_id: c.draft_token_ids for c in scheduled.chunks if c.draft_token_ids}
        return InFlightStep(
            scheduled, reqs, sample, after is not None, fork_logits=forks, drafts=drafts,
            started_s=started_s,
        )  # fmt: skip


def row_offsets(reqs: list[Request]) -> list[int]:
    """Each sampling row's place among its request's rows (a request's rows are adjacent)."""
    offsets: list[int] = []
    for i, req in enumerate(reqs):
        offsets.append(offsets[-1] + 1 if i and reqs[i - 1] is req else 0)
    return offsets
