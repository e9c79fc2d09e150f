"""DraftModel: a small model of the same tokenizer that drafts tokens for speculative decoding,
run by an engine of its own (its own small paged cache, prefix caching on). It owns that engine.

Each step it drafts afresh: every speculating request's real tokens go in as a prompt, and the
draft engine continues it greedily for K tokens. Its prefix cache is keyed by token ids, so the
KV of a request's earlier tokens (prompt, accepted or rejected alike: each block is right for
the tokens it holds) is found again; only the tokens since the last full block are computed,
then K - 1 decode steps, batched over the requests.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from engine.sampling.sampling_params import SamplingParams
from engine.step.request import Request

if TYPE_CHECKING:
    from torch import nn

    from engine.config import ModelConfig
    from engine.step.step_types import RequestOutput


class DraftEngine(Protocol):
    """What a draft model asks of the engine that runs it (an engine.engine.Engine)."""

    model_config: ModelConfig

    def add_request(
        self, req_id: str, prompt: Sequence[int], params: SamplingParams, cacheable: bool = True
    ) -> Request: ...

    def step(self) -> list[RequestOutput]: ...

    @property
    def has_unfinished_requests(self) -> bool: ...

    def abort(self, req_id: str) -> bool: ...


# Builds the draft engine from its config and the weights it shares (Engine itself).
EngineFactory = Callable[[EngineConfig, "nn.Module | None"], DraftEngine]


def draft_engine_config(target: EngineConfig, max_model_len: int, shares: bool) -> EngineConfig:
    """The draft engine's config: the target's block size, device, dtype, seed and settings, the
    draft checkpoint, its own small pool, no graphs, no overlap, no speculation of its own."""
    spec = target.speculative
    assert spec.draft_model is not None
    return EngineConfig(
        model=spec.draft_model,
        cache=CacheConfig(
            block_size=target.cache.block_size,
            kv_cache_memory_bytes=spec.draft_kv_cache_bytes,
            partial_reuse_min_tokens=0,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=spec.max_batch,
            max_model_len=max_model_len if shares else None,
        ),
        device=target.device,
        dtype=target.dtype,
        cuda_graph=False,
        async_scheduling=False,
        load_format=target.load_format,
        seed=target.seed,
        speculative=SpeculativeConfig(),
        warm_up=False,  # the target's warm-up drafts through it (uncached there too)
        settings=target.settings,
    )


class DraftModel:
    def __init__(
        self,
        target: EngineConfig,
        vocab_size: int,
        max_model_len: int,
        make_engine: EngineFactory,
        shared: nn.Module | None = None,
    ):
        """target: the target engine's config (its speculative.draft_model names the draft)
        and vocabulary size, and its max_model_len (the draft's, when it shares the weights);
        make_engine: builds the draft engine; shared: the target's own weights, when it
        drafts for itself."""
        config = draft_engine_config(target, max_model_len, shared is not None)
        self.engine = make_engine(config, shared)
        draft_vocab = self.engine.model_config.vocab_size
        if draft_vocab != vocab_size:
            raise ValueError(
                f"the draft model {config.model!r} has a vocabulary of {draft_vocab} tokens, "
                f"the target {vocab_size}: a draft model must share the target's tokenizer"
            )

    def draft(self, reqs: list[Request], rooms: list[int]) -> None:
        """Set each request's draft_token_ids: up to room greedy tokens of the draft model
        after its real tokens (none for a request the draft engine cannot hold)."""
        engine = self.engine
        ids = {}
        for req, room in zip(reqs, rooms, strict=True):
            params = SamplingParams(max_tokens=room, temperature=0.0, ignore_eos=True)
            try:
                engine.add_request(req.req_id, req.all_token_ids, params, cacheable=req.cacheable)
            except ValueError:  # longer than the draft engine holds: no draft
                continue
            ids[req.req_id] = req
        drafted: dict[str, list[int]] = {req_id: [] for req_id in ids}
        try:
            while engine.has_unfinished_requests:
                for out in engine.step():
                    drafted[out.req_id].extend(out.new_token_ids)
        except BaseException:  # the target's step fails with it: leave the draft engine empty
            for req_id in ids:
                engine.abort(req_id)
            raise
        for req_id, req in ids.items():
            req.draft_token_ids = drafted[req_id]
