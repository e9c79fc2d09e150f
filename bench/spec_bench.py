"""Speculative decoding (n-gram drafting) in-process: batch-1 ms per output token on prompts
whose answer repeats them ("rewrite this paragraph with one word changed"), and output tok/s
at larger batches on random prompts, each with and without speculation in the same engine
(requests turn it off with SamplingParams.speculative). Reports acceptance; owns no state.

    python -m bench.spec_bench [--device cpu] [--json out.json]
    python -m bench.spec_bench --device cuda --model FOLDER --load-format dummy \\
        --batch-sizes 64 256 --input-len 1000 --output-len 1000 --kv-cache-gib 72

On CUDA it adds the batch-1 bf16 roofline (weight bytes read per step / measured copy rate).
bench/vllm_spec_peer.py runs vLLM's n-gram speculation on the same prompts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch

from bench.lib.engine_config import engine_config
from bench.lib.gpu_timing import copy_bandwidth
from bench.lib.random_models import weight_bytes
from bench.lib.rewrite_prompts import batch1_row, random_batch, rewrite_turns
from bench.lib.run_report import report_header, write_report
from engine.config import DEFAULT_MODEL, SpeculativeConfig
from engine.engine import Engine
from engine.sampling.sampling_params import SamplingParams
from engine.speculation.speculation_cost import CostGuard


def rewrite_prompts(engine: Engine, num: int) -> list[list[int]]:
    assert engine.tokenizer is not None
    return [engine.tokenizer.apply_chat_template(turn) for turn in rewrite_turns(num)]


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
    return batch1_row(seconds, tokens, drafted, accepted, steps)


def throughput(
    engine: Engine,
    batch: int,
    args: argparse.Namespace,
    speculative: bool,
    output_len: int = 0,
    seed: int = 0,
) -> dict:
    prompts = random_batch(batch, args.input_len, engine.model_config.vocab_size, seed)
    params = SamplingParams(
        max_tokens=output_len or args.output_len,
        temperature=0.0,
        ignore_eos=True,
        speculative=speculative,
    )
    accepted = engine.speculator.num_accepted_tokens
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
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
    p.add_argument("--kv-cache-gib", type=float, default=None, help="default: 40 GPU, 2 CPU")
    p.add_argument(
        "--repeating-scale",
        type=float,
        default=0.0,
        help="then scale the (random) weights by this and run batch 1 again: a repeating stream",
    )
    p.add_argument(
        "--repeating-batch-sizes",
        type=int,
        nargs="*",
        default=[],
        help="with --repeating-scale: throughput rows on the repeating stream, speculating",
    )
    p.add_argument("--json")
    args = p.parse_args()
    on_gpu = args.device.startswith("cuda")
    kv_gib = args.kv_cache_gib or (40 if on_gpu else 2)
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
        kv_cache_memory_bytes=int(kv_gib * (1 << 30)),
        max_model_len=max(args.input_len + args.output_len, 2048),
    )
    engine = Engine(dataclasses.replace(config, speculative=spec))
    prompts = rewrite_prompts(engine, args.prompts)
    warm = SamplingParams(max_tokens=8, temperature=0.0)
    decode_ms_per_token(engine, prompts[:1], warm)  # first-use compiles and graphs
    batch1 = batch1_rows(engine, prompts, args.max_tokens)
    rows = []
    for batch in args.batch_sizes:
        throughput(engine, batch, args, False, output_len=4)  # warm: this batch's first shapes
        for speculative in (False, True):
            rows.append(throughput(engine, batch, args, speculative))
            print(json.dumps(rows[-1]), flush=True)
    report = report_header("python -m bench.spec_bench " + json.dumps(vars(args)))
    report["device"] = torch.cuda.get_device_name() if on_gpu else "cpu"
    report["prompt_lens"] = [len(prompt) for prompt in prompts]
    report |= {"batch1": batch1, "throughput": rows}
    if args.repeating_scale:
        scale_weights(engine, args.repeating_scale)
        # A leading token gives every block a new hash: the cached ones hold the old weights' KV.
        repeat_prompts = [[1, *prompt] for prompt in prompts]
        print(f"weights scaled by {args.repeating_scale}: a repeating stream", flush=True)
        report["batch1_repeating"] = batch1_rows(engine, repeat_prompts, args.max_tokens)
        report["throughput_repeating"] = repeating_throughput(engine, args)
    engine.assert_no_leaks()
    if on_gpu:
        all_rows = batch1 | {
            f"{k}, repeating": v for k, v in report.get("batch1_repeating", {}).items()
        }
        report["roofline"] = decode_roofline(engine, all_rows)
        print(json.dumps({"roofline": report["roofline"]}), flush=True)
    write_report(args.json, report)


def batch1_rows(engine: Engine, prompts: list[list[int]], max_tokens: int) -> dict:
    """Batch-1 ms per token without speculation, with it, and with it under the cost guard."""
    batch1 = {}
    for mode, speculative in (("off", False), ("ngram", True)):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, speculative=speculative)
        batch1[mode] = decode_ms_per_token(engine, prompts, params)
        print(json.dumps({f"batch1 {mode}": batch1[mode]}), flush=True)
    engine.speculator.guard = CostGuard()
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    batch1["ngram, adaptive"] = decode_ms_per_token(engine, prompts, params)
    batch1["ngram, adaptive"]["guard_cost_s_per_token"] = engine.speculator.guard.cost
    print(json.dumps({"batch1 ngram, adaptive": batch1["ngram, adaptive"]}), flush=True)
    engine.speculator.guard = None
    return batch1


def repeating_throughput(engine: Engine, args: argparse.Namespace) -> list[dict]:
    """Throughput rows on the repeating stream, speculation allowed up to each batch size (new
    prompts: the cached blocks hold the old weights' KV)."""
    rows = []
    for batch in args.repeating_batch_sizes:
        spec = engine.speculator
        spec.config = dataclasses.replace(spec.config, max_batch=batch)
        throughput(engine, batch, args, False, output_len=4, seed=1 << 20)
        for speculative in (False, True):
            rows.append(throughput(engine, batch, args, speculative, seed=1 << 20))
            rows[-1]["repeating"] = True
            print(json.dumps(rows[-1]), flush=True)
    return rows


def scale_weights(engine: Engine, factor: float) -> None:
    """Scale every weight but the norms in place (the graphs keep their addresses). Random
    weights near zero make each token a function of the one before, so greedy output settles
    into a cycle: the repeating synthetic stream, for random-weight shapes."""
    with torch.inference_mode():
        for name, param in engine.runner.model.named_parameters():
            if not name.endswith("norm.weight"):
                param.mul_(factor)


def decode_roofline(engine: Engine, batch1: dict) -> dict:
    """The bf16 roofline of one batch-1 decode step: the weight bytes a step reads over the
    measured device copy rate; each batch-1 row's ms per output token against it."""
    bandwidth = copy_bandwidth(engine.device)
    weights = weight_bytes(engine.runner.model, read_per_decode_step=True)
    roofline_ms = 1e3 * weights / bandwidth
    return {
        "weight_bytes_read_per_step": weights,
        "copy_bytes_per_s": round(bandwidth),
        "roofline_ms_per_step": round(roofline_ms, 3),
        "ms_per_token_over_roofline": {
            mode: round(row["ms_per_output_token"] / roofline_ms, 3) for mode, row in batch1.items()
        },
    }


if __name__ == "__main__":
    main()
