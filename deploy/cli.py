"""The `kvrelay` command line (holds no state): `kvrelay generate "prompt"`, `kvrelay serve`,
`kvrelay bench` (a checkout's bench/serve_bench.py), and the operator commands
`kvrelay scale|status|router|up|down|plan`."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from common.version import version
from deploy.flag_types import OneLineErrors
from deploy.launcher import add_down_parser, add_up_parser
from deploy.ops_cli import add_ops_parsers
from deploy.plan_cli import add_plan_parser
from deploy.serve import serve
from deploy.serve_flags import add_serve_parser
from deploy.speculative_flags import add_speculative_flags, speculative_from_args
from engine.config import DEFAULT_MODEL
from engine.quant.config import QUANTIZATION_FLAGS, QUANTIZATION_HELP, quantization_from_flag

if TYPE_CHECKING:
    from engine.engine import Engine
    from engine.sampling.sampling_params import SamplingParams


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="print the model's reply to one prompt")
    p.add_argument("prompt", help="the user's message (or raw text with --raw)")
    p.add_argument("--model", default=DEFAULT_MODEL, help="model name, .gguf file or HF folder")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--system", default=None, help="system message for the chat template")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2]")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2]")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="HF's; 1 is off")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:N or auto")
    p.add_argument(
        "--quantization", default="none", choices=QUANTIZATION_FLAGS, help=QUANTIZATION_HELP
    )
    p.add_argument(
        "--tp",
        "--tensor-parallel-size",  # vLLM's name
        dest="tp",
        type=int,
        default=1,
        help="tensor-parallel ranks the model is split over (local processes; on CUDA one GPU "
        "each; it must divide the model's attention heads)",
    )
    add_speculative_flags(p)
    p.set_defaults(func=_generate)


def _generate(args: argparse.Namespace) -> int:
    from engine.sampling.sampling_params import SamplingParams
    from engine.sampling.validation import check_sampling

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
    )
    check_sampling(params, sys.maxsize)  # before torch and the model (the vocabulary: later)
    speculative = speculative_from_args(args)
    from engine.engine import Engine, EngineConfig

    quantization = quantization_from_flag(args.quantization)
    config = EngineConfig(
        model=args.model,
        device=args.device,
        quantization=quantization,
        detokenize=True,
        speculative=speculative,
        tensor_parallel_size=args.tp,
    )
    engine = Engine(config)
    try:
        return _print_reply(engine, args, params)
    finally:
        engine.shutdown()


def _print_reply(engine: Engine, args: argparse.Namespace, params: SamplingParams) -> int:
    if engine.tokenizer is None:
        print("error: this model has no tokenizer files", file=sys.stderr)
        return 2
    if args.raw:
        prompt = engine.tokenizer.encode(args.prompt)
    else:
        messages = [{"role": "user", "content": args.prompt}]
        if args.system:
            messages.insert(0, {"role": "system", "content": args.system})
        prompt = engine.tokenizer.apply_chat_template(messages)
    engine.add_request("cli", prompt, params)
    while engine.has_unfinished_requests:
        for out in engine.step():
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def _add_bench(sub: argparse._SubParsersAction) -> None:
    # Listed here for `kvrelay --help`; main() hands `kvrelay bench ...` to serve_bench whole.
    sub.add_parser(
        "bench",
        add_help=False,
        help="load a running (or --launch'ed) cluster and report goodput, TTFT, TPOT, "
        "throughput: bench/serve_bench.py of this checkout, same flags (kvrelay bench --help)",
    )


def bench(argv: Sequence[str]) -> int:
    """`kvrelay bench ...`: bench/serve_bench.py of the checkout this kvrelay runs from (bench/
    is not installed: the load generator launches and compares checkouts, so it lives in one)."""
    root = Path(__file__).resolve().parents[1]
    if not (root / "bench" / "serve_bench.py").is_file():
        print(
            f"error: kvrelay bench runs bench/serve_bench.py of a kvrelay checkout, and this "
            f"kvrelay is installed from {root}, which has none; install kvrelay from a "
            "checkout (pip install -e .) or run python -m bench.serve_bench in one",
            file=sys.stderr,
        )
        return 2
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    from bench import serve_bench

    return serve_bench.main(argv, prog="kvrelay bench")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvrelay", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineErrors)
    _add_generate(sub)
    add_serve_parser(sub, serve)
    _add_bench(sub)
    add_ops_parsers(sub)
    add_up_parser(sub)
    add_down_parser(sub)
    add_plan_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # every flag after it is serve_bench's, --help included
        return bench(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except TimeoutError as err:  # the cluster did not answer in time (an overloaded controller)
        print(f"error: {err}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `kvrelay status | head`: the reader left; no traceback
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the exit's flush of stdout fails quietly too
        return 141  # 128 + SIGPIPE, as a shell reports a command cut off by its reader


if __name__ == "__main__":
    sys.exit(main())
