"""Speculator: n-gram (prompt-lookup) speculative decoding. It drafts tokens for running
requests, says which requests speculate, and turns a verify step's sampled rows into the tokens
accepted; it owns the drafting and acceptance counters.

Verification is exact: every row of a verify step is sampled from the target model as a
normal decode would sample it (the same logits processing, and for seeded requests the same
per-position draw), and a drafted token is accepted while it equals the token sampled at its
position. For a drafter that proposes one token with certainty this is rejection sampling
(accept d with probability p(d), else draw from p without d), so the output distribution is
the target's; greedy output is the same as without speculation, token for token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from torch import nn

from engine.config import EngineConfig, SpeculativeConfig
from engine.kv_cache.manager import KVCacheManager
from engine.models.loader import resolve_model
from engine.speculation.draft_model import DraftModel, EngineFactory
from engine.speculation.speculation_cost import CostGuard
from engine.step.request import Request
from engine.step.step_types import RequestOutput

AppendToken = Callable[[Request, int, float | None], RequestOutput]
MAX_MISS_PAUSE = 32  # tokens a request that keeps missing decodes plainly between tries


def ngram_draft(tokens: Sequence[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to k tokens that followed an earlier occurrence of the last n tokens (the longest n
    in [n_min, n_max] that matches): the latest occurrence with k tokens after it, else the one
    with the most; [] when none matches."""
    num = len(tokens)
    for n in range(min(n_max, num - 1), n_min - 1, -1):
        suffix = list(tokens[num - n :])
        first, best = suffix[0], -1
        for i in range(num - n - 1, -1, -1):  # starts i < num - n, latest first
            if tokens[i] == first and list(tokens[i : i + n]) == suffix:
                if num - (i + n) >= k:
                    return list(tokens[i + n : i + n + k])
                best = i  # an earlier one has more tokens after it
        if best >= 0:
            return list(tokens[best + n : best + n + k])
    return []


