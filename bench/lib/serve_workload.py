"""The seeded serve_bench workloads, all derived from --seed; stateless.

- random: prompts of --input-len random token ids (+- --input-len-range), --output-len outputs.
- shared-prefix: request i joins group i % --num-groups (order shuffled); its prompt is the
  group's --prefix-len token prefix (a shared system prompt) + a unique --input-len suffix.
- sharegpt: ShareGPT-like lengths without the dataset: input and output lengths drawn from
  lognormals, input mu=4.894 sigma=1.0 (median ~133, mean ~220, p99 ~1370 tokens) and output
  mu=4.893 sigma=0.9 (median ~133, mean ~200, p99 ~1080), rounded and clipped to
  [4, --max-input-len] and [1, --max-output-len] (the default clips, 2048 and 1024, give
  means ~218 and ~195); random ids. The parameters are picked to give ShareGPT's usual shape
  (means near 220 in / 200 out, a long right tail), not fitted to the data.
- multi-turn: --num-conversations conversations of --turns turns. Turn 0's prompt is
  --input-len random ids (the system prompt and first message); turn k+1's prompt is turn k's
  prompt + the tokens turn k generated + --turn-input-len fresh ids (the next user message),
  so each turn's prompt extends the previous one. Every turn asks for --output-len tokens.
  The generated tokens are known only at run time: a Conversation holds each turn's fresh ids
  and `next_request` builds the next prompt from a finished turn: over gRPC from the ids the
  stream carried, over HTTP (OpenAI streams carry text) from the streamed text re-tokenized
  with the served model's tokenizer (`text_encoder`).
Every workload is a list of Conversations (one turn each but for multi-turn), sent one per
arrival time (arrival_offsets).
"""

from __future__ import annotations

import argparse
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from bench.lib.serve_client import BenchRequest, RequestResult

if TYPE_CHECKING:
    from tokenizers import Tokenizer

SHAREGPT_INPUT = (4.894, 1.0)  # lognormal (mu, sigma) of prompt tokens
SHAREGPT_OUTPUT = (4.893, 0.9)  # lognormal (mu, sigma) of output tokens
SHAREGPT_MIN_INPUT = 4

TextEncoder = Callable[[str], Sequence[int]]  # text -> the served model's token ids


@dataclass(frozen=True)
class Conversation:
    """A session of turns sent one after the other. turns[0] is the first request as sent;
    turns[k > 0] carry only turn k's fresh user tokens (prompt_ids) and its max_tokens."""

    turns: tuple[BenchRequest, ...]

    def first_request(self) -> BenchRequest:
        return self.turns[0]

    def next_request(
        self, sent: BenchRequest, result: RequestResult, encode: TextEncoder | None = None
    ) -> BenchRequest | None:
        """The turn after `sent` (its prompt: sent's prompt + what it generated + the fresh
        user tokens), or None after the last turn. What it generated: result.output_ids, or
        with `encode` (HTTP) encode(result.output_text)."""
        turn = sent.turn + 1
        if turn >= len(self.turns):
            return None
        fresh = self.turns[turn]
        generated = result.output_ids if encode is None else encode(result.output_text)
        history = sent.prompt_ids + tuple(generated)
        return replace(fresh, prompt_ids=history + fresh.prompt_ids)


def sample_len(rng: random.Random, mean: int, range_ratio: float) -> int:
    """mean, or uniform in [mean * (1 - r), mean * (1 + r)] when range_ratio r > 0; >= 1."""
    if range_ratio <= 0:
        return max(1, mean)
    low = max(1, round(mean * (1 - range_ratio)))
    return rng.randint(low, max(low, round(mean * (1 + range_ratio))))


def lognormal_len(rng: random.Random, mu_sigma: tuple[float, float], low: int, high: int) -> int:
    """round(lognormal(mu, sigma)) clipped to [low, high]."""
    return min(high, max(low, round(rng.lognormvariate(*mu_sigma))))


def sharegpt_lens(rng: random.Random, max_input: int, max_output: int) -> tuple[int, int]:
    """(input, output) lengths of one sharegpt request."""
    num_input = lognormal_len(rng, SHAREGPT_INPUT, SHAREGPT_MIN_INPUT, max_input)
    return num_input, lognormal_len(rng, SHAREGPT_OUTPUT, 1, max_output)


def random_ids(rng: random.Random, n: int, id_range: tuple[int, int]) -> tuple[int, ...]:
    return tuple(rng.randrange(*id_range) for _ in range(n))


def group_prefixes(
    args: argparse.Namespace, rng: random.Random | None = None
) -> list[tuple[int, ...]]:
    """The shared-prefix groups' prefixes (the first draws of the workload's RNG)."""
    rng = rng or random.Random(args.seed)
    id_range = (args.min_token_id, args.max_token_id)
    return [random_ids(rng, args.prefix_len, id_range) for _ in range(args.num_groups)]


