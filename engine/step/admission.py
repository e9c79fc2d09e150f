"""Admission: a request's way in and out of the engine (new records, prefilled ones whose KV
loads from a peer, aborts), ahead of the step loop. Holds no state of its own: the records live
in the scheduler, the loader and the forks it is given."""

from __future__ import annotations

from collections.abc import Sequence

from engine.execution.block_copies import BlockCopies
from engine.kv_cache.block_pool import DEFAULT_PRIORITY, MAX_PRIORITY, MIN_PRIORITY
from engine.kv_cache.manager import KVCacheManager, cdiv
from engine.kv_cache.retention import RetentionRange, check_ranges
from engine.priority import DEFAULT_LEVEL, check_priority
from engine.sampling.sampling_params import SamplingParams
from engine.sampling.validation import check_prefilled, check_request, resumed_tokens
from engine.step.fork import ChoiceForks
from engine.step.kv_loading import KVLoadPlan, RemoteKVLoader
from engine.step.output_processor import OutputProcessor
from engine.step.request import FinishReason, PrefilledChoices, Request
from engine.step.scheduler import Scheduler
from engine.tokenizer import Tokenizer


class Admission:
    """Adds, admits prefilled and aborts requests over the engine's scheduler, loader and forks."""

    def __init__(
        self,
        scheduler: Scheduler,
        loader: RemoteKVLoader,
        forks: ChoiceForks,
        output: OutputProcessor,
        kv: KVCacheManager,
        copies: BlockCopies,
        tokenizer: Tokenizer | None,
        vocab_size: int,
        max_model_len: int,
    ):
        self.scheduler, self.loader, self.forks, self.output = scheduler, loader, forks, output
        self.kv, self.copies, self.tokenizer = kv, copies, tokenizer
        self.vocab_size, self.max_model_len = vocab_size, max_model_len

    def tokenize_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer; send token ids")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise InvalidField (a ValueError naming the field) for input this engine cannot serve."""
        check_request(prompt_token_ids, params, self.vocab_size, self.max_model_len)

    def add(
        self,
        req_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        cache_salt: str | None = None,
        retention_priority: int = DEFAULT_PRIORITY,
        keep_blocks: bool = False,
        num_resumed_tokens: int = 0,
        kv_retention: Sequence[RetentionRange] = (),
        priority: int = DEFAULT_LEVEL,
        cacheable: bool = True,
    ) -> Request:
        """Queue a request.

        keep_blocks: the request ends after its first token and keeps its blocks, named in
        that output (kept_block_ids), until release_blocks frees them. Its finish reason is the
        true one when that token ends it (stop, length), else "first_token" (the caller goes on
        from there). With n > 1 each choice's first token comes out (choices 1..n-1 with no
        block: choice 0's are the ones kept).
        num_resumed_tokens: the prompt's last tokens are an earlier leg's output (migration).
        kv_retention: token ranges whose blocks keep their own priority once freed.
        priority: the scheduling priority (engine/priority.py; higher runs first).
        cacheable: False keeps it out of the prefix cache (Request.cacheable).
        """
        if req_id in self.kv.kept:
            raise ValueError(f"request id {req_id!r} is already in use (its blocks are kept)")
        if self.forks.live_choices(req_id):
            raise ValueError(f"request id {req_id!r} is already in use (by its other choices)")
        req = self._new_request(req_id, prompt, params, cache_salt, retention_priority)
        req.priority = check_priority(priority)
        check_ranges(kv_retention)
        req.retention = tuple(kv_retention)
        req.keep_blocks = keep_blocks
        req.cacheable = cacheable
        req.num_resumed_tokens = resumed_tokens(num_resumed_tokens, req.num_prompt_tokens)
        self.output.start(req)  # before queueing: a grammar the compiler refuses raises here
        try:
            self.scheduler.add(req)
        except ValueError:  # its id is in use: the request that has it keeps its own state
            self.output.release(req)
            raise
        return req

    def add_prefilled(
        self,
        req_id: str,
        prompt_token_ids: Sequence[int],
        first_token_id: int,
        params: SamplingParams,
        cache_salt: str | None = None,
        num_resumed_tokens: int = 0,
        choices: PrefilledChoices | None = None,
        kv_retention: Sequence[RetentionRange] = (),
        priority: int = DEFAULT_LEVEL,
    ) -> KVLoadPlan | None:
        """Admit a prompt computed elsewhere: reserve its blocks; None if no room now.

        The caller pulls the remote blocks named by the plan, then calls commit_kv (or fail_kv
        to recompute locally). n > 1: `choices` (the prefill engine's first tokens of the
        other choices) are forked off the prompt's KV once it is in.
        """
        if req_id in self.scheduler.requests or req_id in self.loader.loading:
            raise ValueError(f"request id {req_id!r} is already in use")
        blocks_needed = cdiv(len(prompt_token_ids) + 1, self.kv.block_size)
        limits = (blocks_needed, self.kv.num_blocks, self.vocab_size)
        check_prefilled(len(prompt_token_ids), first_token_id, self.max_model_len, limits)
        req = Request(req_id, list(prompt_token_ids), params, cache_salt, DEFAULT_PRIORITY)
        req.priority = check_priority(priority)
        check_ranges(kv_retention)
        req.retention = tuple(kv_retention)
        req.num_resumed_tokens = resumed_tokens(num_resumed_tokens, req.num_prompt_tokens)
        req.append_token(first_token_id)
        if choices is not None:  # checked before the grammar starts: a refusal leaves nothing
            self.forks.expect_prefilled(req, choices)
        self.output.start(req)  # its grammar replays the first token (and a migration's sent)
        plan = self.loader.reserve(req)
        if plan is not None:  # an offload of a block the pull will write must be done first
            self.copies.run_owed(self.kv, wait=True, writes=plan.local_block_ids)
        else:
            self.output.release(req)
        return plan

    def commit_kv(self, req_id: str) -> None:
        req = self.loader.loading[req_id]
        self.loader.commit(req_id)
        self.output.fork_prefilled(req)

    def fail_kv(self, req_id: str) -> None:
        req = self.loader.loading[req_id]
        self.loader.fail(req_id)
        self.output.fork_prefilled(req)

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

    def abort(self, req_id: str) -> bool:
        """Abort a request and its other choices (n > 1); False when none of them was known."""
        aborted = [self._abort_one(choice_id) for choice_id in self.forks.live_choices(req_id)]
        return self._abort_one(req_id) or any(aborted)

    def _abort_one(self, req_id: str) -> bool:
        req = self.scheduler.requests.get(req_id)
        if req is not None:
            self.scheduler.finish(req, FinishReason.ABORT)
            self.forks.discard(req)
        else:
            req = self.loader.abort(req_id)
        if req is None:
            return False
        self.output.release(req)
        return True

    def is_unfinished(self, req_id: str) -> bool:
        """Some choice of req_id is queued, running or loading its KV."""
        requests, loading = self.scheduler.requests, self.loader.loading
        return req_id in requests or req_id in loading or bool(self.forks.live_choices(req_id))

    @property
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished or bool(self.loader.loading)
