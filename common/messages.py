"""Every value that crosses a process boundary (router <-> prefill / decode workers, workers <->
Redis): requests, token deltas, KV handles, transfer stats, worker load, served-model info.

Holds no state. Every type is a frozen dataclass and the module is torch-free, so Ray pickles
them cheaply and the router imports them without the engine's model code.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.finish_reason import FinishReason
from engine.kv_cache.retention import RetentionRange
from engine.sampling.sampling_params import SamplingParams

TopLogprobs = tuple[tuple[int, float], ...]  # (token id, logprob) pairs, most likely first


@dataclass(frozen=True)
class GenerateRequest:
    """A validated, tokenized request. Stop strings stay in the router (it detokenizes);
    the workers see `sampling` with stop=() and only stop token ids."""

    req_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    cache_salt: str | None = None
    arrival_time: float = 0.0
    # A migrated leg: the prompt's last tokens were sent to the client by an earlier leg; they
    # count as output for presence / frequency penalties (engine Request.num_resumed_tokens).
    num_resumed_tokens: int = 0
    # Retention by token range: these blocks keep their own priority once freed, on every worker.
    kv_retention: tuple[RetentionRange, ...] = ()
    # W3C traceparent of the router's span of this request (common/tracing.py); None: untraced.
    traceparent: str | None = None
    # Scheduling (engine/priority.py): higher runs first in the router's queue and on every
    # worker, and may preempt lower ones there; the class's cap is applied (router/traffic_class).
    priority: int = 0
    # Batch class: seconds after arrival by which the router must have sent it on, else it is
    # refused (router/fair_queue.py); None: no deadline. Workers ignore it.
    deadline_s: float | None = None
    # The served model whose pools run it (the Frontend's pick from the request's `model`); ""
    # from a caller that did not pick (the default model). Workers serve one model each.
    model: str = ""

    @property
    def max_total_tokens(self) -> int:
        """The most tokens it may take: its prompt and every choice's max_tokens (what per-key
        limits charge and the router's fair queue counts)."""
        return len(self.prompt_token_ids) + self.sampling.n * self.sampling.max_tokens


@dataclass(frozen=True)
class TransferStats:
    """How a decode worker got one request's prompt KV (on that request's first delta)."""

    num_blocks: int = 0  # blocks pulled over NIXL (0: all reused locally, or recomputed)
    num_bytes: int = 0
    seconds: float = 0.0
    recomputed: bool = False  # the pull failed or was refused: the decode worker recomputed


@dataclass(frozen=True)
class FirstToken:
    """One choice's first token, sampled by the prefill worker from the prompt's last logits
    (n > 1: choices 1..n-1; choice 0's is the KVHandle's own)."""

    token_id: int
    logprob: float | None = None
    top_logprobs: TopLogprobs = ()
    finish_reason: FinishReason | None = None  # set when this token ends the choice (as KVHandle's)


@dataclass(frozen=True)
class KVHandle:
    """Returned by a prefill worker; the blocks stay pinned under an epoch-fenced lease
    until released with (req_id, epoch), read (the READ's notification releases them) or expired.

    lease_s is a duration, not a time: the decode worker reckons its own deadline from when the
    handle reached it, on its own monotonic clock.

    finish_reason is set when the first token already ends the request (the prefill engine's
    own finish reason: eos, a stop token or the length; stop strings stay in the router); no
    decode is needed, no block is held and epoch is None.

    n > 1: other_choices holds the first tokens of choices 1..n-1 (one lease covers them all:
    they share the prompt's blocks). finish_reason is choice 0's; the lease is held (epoch set)
    unless every choice ended on its first token.
    """

    req_id: str
    worker_id: str
    actor_name: str
    agent_name: str
    block_ids: tuple[int, ...]
    num_tokens: int
    first_token_id: int
    protocol_version: int
    epoch: int | None  # names this grant of the lease (a release naming another is ignored)
    lease_s: float  # how long the lease lasts unless a read starts
    num_cached_tokens: int = 0
    first_logprob: float | None = None
    finish_reason: FinishReason | None = None
    first_top_logprobs: TopLogprobs = ()  # the first token's most likely tokens, when asked
    other_choices: tuple[FirstToken, ...] = ()
    # host leases: the first num_host_blocks of block_ids are slots of the holder's host tier
    # (read from its registered host memory), the rest device blocks
    num_host_blocks: int = 0

    @property
    def needs_decode(self) -> bool:
        """Some choice goes on after its first token (the lease is held for a decode worker)."""
        reasons = [self.finish_reason, *(c.finish_reason for c in self.other_choices)]
        return any(reason is None for reason in reasons)

    def first_deltas(self) -> list[TokenDelta]:
        """Each choice's first token as a delta (the router streams them before the decode)."""
        first = FirstToken(
            self.first_token_id, self.first_logprob, self.first_top_logprobs, self.finish_reason
        )
        return [
            TokenDelta(
                self.req_id,
                (choice.token_id,),
                finished=choice.finish_reason is not None,
                finish_reason=choice.finish_reason,
                num_prompt_tokens=self.num_tokens,
                num_cached_tokens=self.num_cached_tokens,
                logprobs=() if choice.logprob is None else (choice.logprob,),
                top_logprobs=(choice.top_logprobs,) if choice.top_logprobs else (),
                index=index,
            )
            for index, choice in enumerate((first, *self.other_choices))
        ]


