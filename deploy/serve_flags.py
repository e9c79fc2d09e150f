"""`kvrelay serve`'s flags and the checked configuration they become (the ClusterSpec, with the
engine's from engine_flags.py; SLO targets, autoscale bounds, the cluster's local name), read
before any process starts. Holds no state."""

from __future__ import annotations

import argparse
import logging
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from common.cluster_state import MAX_POOL_SIZE
from common.placement_rules import OVERLOAD_MODES, LocalPrefill, SloTargets
from common.redis_url import check_url
from deploy.autoscale import AutoscaleConfig
from deploy.cluster_address import check_name
from deploy.engine_flags import (
    add_engine_flags,
    add_model_args,
    as_flags,
    engine_from_args,
    models_from_args,
)
from deploy.flag_types import (
    add_http_port,
    non_negative_float,
    port,
    positive_float,
    positive_int,
)
from deploy.local_cluster import ClusterSpec, ModelPools, controller_names
from deploy.models_file import read_models_file
from deploy.router_flags import add_router_flags
from engine.config import EngineConfig, is_object_store
from router.stats_log import DEFAULT_INTERVAL_S

logger = logging.getLogger(__name__)
DEFAULT_LOCAL_CHUNK_TOKENS = 256  # --local-prefill-chunk-tokens beside a prefill pool


def add_serve_parser(
    sub: argparse._SubParsersAction, run: Callable[[argparse.Namespace], int]
) -> None:
    """`kvrelay serve`'s flags; `run` serves the parsed arguments."""
    p = sub.add_parser(
        "serve",
        help="serve a model on an embedded local cluster",
        description="Serve a model on an embedded local cluster (local Ray, workers, Redis) "
        "behind the router's OpenAI HTTP and gRPC servers, until Ctrl-C.",
        formatter_class=DefaultsShown,
    )
    add_model_args(p, several=True)
    p.add_argument(
        "--models-file",
        default=None,
        metavar="PATH",
        help="several models side by side from a YAML or JSON file (instead of MODEL / "
        "--model): each with its pool sizes and its own engine flags on top of the command "
        "line's (deploy/models_file.py shows the format)",
    )
    p.add_argument(
        "--name",
        default=None,
        help="this cluster's name on this machine, for `kvrelay status|scale|router --name` "
        "(default: its HTTP port, e.g. 8000)",
    )
    p.add_argument(
        "--prefill",
        type=int,
        default=1,
        help="number of prefill workers (of each model); 0: aggregated, the decode workers "
        "compute every prompt themselves (one GPU: the decode worker gets the whole card)",
    )
    p.add_argument("--decode", type=int, default=1, help="number of decode workers (of each model)")
    p.add_argument(
        "--tp",
        "--tensor-parallel-size",  # vLLM's name
        dest="tp",
        type=int,
        default=1,
        help="tensor-parallel ranks of every worker (a Ray actor and, on CUDA, a GPU each, "
        "all of a worker's on one node)",
    )
    p.add_argument("--prefill-tp", type=int, default=None, help="ranks of a prefill worker (--tp)")
    p.add_argument("--decode-tp", type=int, default=None, help="ranks of a decode worker (--tp)")
    p.add_argument("--host", default="127.0.0.1", help="address the HTTP and gRPC servers bind")
    add_http_port(p, "OpenAI HTTP port (0: a free one)")
    p.add_argument("--grpc-port", type=port, default=50051, help="gRPC port (0: a free one)")
    p.add_argument("--redis-url", default=None, help="use this Redis (default: start one)")
    p.add_argument("--no-redis", action="store_true", help="run without the Redis index")
    p.add_argument(
        "--policy",
        default="kv_aware",
        choices=["kv_aware", "round_robin", "random"],
        help="how a prefill worker is chosen: kv_aware weighs its cached prefix against its "
        "load; round_robin and random are there for comparison",
    )
    p.add_argument(
        "--max-migrations",
        type=int,
        default=2,
        help="times a request may move to another decode worker when its own dies (default 2)",
    )
    p.add_argument(
        "--local-prefill-max-tokens",
        type=int,
        default=0,
        metavar="N",
        help="conditional prefill: a decode worker computes a prompt itself when at most N of "
        "its tokens are not in that worker's prefix cache, skipping the prefill pool and the KV "
        "transfer (default 0: never)",
    )
    p.add_argument(
        "--local-prefill-min-cached",
        type=positive_float,
        default=2.0,
        metavar="F",
        help="conditional prefill: ... or when at least this fraction of the prompt is in its "
        "cache, e.g. 0.8 for multi-turn chat (default 2: never)",
    )
    p.add_argument(
        "--local-prefill-chunk-tokens",
        type=int,
        default=None,
        metavar="N",
        help="with conditional prefill on: prompt tokens a decode worker computes per step "
        "beside its running decodes (default 256; with --prefill 0, the engine's own "
        "--max-num-batched-tokens)",
    )
    p.add_argument(
        "--local-prefill-on-slo-miss",
        action="store_true",
        help="conditional prefill: ... or when the prefill pool is predicted to miss "
        "--slo-ttft-ms and a decode worker is predicted to meet it",
    )
    p.add_argument(
        "--slo-ttft-ms",
        type=non_negative_float,
        default=0.0,
        metavar="MS",
        help="time-to-first-token objective: routers place each request on a prefill worker "
        "predicted to meet it, from its queued tokens and measured token rate (default 0: none)",
    )
    p.add_argument(
        "--slo-tpot-ms",
        type=non_negative_float,
        default=0.0,
        metavar="MS",
        help="time-per-output-token objective: routers leave out decode workers whose recent "
        "steps take longer (default 0: none)",
    )
    p.add_argument(
        "--slo-overload",
        default=None,
        choices=list(OVERLOAD_MODES),
        help="a request no worker is predicted to serve within the objectives: queue (wait in "
        "the router for at most --slo-ttft-ms, or 1 s with only --slo-tpot-ms, then 503), shed "
        "(503 at once) or place (on the best worker anyway); default queue; needs an objective",
    )
    for role in ("prefill", "decode"):
        p.add_argument(
            f"--autoscale-{role}",
            default=None,
            metavar="MIN:MAX",
            help=f"let the controller resize the {role} pool within MIN..MAX from its load "
            f"(starting at --{role}); default: fixed",
        )
    add_engine_flags(p)
    p.add_argument(
        "--threads-per-worker",
        type=positive_int,
        default=None,
        help="torch CPU threads of each worker (default: half the CPU cores)",
    )
    p.add_argument(
        "--log-stats-interval",
        type=non_negative_float,
        default=DEFAULT_INTERVAL_S,
        metavar="S",
        help="log one line of throughput, requests and KV use per pool every S seconds while "
        "busy (0: never)",
    )
    p.add_argument("--ray-address", default="local", help='"local" starts Ray here')
    add_router_flags(p)
    p.set_defaults(func=run)


