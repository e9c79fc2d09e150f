"""Engine: add_request / step / abort over one model and one KV pool.

The engine owns its parts (scheduler, runner, sampler, KV manager and copies, loader, forks,
speculator) and the step counters; model_setup.py builds its device side, admission.py takes
requests in and aborts them, step_launcher.py queues a step, overlap.py runs one ahead,
output_processor.py turns tokens into outputs. It is single-threaded: callers serialise their
calls.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path

from torch import nn

from engine import warm_up
from engine.config import EngineConfig, ModelConfig
from engine.execution import kernel_compiles
from engine.execution.backend_builder import DeviceSide, resolve_device
from engine.execution.gc_heap import freeze_heap, thaw_heap
from engine.execution.model_setup import build_device_parts
from engine.execution.runner import ModelRunner
from engine.kv_cache import tier_ops
from engine.kv_cache.block_pool import DEFAULT_PRIORITY, KVEvent
from engine.kv_cache.hashing import hash_blocks, root_hash
from engine.kv_cache.load_gate import LoadGate
from engine.kv_cache.retention import RetentionRange
from engine.models.loader import read_model_config, resolve_model
from engine.parallel.launch import StartFollower, start_leader
from engine.parallel.leader import FollowerHandle, LeaderRunner, RankLost
from engine.parallel.step_plan import ReadPlan
from engine.priority import DEFAULT_LEVEL
from engine.sampling.sampler import Sampler
from engine.sampling.sampling_params import SamplingParams
from engine.sampling.structured import new_grammars
from engine.say import say
from engine.speculation.draft_model import DraftModel
from engine.speculation.speculative import Speculator, drafter
from engine.step.admission import Admission
from engine.step.fork import ChoiceForks
from engine.step.kv_loading import KVLoadPlan, RemoteKVLoader
from engine.step.output_processor import OutputProcessor
from engine.step.overlap import RunAhead
from engine.step.request import PrefilledChoices, Request
from engine.step.scheduler import Scheduler
from engine.step.slow_steps import SlowSteps
from engine.step.step_launcher import StepLauncher
from engine.step.step_types import (
    EngineSnapshot,
    EngineStats,
    InFlightStep,
    KVMemory,
    RequestOutput,
)
from engine.tokenizer import find_tokenizer, stop_token_ids

PREFILL_STEP_TOKENS = 64  # a step carrying this many prompt tokens or more, and mostly them,
# measures the prefill rate (EngineStats.prefill_rate)


class Engine:
    def __init__(
        self,
        config: EngineConfig | None = None,
        model: nn.Module | None = None,
        start_follower: StartFollower | None = None,
    ):
        """model: weights already loaded from the same checkpoint (shared across engines).
        start_follower: how tensor-parallel ranks 1.. start (None: local processes)."""
        config = config or EngineConfig()
        say(config.settings.describe())
        self.checkpoint_dir = folder = resolve_model(
            config.model, cache_dir=config.settings.cache_dir
        )
        self.model_config: ModelConfig = read_model_config(folder, config.model_id)
        mc = self.model_config
        self.model_id = mc.model_id
        self.tokenizer = find_tokenizer(folder)
        self.device = resolve_device(config.device)
        thaw_heap(self.device)  # an earlier engine's frozen cycles are freed before sizing
        # Tensor parallelism: ranks 1.. follow this engine's steps (engine/parallel/).
        self.leader = start_leader(config, mc, start_follower)
        # Triton variants built from here to the warm-up's end are start-up's; later, said
        watch = kernel_compiles.install() if self.device.type == "cuda" else None
        with watch.starting() if watch is not None else nullcontext():
            self._start_device_side(config, folder, model)
        if watch is not None and not watch.is_starting():  # a draft's engine starts inside
            say(watch.start_line())
        # served steps far slower than the recent ones: said on stderr
        self.slow_steps = SlowSteps(self.config.model_id)
        freeze_heap(self.device)  # the start-up heap, out of the cyclic collector's walks

    def _start_device_side(
        self, config: EngineConfig, folder: Path, model: nn.Module | None
    ) -> None:
        """Model, KV pool, backend and graphs, the draft model's engine, the step parts; then
        the warm-up where it runs (its step parts are then built afresh)."""
        mc = self.model_config
        try:
            parts = build_device_parts(config, mc, folder, self.device, model, self.leader)
        except BaseException:  # the follower ranks end with the failed start
            if self.leader is not None:
                self.leader.shutdown()
            raise
        self.config, self.max_model_len = parts.config, parts.max_model_len
        self.attention_backend, self.kv_cache = parts.backend.name, parts.backend.kv_cache
        self.copies, self.kv, self.block_size = parts.copies, parts.kv, parts.kv.block_size
        config = self.config
        draft = drafter(config, parts.model, mc.vocab_size, self.max_model_len, Engine)
        self._build_step_parts(parts.model, parts.backend, draft)
        self.slow_steps = SlowSteps(say_line=lambda _line: None)  # warm-up steps compile
        wanted = config.warm_up
        if wanted if wanted is not None else self.device.type == "cuda":
            try:
                warm_up.report(warm_up.warm_up(self))
            except BaseException:  # the follower ranks end with the failed start
                if self.leader is not None:
                    self.leader.shutdown()
                raise
            # fresh step parts: counters, the sampler's seed and step timings start at serving
            self._build_step_parts(parts.model, parts.backend, draft)

    def _build_step_parts(
        self, model: nn.Module, backend: DeviceSide, draft: DraftModel | None
    ) -> None:
        config, mc, kv = self.config, self.model_config, self.kv
        self.scheduler = sched = Scheduler(config.scheduler, kv, self.max_model_len)
        self.loader = RemoteKVLoader(sched, kv, lambda: self.run_ahead.between_steps())
        self.forks = forks = ChoiceForks(sched, kv)
        rows = backend.graphs.max_batch_size if backend.graphs else None  # a verify's cap
        self.speculator = spec = Speculator(config.speculative, self.max_model_len, kv, draft, rows)
        if self.leader is None:
            self.runner = ModelRunner(model, backend, kv, config.cache.block_size)
        else:
            self.runner = LeaderRunner(self.leader, model, backend, kv, config.cache.block_size)
        self.sampler = sampler = Sampler(self.device, config.seed)
        self.stats = stats = EngineStats()
        if kv.disk_tier is not None and config.cache.file_tier_reads == "measured":
            prefill = stats.prefill_rate  # a file tier's hits read back when that beats
            kv.prefix.gate = LoadGate(config.cache.block_size, lambda: prefill.tokens_per_s)
        self.eos_token_ids = eos_ids = stop_token_ids(mc.eos_token_ids, self.tokenizer)
        self.grammars = grammars = None
        if self.tokenizer is not None:  # compiled grammars (structured outputs)
            self.grammars = grammars = new_grammars(self.tokenizer, mc.vocab_size, eos_ids)
        self.launcher = StepLauncher(
            sched, self.runner, sampler, self.copies, spec, forks, grammars, stats
        )
        overlap = config.async_scheduling  # None: where decode steps replay CUDA graphs
        overlap = backend.graphs is not None if overlap is None else overlap
        self.run_ahead = RunAhead(overlap, self.launcher, sched, spec, forks, stats)
        self._failed_steps: list[InFlightStep | None] = []  # a raising step's, for fail_running
        self._last_read_s = 0.0  # perf_counter when the latest step's tokens were read
        self.output = output = OutputProcessor(
            sched, forks, spec, sampler, self.tokenizer, eos_ids, grammars, config.detokenize
        )
        self.admission = Admission(
            sched, self.loader, forks, output, kv, self.copies, self.tokenizer, mc.vocab_size,
            self.max_model_len,
        )  # fmt: skip

    @property
    def overlap_steps(self) -> bool:
        """Whether the next step is queued before a step's tokens are read (overlap.py)."""
        return self.run_ahead.enabled

    # ---- requests (admission.py) --------------------------------------------------------
    def tokenize_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        return self.admission.tokenize_prompt(prompt)

    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise InvalidField (a ValueError naming the field) for input this engine cannot serve."""
        self.admission.validate(prompt_token_ids, params)

    def add_request(
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
        """Queue a request (Admission.add says what each option does)."""
        return self.admission.add(
            req_id, prompt, params, cache_salt, retention_priority, keep_blocks,
            num_resumed_tokens, kv_retention, priority, cacheable,
        )  # fmt: skip

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
        priority: int = DEFAULT_LEVEL,
    ) -> KVLoadPlan | None:
        """Admit a prompt computed elsewhere (Admission.add_prefilled); None if no room now.
        At TP > 1 every rank loads its own KV heads of the plan's blocks (Leader.read_on_ranks,
        before rank 0 reads its own)."""
        return self.admission.add_prefilled(
            req_id, prompt_token_ids, first_token_id, params, cache_salt, num_resumed_tokens,
            choices, kv_retention, priority,
        )  # fmt: skip

    def commit_kv(self, req_id: str) -> None:
        self.admission.commit_kv(req_id)

    def fail_kv(self, req_id: str) -> None:
        self.admission.fail_kv(req_id)

    def release_blocks(self, req_id: str) -> bool:
        """Free the blocks a keep_blocks request kept; False when none are kept for req_id."""
        return self.kv.release_kept(req_id)

    def abort(self, req_id: str) -> bool:
        """Abort a request and its other choices (n > 1); False when none of them was known."""
        return self.admission.abort(req_id)

    def fail_running(self) -> list[str]:
        """After a step raised: the requests it ran (those it finished too: their outputs are
        lost), the step launched ahead of it and every running one, ended with their other
        choices (aborted, blocks freed, kept blocks released); with none of those, the waiting
        ones (scheduling one of them raised). So the next step does not meet the same failure;
        returns their ids."""
        failed, self._failed_steps = self._failed_steps, []
        failed.append(self.run_ahead.drop())
        reqs = [r for step in failed if step is not None for r in step.reqs]
        reqs += self.scheduler.running
        if not reqs:
            reqs = list(self.scheduler.waiting)
        req_ids = list(dict.fromkeys(r.choice_of or r.req_id for r in reqs))
        for req_id in req_ids:
            self.abort(req_id)
            if req_id in self.kv.kept:
                self.kv.release_kept(req_id)
        return req_ids

    def _abort_all(self) -> None:
        for req_id in [*self.scheduler.requests, *self.loader.loading]:
            self.abort(req_id)
        for req_id in list(self.kv.kept.block_ids()):
            self.kv.release_kept(req_id)

    def shutdown(self, flush: bool = True) -> None:
        """Write the cached blocks the disk tier lacks into it (a restart on the same directory
        finds them) and stop its reader and writer threads, then end the tensor-parallel
        follower ranks (none with one rank); the engine steps no more after it. flush False:
        the follower ranks only (its engine thread did not stop: the tiers are still that
        thread's). Idempotent."""
        if flush:
            self.flush_disk_tier()
            if self.kv.disk_tier is not None:
                self.kv.disk_tier.close()
        if self.leader is not None:
            self.leader.shutdown()

    def flush_disk_tier(self) -> None:
        """Write every cached block the disk tier lacks into it (none without one), and publish
        those the shared store lacks (waiting for their writers: none dropped; up to 60 s
        each)."""
        disk = self.kv.disk_tier
        shared = None if disk is None else disk.shared
        with (
            nullcontext() if disk is None else disk.flushing(),
            nullcontext() if shared is None else shared.flushing(),
        ):
            self.copies.flush_to_disk(self.kv)

    def is_unfinished(self, req_id: str) -> bool:
        return self.admission.is_unfinished(req_id)

    @property
    def has_unfinished_requests(self) -> bool:
        return self.admission.has_unfinished_requests

    # ---- stepping ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step and return what it produced.

        With overlapped steps the next step is already queued on the GPU when this returns:
        its host work (scheduling, inputs, attention plan) ran while this step's kernels did.
        """
        outputs: list[RequestOutput] = []
        current = None
        try:
            current = self.run_ahead.next_step()  # scheduled and launched, or launched ahead
            if current is not None:
                self.run_ahead.launch_ahead(current)  # queued before current's tokens are read
                outputs = self.output.process(current)  # its tokens appended; what stops, stops
                self.run_ahead.settle()
            # the blocks it committed, behind it (done before kept host copies are read)
            self.copies.offload_owed(self.kv, sync=any(o.num_kept_host_blocks for o in outputs))
        except RankLost:
            self._abort_all()  # a rank is gone: no step can run; every block goes back
            raise
        except Exception:  # its requests are fail_running's to end
            self._failed_steps = [current]
            raise
        if current is not None:
            self._record_step(current, outputs)
        return outputs

    def _record_step(self, step: InFlightStep, outputs: list[RequestOutput]) -> None:
        """The step just read, its own tokens against its own wall time: from when it began
        to be scheduled, or when the step before it was read if it ran ahead of that one, to
        now. (With overlapped steps a step() call waits for one step and launches the next:
        its duration and the tokens it launched belong to two different steps.) A step run
        ahead is charged the host's time between step() calls (outputs delivered, commands
        taken), which it ran beside; one launched in its step() call is not, as before."""
        read_s = time.perf_counter()
        seconds = read_s - max(step.started_s, self._last_read_s)
        self._last_read_s = read_s
        self.stats.last_step_s = seconds
        num_out = sum(len(out.new_token_ids) for out in outputs)
        self.stats.num_generated_tokens += num_out
        chunks = step.scheduled.chunks
        num_computed = step.scheduled.num_batched_tokens
        self.speculator.observe(seconds, num_out, num_computed, len(self.scheduler.running))
        rate = self.stats.rate
        self.slow_steps.observe(seconds, num_computed, rate.step_s, rate.tokens_per_s, chunks)
        rate.record(seconds, num_computed)
        num_prompt = sum(c.num_new_tokens for c in chunks if c.is_prompt)
        if num_prompt >= max(PREFILL_STEP_TOKENS, num_computed // 2):
            self.stats.prefill_rate.record(seconds, num_computed)

    # ---- summary, and what a worker shares with its peers and the index ---------------------
    def snapshot(self) -> EngineSnapshot:
        """Load, leak counts and counters now (between steps)."""
        sched, loading, kv, spec = self.scheduler, self.loader.loading, self.kv, self.speculator
        # a block's KV on every rank (each holds its heads' share, or a replica of one head)
        block_bytes = self.copies.kv_cache[0].nbytes * self.config.tensor_parallel_size
        return EngineSnapshot(
            num_running=len(sched.running),
            num_waiting=len(sched.waiting) + len(loading),
            num_requests=len(sched.requests) + len(loading),
            num_free_blocks=kv.num_free_blocks,
            num_total_blocks=kv.num_blocks,
            num_queued_tokens=sched.num_queued_tokens,
            num_kept_requests=len(kv.kept),
            tokens_per_s=self.stats.rate.tokens_per_s,
            step_s=self.stats.rate.step_s,
            prompt_tokens_per_s=self.stats.prefill_rate.tokens_per_s,
            num_computed_tokens=self.stats.num_computed_tokens,
            num_preemptions=sched.num_preemptions,
            num_priority_preemptions=sched.num_priority_preemptions,
            num_partial_reused_tokens=kv.num_partial_reused_tokens,
            num_host_offloaded_blocks=0 if kv.host_tier is None else kv.host_tier.num_stored,
            num_host_hit_blocks=kv.num_host_hit_blocks,
            num_spec_verify_steps=spec.num_verify_steps,
            num_spec_drafted_tokens=spec.num_drafted_tokens,
            num_spec_accepted_tokens=spec.num_accepted_tokens,
            **({} if kv.disk_tier is None else kv.disk_tier.snapshot_fields()),
            tiers=tier_ops.tier_stats(kv, block_bytes, self.copies.host_copy_back_s),
        )

    def evict_kv(
        self, token_ids: Sequence[int] | None = None, cache_salt: str | None = None
    ) -> dict[str, int]:
        """Drop a prompt's blocks (token_ids, hashed under cache_salt) or, without token_ids,
        every block computed under cache_salt from every tier, the shared store included
        (`kvrelay kv evict`); returns how many each tier dropped."""
        if token_ids is None and not cache_salt:
            raise ValueError("evict_kv needs token_ids, a cache_salt or both")
        if token_ids is None:
            return tier_ops.evict(self.kv, [], root_hash(self.model_id, cache_salt))
        hashes = hash_blocks(token_ids, self.block_size, self.model_id, cache_salt)
        return tier_ops.evict(self.kv, hashes)

    def disk_cached_hashes(self) -> list[int]:
        """The disk tier's block hashes (for a full index publish; [] without one)."""
        disk = self.kv.disk_tier
        return disk.cached_hashes() if disk is not None and disk.record_events else []

    def kept_block_ids(self) -> dict[str, tuple[int, ...]]:
        """req_id -> the ids kept for it (keep_blocks; host slots first), a copy."""
        return self.kv.kept.block_ids()

    def loading_block_ids(self) -> dict[str, list[int]]:
        """req_id -> the blocks reserved for a prompt whose KV is loading (a live list)."""
        return {req_id: self.kv.block_ids(req_id) for req_id in self.loader.loading}

    @property
    def followers(self) -> tuple[FollowerHandle, ...]:
        """Ranks 1.. of a tensor-parallel engine (their handles); () at one rank."""
        return () if self.leader is None else tuple(self.leader.followers)

    def rank_lost(self, probe: bool) -> RankLost | None:
        """Why the tensor-parallel group failed; None at one rank or while every rank runs.
        probe: also ask each follower whether its process ended (an idle engine sends nothing,
        so only a probe notices a killed rank)."""
        if self.leader is None:
            return None
        return self.leader.check_followers() if probe else self.leader.lost

    def read_on_ranks(self, plan: ReadPlan) -> bool:
        """A tensor-parallel engine's ranks 1.. read their own heads of a peer's blocks (before
        rank 0 reads its own); False when a rank's read failed. True at one rank (nothing to do)."""
        return self.leader is None or self.leader.read_on_ranks(plan)

    def kv_memory(self) -> KVMemory:
        """What a peer reads KV from: the device cache, and with keep_on_host the host tier.
        At TP > 1 rank 0's cache and host tier (its KV heads): every rank registers its own
        (a peer reads each head from the rank holding it)."""
        return KVMemory(self.kv_cache, self.copies.host if self.config.cache.keep_on_host else None)

    def drain_kv_events(self) -> list[KVEvent]:
        """Both tiers' KV events since the last call (none without config.record_kv_events)."""
        return self.kv.drain_events()

    def cached_hashes(self) -> list[int]:
        """The device tier's cached block hashes for a full index publish ([] if it records no
        KV events); host_cached_hashes the host tier's. Both safe from another thread."""
        return self.kv.pool.cached_hashes() if self.kv.pool.record_events else []

    def host_cached_hashes(self) -> list[int]:
        host = self.kv.host_tier
        return host.cached_hashes() if host is not None and host.record_events else []

    def check_integrity(self) -> None:
        self.kv.check_integrity()

    def assert_no_leaks(self) -> None:
        """No request has blocks, none are kept, and every block is free (cached or not)."""
        assert not self.has_unfinished_requests, "requests still in flight"
        num_grammars = 0 if self.grammars is None else self.grammars.num_active
        assert num_grammars == 0, f"{num_grammars} grammar matchers left"
        self.kv.assert_all_free()
