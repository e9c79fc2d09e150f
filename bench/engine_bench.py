"""Offline throughput: kvrelay's engine (LLM.generate) vs transformers' batched generate.

Builds one deterministic set of mixed-length prompts (chat-templated and raw text, ~16..512
tokens), runs it greedily through both systems in this process with the same number of output
tokens per prompt, and prints output tokens/s of each, their ratio and how many outputs match
token for token. Owns no state beyond the two models it loads. Progress goes to stderr.

    python -m bench.engine_bench [--num-prompts 64] [--max-tokens 64] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from bench.lib.engine_config import engine_config
from engine.llm import LLM
from engine.loader import resolve_model
from engine.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parent.parent  # the checkout whose git state is reported

_WORD_TEXT = (
    "the of and to in is that it was for on are as with his they at be this from have or by "
    "one had not but what all were when we there can an your which their said if do will each "
    "about how up out them then she many some so these would other into has more her two like "
    "him see time could no make than first been its who now people my made over did down only "
    "way find use may water long little very after words called just where most know get "
    "through back much before go good new write our used me man too any day same right look "
    "think also around another came come work three word must because does part even place "
    "well such here take why things help put years different away again off went old number "
    "great tell men say small every found still between name should home big give air line set "
    "own under read last never us left end along while might next sound below saw something "
    "thought both few those always looked show large often together asked house world going "
    "want school important until form food keep children feet land side without boy once "
    "animals life enough took sometimes four head above kind began almost live page got earth "
    "need far hand high year mother light parts country father let night following picture "
    "being study second eyes soon times story boys since white days ever paper hard near "
    "sentence better best across during today others however sure means knew try told young "
    "river mountain city engine memory cache token model server request network garden"
)
_WORDS = _WORD_TEXT.split()

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

_CHAT_TASKS = (
    "Summarize the following notes in two sentences:",
    "Rewrite this text as a short poem:",
    "List three questions a reader might ask about this passage:",
    "Explain the main idea of this paragraph to a child:",
    "Translate the gist of this text into plain English:",
)


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


def log(message: str) -> None:
    print(f"[engine_bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ---- prompts ---------------------------------------------------------------------------------
def _random_text(rng: random.Random, num_words: int) -> str:
    sentences, words = [], []
    for _ in range(num_words):
        words.append(rng.choice(_WORDS))
        if len(words) >= rng.randint(6, 18):
            sentences.append(" ".join(words).capitalize() + ".")
            words = []
    if words:
        sentences.append(" ".join(words).capitalize() + ".")
    return " ".join(sentences)


def build_prompts(
    tokenizer: Any, num_prompts: int, min_len: int, max_len: int, seed: int
) -> list[list[int]]:
    """Deterministic prompts: every other one chat-templated, lengths uniform in [min, max]."""
    rng = random.Random(seed)
    task = max(_CHAT_TASKS, key=len)
    template = tokenizer.apply_chat_template(
        [{"role": "user", "content": f"{task}\n\n"}], tokenize=False, add_generation_prompt=True
    )
    chat_overhead = len(tokenizer.encode(template, add_special_tokens=False))
    prompts = []
    for i in range(num_prompts):
        target = rng.randint(min_len, max_len)
        is_chat = i % 2 == 0 and target > chat_overhead + 4
        body_len = target - chat_overhead if is_chat else target
        body = tokenizer.encode(_random_text(rng, body_len + 8), add_special_tokens=False)
        body_text = tokenizer.decode(body[:body_len])
        if is_chat:
            content = f"{rng.choice(_CHAT_TASKS)}\n\n{body_text}"
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
            )
            prompts.append(tokenizer.encode(text, add_special_tokens=False))
        else:
            prompts.append(tokenizer.encode(body_text, add_special_tokens=True)[:target])
    return prompts


# ---- systems ---------------------------------------------------------------------------------
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
    model: Any, pad_token_id: int, prompts: Sequence[list[int]], max_tokens: int, batch_size: int
) -> tuple[RunResult, list]:
    """Batched greedy generate, left padded; batches are formed after sorting by length."""
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


# ---- main ------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per prompt")
    p.add_argument("--min-prompt-len", type=int, default=16)
    p.add_argument("--max-prompt-len", type=int, default=512)
    p.add_argument(
        "--hf-batch-size",
        type=int,
        nargs="+",
        default=[64, 16],
        help="transformers batch size(s); each is one timed run (prompts sorted by length)",
    )
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="float32", help="both systems")
    p.add_argument("--seed", type=int, default=0, help="prompt RNG seed")
    p.add_argument("--skip-transformers", action="store_true", help="time kvrelay only")
    p.add_argument("--json", type=Path, default=None, help="also write results here")
    return p.parse_args(argv)


def bench_kvrelay(
    args: argparse.Namespace, prompts: list[list[int]], warmup: list[list[int]]
) -> tuple[RunResult, list]:
    config = engine_config(
        dtype=args.dtype,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
    )
    llm = LLM(config)
    log("kvrelay: warm-up")
    run_kvrelay(llm, warmup, 8)
    llm.engine.kv.pool.evict_all_cached()  # the timed run starts with a cold prefix cache
    log("kvrelay: timed run")
    result, outputs = run_kvrelay(llm, prompts, args.max_tokens)
    log(f"kvrelay: {result.seconds:.1f}s")
    return result, outputs


def bench_transformers(
    args: argparse.Namespace,
    folder: Path,
    pad_token_id: int,
    prompts: list[list[int]],
    warmup: list[list[int]],
    reference: list[list[int]],
) -> list[RunResult]:
    model = load_transformers(folder, _DTYPES[args.dtype])
    log("transformers: warm-up")
    run_transformers(model, pad_token_id, warmup, 8, len(warmup))
    results = []
    for batch_size in args.hf_batch_size:
        log(f"transformers: timed run, batch size {batch_size}")
        result, outputs = run_transformers(
            model, pad_token_id, prompts, args.max_tokens, batch_size
        )
        result.detail.update(compare(reference, outputs))
        results.append(result)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    folder = resolve_model("default", log)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    prompts = build_prompts(
        tokenizer, args.num_prompts, args.min_prompt_len, args.max_prompt_len, args.seed
    )
    warmup = build_prompts(tokenizer, 4, 16, 128, args.seed + 1)
    lens = [len(p) for p in prompts]
    log(f"{len(prompts)} prompts, {sum(lens)} tokens, lengths {min(lens)}..{max(lens)}")
    kv_result, kv_outputs = bench_kvrelay(args, prompts, warmup)
    results = [kv_result]
    if not args.skip_transformers:
        pad_id = tokenizer.pad_token_id
        pad_id = tokenizer.eos_token_id if pad_id is None else pad_id
        results += bench_transformers(args, folder, pad_id, prompts, warmup, kv_outputs)
    print_report(args, results)
    if args.json:
        args.json.write_text(json.dumps(report_dict(args, results), indent=2) + "\n")
        log(f"wrote {args.json}")
    return 0


def _label(r: RunResult) -> str:
    return f"transformers bs={r.detail['batch_size']}" if r.system == "transformers" else r.system


def print_report(args: argparse.Namespace, results: list[RunResult]) -> None:
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, dtype {args.dtype}, "
        f"kvrelay at {git_state()}"
    )
    header = ("seconds", "prompt tok", "output tok", "out tok/s", "kvrelay x", "cpu/wall", "load")
    print(f"{'system':<20}" + "".join(f"{h:>11}" for h in header))
    kv_rate = results[0].output_tokens_per_s
    for r in results:
        print(
            f"{_label(r):<20}{r.seconds:>11.2f}{r.num_prompt_tokens:>11}{r.num_output_tokens:>11}"
            f"{r.output_tokens_per_s:>11.1f}{kv_rate / r.output_tokens_per_s:>11.2f}"
            f"{r.cpu_per_wall:>11.2f}{r.load_avg_1m:>11.2f}"
        )
    for r in results[1:]:
        print(
            f"{_label(r)}: greedy outputs identical to kvrelay token-for-token: "
            f"{r.detail['num_exact']}/{r.num_prompts} (mean common prefix "
            f"{r.detail['mean_common_prefix']:.1f}/{args.max_tokens})"
        )
    for r in results:
        print(f"{_label(r)} detail: {r.detail}")


def git_state() -> str:
    """HEAD's short hash, with "+dirty" when engine/ has uncommitted changes."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "engine"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        return "unknown"
    return f"{head}+dirty" if dirty else head


def report_dict(args: argparse.Namespace, results: list[RunResult]) -> dict[str, Any]:
    import transformers

    kv_rate = results[0].output_tokens_per_s
    return {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "num_cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
        },
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "git": git_state(),
        "results": [
            asdict(r) | {"kvrelay_speedup": kv_rate / r.output_tokens_per_s} for r in results
        ],
    }


if __name__ == "__main__":
    sys.exit(main())
