"""A warmed-up engine's first served steps, timed one by one (GPU; owns no state): built on the
thread that steps it (as EngineThread builds a worker's engine) or on another one (how workers
built it before 2026-12-06), three rounds of the same arrivals: one 299-token prompt alone, then
four more (759, 169, 53, 177) while it decodes. A step is timed to its kernels' end. With
--profile DIR the first round runs under cProfile (the Python it spends: a Triton compile, an
autotune, a library's first lookup) and torch's profiler (the kernels and ops), each written to
DIR as a table sorted by time.

    python -m bench.first_steps [--built-on caller] [--profile DIR] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import pstats
import random
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from bench.gpu_engine_bench import build_engine
from bench.lib.random_models import write_random_model
from engine.engine import Engine
from engine.models.loader import random_model, read_model_config
from engine.sampling.sampling_params import SamplingParams

ALONE, BESIDE = 299, (759, 169, 53, 177)  # a ShareGPT-like served run's first arrivals


def timed_steps(engine: Engine, n: int) -> list[float]:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        times.append(round((time.perf_counter() - start) * 1000, 2))
    return times


def one_round(engine: Engine, tag: str, rng: random.Random) -> dict[str, list[float]]:
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, 20000) for _ in range(n)]

    engine.add_request(f"{tag}-alone", prompt(ALONE), params)
    alone = timed_steps(engine, 4)
    for i, n in enumerate(BESIDE):
        engine.add_request(f"{tag}-{i}", prompt(n), params)
    beside = timed_steps(engine, 6)
    while engine.has_unfinished_requests:
        engine.step()
    torch.cuda.synchronize()
    return {"alone_ms": alone, "four_more_ms": beside}


@contextlib.contextmanager
def profiled(folder: Path | None) -> Iterator[None]:
    """cProfile and torch's profiler around the block, their tables written to folder."""
    if folder is None:
        yield
        return
    folder.mkdir(parents=True, exist_ok=True)
    python = cProfile.Profile()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as torch_prof:
        python.enable()
        try:
            yield
        finally:
            python.disable()
    text = io.StringIO()
    pstats.Stats(python, stream=text).sort_stats("cumulative").print_stats(60)
    (folder / "python_cumulative.txt").write_text(text.getvalue())
    averages = torch_prof.key_averages()
    (folder / "torch_by_cpu.txt").write_text(averages.table(sort_by="cpu_time_total", row_limit=40))
    (folder / "torch_by_cuda.txt").write_text(
        averages.table(sort_by="cuda_time_total", row_limit=40)
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="llama-3.1-8b")
    p.add_argument(
        "--built-on",
        choices=("stepping", "caller"),
        default="stepping",
        help="stepping: the thread that steps it builds it; caller: built here, stepped on another",
    )
    p.add_argument("--profile", type=Path, default=None, help="profile the first round into DIR")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    folder = write_random_model(tempfile.mkdtemp(prefix="kvrelay-"), args.shape, weights=False)
    config = read_model_config(folder)
    result: dict[str, Any] = {"shape": args.shape, "built_on": args.built_on}

    def build() -> Engine:
        model = random_model(
            config, config.max_position_embeddings, torch.device("cuda"), torch.bfloat16
        )
        return build_engine(folder, model, max_num_seqs=256, kv_bytes=40 << 30)

    def serve(engine: Engine) -> None:
        rng = random.Random(0)
        for r in range(3):
            with profiled(args.profile if r == 0 else None):
                result[f"round{r}"] = one_round(engine, f"r{r}", rng)

    if args.built_on == "caller":
        engine = build()
        thread = threading.Thread(target=serve, args=(engine,))
    else:
        thread = threading.Thread(target=lambda: serve(build()))
    thread.start()
    thread.join()
    for r in range(3):
        row = result.get(f"round{r}")
        if row is None:
            raise SystemExit("the run failed (see above)")
        print(
            f"round {r}: alone {row['alone_ms'][0]:.1f} ms then {row['alone_ms'][1]:.1f}; "
            f"four more {row['four_more_ms'][0]:.1f} ms then {row['four_more_ms'][1]:.1f}"
        )
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