class Speculator:
    def __init__(
        self,
        config: SpeculativeConfig,
        max_model_len: int,
        kv: KVCacheManager,
        draft_model: DraftModel | None = None,
        max_rows: int | None = None,
    ):
        """max_rows: the most rows a verify step may have and still replay a decode graph (the
        largest captured batch); drafts are trimmed to fit it. None: no graphs, no limit."""
        self.config = config
        self.max_rows = max_rows
        self.kv = kv
        self.draft_model = draft_model
        self.max_model_len = max_model_len
        self.guard = CostGuard() if config.adaptive else None
        self.num_verify_steps = 0  # request-steps that verified at least one drafted token
        self.num_drafted_tokens = 0
        self.num_accepted_tokens = 0

    @property
    def enabled(self) -> bool:
        return self.config.method is not None

    def wants(self, req: Request, num_running: int) -> bool:
        """req would speculate at its next decode step: it allows it, nothing it samples with
        reads its token history or a grammar state per token (penalties, structured outputs),
        it returns no logprobs, the batch is small enough, and it is not pausing after misses."""
        params = req.sampling
        return (
            self.enabled
            and params.speculative
            and req.num_tokens >= req.draft_again_at
            and num_running <= self.config.max_batch
            and self.drafts_per_request(num_running) > 0
            and (self.guard is None or self.guard.speculating)
            and not req.keep_blocks
            and not params.has_penalties
            and params.structured is None
            and not params.logprobs
            and params.n == 1
        )

    def drafts_per_request(self, num_running: int) -> int:
        """K, or fewer when a verify step of num_running requests would outgrow the largest
        decode graph (each request's row, then its drafts' rows)."""
        k = self.config.num_speculative_tokens
        if self.max_rows is None:
            return k
        return min(k, self.max_rows // max(1, num_running) - 1)

    def observe(
        self, seconds: float, num_generated: int, num_computed: int, num_running: int
    ) -> None:
        """One engine step's wall time and tokens, for the cost guard: counted when it was a
        decode step of a batch speculation may apply to (not mostly prefill)."""
        if self.guard is None or not self.enabled or not 0 < num_running <= self.config.max_batch:
            return
        if num_computed <= num_generated * (self.config.num_speculative_tokens + 1):
            self.guard.observe(seconds, num_generated)

    def propose(self, running: list[Request]) -> None:
        """Draft tokens for the running requests that decode next and speculate."""
        if not self.enabled:
            return
        cfg = self.config
        reqs, rooms = [], []
        per_request = self.drafts_per_request(len(running))
        for req in running:  # none has drafts: Scheduler.schedule clears them after each step
            decoding = req.num_computed_tokens == req.num_tokens - 1 and not req.num_pending_tokens
            if not decoding or not self.wants(req, len(running)):
                continue
            # room for the drafts and one more token, by max_tokens and by max_model_len
            room = min(
                req.sampling.max_tokens - req.num_output_tokens - 1,
                self.max_model_len - req.num_tokens - 1,
                per_request,
            )
            if room > 0:
                reqs.append(req)
                rooms.append(room)
        if self.draft_model is not None:
            self.draft_model.draft(reqs, rooms)
        else:
            for req, room in zip(reqs, rooms, strict=True):
                tokens = req.all_token_ids
                req.draft_token_ids = ngram_draft(tokens, room, cfg.ngram_min, cfg.ngram_max)
        for req in reqs:
            if not req.draft_token_ids:
                self._missed(req)

    def _missed(self, req: Request) -> None:
        """No draft, or none of it accepted: the request decodes plainly (and runs ahead) for
        2, 4, 8 ... up to MAX_MISS_PAUSE tokens before it drafts again."""
        req.num_draft_misses += 1
        req.draft_again_at = req.num_tokens + min(MAX_MISS_PAUSE, 1 << req.num_draft_misses)

    def accept(self, req: Request, drafts: Sequence[int], sampled: Sequence[int]) -> list[int]:
        """The tokens a verify step yields: the drafted tokens that equal the token sampled at
        their position, then the first sampled token that does not (or the one after the last
        draft). sampled: one token per row, len(drafts) + 1 rows."""
        num_accepted = 0
        while num_accepted < len(drafts) and sampled[num_accepted] == drafts[num_accepted]:
            num_accepted += 1
        self.num_verify_steps += 1
        self.num_drafted_tokens += len(drafts)
        self.num_accepted_tokens += num_accepted
        req.num_drafted_tokens += len(drafts)
        req.num_accepted_tokens += num_accepted
        if num_accepted:
            req.num_draft_misses = 0
        else:
            self._missed(req)
        return list(sampled[: num_accepted + 1])

    def apply(
        self, req: Request, drafts: Sequence[int], sampled: Sequence[int], append: AppendToken
    ) -> RequestOutput:
        """Append (with the engine's `append`, which stops what stops) the tokens a verify
        step accepted, as one output; the accepted drafts' KV then counts as computed."""
        tokens = self.accept(req, drafts, sampled)
        output = None
        for token_id in tokens:
            new = append(req, token_id, None)
            output = new if output is None else merged(output, new)
            if new.finished:
                return output
        req.num_computed_tokens += len(tokens) - 1
        self.kv.cache_full_blocks(req)
        assert output is not None
        return output


def merged(first: RequestOutput, later: RequestOutput) -> RequestOutput:
    """One output for two of one request's steps' worth of tokens (a verify step's several
    tokens; no logprobs: a speculating request returns none)."""
    return replace(
        later,
        new_token_ids=first.new_token_ids + later.new_token_ids,
        new_text=first.new_text + later.new_text,
    )


def drafter(
    config: EngineConfig,
    model: nn.Module,
    vocab_size: int,
    max_model_len: int,
    make_engine: EngineFactory,
) -> DraftModel | None:
    """The draft model a target engine's config asks for (its own weights if it names the same
    checkpoint), run by an engine make_engine builds; or None. A tensor-parallel target drafts
    on rank 0 alone, with an engine of one rank (its drafts reach the other ranks in each
    verify step's plan): it loads the draft's full weights, never rank 0's shard of its own."""
    spec = config.speculative
    if spec.method != "draft" or spec.draft_model is None:
        return None
    cache_dir = config.settings.cache_dir
    same = resolve_model(spec.draft_model, cache_dir=cache_dir) == resolve_model(
        config.model, cache_dir=cache_dir
    )
    shared = model if same and config.tensor_parallel_size == 1 else None
    return DraftModel(config, vocab_size, max_model_len, make_engine, shared)
