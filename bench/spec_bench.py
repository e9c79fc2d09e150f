"""Speculative decoding (n-gram drafting) in-process: batch-1 ms per output token on prompts
whose answer repeats them ("rewrite this paragraph with one word changed"), and output tok/s
at larger batches on random prompts, each with and without speculation in the same engine
(requests turn it off with SamplingParams.speculative). Reports acceptance; owns no state.

    python -m bench.spec_bench [--device cpu] [--json out.json]
    python -m bench.spec_bench --device cuda --model FOLDER --load-format dummy \\
        --batch-sizes 1 64 256 --input-len 1000 --output-len 1000
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import time

import torch

from bench.lib.engine_config import engine_config
from bench.lib.run_report import report_header, write_report
from engine.config import DEFAULT_MODEL, SpeculativeConfig
from engine.engine import Engine
from engine.sampling_params import SamplingParams
from engine.speculation_cost import CostGuard

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


def rewrite_prompts(engine: Engine, num: int) -> list[list[int]]:
    assert engine.tokenizer is not None
    ask = "Rewrite this paragraph with one word changed, and nothing else:\n\n"
    return [
        engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": ask + PARAGRAPHS[i % len(PARAGRAPHS)]}]
        )
        for i in range(num)
    ]


def decode_ms_per_token(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> dict:
    """One request at a time: the time from its first token to its last, per token after the
    first (prefill excluded), summed over the prompts."""
    spec = engine.speculator
    drafted, accepted, steps = (
        spec.num_drafted_tokens,
        spec.num_accepted_tokens,
        spec.num_verify_steps,
    )
    seconds, tokens = 0.0, 0
    for i, prompt in enumerate(prompts):
        engine.add_request(f"b1-{params.speculative}-{i}", prompt, params)
        first, count = None, 0
        while engine.has_unfinished_requests:
            for out in engine.step():
                count += len(out.new_token_ids)
                first = first or time.perf_counter()
        seconds += time.perf_counter() - (first or time.perf_counter())
        tokens += count - 1
    drafted, accepted = spec.num_drafted_tokens - drafted, spec.num_accepted_tokens - accepted
    steps = spec.num_verify_steps - steps
    return {
        "ms_per_output_token": round(1000 * seconds / max(1, tokens), 3),
        "output_tokens": tokens,
        "drafted": drafted,
        "accepted": accepted,
        "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
        "mean_accepted_per_verify_step": round(accepted / steps, 2) if steps else None,
    }


def throughput(
    engine: Engine, batch: int, args: argparse.Namespace, speculative: bool, output_len: int = 0
) -> dict:
    vocab = engine.model_config.vocab_size
    rng = random.Random(batch)
    params = SamplingParams(
        max_tokens=output_len or args.output_len,
        temperature=0.0,
        ignore_eos=True,
        speculative=speculative,
    )
    accepted = engine.speculator.num_accepted_tokens
    start = time.perf_counter()
    for i in range(batch):
        prompt = [rng.randrange(100, vocab) for _ in range(args.input_len)]
        engine.add_request(f"t{batch}-{speculative}-{i}", prompt, params)
    tokens = 0
    while engine.has_unfinished_requests:
        tokens += sum(len(out.new_token_ids) for out in engine.step())
    seconds = time.perf_counter() - start
    return {
        "batch": batch,
        "speculative": speculative,
        "output_tok_s": round(tokens / seconds, 1),
        "accepted": engine.speculator.num_accepted_tokens - accepted,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--device", default="cpu")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--prompts", type=int, default=4, help="batch-1 requests")
    p.add_argument("--max-tokens", type=int, default=64, help="batch-1 output tokens")
    p.add_argument("--batch-sizes", type=int, nargs="*", default=[1, 16])
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--json")
    args = p.parse_args()
    # adaptive off: the rows measure speculation itself; "ngram, adaptive" adds the cost guard
    spec = SpeculativeConfig(
        method="ngram", num_speculative_tokens=args.num_speculative_tokens, adaptive=False
    )
    config = engine_config(
        args.model,
        device=args.device,
        load_format=args.load_format,
        max_num_seqs=max([*args.batch_sizes, 8]),
        max_num_batched_tokens=max(2048, args.input_len),
        num_blocks=None,
        kv_cache_memory_bytes=(40 << 30) if args.device.startswith("cuda") else (2 << 30),
        max_model_len=max(args.input_len + args.output_len, 2048),
    )
    engine = Engine(dataclasses.replace(config, speculative=spec))
    prompts = rewrite_prompts(engine, args.prompts)
    warm = SamplingParams(max_tokens=8, temperature=0.0)
    decode_ms_per_token(engine, prompts[:1], warm)  # first-use compiles and graphs
    batch1 = {}
    for speculative in (False, True):
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=0.0, speculative=speculative
        )
        batch1["ngram" if speculative else "off"] = decode_ms_per_token(engine, prompts, params)
        print(
            json.dumps(
                {
                    "batch1_" + ("ngram" if speculative else "off"): batch1[
                        "ngram" if speculative else "off"
                    ]
                }
            ),
            flush=True,
        )
    engine.speculator.guard = CostGuard()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    batch1["ngram, adaptive"] = decode_ms_per_token(engine, prompts, params)
    batch1["ngram, adaptive"]["guard_cost_s_per_token"] = engine.speculator.guard.cost
    print(json.dumps({"batch1_ngram_adaptive": batch1["ngram, adaptive"]}), flush=True)
    engine.speculator.guard = None
    rows = []
    for batch in args.batch_sizes:
        throughput(engine, batch, args, False, output_len=4)  # warm: this batch's first shapes
        for speculative in (False, True):
            rows.append(throughput(engine, batch, args, speculative))
            print(json.dumps(rows[-1]), flush=True)
    engine.assert_no_leaks()
    report = report_header("python -m bench.spec_bench " + json.dumps(vars(args)))
    report["device"] = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    write_report(args.json, {**report, "batch1": batch1, "throughput": rows})


if __name__ == "__main__":
    main()
