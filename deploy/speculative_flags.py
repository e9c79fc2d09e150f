"""The speculative-decoding flags of `kvrelay serve` and `kvrelay generate` (holds no state)."""

from __future__ import annotations

import argparse

from engine.config import SPECULATIVE_METHODS, SpeculativeConfig


def add_speculative_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--speculative",
        default=None,
        choices=SPECULATIVE_METHODS,
        help="speculative decoding on decode steps: ngram drafts the tokens that followed the "
        "last few tokens' latest earlier match in the prompt and output, draft has "
        "--draft-model continue each request; one forward verifies the drafts (greedy output "
        "unchanged); default: off",
    )
    p.add_argument(
        "--draft-model",
        default=None,
        metavar="PATH",
        help="with --speculative draft: a small model of the same tokenizer (HF folder, .gguf, "
        "or default for SmolLM2), run beside each decode engine with its own KV pool",
    )
    p.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=4,
        metavar="K",
        help="tokens drafted and verified per step with --speculative (1..16, default 4)",
    )
    p.add_argument(
        "--speculative-max-batch",
        type=int,
        default=8,
        metavar="N",
        help="speculation steps aside while more than N requests run on a worker (default 8)",
    )


def speculative_from_args(args: argparse.Namespace) -> SpeculativeConfig:
    """The flags as a config; a bad value is refused naming its flag."""
    num = args.num_speculative_tokens
    if not 1 <= num <= 16:
        raise ValueError(f"--num-speculative-tokens must be in [1, 16], got {num}")
    if args.speculative_max_batch < 1:
        raise ValueError(f"--speculative-max-batch must be >= 1, got {args.speculative_max_batch}")
    if (args.speculative == "draft") != (args.draft_model is not None):
        raise ValueError("--speculative draft needs --draft-model, and --draft-model needs it")
    return SpeculativeConfig(
        method=args.speculative,
        draft_model=args.draft_model,
        num_speculative_tokens=args.num_speculative_tokens,
        max_batch=args.speculative_max_batch,
    )
