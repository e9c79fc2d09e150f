"""`kvrelay serve`'s flags and the checked configuration they become (ClusterSpec, EngineConfig,
SLO targets, autoscale bounds), read before any process starts. Holds no state."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from common.placement_rules import OVERLOAD_MODES, LocalPrefill, SloTargets
from common.redis_url import check_url
from deploy.autoscale import AutoscaleConfig
from deploy.local_cluster import ClusterSpec
from deploy.router_flags import add_router_flags
from deploy.speculative_flags import add_speculative_flags, speculative_from_args
from deploy.worker_launch import check_gpus_per_worker
from engine.config import (
    DEFAULT_MODEL,
    KV_CACHE_DTYPES,
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
)
from engine.quant.config import QUANTIZATION_FLAGS, QUANTIZATION_HELP, quantization_from_flag


def add_serve_parser(
    sub: argparse._SubParsersAction, run: Callable[[argparse.Namespace], int]
) -> None:
    """`kvrelay serve`'s flags; `run` serves the parsed arguments."""
    p = sub.add_parser("serve", help="serve a model on an embedded local cluster")
    p.add_argument("--model", default=DEFAULT_MODEL, help="model name, .gguf file or HF folder")
    p.add_argument("--prefill", type=int, default=1, help="number of prefill workers")
    p.add_argument("--decode", type=int, default=1, help="number of decode workers")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=50051)
    p.add_argument("--redis-url", default=None, help="use this Redis (default: start one)")
    p.add_argument("--no-redis", action="store_true", help="run without the Redis index")
    p.add_argument("--policy", default="kv_aware", choices=["kv_aware", "round_robin", "random"])
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
        type=float,
        default=2.0,
        metavar="F",
        help="conditional prefill: ... or when at least this fraction of the prompt is in its "
        "cache, e.g. 0.8 for multi-turn chat (default 2: never)",
    )
    p.add_argument(
        "--local-prefill-chunk-tokens",
        type=int,
        default=256,
        metavar="N",
        help="with conditional prefill on: prompt tokens a decode worker computes per step "
        "beside its running decodes (default 256)",
    )
    p.add_argument(
        "--local-prefill-on-slo-miss",
        action="store_true",
        help="conditional prefill: ... or when the prefill pool is predicted to miss "
        "--slo-ttft-ms and a decode worker is predicted to meet it",
    )
    p.add_argument(
        "--slo-ttft-ms",
        type=float,
        default=0.0,
        metavar="MS",
        help="time-to-first-token objective: routers place each request on a prefill worker "
        "predicted to meet it, from its queued tokens and measured token rate (default 0: none)",
    )
    p.add_argument(
        "--slo-tpot-ms",
        type=float,
        default=0.0,
        metavar="MS",
        help="time-per-output-token objective: routers leave out decode workers whose recent "
        "steps take longer (default 0: none)",
    )
    p.add_argument(
        "--slo-overload",
        default="queue",
        choices=list(OVERLOAD_MODES),
        help="a request no worker is predicted to serve within the objectives: queue (wait in "
        "the router for at most --slo-ttft-ms, then 503), shed (503 at once) or place (on the "
        "best worker anyway); default queue",
    )
    for role in ("prefill", "decode"):
        p.add_argument(
            f"--autoscale-{role}",
            default=None,
            metavar="MIN:MAX",
            help=f"let the controller resize the {role} pool within MIN..MAX from its load "
            f"(starting at --{role}); default: fixed",
        )
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--kv-cache-gib",
        type=float,
        default=None,
        help="KV pool size per worker (default: on CUDA what --gpu-memory-utilization leaves after "
        "the weights, the activation peak and the CUDA graphs; on CPU 1 GiB)",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        metavar="U",
        help="the part of each GPU's memory kvrelay's workers on it use together; it sizes the KV "
        "pool when --kv-cache-gib is not given (default 0.9)",
    )
    p.add_argument(
        "--host-kv-gib",
        type=float,
        default=0.0,
        help="a host-memory tier of each worker's prefix cache (pinned on CUDA): blocks evicted "
        "from the device pool are kept there and copied back on a prefix hit (default 0: none)",
    )
    p.add_argument(
        "--host-leases",
        action="store_true",
        help="prefill workers lease the host-tier copies of a prompt's leading blocks to decode "
        "workers (read from host memory over NIXL) instead of pinning their device blocks, so a "
        "slow decode pull never holds device memory; needs --host-kv-gib",
    )
    p.add_argument(
        "--partial-reuse-min-tokens",
        type=int,
        default=None,
        metavar="N",
        help="a prompt that diverges inside a cached block reuses its matching tokens (the block "
        "is copied) when at least N match; 0: whole blocks only (default: half a block)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=list(KV_CACHE_DTYPES),
        help="auto: the model's dtype; fp8: e4m3 (half the bytes per token; FlashInfer, CUDA)",
    )
    add_speculative_flags(p)
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help="sequences a worker runs at once (default: 64 for a fixed-size pool, as on CPU; for a "
        "pool sized by GPU memory one per 1024 tokens it holds, at most 1024)",
    )
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument(
        "--device",
        default="auto",
        help="auto (cuda when Ray has the GPUs every worker needs, else cpu), cpu, or cuda "
        "(--gpus-per-worker of a GPU per worker)",
    )
    p.add_argument(
        "--gpus-per-worker",
        type=float,
        default=None,
        metavar="F",
        help="CUDA: the part of a GPU each worker gets, 0 < F <= 1 (default 1); a fraction "
        "shares a card, e.g. 0.5 puts a prefill and a decode worker on one GPU, each with "
        "F of --gpu-memory-utilization of its memory",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="auto: bfloat16 on CUDA, float32 on CPU",
    )
    p.add_argument(
        "--attention-backend",
        default="auto",
        choices=["auto", "torch", "flashinfer"],
        help="auto: FlashInfer on CUDA when installed, else torch",
    )
    p.add_argument(
        "--no-cuda-graph", action="store_true", help="run decode eagerly (no CUDA graphs)"
    )
    p.add_argument(
        "--mixed-step-graphs",
        action="store_true",
        help="replay steps with prefill chunks from piecewise CUDA graphs (attention eager "
        "between the pieces; FlashInfer with CUDA graphs only, else ignored)",
    )
    p.add_argument(
        "--no-async-scheduling",
        action="store_true",
        help="do not schedule a step while the previous one runs on the GPU",
    )
    p.add_argument(
        "--load-format",
        default="auto",
        choices=["auto", "dummy"],
        help="dummy: random weights of the model's shape (speed runs; config.json is enough)",
    )
    p.add_argument(
        "--quantization", default="none", choices=QUANTIZATION_FLAGS, help=QUANTIZATION_HELP
    )
    p.add_argument("--threads-per-worker", type=int, default=None)
    p.add_argument("--ray-address", default="local", help='"local" starts Ray here')
    add_router_flags(p)
    p.set_defaults(func=run)


