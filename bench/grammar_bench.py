"""Throughput cost of grammar masks (structured outputs): the engine in-process, the same chat
prompts at batch 1 and 64, greedy, with and without a json_schema; output tok/s, ms per step
and the host time spent filling and applying the masks. Owns no state.

    python -m bench.grammar_bench [--batch 1 64] [--max-tokens 64] [--device cpu] [--json out.json]
    python -m bench.grammar_bench --device cuda --model FOLDER --load-format dummy  # 8B shape
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from bench.lib.engine_config import engine_config
from bench.lib.run_report import report_header, write_report
from engine.config import DEFAULT_MODEL
from engine.engine import Engine
from engine.sampling.sampling_params import SamplingParams, StructuredOutput
from engine.sampling.structured import Grammars, TokenBitmask

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "bio": {"type": "string"},
        "hobbies": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "bio", "hobbies"],
}


class MaskTimer:
    """Wall time inside Grammars.bitmask (host fill) and TokenBitmask.apply (device op)."""

    def __init__(self) -> None:
        self.fill_s = 0.0
        self.apply_s = 0.0
        self._bitmask, self._apply = Grammars.bitmask, TokenBitmask.apply

    def __enter__(self) -> MaskTimer:
        timer, bitmask, apply = self, self._bitmask, self._apply

        def timed_bitmask(grammars, reqs):  # type: ignore[no-untyped-def]
            start = time.perf_counter()
            try:
                return bitmask(grammars, reqs)
            finally:
                timer.fill_s += time.perf_counter() - start

        def timed_apply(mask, logits):  # type: ignore[no-untyped-def]
            start = time.perf_counter()
            try:
                return apply(mask, logits)
            finally:
                timer.apply_s += time.perf_counter() - start

        Grammars.bitmask, TokenBitmask.apply = timed_bitmask, timed_apply  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        Grammars.bitmask, TokenBitmask.apply = self._bitmask, self._apply  # type: ignore[method-assign]


def prompts(engine: Engine, batch: int, tag: str) -> list[list[int]]:
    """Chat prompts unique to one run (tag), so no run reuses another's prompt KV."""
    assert engine.tokenizer is not None
    return [
        engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": f"[{tag}] Describe person {i} as JSON, with a long bio."}]
        )
        for i in range(batch)
    ]


def run(
    engine: Engine, batch: int, max_tokens: int, grammar: bool, tag: str = ""
) -> dict[str, float]:
    structured = StructuredOutput("json_schema", json.dumps(SCHEMA)) if grammar else None
    # ignore_eos: free rows run max_tokens; a grammar row ends when its JSON is complete.
    params = SamplingParams(
        max_tokens=max_tokens, temperature=0, ignore_eos=True, structured=structured
    )
    for i, ids in enumerate(prompts(engine, batch, f"{tag}{batch}-{grammar}")):
        engine.add_request(f"r{i}", ids, params)
    steps_before = engine.stats.num_steps
    num_tokens = 0
    with MaskTimer() as timer:
        start = time.perf_counter()
        while engine.has_unfinished_requests:
            num_tokens += len(engine.step())
        seconds = time.perf_counter() - start
    num_steps = engine.stats.num_steps - steps_before
    return {
        "batch": batch,
        "grammar": grammar,
        "output_tokens": num_tokens,
        "seconds": round(seconds, 3),
        "output_tok_s": round(num_tokens / seconds, 1),
        "ms_per_step": round(1000 * seconds / num_steps, 2),
        "mask_fill_ms_per_step": round(1000 * timer.fill_s / num_steps, 3),
        "mask_apply_ms_per_step": round(1000 * timer.apply_s / num_steps, 3),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--model", default=DEFAULT_MODEL, help="a model folder or name")
    p.add_argument("--load-format", default="auto", help="dummy: random weights")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    torch.manual_seed(0)
    config = engine_config(
        args.model,
        load_format=args.load_format,
        device=args.device,
        dtype=args.dtype,
        num_blocks=max(args.batch) * 16,
        max_num_seqs=max(args.batch),
        max_num_batched_tokens=4096,
    )
    engine = Engine(config)
    # Warm-up at every measured batch size: the tokenizer's table, the schema's compile, and
    # the kernels specialised on the batch (xgrammar's mask kernel on CUDA at batch 1).
    for batch in args.batch:
        run(engine, batch, 8, grammar=True, tag="warm-up ")
    rows = []
    for batch in args.batch:
        for grammar in (False, True):
            row = run(engine, batch, args.max_tokens, grammar)
            print(json.dumps(row), flush=True)
            rows.append(row)
    engine.assert_no_leaks()
    report = report_header("python -m bench.grammar_bench " + " ".join(_argv(args)))
    write_report(args.json, {**report, "device": str(engine.device), "rows": rows})


def _argv(args: argparse.Namespace) -> list[str]:
    out = ["--batch", *map(str, args.batch), "--max-tokens", str(args.max_tokens)]
    out += ["--model", args.model, "--load-format", args.load_format]
    return [*out, "--device", args.device]


if __name__ == "__main__":
    main()