class DefaultsShown(argparse.HelpFormatter):
    """Help that shows every flag's default: a help text that does not already say it in words
    gets "(default: X)" ("none" for None); an on/off flag is off by default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text.lower() or action.nargs == 0 or action.default is argparse.SUPPRESS:
            return text
        return f"{text} (default: {'none' if action.default is None else '%(default)s'})"


def serve_name(args: argparse.Namespace) -> str | None:
    """The cluster's local name: --name, else its HTTP port (None: port 0, known once bound)."""
    if args.name is not None:
        return check_name(args.name)
    return str(args.http_port) if args.http_port else None


def slo_from_args(args: argparse.Namespace) -> SloTargets:
    """--slo-ttft-ms / --slo-tpot-ms / --slo-overload; ValueError naming the flag."""
    for flag, value in (("--slo-ttft-ms", args.slo_ttft_ms), ("--slo-tpot-ms", args.slo_tpot_ms)):
        if value < 0:
            raise ValueError(f"{flag} must be >= 0 (0: no objective), got {value:g}")
    if args.slo_overload is not None and not (args.slo_ttft_ms or args.slo_tpot_ms):
        raise ValueError(  # else it would be taken and do nothing
            f"--slo-overload {args.slo_overload} needs an objective: --slo-ttft-ms or --slo-tpot-ms"
        )
    return SloTargets(args.slo_ttft_ms, args.slo_tpot_ms, args.slo_overload or "queue")