def slo_from_args(args: argparse.Namespace) -> SloTargets:
    """--slo-ttft-ms / --slo-tpot-ms / --slo-overload; ValueError naming the flag."""
    for flag, value in (("--slo-ttft-ms", args.slo_ttft_ms), ("--slo-tpot-ms", args.slo_tpot_ms)):
        if value < 0:
            raise ValueError(f"{flag} must be >= 0 (0: no objective), got {value:g}")
    return SloTargets(args.slo_ttft_ms, args.slo_tpot_ms, args.slo_overload)


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
        if not sep or not low.isdigit() or not high.isdigit() or not 1 <= int(low) <= int(high):
            raise ValueError(f"--autoscale-{role} wants MIN:MAX with 1 <= MIN <= MAX, got {text!r}")
        if not int(low) <= size <= int(high):
            raise ValueError(f"--{role} {size} is outside --autoscale-{role} {text}")
        bounds[role] = (int(low), int(high))
    if all(low == high for low, high in bounds.values()):
        return None
    return AutoscaleConfig(
        min_size={role: low for role, (low, _) in bounds.items()},
        max_size={role: high for role, (_, high) in bounds.items()},
    )


def engine_from_args(args: argparse.Namespace) -> EngineConfig:
    """Every worker's engine; a bad size or fraction is refused naming its flag."""
    if args.kv_cache_gib is not None and args.kv_cache_gib <= 0:
        raise ValueError(f"--kv-cache-gib must be > 0, got {args.kv_cache_gib:g}")
    if not 0 < args.gpu_memory_utilization <= 1:
        raise ValueError(
            f"--gpu-memory-utilization must be in (0, 1], got {args.gpu_memory_utilization:g}"
        )
    if args.gpus_per_worker is not None:
        check_gpus_per_worker(args.gpus_per_worker)
        if args.device == "cpu":
            raise ValueError("--gpus-per-worker applies to CUDA workers, not --device cpu")
    kv_bytes = None if args.kv_cache_gib is None else int(args.kv_cache_gib * (1 << 30))
    return EngineConfig(
        model=args.model,
        cache=CacheConfig(
            block_size=args.block_size,
            kv_cache_memory_bytes=kv_bytes,
            kv_cache_dtype=args.kv_cache_dtype,
            partial_reuse_min_tokens=args.partial_reuse_min_tokens,
            host_kv_cache_bytes=int(args.host_kv_gib * (1 << 30)),
            host_leases=args.host_leases,
        ),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            max_model_len=args.max_model_len,
        ),
        device=args.device,
        dtype=args.dtype,
        attention_backend=args.attention_backend,
        cuda_graph=not args.no_cuda_graph,
        mixed_step_graphs=args.mixed_step_graphs,
        async_scheduling=False if args.no_async_scheduling else None,
        load_format=args.load_format,
        quantization=quantization_from_flag(args.quantization),
        gpu_memory_utilization=args.gpu_memory_utilization,
        speculative=speculative_from_args(args),
    )


