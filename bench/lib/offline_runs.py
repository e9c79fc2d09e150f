"""One timed offline generate run each of kvrelay (LLM.generate) and transformers (batched,
left-padded greedy generate) on the same prompts, as RunResults, and how alike their outputs
are; stateless (the caller holds the models).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.llm import LLM
from engine.sampling.sampling_params import SamplingParams


@dataclass(frozen=True)
class RunResult:
    system: str
    seconds: float
    num_prompts: int
    num_prompt_tokens: int
    num_output_tokens: int
    output_tokens_per_s: float
    total_tokens_per_s: float
    cpu_per_wall: float  # process CPU seconds / wall seconds: ~threads when nothing competes
    load_avg_1m: float  # system load just after the run (other processes inflate it)
    detail: dict[str, Any]


def run_kvrelay(llm: LLM, prompts: Sequence[list[int]], max_tokens: int) -> tuple[RunResult, list]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    stats = llm.engine.stats
    steps0, computed0 = stats.num_steps, stats.num_computed_tokens
    start, cpu_start = time.perf_counter(), time.process_time()
    completions = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    cpu_seconds = time.process_time() - cpu_start
    outputs = [c.token_ids for c in completions]
    detail = {
        "num_steps": stats.num_steps - steps0,
        "num_computed_tokens": stats.num_computed_tokens - computed0,
        "num_prefix_cached_tokens": sum(c.num_cached_tokens for c in completions),
        "num_preemptions": llm.engine.scheduler.num_preemptions,
    }
    return _result("kvrelay", seconds, cpu_seconds, prompts, outputs, detail), outputs


def run_transformers(
    model: Any,
    pad_token_id: int,
    prompts: Sequence[list[int]],
    max_tokens: int,
    batch_size: int,
    log: Callable[[str], None],
) -> tuple[RunResult, list]:
    """Batched greedy generate, left padded; batches are formed after sorting by length.
    log: where each finished batch is reported."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    outputs: list[list[int]] = [[] for _ in prompts]
    num_padded = 0
    start, cpu_start = time.perf_counter(), time.process_time()
    for b in range(0, len(order), batch_size):
        index = order[b : b + batch_size]
        width = max(len(prompts[i]) for i in index)
        ids = torch.full((len(index), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(index), width), dtype=torch.long)
        for row, i in enumerate(index):
            ids[row, width - len(prompts[i]) :] = torch.tensor(prompts[i])
            mask[row, width - len(prompts[i]) :] = 1
        num_padded += ids.numel()
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                pad_token_id=pad_token_id,
            )
        for row, i in enumerate(index):
            outputs[i] = out[row, width:].tolist()
        done = min(b + batch_size, len(order))
        log(f"transformers: batch {done}/{len(order)} done ({time.perf_counter() - start:.1f}s)")
    seconds = time.perf_counter() - start
    cpu_seconds = time.process_time() - cpu_start
    detail = {"batch_size": batch_size, "num_padded_prompt_tokens": num_padded}
    return _result("transformers", seconds, cpu_seconds, prompts, outputs, detail), outputs


def _result(
    system: str,
    seconds: float,
    cpu_seconds: float,
    prompts: Sequence[list[int]],
    outputs: list,
    detail: dict,
) -> RunResult:
    num_prompt = sum(len(p) for p in prompts)
    num_out = sum(len(o) for o in outputs)
    return RunResult(
        system=system,
        seconds=seconds,
        num_prompts=len(prompts),
        num_prompt_tokens=num_prompt,
        num_output_tokens=num_out,
        output_tokens_per_s=num_out / seconds,
        total_tokens_per_s=(num_prompt + num_out) / seconds,
        cpu_per_wall=cpu_seconds / seconds,
        load_avg_1m=os.getloadavg()[0],
        detail=detail,
    )


def load_transformers(folder: Path, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype)
    model.eval()
    # Same semantics as the engine's ignore_eos: no early stop, and EOS is not suppressed
    # (min_new_tokens alone would mask EOS logits and change greedy choices after an EOS).
    model.generation_config.eos_token_id = None
    return model


def compare(a: list[list[int]], b: list[list[int]]) -> dict[str, float]:
    exact = sum(x == y for x, y in zip(a, b, strict=True))
    prefixes = []
    for x, y in zip(a, b, strict=True):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        prefixes.append(n)
    return {"num_exact": exact, "mean_common_prefix": sum(prefixes) / len(prefixes)}
