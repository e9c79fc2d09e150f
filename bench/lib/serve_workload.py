"""The seeded serve_bench workload: random token-id prompts (or groups sharing a prefix),
output lengths, warmup prompts and arrival times, all derived from --seed; stateless.
"""

from __future__ import annotations

import argparse
import random

from bench.lib.serve_client import BenchRequest


def sample_len(rng: random.Random, mean: int, range_ratio: float) -> int:
    """mean, or uniform in [mean * (1 - r), mean * (1 + r)] when range_ratio r > 0; >= 1."""
    if range_ratio <= 0:
        return max(1, mean)
    low = max(1, round(mean * (1 - range_ratio)))
    return rng.randint(low, max(low, round(mean * (1 + range_ratio))))


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
    """The seeded workload. shared-prefix: request i joins group i % G (order shuffled), its
    prompt is the group's prefix of --prefix-len tokens + a unique suffix of --input-len."""
    rng = random.Random(args.seed)
    id_range = (args.min_token_id, args.max_token_id)
    prefixes = group_prefixes(args, rng)
    groups = [i % args.num_groups for i in range(args.num_requests)]
    rng.shuffle(groups)
    requests = []
    for i in range(args.num_requests):
        suffix = random_ids(rng, sample_len(rng, args.input_len, args.input_len_range), id_range)
        output_len = sample_len(rng, args.output_len, args.output_len_range)
        if args.workload == "shared-prefix":
            requests.append(BenchRequest(i, prefixes[groups[i]] + suffix, output_len, groups[i]))
        else:
            requests.append(BenchRequest(i, suffix, output_len))
    return requests


def warmup_requests(args: argparse.Namespace) -> list[BenchRequest]:
    """Random prompts from another seed (never a shared prefix, so the caches stay cold)."""
    rng = random.Random(args.seed + 1_000_003)
    id_range = (args.min_token_id, args.max_token_id)
    return [
        BenchRequest(-1 - i, random_ids(rng, args.input_len, id_range), min(args.output_len, 8))
        for i in range(args.warmup)
    ]


def arrival_offsets(args: argparse.Namespace) -> list[float]:
    """Send times in seconds after the start: all 0 for --rate inf, else fixed or Poisson."""
    if args.rate == float("inf"):
        return [0.0] * args.num_requests
    if args.arrival == "fixed":
        return [i / args.rate for i in range(args.num_requests)]
    rng = random.Random(args.seed + 7)
    offsets, t = [], 0.0
    for _ in range(args.num_requests):
        offsets.append(t)
        t += rng.expovariate(args.rate)
    return offsets


def with_chat_text(requests: list[BenchRequest], tokenizer_path: str | None) -> list[BenchRequest]:
    """Chat prompts are text: decode the random ids with the model's tokenizer."""
    from dataclasses import replace

    from tokenizers import Tokenizer

    if tokenizer_path is None:
        from engine.loader import resolve_model

        tokenizer_path = str(resolve_model("default") / "tokenizer.json")
    tokenizer = Tokenizer.from_file(tokenizer_path)
    return [replace(r, text=tokenizer.decode(list(r.prompt_ids))) for r in requests]
