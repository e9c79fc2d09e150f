"""kvrelay's GPU engine next to transformers on the same GPU: greedy tokens on small random
bf16 weights (with the first divergence and its top-2 logit margin), and offline generate
throughput on a smaller workload of the benchmark's shape. Owns no state; used by
bench.gpu_engine_bench."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.lib.engine_config import engine_config
from bench.lib.random_models import write_random_model
from engine.engine import Engine
from engine.sampling_params import SamplingParams


def _greedy_hf(model: Any, prompt: list[int], num_new: int) -> list[int]:
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=num_new,
        min_new_tokens=num_new,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def _run_engine(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> list[list]:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"g{i}", prompt, params)
    tokens: dict[str, list[int]] = {f"g{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished_requests:
        for out in engine.step():
            tokens[out.req_id].extend(out.new_token_ids)
    engine.assert_no_leaks()
    return [tokens[f"g{i}"] for i in range(len(prompts))]


@torch.no_grad()
def greedy_against_transformers(
    num_new: int = 32, seed: int = 0, device: str = "cuda"
) -> dict[str, Any]:
    """tiny-llama (head_dim 128, GQA), random bf16 weights: kvrelay (FlashInfer, CUDA graphs,
    one batch) against transformers' greedy generate, prompt by prompt."""
    from transformers import AutoModelForCausalLM

    folder = write_random_model(
        tempfile.mkdtemp(prefix="kvrelay-tiny-"), "tiny-llama", std=0.1, dtype=torch.bfloat16
    )
    gen = torch.Generator().manual_seed(seed)
    lengths = [1, 7, 16, 33, 64, 150, 300, 511]
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in lengths]
    config = engine_config(
        str(folder),
        device=device,
        dtype="bfloat16",
        num_blocks=512,
        max_num_batched_tokens=2048,
        max_num_seqs=16,
    )
    engine = Engine(config)
    params = SamplingParams(max_tokens=num_new, temperature=0, ignore_eos=True)
    ours = _run_engine(engine, prompts, params)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16).to(device).eval()
    rows = []
    for prompt, mine in zip(prompts, ours, strict=True):
        theirs = _greedy_hf(hf, prompt, num_new)
        pairs = enumerate(zip(mine, theirs, strict=True))
        diverge = next((i for i, (a, b) in pairs if a != b), None)
        row: dict[str, Any] = {"prompt_len": len(prompt), "equal": diverge is None}
        if diverge is not None:
            context = torch.tensor([prompt + theirs[:diverge]], device=device)
            logits = hf(context).logits[0, -1].float()
            top2 = torch.topk(logits, 2)
            row |= {
                "first_divergence": diverge,
                "hf_top2_margin": float(top2.values[0] - top2.values[1]),
                "kvrelay_token_logit_gap": float(top2.values[0] - logits[mine[diverge]]),
            }
        rows.append(row)
    backend = engine.attention_backend
    del hf, engine
    torch.cuda.empty_cache()
    return {
        "attention_backend": backend,
        "model": "tiny-llama random bf16 (std 0.1)",
        "new_tokens": num_new,
        "num_equal": sum(r["equal"] for r in rows),
        "num_prompts": len(rows),
        "prompts": rows,
    }


@torch.no_grad()
def throughput_against_transformers(
    folder: Path, engine: Engine, num_requests: int, input_len: int, output_len: int
) -> dict[str, Any]:
    """Offline output tok/s of `engine` and of transformers' batched generate (random weights
    of the same shape, one batch, no padding since all prompts have the same length)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    vocab = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(5)
    prompts = torch.randint(0, vocab, (num_requests, input_len), generator=gen)
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    _run_engine(engine, prompts.tolist(), params)
    torch.cuda.synchronize()
    ours_s = time.perf_counter() - start

    config = AutoConfig.from_pretrained(str(folder))
    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    ids = prompts.cuda()
    kwargs = dict(
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    warm = ids[:2, :16]
    hf.generate(warm, max_new_tokens=4, min_new_tokens=4, **kwargs | {"attention_mask": warm > -1})
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = hf.generate(ids, max_new_tokens=output_len, min_new_tokens=output_len, **kwargs)
    torch.cuda.synchronize()
    hf_s = time.perf_counter() - start
    assert out.shape == (num_requests, input_len + output_len)
    del hf, out
    torch.cuda.empty_cache()
    total = num_requests * output_len
    return {
        "num_requests": num_requests,
        "input_len": input_len,
        "output_len": output_len,
        "kvrelay_s": ours_s,
        "transformers_s": hf_s,
        "kvrelay_output_tok_s": total / ours_s,
        "transformers_output_tok_s": total / hf_s,
        "speedup": hf_s / ours_s,
        "transformers_attn": getattr(config, "_attn_implementation", None),
    }
