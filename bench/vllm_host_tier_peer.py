#!/usr/bin/env python3
"""vLLM's peer for bench.host_tier_bench: the same token-id prompts, one at a time, on a KV pool
of the same number of 16-token blocks, without and with vLLM's native CPU offloading; prints
TTFT p50 (max_tokens=1, wall time of one generate call) and prefix-cache hits; owns no state.

On the GPU machine (vLLM staged into /tmp/vsite, ../shared/device/vllm/):
    PYTHONPATH=/tmp/vsite python3 bench/vllm_host_tier_peer.py --model FOLDER \
        --prompts prompts.json --num-gpu-blocks 280 --offload-gib 4 --json out.json
"""

import argparse
import json
import os
import statistics
import time

for _key, _value in (("HF_HUB_OFFLINE", "1"), ("VLLM_NO_USAGE_STATS", "1")):
    os.environ.setdefault(_key, _value)


def run(args: argparse.Namespace, prompts: list[list[int]], offload_gib: float) -> dict:
    from vllm import LLM, SamplingParams, TokensPrompt

    extra = {}
    if offload_gib:
        extra = {"kv_offloading_size": offload_gib, "kv_offloading_backend": "native"}
    llm = LLM(
        model=args.model,
        load_format="dummy",
        enable_prefix_caching=True,
        block_size=16,
        num_gpu_blocks_override=args.num_gpu_blocks,
        max_model_len=args.max_model_len,
        disable_hybrid_kv_cache_manager=True,
        **extra,
    )
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])], params, use_tqdm=False)  # warm-up
    ttfts, cached = [], 0
    for prompt in prompts:
        start = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
        ttfts.append(1000 * (time.perf_counter() - start))
        cached += out[0].num_cached_tokens or 0
    row = {
        "offload_gib": offload_gib,
        "ttft_p50_ms": round(statistics.median(ttfts), 1),
        "ttft_ms": [round(t, 1) for t in ttfts],
        "prompt_tokens": sum(len(p) for p in prompts),
        "cached_tokens_reported": cached,
    }
    del llm
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", required=True, help="JSON list of token-id lists")
    p.add_argument("--num-gpu-blocks", type=int, required=True)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--offload-gib", type=float, default=4.0)
    p.add_argument("--json")
    args = p.parse_args()
    with open(args.prompts) as f:
        prompts = json.load(f)
    rows = []
    for gib in (0.0, args.offload_gib):
        try:
            rows.append(run(args, prompts, gib))
        except Exception as error:  # report the failing config, keep the other row
            rows.append({"offload_gib": gib, "error": repr(error)[:2000]})
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "ttft_ms"}), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "args": vars(args)}, f, indent=2)


if __name__ == "__main__":
    main()
