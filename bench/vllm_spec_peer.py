"""vLLM's peer for bench.spec_bench: the same batch-1 rewrite prompts (bench/lib/rewrite_prompts.py
through the model folder's chat template) and the same random-prompt batches, with vLLM's n-gram
speculation (speculative_config method "ngram") or without; prints batch-1 ms per output token
(first token to last, per token after the first), acceptance from vLLM's own counters, and output
tok/s at each batch; owns no state.

On the GPU machine (vLLM staged into /tmp/vsite, ../shared/device/vllm/), from the repo root,
once per mode:
    PYTHONPATH=/tmp/vsite python3 -m bench.vllm_spec_peer --model FOLDER --load-format dummy \
        --speculative ngram --batch-sizes 64 256 --input-len 1000 --output-len 1000 --json out.json
"""

import argparse
import json
import os
import time

from bench.lib.rewrite_prompts import batch1_row, random_batch, rewrite_turns

for _key, _value in (("HF_HUB_OFFLINE", "1"), ("VLLM_NO_USAGE_STATS", "1")):
    os.environ.setdefault(_key, _value)  # before vLLM is imported (inside the functions)

SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts": "verify_steps",
    "vllm:spec_decode_num_draft_tokens": "drafted",
    "vllm:spec_decode_num_accepted_tokens": "accepted",
}


def spec_counts(llm) -> dict:
    """vLLM's speculation counters so far (0 each when speculation is off)."""
    counts = dict.fromkeys(SPEC_COUNTERS.values(), 0)
    for metric in llm.get_metrics():
        if metric.name in SPEC_COUNTERS:
            counts[SPEC_COUNTERS[metric.name]] += int(getattr(metric, "value", 0) or 0)
    return counts


def batch1(llm, prompts: list[list[int]], max_tokens: int) -> dict:
    """One request at a time through the engine's step loop, as bench.spec_bench measures."""
    from vllm import SamplingParams, TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(
        max_tokens=max_tokens, temperature=0.0, output_kind=RequestOutputKind.DELTA
    )
    before = spec_counts(llm)
    engine = llm.llm_engine
    seconds, tokens = 0.0, 0
    for i, prompt in enumerate(prompts):
        engine.add_request(f"b1-{i}", TokensPrompt(prompt_token_ids=prompt), params)
        first, count = None, 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                count += sum(len(c.token_ids) for c in out.outputs)
                first = first or time.perf_counter()
        seconds += time.perf_counter() - (first or time.perf_counter())
        tokens += count - 1
    after = spec_counts(llm)
    drafted = after["drafted"] - before["drafted"]
    accepted = after["accepted"] - before["accepted"]
    steps = after["verify_steps"] - before["verify_steps"]
    return batch1_row(seconds, tokens, drafted, accepted, steps)


def throughput(llm, batch: int, args: argparse.Namespace, vocab: int) -> dict:
    from vllm import SamplingParams, TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=p) for p in random_batch(batch, args.input_len, vocab)]
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    before = spec_counts(llm)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "batch": batch,
        "speculative": args.speculative != "off",
        "output_tok_s": round(tokens / seconds, 1),
        "accepted": spec_counts(llm)["accepted"] - before["accepted"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--speculative", choices=("ngram", "off"), default="ngram")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--ngram-min", type=int, default=2)
    p.add_argument("--ngram-max", type=int, default=4)
    p.add_argument("--prompts", type=int, default=4, help="batch-1 requests")
    p.add_argument("--max-tokens", type=int, default=64, help="batch-1 output tokens")
    p.add_argument("--batch-sizes", type=int, nargs="*", default=[])
    p.add_argument("--input-len", type=int, default=1000)
    p.add_argument("--output-len", type=int, default=1000)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--json")
    args = p.parse_args()

    import vllm
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams, TokensPrompt

    extra = {}
    if args.speculative == "ngram":
        extra["speculative_config"] = {
            "method": "ngram",
            "num_speculative_tokens": args.num_speculative_tokens,
            "prompt_lookup_min": args.ngram_min,
            "prompt_lookup_max": args.ngram_max,
        }
    start = time.perf_counter()
    llm = LLM(
        model=args.model,
        load_format=args.load_format,
        dtype="bfloat16",
        max_model_len=args.max_model_len,
        gpu_memory_utilization=0.85,
        disable_log_stats=False,  # the speculation counters
        **extra,
    )
    init_s = time.perf_counter() - start
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    prompts = [  # as kvrelay's tokenizer does: the template's text, encoded without specials
        tokenizer.encode(
            tokenizer.apply_chat_template(turn, add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )
        for turn in rewrite_turns(args.prompts)
    ]
    warm = SamplingParams(max_tokens=16, temperature=0.0)
    llm.generate([TokensPrompt(prompt_token_ids=prompts[0])], warm, use_tqdm=False)
    report = {
        "command": "python3 bench/vllm_spec_peer.py " + json.dumps(vars(args)),
        "vllm": vllm.__version__,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "init_s": round(init_s, 1),
        "prompt_lens": [len(p) for p in prompts],
        "batch1": batch1(llm, prompts, args.max_tokens),
    }
    print(json.dumps({"batch1": report["batch1"]}), flush=True)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    rows = []
    for batch in args.batch_sizes:
        rows.append(throughput(llm, batch, args, vocab))
        print(json.dumps(rows[-1]), flush=True)
    report["throughput"] = rows
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    print("SUMMARY", json.dumps({"speculative": args.speculative, **report["batch1"]}))


if __name__ == "__main__":
    main()