def autoscale_from_args(args: argparse.Namespace) -> AutoscaleConfig | None:
    """--autoscale-prefill / --autoscale-decode MIN:MAX; a pool without one keeps its size."""
    bounds = {}
    for role in ("prefill", "decode"):
        size = getattr(args, role)
        text = getattr(args, f"autoscale_{role}")
        if text is None:
            bounds[role] = (size, size)
            continue
        low, sep, high = text.partition(":")
        if (
            not sep
            or not low.isdigit()
            or not high.isdigit()
            or not 1 <= int(low) <= int(high) <= MAX_POOL_SIZE
        ):
            raise ValueError(
                f"--autoscale-{role} wants MIN:MAX with 1 <= MIN <= MAX <= {MAX_POOL_SIZE}, "
                f"got {text!r}"
            )
        if not int(low) <= size <= int(high):
            raise ValueError(f"--{role} {size} is outside --autoscale-{role} {text}")
        bounds[role] = (int(low), int(high))
    autoscaled = tuple(r for r in ("prefill", "decode") if getattr(args, f"autoscale_{r}"))
    if all(low == high for low, high in bounds.values()):
        return None
    return AutoscaleConfig(
        min_size={role: low for role, (low, _) in bounds.items()},
        max_size={role: high for role, (_, high) in bounds.items()},
        autoscaled=autoscaled,
    )


def leaves_gpu_idle(num_prefill: int, num_decode: int, gpus_per_worker: float | None) -> bool:
    """Aggregated workers that fill no whole GPU between them (--gpus-per-worker 0.5 kept from
    a 1 prefill + 1 decode setup): the rest of the card holds nothing."""
    if num_prefill or gpus_per_worker is None or gpus_per_worker >= 1.0:
        return False
    return num_decode * gpus_per_worker < 1.0 - 1e-9


def _model_pools(args: argparse.Namespace, engine: EngineConfig) -> list[ModelPools]:
    """Each served model's engine and pools: --models-file's, else MODEL / --model (repeated:
    the same engine flags and --prefill / --decode for each); the autoscale bounds for each."""
    several = "--served-model-name names one model: with several, give each its own "
    if args.models_file is None:
        if args.served_model_name is not None and len(models_from_args(args)) > 1:
            raise ValueError(several + "(`served-model-name` in its --models-file flags)")
        autoscale = autoscale_from_args(args)
        return [
            ModelPools(replace(engine, model=model), args.prefill, args.decode, autoscale)
            for model in models_from_args(args)
        ]
    if args.model is not None or args.model_flag:
        raise ValueError("give the models either as MODEL / --model or in --models-file")
    pools = read_models_file(args.models_file, args, engine_from_args, autoscale_from_args)
    if args.served_model_name is not None and len(pools) > 1:
        raise ValueError(several + f"in {args.models_file} (`served-model-name` in its flags)")
    return pools


