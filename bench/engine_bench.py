"""Offline throughput: kvrelay's engine (LLM.generate) vs transformers' batched generate.

Builds one deterministic set of mixed-length prompts (chat-templated and raw text, ~16..512
tokens), runs it greedily through both systems in this process with the same number of output
tokens per prompt, and prints output tokens/s of each, their ratio and how many outputs match
token for token. Owns no state beyond the two models it loads. Progress goes to stderr.

    python -m bench.engine_bench [--num-prompts 64] [--max-tokens 64] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from bench.lib.engine_config import engine_config
from bench.lib.offline_runs import (
    RunResult,
    compare,
    load_transformers,
    run_kvrelay,
    run_transformers,
)
from bench.lib.text_prompts import build_prompts
from engine.llm import LLM
from engine.models.loader import resolve_model

ROOT = Path(__file__).resolve().parent.parent  # the checkout whose git state is reported


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def log(message: str) -> None:
    print(f"[engine_bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ---- prompts ---------------------------------------------------------------------------------


# ---- systems ---------------------------------------------------------------------------------


# ---- main ------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per prompt")
    p.add_argument("--min-prompt-len", type=int, default=16)
    p.add_argument("--max-prompt-len", type=int, default=512)
    p.add_argument(
        "--hf-batch-size",
        type=int,
        nargs="+",
        default=[64, 16],
        help="transformers batch size(s); each is one timed run (prompts sorted by length)",
    )
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="float32", help="both systems")
    p.add_argument("--seed", type=int, default=0, help="prompt RNG seed")
    p.add_argument("--skip-transformers", action="store_true", help="time kvrelay only")
    p.add_argument("--json", type=Path, default=None, help="also write results here")
    return p.parse_args(argv)


def bench_kvrelay(
    args: argparse.Namespace, prompts: list[list[int]], warmup: list[list[int]]
) -> tuple[RunResult, list]:
    config = engine_config(
        dtype=args.dtype,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
    )
    llm = LLM(config)
    log("kvrelay: warm-up")
    run_kvrelay(llm, warmup, 8)
    llm.engine.kv.pool.evict_all_cached()  # the timed run starts with a cold prefix cache
    log("kvrelay: timed run")
    result, outputs = run_kvrelay(llm, prompts, args.max_tokens)
    log(f"kvrelay: {result.seconds:.1f}s")
    return result, outputs


def bench_transformers(
    args: argparse.Namespace,
    folder: Path,
    pad_token_id: int,
    prompts: list[list[int]],
    warmup: list[list[int]],
    reference: list[list[int]],
) -> list[RunResult]:
    model = load_transformers(folder, _DTYPES[args.dtype])
    log("transformers: warm-up")
    run_transformers(model, pad_token_id, warmup, 8, len(warmup), log)
    results = []
    for batch_size in args.hf_batch_size:
        log(f"transformers: timed run, batch size {batch_size}")
        result, outputs = run_transformers(
            model, pad_token_id, prompts, args.max_tokens, batch_size, log
        )
        result.detail.update(compare(reference, outputs))
        results.append(result)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    folder = resolve_model("default", log)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    prompts = build_prompts(
        tokenizer, args.num_prompts, args.min_prompt_len, args.max_prompt_len, args.seed
    )
    warmup = build_prompts(tokenizer, 4, 16, 128, args.seed + 1)
    lens = [len(p) for p in prompts]
    log(f"{len(prompts)} prompts, {sum(lens)} tokens, lengths {min(lens)}..{max(lens)}")
    kv_result, kv_outputs = bench_kvrelay(args, prompts, warmup)
    results = [kv_result]
    if not args.skip_transformers:
        pad_id = tokenizer.pad_token_id
        pad_id = tokenizer.eos_token_id if pad_id is None else pad_id
        results += bench_transformers(args, folder, pad_id, prompts, warmup, kv_outputs)
    print_report(args, results)
    if args.json:
        args.json.write_text(json.dumps(report_dict(args, results), indent=2) + "\n")
        log(f"wrote {args.json}")
    return 0


def _label(r: RunResult) -> str:
    return f"transformers bs={r.detail['batch_size']}" if r.system == "transformers" else r.system


def print_report(args: argparse.Namespace, results: list[RunResult]) -> None:
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, dtype {args.dtype}, "
        f"kvrelay at {git_state()}"
    )
    header = ("seconds", "prompt tok", "output tok", "out tok/s", "kvrelay x", "cpu/wall", "load")
    print(f"{'system':<20}" + "".join(f"{h:>11}" for h in header))
    kv_rate = results[0].output_tokens_per_s
    for r in results:
        print(
            f"{_label(r):<20}{r.seconds:>11.2f}{r.num_prompt_tokens:>11}{r.num_output_tokens:>11}"
            f"{r.output_tokens_per_s:>11.1f}{kv_rate / r.output_tokens_per_s:>11.2f}"
            f"{r.cpu_per_wall:>11.2f}{r.load_avg_1m:>11.2f}"
        )
    for r in results[1:]:
        print(
            f"{_label(r)}: greedy outputs identical to kvrelay token-for-token: "
            f"{r.detail['num_exact']}/{r.num_prompts} (mean common prefix "
            f"{r.detail['mean_common_prefix']:.1f}/{args.max_tokens})"
        )
    for r in results:
        print(f"{_label(r)} detail: {r.detail}")


def git_state() -> str:
    """HEAD's short hash, with "+dirty" when engine/ has uncommitted changes."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "engine"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        return "unknown"
    return f"{head}+dirty" if dirty else head


def report_dict(args: argparse.Namespace, results: list[RunResult]) -> dict[str, Any]:
    import transformers

    kv_rate = results[0].output_tokens_per_s
    return {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "num_cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
        },
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "git": git_state(),
        "results": [
            asdict(r) | {"kvrelay_speedup": kv_rate / r.output_tokens_per_s} for r in results
        ],
    }


if __name__ == "__main__":
    sys.exit(main())
