"""Engine host overhead at large batch: a one-layer, 64-wide random model on CPU, so the model
costs almost nothing and an engine step is mostly host work (scheduler, input packing, block
tables, attention plan, sampling, token bookkeeping). The FlashInfer page table a GPU step
would build is built too. Prints ms per decode step and the top functions by own time. Owns no
state.

    python -m bench.host_overhead_bench [--batch 256] [--context 1200] [--steps 40]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import tempfile
import time

import torch

from bench.lib.engine_config import engine_config
from bench.lib.random_models import write_random_model
from engine.attention.base import AttentionMetadata
from engine.attention.flashinfer_backend import page_table
from engine.engine import Engine
from engine.sampling_params import SamplingParams

TINY_SHAPE = {
    "num_hidden_layers": 1,
    "hidden_size": 64,
    "intermediate_size": 64,
    "num_attention_heads": 1,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "max_position_embeddings": 8192,
}


def build_engine(batch: int, context: int, steps: int) -> Engine:
    folder = tempfile.mkdtemp(prefix="kvrelay-host-")
    folder = write_random_model(folder, "tiny-llama", weights=False)
    config = json.loads((folder / "config.json").read_text()) | TINY_SHAPE
    (folder / "config.json").write_text(json.dumps(config))
    blocks = batch * (-(-(context + steps + 16) // 16))
    config = engine_config(
        str(folder),
        load_format="dummy",
        num_blocks=blocks,
        max_num_batched_tokens=8192,
        max_num_seqs=batch,
    )
    return Engine(config)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--context", type=int, default=1200, help="prompt tokens per request")
    p.add_argument("--steps", type=int, default=40, help="timed decode steps")
    args = p.parse_args()
    engine = build_engine(args.batch, args.context, 2 * args.steps)
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=2 * args.steps + 8, temperature=0, ignore_eos=True)
    for i in range(args.batch):
        prompt = torch.randint(0, 500, (args.context,), generator=gen).tolist()
        engine.add_request(f"r{i}", prompt, params)
    while engine.scheduler.waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running
    ):
        engine.step()
    plan = engine.runner.attention.plan

    def plan_with_page_table(metadata: AttentionMetadata) -> None:  # what FlashInfer also builds
        page_table(metadata.seqs, metadata.block_size, torch.device("cpu"))
        plan(metadata)

    engine.runner.attention.plan = plan_with_page_table
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    step_ms = (time.perf_counter() - start) / args.steps * 1e3
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(args.steps):
        engine.step()
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(12)
    print(text.getvalue().strip().split("\n", 4)[-1])
    print(
        f"batch {args.batch}, context ~{args.context}: {step_ms:.2f} ms per decode step "
        f"(torch {torch.__version__}, {torch.get_num_threads()} threads)"
    )


if __name__ == "__main__":
    main()
