"""The speculation benches' workload and rows, shared by bench.spec_bench and its vLLM peer
(which imports nothing of kvrelay's engine): the batch-1 chat turns ("rewrite this paragraph
with one word changed", whose answer repeats its prompt), the throughput rows' random prompts,
and the batch-1 row's figures. Stateless and dependency-free."""

from __future__ import annotations

PARAGRAPHS = [
    "The old lighthouse keeper climbed the spiral stairs every evening, lit the great lamp, and "
    "watched the ships pass safely through the narrow channel below the cliffs.",
    "Our team meets every Monday at nine to review the open tickets, agree on the week's "
    "priorities and decide who pairs with whom on the hardest problems.",
    "To reset the router, hold the small button on the back for ten seconds, wait until the "
    "light turns green, then connect again with the password printed underneath.",
    "The recipe needs two cups of flour, one egg, a pinch of salt and enough milk to make a "
    "smooth batter that coats the back of a spoon without running off.",
]
ASK = "Rewrite this paragraph with one word changed, and nothing else:\n\n"


def rewrite_turns(num: int) -> list[list[dict[str, str]]]:
    """num single-turn chats (the paragraphs in turn), for a tokenizer's chat template."""
    return [
        [{"role": "user", "content": ASK + PARAGRAPHS[i % len(PARAGRAPHS)]}] for i in range(num)
    ]


def random_batch(batch: int, input_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """The throughput rows' prompts: batch random token-id prompts, the same for every engine."""
    import random

    rng = random.Random(batch + seed)
    return [[rng.randrange(100, vocab) for _ in range(input_len)] for _ in range(batch)]


def batch1_row(seconds: float, tokens: int, drafted: int, accepted: int, steps: int) -> dict:
    """One batch-1 row: ms per output token (tokens after each request's first, over seconds
    from its first to its last), the drafts, acceptance and accepted per verify step."""
    return {
        "ms_per_output_token": round(1000 * seconds / max(1, tokens), 3),
        "output_tokens": tokens,
        "drafted": drafted,
        "accepted": accepted,
        "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
        "mean_accepted_per_verify_step": round(accepted / steps, 2) if steps else None,
    }
