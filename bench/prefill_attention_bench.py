"""FlashInfer paged prefill attention alone at the offline run's step (16 prompts of 1,000
tokens, causal, in one 16,000-token step over the engine's layer-packed strided cache): fa2,
the engine's kernel, against fa3 (Hopper). An fp8 cache runs fa2 with bf16 queries (the
engine's way) and fa3 with queries quantized to fp8 (fa3 takes an fp8 cache only so). Each
row gives ms per layer, TFLOP/s and its largest difference from fa2 on the same cache; a
backend this FlashInfer refuses is reported, not fatal. Owns no state; needs a GPU and
flashinfer.

    python -m bench.prefill_attention_bench [--prompts 16] [--prompt-len 1000] [--kv bf16 fp8]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from bench.attention_bench import BLOCK, HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, NUM_LAYERS, time_ms
from engine.attention.flashinfer_backend import WORKSPACE_BYTES
from engine.quant.fp8 import FP8_MAX

KV_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}  # --kv: the caches to time


def run_backend(
    backend: str, q: torch.Tensor, layer: torch.Tensor, table: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, float]:
    """(output, ms per call) of one backend over the planned step."""
    import flashinfer

    workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "HND", backend=backend)
    fp8_q = q.dtype == torch.float8_e4m3fn
    wrapper.plan(
        table["qo_indptr"],
        table["kv_indptr"],
        table["kv_indices"],
        table["last_len"],
        NUM_HEADS,
        NUM_KV_HEADS,
        HEAD_DIM,
        BLOCK,
        causal=True,
        sm_scale=HEAD_DIM**-0.5,
        q_data_type=q.dtype,
        kv_data_type=layer.dtype,
        **({"o_data_type": torch.bfloat16} if fp8_q else {}),
    )
    scales: dict[str, Any] = {}
    if fp8_q:  # plain floats first; FlashInfer builds that take only tensors get per-head ones
        scales = {"q_scale": float(table["q_scale"]), "k_scale": 1.0, "v_scale": 1.0}
        try:
            out = wrapper.run(q, layer, **scales)
        except TypeError:  # 0.7.4 refused a 0-d q_scale tensor beside float k/v scales
            scales = per_head_scales(float(table["q_scale"]))
            out = wrapper.run(q, layer, **scales)
    else:
        out = wrapper.run(q, layer)
    return out, time_ms(lambda: wrapper.run(q, layer, **scales), iters=10)


def per_head_scales(q_scale: float) -> dict[str, torch.Tensor]:
    """q, k and v scales as per-head float32 tensors (q: query heads; k, v: KV heads)."""
    heads = {"q_scale": NUM_HEADS, "k_scale": NUM_KV_HEADS, "v_scale": NUM_KV_HEADS}
    values = {"q_scale": q_scale, "k_scale": 1.0, "v_scale": 1.0}
    return {
        name: torch.full((n,), values[name], dtype=torch.float32, device="cuda")
        for name, n in heads.items()
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=1000)
    p.add_argument("--kv", nargs="*", choices=sorted(KV_DTYPES), default=sorted(KV_DTYPES))
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    prompts, length = args.prompts, args.prompt_len
    pages = -(-length // BLOCK)
    num_blocks = prompts * pages + 1
    gen = torch.Generator("cuda").manual_seed(0)
    table = {
        "qo_indptr": torch.arange(prompts + 1, dtype=torch.int32, device="cuda") * length,
        "kv_indptr": torch.arange(prompts + 1, dtype=torch.int32, device="cuda") * pages,
        "kv_indices": torch.randperm(num_blocks - 1, device="cuda", generator=gen).int(),
        "last_len": torch.full((prompts,), length - (pages - 1) * BLOCK, dtype=torch.int32),
    }
    q = torch.randn(prompts * length, NUM_HEADS, HEAD_DIM, device="cuda", generator=gen)
    q = q.bfloat16()
    q_scale = q.float().abs().amax() / FP8_MAX
    table["q_scale"] = q_scale
    q_fp8 = (q.float() / q_scale).to(torch.float8_e4m3fn)
    # causal: each prompt's L x L / 2 query-key pairs, QK^T and PV, 2 FLOP per multiply-add
    flops = prompts * length * length / 2 * NUM_HEADS * HEAD_DIM * 2 * 2
    rows = []
    for kv_dtype in (KV_DTYPES[name] for name in args.kv):
        shape = (num_blocks, NUM_LAYERS, 2, NUM_KV_HEADS, BLOCK, HEAD_DIM)
        cache = torch.randn(shape, device="cuda", generator=gen).to(kv_dtype)
        layer = cache[:, 1]
        reference = None
        for backend in ("fa2", "fa3"):
            queries = q_fp8 if backend == "fa3" and kv_dtype != torch.bfloat16 else q
            row: dict[str, Any] = {"kv": str(kv_dtype), "backend": backend, "q": str(queries.dtype)}
            try:
                out, ms = run_backend(backend, queries, layer, table)
            except Exception as error:  # a backend this FlashInfer lacks: reported, not fatal
                row["error"] = f"{type(error).__name__}: {error}"[:1500]
                print(f"{row['kv']:20s} {backend}: {row['error']}", flush=True)
                rows.append(row)
                continue
            reference = out.float() if reference is None else reference
            row |= {
                "ms_per_layer": ms,
                "tflops": flops / (ms / 1e3) / 1e12,
                "max_diff_vs_fa2": float((out.float() - reference).abs().max()),
            }
            rows.append(row)
            print(
                f"{row['kv']:20s} {backend} (q {row['q']}): {ms:.3f} ms a layer, "
                f"{row['tflops']:.0f} TFLOP/s, max diff vs fa2 {row['max_diff_vs_fa2']:.3f}",
                flush=True,
            )
        del cache, layer
    if args.json:
        args.json.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows}))


if __name__ == "__main__":
    main()
