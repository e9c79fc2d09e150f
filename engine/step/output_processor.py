"""OutputProcessor: turns a step's sampled tokens into RequestOutputs. It owns the stop rules
(EOS ids, max_model_len) and the engine's grammars, and gives each request what it decodes with
(start: its seeded generator, stop checker and grammar matcher, kept on the Request; release).

Per token it appends, detokenizes, advances the grammar and stops what stops (the finish takes
the request out of the scheduler: its blocks are freed, or kept for the caller). It forks
the choices of an n > 1 request off its prompt's logits, and hands a verify step's rows to the
Speculator.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from engine.kv_cache.kept_blocks import Kept
from engine.sampling.sample_row import sample_row
from engine.sampling.sampler import Sampler, SampleResult
from engine.sampling.structured import Grammars
from engine.sampling.structured import advance as advance_grammar
from engine.sampling.validation import InvalidField, structured_field
from engine.speculation.speculative import Speculator
from engine.step.fork import ChoiceForks
from engine.step.request import FinishReason, Request
from engine.step.scheduler import Scheduler
from engine.step.step_types import InFlightStep, RequestOutput
from engine.step.stop_checker import StopChecker
from engine.tokenizer import Decoder


class OutputProcessor:
    def __init__(
        self,
        scheduler: Scheduler,
        forks: ChoiceForks,
        speculator: Speculator,
        sampler: Sampler,
        tokenizer: Decoder | None,
        eos_token_ids: set[int],
        grammars: Grammars | None,
        detokenize: bool,
    ):
        """grammars: None when the model has no tokenizer (a grammar is refused then);
        detokenize: every request gets a stop checker (text), not only those with stop strings."""
        self.scheduler = scheduler
        self.kv = scheduler.kv
        self.max_model_len = scheduler.max_model_len
        self.forks = forks
        self.speculator = speculator
        self.sampler = sampler
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.grammars = grammars
        self.detokenize = detokenize

    # ---- a request's decoding state ---------------------------------------------------------
    def start(self, req: Request) -> None:
        """Give req its generator (seeded requests), stop checker and grammar matcher; a grammar
        the compiler refuses, or tokens so far that break it, raise here."""
        self.start_grammar(req)
        params = req.sampling
        if params.seed is not None:
            req.generator = torch.Generator(self.sampler.device).manual_seed(params.seed)
        if self.tokenizer is not None and (params.stop or self.detokenize):
            req.stop_checker = StopChecker(self.tokenizer, params.stop)

    def start_grammar(self, req: Request) -> None:
        """Give a request with a grammar its matcher, advanced through its output so far: the
        prompt's resumed tail (migration) and any token already appended (a handoff's first)."""
        spec = req.sampling.structured
        if spec is None or req.grammar is not None:
            return
        if self.grammars is None:
            field = structured_field(spec.kind)
            raise InvalidField(f"{field} needs the model's tokenizer, which it lacks", field)
        num_prompt = req.num_prompt_tokens - req.num_resumed_tokens
        self.grammars.start(req, spec, req.all_token_ids[num_prompt:])

    def release(self, req: Request) -> None:
        """req is done (finished, aborted, or not taken): drop what it decoded with."""
        if self.grammars is not None:
            self.grammars.release(req)
        req.generator = None
        req.stop_checker = None

    # ---- a step's tokens --------------------------------------------------------------------
    def process(self, step: InFlightStep) -> list[RequestOutput]:
        """Wait for step's tokens, append them, stop what stops."""
        result = step.sample.result()
        for req in step.pending_reqs:
            req.num_pending_tokens -= 1  # its token is real now: appended below
        outputs = []
        for i, req in enumerate(step.reqs):
            if req.is_finished:  # aborted, or it stopped one step earlier (we ran ahead)
                continue
            drafts = step.drafts.get(req.req_id)
            if drafts is not None:  # a verify step: its rows are i .. i + len(drafts)
                if not i or step.reqs[i - 1] is not req:
                    tokens = result.token_ids[i : i + len(drafts) + 1]
                    outputs.append(self.speculator.apply(req, drafts, tokens, self.append))
                continue
            if req.req_id in step.fork_logits:  # before its own token: choices fork off
                outputs.extend(self._fork(req, step.fork_logits[req.req_id]))
            outputs.append(self._append_row(req, result, i))
        return outputs

    def _append_row(self, req: Request, result: SampleResult, row: int) -> RequestOutput:
        logprob = result.logprobs[row] if result.logprobs and req.sampling.logprobs else None
        output = self.append(req, result.token_ids[row], logprob)
        k = req.sampling.top_logprobs
        if not k or result.top_logprobs is None:
            return output
        return replace(output, new_top_logprobs=[result.top_logprobs[row][:k]])

    def append(self, req: Request, token_id: int, logprob: float | None) -> RequestOutput:
        """Append one sampled token to req and finish req when the token ends it."""
        req.append_token(token_id, logprob)
        params, stop = req.sampling, req.stop_checker
        reason, stop_reason = None, None
        new_text = stop.add(token_id) if stop else ""
        grammar_ended = req.grammar is not None and advance_grammar(req, token_id)
        if stop and stop.matched is not None:
            reason, stop_reason = FinishReason.STOP, stop.matched
        elif token_id in req.stop_token_ids or (
            not params.ignore_eos and token_id in self.eos_token_ids
        ):
            reason, stop_reason = FinishReason.STOP, token_id
        elif grammar_ended:
            reason = FinishReason.STOP
        elif req.num_output_tokens >= params.max_tokens or req.num_tokens >= self.max_model_len:
            reason = FinishReason.LENGTH
        elif req.keep_blocks:
            reason = FinishReason.FIRST_TOKEN
        kept = None
        if reason is not None:
            new_text += stop.finish() if stop else ""
            kept = self._finish(req, reason, stop_reason)
        return RequestOutput(
            req_id=req.choice_of or req.req_id,
            new_token_ids=[token_id],
            new_text=new_text,
            finished=reason is not None,
            finish_reason=reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens or 0,
            new_logprobs=None if logprob is None else [logprob],
            kept_block_ids=() if kept is None else kept.block_ids,
            num_kept_host_blocks=0 if kept is None else kept.num_host_blocks,
            index=req.choice_index,
            num_accepted_tokens=req.num_accepted_tokens,
        )

    def _finish(
        self, req: Request, reason: FinishReason, stop_reason: str | int | None
    ) -> Kept | None:
        """End req; its blocks when it keeps them (keep_blocks)."""
        kept = None
        if req.req_id in self.scheduler.requests:  # not a first-token-only choice (no blocks)
            kept = self.scheduler.finish(req, reason, stop_reason)
        self.release(req)
        self.forks.discard(req)
        return kept

    # ---- n > 1 ------------------------------------------------------------------------------
    def _fork(self, parent: Request, logits: torch.Tensor) -> list[RequestOutput]:
        """parent's prompt is computed: fork its other choices, each drawing its first token
        from the same prompt logits with its own generator."""
        # keep_blocks: the choices only draw their first tokens; the parent's blocks are kept.
        fork = self.forks.first_token_choices if parent.keep_blocks else self.forks.fork
        children = fork(parent)
        for child in children:
            self.start(child)
        rows = [sample_row(child) for child in children]
        bitmask = None if self.grammars is None else self.grammars.bitmask(children)
        rows_logits = logits.expand(len(children), -1).contiguous()
        result = self.sampler.sample(rows_logits, rows, bitmask).result()
        return [self._append_row(child, result, i) for i, child in enumerate(children)]

    def fork_prefilled(self, parent: Request) -> None:
        """A prefilled parent's KV is in (or queued for recompute): its choices go on; a choice 0
        that ended at prefill only carried the KV and leaves quietly (its end was reported
        there)."""
        children, parent_reason = self.forks.fork_prefilled(parent)
        for child in children:
            self.start(child)
        if parent_reason is not None:
            self.scheduler.finish(parent, FinishReason(parent_reason))
            self.release(parent)