def spec_from_args(args: argparse.Namespace) -> ClusterSpec:
    if args.prefill < 1 or args.decode < 1:
        raise ValueError("--prefill and --decode must be >= 1")
    if args.max_migrations < 0:
        raise ValueError(f"--max-migrations must be >= 0, got {args.max_migrations}")
    if args.redis_url and not args.no_redis:
        check_url(args.redis_url)  # a URL redis-py cannot use: refused before any worker starts
    engine = engine_from_args(args)
    # A bad threshold is refused here, before Ray starts.
    if args.local_prefill_max_tokens < 0:
        raise ValueError("--local-prefill-max-tokens must be >= 0")
    if args.local_prefill_min_cached <= 0:
        raise ValueError("--local-prefill-min-cached must be > 0")
    if args.local_prefill_chunk_tokens < 1:
        raise ValueError("--local-prefill-chunk-tokens must be >= 1")
    if args.local_prefill_on_slo_miss and args.slo_ttft_ms <= 0:
        raise ValueError("--local-prefill-on-slo-miss needs --slo-ttft-ms")
    local = LocalPrefill(
        args.local_prefill_max_tokens,
        args.local_prefill_min_cached,
        args.local_prefill_on_slo_miss,
        args.local_prefill_chunk_tokens,
    )
    slo = slo_from_args(args)
    autoscale = autoscale_from_args(args)
    return ClusterSpec(
        engine=engine,
        num_prefill=args.prefill,
        num_decode=args.decode,
        redis_url="" if args.no_redis else args.redis_url,
        policy=args.policy,
        max_migrations=args.max_migrations,
        local_prefill=local,
        slo=slo,
        decode_prefill_chunk_tokens=args.local_prefill_chunk_tokens if local.enabled else None,
        autoscale=autoscale,
        threads_per_worker=args.threads_per_worker,
        gpus_per_worker=args.gpus_per_worker,
        ray_address=args.ray_address,
    )