def build_requests(args: argparse.Namespace) -> list[BenchRequest]:
    """The seeded one-request-per-arrival workloads: random, shared-prefix or sharegpt."""
    rng = random.Random(args.seed)
    id_range = (args.min_token_id, args.max_token_id)
    prefixes = group_prefixes(args, rng)
    groups = [i % args.num_groups for i in range(args.num_requests)]
    rng.shuffle(groups)
    requests = []
    for i in range(args.num_requests):
        if args.workload == "sharegpt":
            num_input, output_len = sharegpt_lens(rng, args.max_input_len, args.max_output_len)
        else:
            num_input = sample_len(rng, args.input_len, args.input_len_range)
            output_len = sample_len(rng, args.output_len, args.output_len_range)
        suffix = random_ids(rng, num_input, id_range)
        if args.workload == "shared-prefix":
            requests.append(BenchRequest(i, prefixes[groups[i]] + suffix, output_len, groups[i]))
        else:
            requests.append(BenchRequest(i, suffix, output_len))
    return requests


def build_conversations(args: argparse.Namespace) -> list[Conversation]:
    """multi-turn: seeded conversations (request index conversation * turns + turn)."""
    rng = random.Random(args.seed)
    id_range = (args.min_token_id, args.max_token_id)
    conversations = []
    for c in range(args.num_conversations):
        turns = []
        for k in range(args.turns):
            num_input = args.input_len if k == 0 else args.turn_input_len
            ids = random_ids(rng, num_input, id_range)
            index = c * args.turns + k
            turns.append(BenchRequest(index, ids, args.output_len, conversation=c, turn=k))
        conversations.append(Conversation(tuple(turns)))
    return conversations


def single_turns(requests: Sequence[BenchRequest]) -> list[Conversation]:
    return [Conversation((request,)) for request in requests]


def num_arrivals(args: argparse.Namespace) -> int:
    """Conversations started (multi-turn) or requests sent: one per arrival time."""
    return args.num_conversations if args.workload == "multi-turn" else args.num_requests


def warmup_requests(args: argparse.Namespace) -> list[BenchRequest]:
    """Random prompts from another seed (never a shared prefix, so the caches stay cold)."""
    rng = random.Random(args.seed + 1_000_003)
    id_range = (args.min_token_id, args.max_token_id)
    return [
        BenchRequest(-1 - i, random_ids(rng, args.input_len, id_range), min(args.output_len, 8))
        for i in range(args.warmup)
    ]


def arrival_offsets(args: argparse.Namespace) -> list[float]:
    """Send times in seconds after the start, one per arrival (num_arrivals): all 0 for
    --rate inf, else fixed or Poisson."""
    num = num_arrivals(args)
    if math.isinf(args.rate):
        return [0.0] * num
    if args.arrival == "fixed":
        return [i / args.rate for i in range(num)]
    rng = random.Random(args.seed + 7)
    offsets, t = [], 0.0
    for _ in range(num):
        offsets.append(t)
        t += rng.expovariate(args.rate)
    return offsets


def load_tokenizer(tokenizer_path: str | None) -> Tokenizer:
    """--tokenizer's tokenizer.json, or by default the default model's (SmolLM2's)."""
    from tokenizers import Tokenizer

    if tokenizer_path is None:
        from engine.models.loader import resolve_model

        tokenizer_path = str(resolve_model("default") / "tokenizer.json")
    return Tokenizer.from_file(tokenizer_path)


def with_chat_text(requests: list[BenchRequest], tokenizer_path: str | None) -> list[BenchRequest]:
    """Chat prompts are text: decode the random ids with the model's tokenizer."""
    tokenizer = load_tokenizer(tokenizer_path)
    return [replace(r, text=tokenizer.decode(list(r.prompt_ids))) for r in requests]


def text_encoder(tokenizer_path: str | None) -> TextEncoder:
    """How multi-turn over HTTP turns a turn's streamed output text back into the ids the next
    turn resends (no BOS or other special tokens: the text continues a prompt).

    Why this is fair to kvrelay and vLLM alike: an OpenAI stream carries text, not ids (vLLM's
    `return_token_ids` extension has no counterpart in kvrelay's server), so the client builds
    every next prompt itself, as token ids, from the ids it sent + this one tokenizer's encoding
    of the text the server returned + the seeded fresh ids. Identical output text gives
    identical next prompts, byte for byte, whichever server produced it; neither server's own
    tokenizer or chat template touches the history. The encoding need not give back the ids
    that were generated (BPE does not round-trip arbitrary id sequences), so a server's cache
    of a turn's generated tokens may stop matching early in the output; that costs both
    servers alike, and it is what a real chat client that resends text costs them too."""
    tokenizer = load_tokenizer(tokenizer_path)

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False).ids

    return encode