def spec_from_args(args: argparse.Namespace) -> ClusterSpec:
    if not 0 <= args.prefill <= MAX_POOL_SIZE:
        raise ValueError(
            f"--prefill must be in [0, {MAX_POOL_SIZE}] (0: aggregated workers), got {args.prefill}"
        )
    if not 1 <= args.decode <= MAX_POOL_SIZE:
        raise ValueError(f"--decode must be in [1, {MAX_POOL_SIZE}], got {args.decode}")
    if args.log_stats_interval < 0:
        raise ValueError(
            f"--log-stats-interval must be >= 0 (0: never), got {args.log_stats_interval:g}"
        )
    if args.max_migrations < 0:
        raise ValueError(f"--max-migrations must be >= 0, got {args.max_migrations}")
    if args.redis_url and not args.no_redis:
        check_url(args.redis_url)  # a URL redis-py cannot use: refused before any worker starts
    engine = engine_from_args(args)
    prefill_tp = args.tp if args.prefill_tp is None else args.prefill_tp
    decode_tp = args.tp if args.decode_tp is None else args.decode_tp
    for flag, value in (
        ("--tp", args.tp),
        ("--prefill-tp", prefill_tp),
        ("--decode-tp", decode_tp),
    ):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    share = args.gpus_per_worker
    if leaves_gpu_idle(args.prefill, args.decode, share):
        logger.warning(
            "--prefill 0 --decode %d --gpus-per-worker %g leaves part of each GPU idle: drop "
            "--gpus-per-worker to give the decode worker the whole card",
            args.decode,
            share,
        )
    if max(prefill_tp, decode_tp) > 1 and args.gpus_per_worker not in (None, 1.0):
        raise ValueError("a tensor-parallel worker takes whole GPUs: drop --gpus-per-worker")
    for flag, given, tp in (
        ("--prefill-tp", args.prefill_tp, prefill_tp),
        ("--decode-tp", args.decode_tp, decode_tp),
    ):
        try:  # what a TP worker's engine refuses (the shared KV store ...), before Ray starts
            replace(engine, tensor_parallel_size=tp)
        except ValueError as e:  # named as the user set it: --tp, or the pool's own flag
            named = flag if given is not None else "--tp"
            raise ValueError(f"{named} {tp}: {as_flags(str(e))}") from None
    # A bad threshold is refused here, before Ray starts.
    if args.local_prefill_max_tokens < 0:
        raise ValueError("--local-prefill-max-tokens must be >= 0")
    if args.local_prefill_min_cached <= 0:
        raise ValueError("--local-prefill-min-cached must be > 0")
    chunk = args.local_prefill_chunk_tokens
    if chunk is not None and chunk < 1:
        raise ValueError("--local-prefill-chunk-tokens must be >= 1")
    if args.local_prefill_on_slo_miss and args.slo_ttft_ms <= 0:
        raise ValueError("--local-prefill-on-slo-miss needs --slo-ttft-ms")
    engine_chunk = engine.scheduler.max_num_batched_tokens
    aggregated = args.prefill == 0
    if chunk is None:  # aggregated: the decode workers' steps are the engine's own
        chunk = engine_chunk if aggregated else DEFAULT_LOCAL_CHUNK_TOKENS
    local = LocalPrefill(
        args.local_prefill_max_tokens,
        args.local_prefill_min_cached,
        args.local_prefill_on_slo_miss,
        chunk,
    )
    # A decode worker's step budget: its batch plus the prompt chunk when it computes prompts
    # beside decodes (conditional prefill, or aggregated with a chunk given); None: the
    # engine's own budget (aggregated by default: prompts and decodes share it as offline).
    explicit = args.local_prefill_chunk_tokens is not None
    decode_chunk = chunk if local.enabled or (aggregated and explicit) else None
    slo = slo_from_args(args)
    pools = _model_pools(args, engine)
    autoscale = pools[0].autoscale
    spec = ClusterSpec(
        engine=pools[0].engine,
        num_prefill=pools[0].num_prefill,
        num_decode=pools[0].num_decode,
        redis_url="" if args.no_redis else args.redis_url,
        policy=args.policy,
        max_migrations=args.max_migrations,
        local_prefill=local,
        slo=slo,
        decode_prefill_chunk_tokens=decode_chunk,
        autoscale=autoscale,
        threads_per_worker=args.threads_per_worker,
        gpus_per_worker=args.gpus_per_worker,
        ray_address=args.ray_address,
        prefill_tp=prefill_tp,
        decode_tp=decode_tp,
        otlp_endpoint=args.otlp_endpoint,
        more_models=tuple(pools[1:]),
    )
    if len(pools) > 1:
        controller_names(spec)  # two models served under one id: refused before Ray starts
    return spec


def check_models(spec: ClusterSpec) -> None:
    """Each served model (and draft model) names a .gguf file or HF folder here, or the default
    model with its package installed, and a folder holds what serving it needs
    (deploy/model_preflight.py); FileNotFoundError / ValueError naming it. For an embedded
    cluster only: a remote cluster's workers may have paths this machine lacks."""
    from deploy.model_preflight import check_checkpoint
    from engine.model_source import model_source

    for pools in spec.models:
        engine = pools.engine
        weights = engine.load_format != "dummy"
        check_checkpoint(
            model_source(engine.model),
            engine.scheduler.max_model_len,
            weights,
            named=engine.served_model_name is not None,
        )
        draft = pools.engine.speculative.draft_model
        if draft is not None:
            try:
                check_checkpoint(model_source(draft), weights=weights, draft=True)
            except (FileNotFoundError, ValueError) as e:
                raise type(e)(f"--draft-model: {e}") from None


def check_tier_paths(spec: ClusterSpec) -> None:
    """Each disk tier's and shared store's directory (not an object store) can be made and
    written here; ValueError naming the flag. For an embedded cluster only: a remote cluster's
    workers have disks of their own."""
    for pools in spec.models:
        cache = pools.engine.cache
        for flag, path in (
            ("--disk-kv-path", cache.disk_kv_path),
            ("--shared-kv-path", cache.shared_kv_path),
        ):
            if path is None or is_object_store(path):
                continue
            try:
                Path(path).mkdir(parents=True, exist_ok=True)
                with tempfile.TemporaryFile(dir=path):
                    pass
            except OSError as e:
                raise ValueError(f"{flag} {path}: {e.strerror or e}") from None