@dataclass(frozen=True)
class TokenDelta:
    """New tokens of one request from one engine step (the backend's streaming unit)."""

    req_id: str
    token_ids: tuple[int, ...]
    finished: bool = False
    finish_reason: FinishReason | None = None  # set on a choice's last delta
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    logprobs: tuple[float, ...] = ()
    top_logprobs: tuple[TopLogprobs, ...] = ()  # one per token id, when asked
    error: str | None = None  # set with FinishReason.ERROR: why the request failed
    # With ERROR: the worker gave the request up for a reason not its own (its router went
    # silent); the router resumes it elsewhere as after a worker death, with the tokens sent.
    resumable: bool = False
    # With ERROR: no worker could take the request on (its decode worker died and none took it
    # over, or it ran out of migrations): the client may send it again (HTTP 503, UNAVAILABLE).
    unavailable: bool = False
    transfer: TransferStats | None = None  # on the decode worker's first delta only
    index: int = 0  # which of the request's n choices these tokens belong to
    # speculative decoding: the request's drafted tokens accepted so far, on this worker
    num_accepted_tokens: int = 0


@dataclass(frozen=True)
class WorkerLoad:
    """A worker's load as published to Redis and used by placement."""

    running: int = 0
    waiting: int = 0
    free_blocks: int = 0
    total_blocks: int = 0
    queued_tokens: int = 0
    prefill_tok_s: int = 0  # tokens computed per second of recent steps (0: not measured yet)
    step_us: int = 0  # mean wall time of a recent step, microseconds (0: not measured yet)
    # tokens computed per second of recent steps that were mostly prompt: how fast a decode
    # worker computes a prompt itself (0: it has not computed one yet; its decode steps would
    # make prompts look slow, its all-steps rate above is no stand-in)
    prompt_tok_s: int = 0
    # recent time to read and check one disk tier block file, microseconds (0: not measured yet)
    disk_load_us: int = 0
    # and one block of the cluster-shared store (a directory, or an object store's ~5x slower)
    shared_load_us: int = 0
    # one host tier block's copy back into device memory, microseconds, measured at start (0:
    # no host tier)
    host_load_us: int = 0

    @property
    def compute_tok_s(self) -> int:
        """How fast it computes a prompt: its prompt rate, else its all-steps rate until it has
        one (a fresh worker's only steps are the warm-up's; 0: neither measured yet)."""
        return self.prompt_tok_s or self.prefill_tok_s


@dataclass(frozen=True)
class WorkerInfo:
    """A live worker as the router sees it (from Redis membership or the local registry)."""

    worker_id: str
    role: str  # "prefill" | "decode"
    actor_name: str = ""
    nixl_agent: str = ""
    load: WorkerLoad = field(default_factory=WorkerLoad)
    state: str = "ready"  # common.cluster_state.WorkerState value; routers place on "ready" only


@dataclass(frozen=True)
class ServedModel:
    """What a worker serves, as the router needs it (the router loads only the tokenizer)."""

    model_id: str
    checkpoint_dir: str
    max_model_len: int
    vocab_size: int
    block_size: int
