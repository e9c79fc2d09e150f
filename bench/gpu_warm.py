"""Build, before a GPU session's timed runs, the JIT-compiled kernels those runs load (FlashInfer's
attention modules, the Triton kernels), each row's kernels (bf16, fp8 KV, fp8 weights + fp8 KV)
in a process of its own at once, so that the compiles share the machine's cores instead of
queueing inside the first timed run. Each process runs a 2-layer model of the 8B shape through
mixed and decode steps with CUDA graphs. Owns no state; the compiled modules land in
FlashInfer's and Triton's caches (~/.cache). Needs a GPU.

    python -m bench.gpu_warm [--variants bf16 fp8kv fp8w]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time

VARIANTS = {  # name -> (kv_cache_dtype, quantization)
    "bf16": ("auto", "none"),
    "fp8kv": ("fp8", "none"),
    "fp8w": ("fp8", "fp8"),
}


def warm_one(variant: str, shape: str, device: str = "cuda") -> None:
    """One engine of the variant on a 2-layer model of the shape: prompts of several lengths,
    so that steps carry prefill chunks beside decodes, then decode-only graph steps."""
    import torch

    from bench.lib.engine_config import engine_config
    from bench.lib.random_models import write_random_model
    from engine.engine import Engine
    from engine.models.loader import random_model, read_model_config
    from engine.quant.config import quantization_from_flag, resolve_quantization
    from engine.sampling.sampling_params import SamplingParams

    kv_dtype, quantization = VARIANTS[variant]
    folder = write_random_model(tempfile.mkdtemp(prefix="kvrelay-warm-"), shape, weights=False)
    config_path = folder / "config.json"
    hf = json.loads(config_path.read_text())
    config_path.write_text(json.dumps(hf | {"num_hidden_layers": 2}))
    config = read_model_config(folder)
    quant = resolve_quantization(quantization_from_flag(quantization), None)
    model = random_model(config, 4096, torch.device(device), torch.bfloat16, quant=quant)
    engine = Engine(
        engine_config(
            str(folder),
            device=device,
            dtype="bfloat16",
            cuda_graph=device == "cuda",
            kv_cache_memory_bytes=2 << 30,
            kv_cache_dtype=kv_dtype,
            max_num_batched_tokens=1024,
            max_num_seqs=16,
            max_model_len=4096,
        ),
        model=model,
    )
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    for i, length in enumerate((700, 40, 300, 5, 1200, 90, 16, 500)):
        engine.add_request(f"w{i}", [(7 * i + j) % 1000 + 1 for j in range(length)], params)
    while engine.has_unfinished_requests:
        engine.step()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--shape", default="llama-3.1-8b")
    p.add_argument("--one", choices=list(VARIANTS), help=argparse.SUPPRESS)  # a child process
    args = p.parse_args()
    if args.one:
        warm_one(args.one, args.shape)
        return
    start = time.perf_counter()
    children = {
        name: subprocess.Popen(
            [sys.executable, "-m", "bench.gpu_warm", "--one", name, "--shape", args.shape]
        )
        for name in args.variants
    }
    failed = [name for name, child in children.items() if child.wait() != 0]
    print(
        f"warmed {', '.join(args.variants)} in {time.perf_counter() - start:.0f} s"
        + (f"; failed: {', '.join(failed)}" if failed else ""),
        flush=True,
    )
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
