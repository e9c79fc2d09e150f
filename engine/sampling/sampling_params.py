"""SamplingParams: how one request samples and when it stops (validated, immutable)."""

from __future__ import annotations

from dataclasses import dataclass

STRUCTURED_KINDS = ("json_object", "json_schema", "regex", "grammar")
# A temperature below this samples greedily: 1e-40 divided the logits into inf (garbage tokens).
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class StructuredOutput:
    """The grammar a request's output must follow (engine/sampling/structured.py compiles it).

    kind json_object: any JSON object (spec ""); json_schema: spec is the schema as JSON text;
    regex: spec is the pattern; grammar: spec is an EBNF grammar (GBNF style, root rule `root`).
    """

    kind: str
    spec: str = ""


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. temperature 0 (or below GREEDY_BELOW) means greedy; top_k 0 means
    no top-k filter.

    Logits processing, in this order, before temperature, top-k, top-p, min-p and greedy argmax:
    - repetition_penalty (HF's RepetitionPenaltyLogitsProcessor): every token id seen in the
      prompt or the output so far has its logit divided by the penalty when positive, multiplied
      when negative. > 0; 1 is off.
    - presence_penalty and frequency_penalty (OpenAI's definition): subtract
      presence * [count > 0] + frequency * count, count = occurrences of the token in the OUTPUT
      so far (a migrated request's already-sent tokens count as output). Each in [-2, 2].
    - logit_bias: (token_id, bias) pairs, bias in [-100, 100], added to the logits.
    logprobs (and top_logprobs) are log_softmax of the logits after those three, before
    temperature and the top-k/top-p/min-p filters: the model's distribution as penalised and
    biased, independent of the temperature. top_logprobs: how many most likely tokens (0..20)
    to return with each output token, with their logprobs; it needs logprobs=True.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    # Choices drawn from one prompt (computed once, engine/step/fork.py); choice i > 0 draws with
    # seed + i when a seed is given.
    n: int = 1
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # a dict {token_id: bias} is accepted too
    structured: StructuredOutput | None = None  # a grammar the output follows (None: free text)
    speculative: bool = True  # False: this request never decodes speculatively

    def __post_init__(self) -> None:
        # Normalise lists given by callers into tuples so the object stays hashable.
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias = self.logit_bias
        pairs = bias.items() if isinstance(bias, dict) else bias
        object.__setattr__(self, "logit_bias", tuple((t, b) for t, b in pairs))
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        object.__setattr__(self, "stop", stop)

    @property
    def greedy(self) -> bool:
        """temperature 0, or below GREEDY_BELOW (dividing logits by less overflows them)."""
        return self.temperature < GREEDY_BELOW

    @property
    def counts_output(self) -> bool:
        """Sampling needs the output tokens so far (presence / frequency penalties)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def has_penalties(self) -> bool:
        """Sampling depends on the request's token history (any penalty)."""
        return self.counts_output or self.repetition_penalty != 1.0
