"""Engine (add_request / step / abort over one model and one KV pool) and the offline LLM.

The engine owns the scheduler, the runner, the sampler, per-request generators and
detokenizers, the step in flight (overlapped steps) and step counters; backend_builder.py
makes its device side. It is single-threaded: callers serialise their calls.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch import nn

from engine.backend_builder import (
    build_backend,
    model_len_limit,
    resolve_device,
    resolve_dtype,
    size_kv_pool,
    size_kv_pool_by_memory,
    sizes_by_memory,
    with_batch_limit,
)
from engine.block_copies import BlockCopies
from engine.config import EngineConfig, ModelConfig
from engine.fork import ChoiceForks, PrefilledChoices
from engine.gc_heap import freeze_heap, thaw_heap
from engine.kv_cache.block_pool import DEFAULT_PRIORITY, MAX_PRIORITY, MIN_PRIORITY
from engine.kv_cache.manager import KVCacheManager, cdiv
from engine.kv_cache.retention import RetentionRange, check_ranges
from engine.kv_loading import KVLoadPlan, RemoteKVLoader
from engine.loader import load_model, read_model_config, resolve_model
from engine.request import FinishReason, Request
from engine.runner import ModelRunner
from engine.sampler import Sampler, SampleRow
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.speculative import Speculator, drafter
from engine.step_inputs import TokenFill
from engine.step_types import (
    EngineStats,
    InFlightStep,
    RequestOutput,
    find_tokenizer,
    resumed_tokens,
    row_offsets,
    served_model_id,
    stop_token_ids,
    with_top_logprobs,
)
from engine.stop_checker import StopChecker
from engine.structured import new_grammars
from engine.validation import InvalidField, check_prefilled, check_request, structured_field


class Engine:
    def __init__(self, config: EngineConfig | None = None, model: nn.Module | None = None):
        """model: weights already loaded from the same checkpoint (shared across engines)."""
        self.config = config = config or EngineConfig()
        self.checkpoint_dir = folder = resolve_model(config.model)
        self.model_config: ModelConfig = read_model_config(folder, served_model_id(config.model))
        mc = self.model_config
        self.model_id = mc.model_id
        self.tokenizer = find_tokenizer(folder)
        self.device = resolve_device(config.device)
        thaw_heap(self.device)  # an earlier engine's frozen cycles are freed before sizing
        dtype = resolve_dtype(config.dtype, self.device)
        by_memory = sizes_by_memory(config, self.device)
        # A pool sized by GPU memory is known only once the weights are in.
        pool = None if by_memory else size_kv_pool(config, mc, dtype)
        model_len = model_len_limit(config, mc) if pool is None else pool.max_model_len
        if model is None:
            model = load_model(
                folder,
                mc,
                model_len,
                self.device,
                dtype,
                config.load_format,
                quantization=config.quantization,
            )
        elif model.rope.cos.shape[0] < model_len:
            raise ValueError("the shared model's rotary table is shorter than max_model_len")
        if pool is None:
            pool = size_kv_pool_by_memory(config, model, mc, self.device, dtype)
        self.max_model_len = pool.max_model_len
        self.config = config = with_batch_limit(config, pool, by_memory)  # max_num_seqs set
        backend = build_backend(config, model, mc, self.device, dtype, pool)
        self.attention_backend = backend.name
        self.kv_cache = backend.kv_cache
        cache = config.cache
        self.copies = BlockCopies(self.kv_cache, cache.host_kv_cache_bytes)
        slots, events = self.copies.num_host_slots, config.record_kv_events
        self.kv = KVCacheManager.from_config(cache, pool.num_blocks, self.model_id, events, slots)
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len)
        self.loader = RemoteKVLoader(self.scheduler, self.kv)
        self.forks = ChoiceForks(self.scheduler, self.kv)
        draft = drafter(config, model, mc.vocab_size, self.max_model_len)
        rows = backend.graphs.max_batch_size if backend.graphs else None  # a verify's cap
        self.speculator = Speculator(config.speculative, self.max_model_len, self.kv, draft, rows)
        self.runner = ModelRunner(model, backend, self.kv, cache.block_size)
        overlap = config.async_scheduling
        self.overlap_steps = backend.graphs is not None if overlap is None else overlap
        self._in_flight: InFlightStep | None = None
        self.sampler = Sampler(self.device, config.seed)
        self.stats = EngineStats()
        self._generators: dict[str, torch.Generator] = {}
        self._stops: dict[str, StopChecker] = {}
        self.eos_token_ids = stop_token_ids(mc.eos_token_ids, self.tokenizer)
        self.grammars = None
        if self.tokenizer is not None:  # matchers and compiled grammars (structured outputs)
            self.grammars = new_grammars(self.tokenizer, mc.vocab_size, self.eos_token_ids)
        freeze_heap(self.device)  # the start-up heap, out of the cyclic collector's walks

    # ---- requests ------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer; send token ids")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise InvalidField (a ValueError naming the field) for input this engine cannot serve."""
        check_request(prompt_token_ids, params, self.model_config.vocab_size, self.max_model_len)

    def add_request(
        self,
        req_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        cache_salt: str | None = None,
        retention_priority: int = DEFAULT_PRIORITY,
        hold_kv: bool = False,
        num_resumed_tokens: int = 0,
        kv_retention: Sequence[RetentionRange] = (),
    ) -> Request:
        """Queue a request.

        hold_kv (prefill role): the request ends after its first token and keeps its blocks
        under a lease (release_kv drops it). Its finish reason is the true one when that token
        ends it (stop, length), else "prefilled": the decode continues elsewhere. With n > 1
        each choice's first token comes out (index 1..n-1 holding no block; one lease).
        num_resumed_tokens: the prompt's last tokens are an earlier leg's output (migration).
        kv_retention: token ranges whose blocks keep their own priority once freed.
        """
        if self.kv.is_held(req_id):
            raise ValueError(f"request id {req_id!r} is already in use (its blocks are leased)")
        if self.forks.live_choices(req_id):
            raise ValueError(f"request id {req_id!r} is already in use (by its other choices)")
        req = self._new_request(req_id, prompt, params, cache_salt, retention_priority)
        check_ranges(kv_retention)
        req.retention = tuple(kv_retention)
        req.hold_kv = hold_kv
        req.num_resumed_tokens = resumed_tokens(num_resumed_tokens, req.num_prompt_tokens)
        self._start_grammar(req)  # before queueing: a spec the compiler refuses raises here
        self.scheduler.add(req)
        self._track(req)
        return req

    def add_prefilled_request(
        self,
        req_id: str,
        prompt_token_ids: Sequence[int],
        first_token_id: int,
        params: SamplingParams,
        cache_salt: str | None = None,
        num_resumed_tokens: int = 0,
        choices: PrefilledChoices | None = None,
        kv_retention: Sequence[RetentionRange] = (),
    ) -> KVLoadPlan | None:
        """Decode role: reserve blocks for a prompt prefilled elsewhere; None if no room now.

        The caller pulls the remote blocks named by the plan, then calls commit_kv (or fail_kv
        to recompute locally). n > 1: `choices` (the prefill engine's first tokens of the
        other choices) are forked off the prompt's KV once it is in.
        """
        if req_id in self.scheduler.requests or req_id in self.loader.loading:
            raise ValueError(f"request id {req_id!r} is already in use")
        blocks_needed = cdiv(len(prompt_token_ids) + 1, self.kv.block_size)
        limits = (blocks_needed, self.kv.num_blocks, self.model_config.vocab_size)
        check_prefilled(len(prompt_token_ids), first_token_id, self.max_model_len, limits)
        req = Request(req_id, list(prompt_token_ids), params, cache_salt, DEFAULT_PRIORITY)
        check_ranges(kv_retention)
        req.retention = tuple(kv_retention)
        req.num_resumed_tokens = resumed_tokens(num_resumed_tokens, req.num_prompt_tokens)
        req.append_token(first_token_id)
        self._start_grammar(req)  # replays the first token (and a migration's sent tokens)
        if choices is not None:
            self.forks.expect_prefilled(req, choices)
        plan = self.loader.reserve(req)
        if plan is not None:  # an offload of a block the pull will write must be done first
            self.copies.run_owed(self.kv, wait=True, writes=plan.local_block_ids)
            self._track(req)
        else:
            self.forks.forget_prefilled(req_id)
            self._forget(req_id)
        return plan

    def commit_kv(self, req_id: str) -> None:
        req = self.loader.loading[req_id]
        self.loader.commit(req_id)
        self._fork_prefilled(req)

    def fail_kv(self, req_id: str) -> None:
        req = self.loader.loading[req_id]
        self.loader.fail(req_id)
        self._fork_prefilled(req)

    def _fork_prefilled(self, parent: Request) -> None:
        """n > 1: the prefilled parent's choices go on; a choice 0 that ended at prefill only
        carried the KV and leaves quietly (its end was reported there)."""
        children, parent_reason = self.forks.fork_prefilled(parent)
        for child in children:
            self._track(child)
        if parent_reason is not None:
            self.scheduler.finish(parent, FinishReason(parent_reason))
            self._forget(parent.req_id)

    def release_kv(self, req_id: str) -> bool:
        """Prefill role: drop the lease on a finished request's blocks."""
        return self.kv.release_held(req_id)

    def _new_request(
        self,
        req_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | None,
        cache_salt: str | None,
        retention_priority: int,
    ) -> Request:
        params = params or SamplingParams()
        token_ids = self.tokenize_prompt(prompt)
        self.validate(token_ids, params)
        if not MIN_PRIORITY <= retention_priority <= MAX_PRIORITY:
            raise ValueError(f"retention_priority must be in [0, 100], got {retention_priority}")
        return Request(req_id, token_ids, params, cache_salt, retention_priority)

    def _start_grammar(self, req: Request) -> None:
        """Give a request with a grammar its matcher, advanced through its output so far: the
        prompt's resumed tail (migration) and any token already appended (a handoff's first)."""
        spec = req.sampling.structured
        if spec is None or (self.grammars is not None and self.grammars.has(req.req_id)):
            return
        if self.grammars is None:
            field = structured_field(spec.kind)
            raise InvalidField(f"{field} needs the model's tokenizer, which it lacks", field)
        num_prompt = req.num_prompt_tokens - req.num_resumed_tokens
        self.grammars.start(req.req_id, spec, req.all_token_ids[num_prompt:])

    def _track(self, req: Request) -> None:
        req_id, params = req.req_id, req.sampling
        self._start_grammar(req)  # n > 1: a forked choice gets its own matcher here
        if params.seed is not None:
            self._generators[req_id] = torch.Generator(self.device).manual_seed(params.seed)
        if self.tokenizer is not None and (params.stop or self.config.detokenize):
            self._stops[req_id] = StopChecker(self.tokenizer, params.stop)

    def abort(self, req_id: str) -> bool:
        """Abort a request and its other choices (n > 1); False when none of them was known."""
        aborted = [self._abort_one(choice_id) for choice_id in self.forks.live_choices(req_id)]
        self.forks.forget_prefilled(req_id)
        return self._abort_one(req_id) or any(aborted)

    def _abort_one(self, req_id: str) -> bool:
        req = self.scheduler.requests.get(req_id)
        if req is not None:
            self.scheduler.finish(req, FinishReason.ABORT)
            self.forks.discard(req)
        elif not self.loader.abort(req_id):
            return False
        self._forget(req_id)
        return True

    def is_unfinished(self, req_id: str) -> bool:
        """Some choice of req_id is queued, running or loading its KV."""
        requests, loading = self.scheduler.requests, self.loader.loading
        return req_id in requests or req_id in loading or bool(self.forks.live_choices(req_id))

    @property
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished or bool(self.loader.loading)

    # ---- stepping ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step and return what it produced.

        With overlapped steps the next step is already queued on the GPU when this returns:
        its host work (scheduling, inputs, attention plan) ran while this step's kernels did.
        """
        started = time.perf_counter()
        stats = self.stats
        computed_before, generated_before = stats.num_computed_tokens, stats.num_generated_tokens
        outputs = self._step()
        # the blocks it committed, behind it (done before a host lease's handle leaves)
        self.copies.offload_owed(self.kv, sync=any(o.num_held_host_blocks for o in outputs))
        seconds = time.perf_counter() - started
        num_computed = stats.num_computed_tokens - computed_before
        num_out = stats.num_generated_tokens - generated_before
        self.speculator.observe(seconds, num_out, num_computed, len(self.scheduler.running))
        if num_computed:
            self.stats.rate.record(seconds, num_computed)
        return outputs

    def _step(self) -> list[RequestOutput]:
        if not self.overlap_steps:
            current = self._launch_scheduled()
            return [] if current is None else self._finish(current)
        current = self._in_flight or self._launch_scheduled()
        if current is None:
            return []
        self._in_flight = self._launch_ahead(current)
        return self._finish(current)

    def _launch_scheduled(self) -> InFlightStep | None:
        self.speculator.propose(self.scheduler.running)  # drafts verified by this step
        scheduled = self.scheduler.schedule()
        return self._launch(scheduled, None) if scheduled.chunks else None

    def _launch(self, scheduled: SchedulerOutput, after: InFlightStep | None) -> InFlightStep:
        """Queue a step's forward pass and sampling. `after`: the step still in flight whose
        sampled tokens are this step's pending input tokens (gathered on the device)."""
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
        rows = [self._sample_row(req, j) for req, j in zip(reqs, row_offsets(reqs), strict=True)]
        bitmask = None if self.grammars is None else self.grammars.bitmask(reqs)
        forks = {  # copied before sampling, which may change the logits in place
            req.req_id: step_logits.logits[i : i + 1].clone()
            for i, req in enumerate(reqs)
            if self.forks.owes_choices(req)
        }
        sample = self.sampler.sample(step_logits.logits, rows, bitmask)
        drafts = {c.req.req_id: c.draft_token_ids for c in scheduled.chunks if c.draft_token_ids}
        return InFlightStep(
            scheduled, reqs, sample, after is not None, fork_logits=forks, drafts=drafts
        )

    def _sample_row(self, req: Request, offset: int = 0) -> SampleRow:
        generator = self._generators.get(req.req_id)
        if not req.sampling.has_penalties:
            return SampleRow(req.sampling, generator, req.num_tokens + offset)
        # Penalties read the token history: never run ahead of it (see _cannot_run_ahead_of).
        assert not req.num_pending_tokens, "a penalised request ran ahead"
        num_prompt = req.num_prompt_tokens - req.num_resumed_tokens
        return SampleRow(req.sampling, generator, req.num_tokens, req.all_token_ids, num_prompt)

    def _launch_ahead(self, current: InFlightStep) -> InFlightStep | None:
        """Schedule and queue the next step before `current`'s tokens are known: each request
        that samples in `current` gets a pending token, which the device fills in.

        A request whose pending token ends it (its length limit; the prefill role's first
        token) is not in the next step (the scheduler sees it has nothing left to compute, and
        preempts nothing while its blocks are about to be freed or leased: Scheduler.schedule).
        A step where nothing samples runs ahead too. One that stops on a stop token or string
        is found a step late, its extra row is dropped and its blocks are freed then (queued
        work that writes them runs before any new owner's).
        """
        live = [req for req in current.reqs if not req.is_finished]
        if current.drafts or any(self._cannot_run_ahead_of(req) for req in live):
            return None
        for req in live:
            req.num_pending_tokens += 1
        current.pending_reqs = live
        scheduled = self.scheduler.schedule()
        if not scheduled.chunks:
            return None
        self.stats.num_steps_ahead += 1
        return self._launch(scheduled, current)

    def _cannot_run_ahead_of(self, req: Request) -> bool:
        """req's next draw reads its token history (penalties) or grammar state (structured
        outputs), which would miss the pending token, or it speculates (drafts need every
        token), or (prefill role) its host lease's copies or its forks' first draws would queue
        behind the step run ahead: do not run ahead of it. (Held KV is whole once read.)"""
        return (
            (req.hold_kv and (self.kv.host_leases or self.forks.owes_choices(req)))
            or self.speculator.wants(req, len(self.scheduler.running))
            or req.sampling.has_penalties
            or req.sampling.structured is not None
        )

    def _finish(self, current: InFlightStep) -> list[RequestOutput]:
        """Wait for `current`'s tokens, append them, stop what stops; then the step launched
        ahead of it (if any) records its computed tokens."""
        result = current.sample.result()
        for req in current.pending_reqs:
            req.num_pending_tokens -= 1  # its token is real now: appended below
        outputs = []
        for i, req in enumerate(current.reqs):
            if req.is_finished:  # aborted, or it stopped one step earlier (we ran ahead)
                continue
            drafts = current.drafts.get(req.req_id)
            if drafts is not None:  # a verify step: its rows are i .. i + len(drafts)
                if not i or current.reqs[i - 1] is not req:
                    tokens = result.token_ids[i : i + len(drafts) + 1]
                    outputs.append(self.speculator.apply(req, drafts, tokens, self._append_token))
                continue
            if req.req_id in current.fork_logits:  # before its own token: choices fork off
                outputs.extend(self._fork(req, current.fork_logits[req.req_id]))
            logprob = result.logprobs[i] if result.logprobs and req.sampling.logprobs else None
            output = self._append_token(req, result.token_ids[i], logprob)
            outputs.append(with_top_logprobs(output, result, i, req.sampling.top_logprobs))
        self.stats.num_generated_tokens += sum(len(out.new_token_ids) for out in outputs)
        ahead = self._in_flight
        if ahead is not None and ahead.update_pending:
            self.scheduler.update(ahead.scheduled, skip_finished=True)
            ahead.update_pending = False
        if ahead is not None and all(req.is_finished for req in ahead.reqs):
            self._in_flight = None  # nothing left to read from it (its GPU work just runs out)
        return outputs

    def _fork(self, parent: Request, logits: torch.Tensor) -> list[RequestOutput]:
        """parent's prompt is computed: fork its other choices, each drawing its first token
        from the same prompt logits with its own generator."""
        # The prefill role only samples the choices' first tokens: its parent holds the lease.
        fork = self.forks.first_token_choices if parent.hold_kv else self.forks.fork
        children = fork(parent)
        for child in children:
            self._track(child)
        rows = [self._sample_row(child) for child in children]
        bitmask = None if self.grammars is None else self.grammars.bitmask(children)
        rows_logits = logits.expand(len(children), -1).contiguous()
        result = self.sampler.sample(rows_logits, rows, bitmask).result()
        outputs = []
        for i, child in enumerate(children):
            logprob = result.logprobs[i] if result.logprobs and child.sampling.logprobs else None
            output = self._append_token(child, result.token_ids[i], logprob)
            outputs.append(with_top_logprobs(output, result, i, child.sampling.top_logprobs))
        return outputs

    def _append_token(self, req: Request, token_id: int, logprob: float | None) -> RequestOutput:
        req.append_token(token_id, logprob)
        params = req.sampling
        reason, stop_reason = None, None
        stop = self._stops.get(req.req_id)
        new_text = stop.add(token_id) if stop else ""
        grammar_ended = self.grammars is not None and self.grammars.advance(req.req_id, token_id)
        if stop and stop.matched is not None:
            reason, stop_reason = FinishReason.STOP, stop.matched
        elif token_id in params.stop_token_ids or self._is_eos(token_id, params):
            reason, stop_reason = FinishReason.STOP, token_id
        elif grammar_ended:
            reason = FinishReason.STOP
        elif req.num_output_tokens >= params.max_tokens or req.num_tokens >= self.max_model_len:
            reason = FinishReason.LENGTH
        elif req.hold_kv:
            reason = FinishReason.PREFILLED
        held: list[int] | None = None
        if reason is not None:
            if stop:
                new_text += stop.finish()
            if req.req_id in self.scheduler.requests:  # not a prefill role's extra first token
                held = self.scheduler.finish(req, reason, stop_reason)
            self._forget(req.req_id)
            self.forks.discard(req)
        return RequestOutput(
            req_id=req.choice_of or req.req_id,
            new_token_ids=[token_id],
            new_text=new_text,
            finished=reason is not None,
            finish_reason=reason.value if reason else None,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            new_logprobs=None if logprob is None else [logprob],
            held_block_ids=tuple(held or ()),
            num_held_host_blocks=self.kv.num_held_host_blocks(req.req_id) if held else 0,
            index=req.choice_index,
            num_accepted_tokens=req.num_accepted_tokens,
        )

    def _is_eos(self, token_id: int, params: SamplingParams) -> bool:
        return not params.ignore_eos and token_id in self.eos_token_ids

    def _forget(self, req_id: str) -> None:
        self._generators.pop(req_id, None)
        self._stops.pop(req_id, None)
        if self.grammars is not None:
            self.grammars.forget(req_id)

    # ---- checks --------------------------------------------------------------------------
    def check_integrity(self) -> None:
        self.kv.check_integrity()

    def assert_no_leaks(self) -> None:
        """No request holds blocks and every block is free (cached or not)."""
        assert not self.has_unfinished_requests, "requests still in flight"
        num_grammars = 0 if self.grammars is None else self.grammars.num_active
        assert num_grammars == 0, f"{num_grammars} grammar matchers left"
        self.kv.assert_all_free()
