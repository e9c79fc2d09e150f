"""`kvrelay serve`: an embedded cluster (local Ray, local redis-server unless --redis-url, N prefill
and M decode workers) behind the router's HTTP and gRPC servers, until Ctrl-C. Owns no state
beyond the running servers; every process it started is stopped on exit."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from common.cluster_state import RouterStatus
from common.redis_url import check_url
from deploy import cluster_address
from deploy.autoscale import AutoscaleConfig
from deploy.local_cluster import ClusterSpec, LocalCluster
from deploy.router_flags import RouterOptions, add_router_flags, router_options
from engine.config import (
    DEFAULT_MODEL,
    KV_CACHE_DTYPES,
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
)
from router.policy import LocalPrefill


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
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
    for role in ("prefill", "decode"):
        p.add_argument(
            f"--autoscale-{role}",
            default=None,
            metavar="MIN:MAX",
            help=f"let the controller resize the {role} pool within MIN..MAX from its load "
            f"(starting at --{role}); default: fixed",
        )
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-gib", type=float, default=1.0, help="KV pool size per worker")
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=list(KV_CACHE_DTYPES),
        help="auto: the model's dtype; fp8: e4m3 (half the bytes per token; FlashInfer, CUDA)",
    )
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument(
        "--device",
        default="auto",
        help="auto (cuda when Ray sees a GPU for every worker, else cpu), cpu, or cuda "
        "(one GPU per worker)",
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
    p.add_argument("--threads-per-worker", type=int, default=None)
    p.add_argument("--ray-address", default="local", help='"local" starts Ray here')
    add_router_flags(p)
    p.set_defaults(func=serve)


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


def spec_from_args(args: argparse.Namespace) -> ClusterSpec:
    if args.prefill < 1 or args.decode < 1:
        raise ValueError("--prefill and --decode must be >= 1")
    if args.max_migrations < 0:
        raise ValueError(f"--max-migrations must be >= 0, got {args.max_migrations}")
    if args.redis_url and not args.no_redis:
        check_url(args.redis_url)  # a URL redis-py cannot use: refused before any worker starts
    engine = EngineConfig(
        model=args.model,
        cache=CacheConfig(
            block_size=args.block_size,
            kv_cache_memory_bytes=int(args.kv_cache_gib * (1 << 30)),
            kv_cache_dtype=args.kv_cache_dtype,
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
        async_scheduling=False if args.no_async_scheduling else None,
        load_format=args.load_format,
    )
    # A bad threshold is refused here, before Ray starts.
    if args.local_prefill_max_tokens < 0:
        raise ValueError("--local-prefill-max-tokens must be >= 0")
    if args.local_prefill_min_cached <= 0:
        raise ValueError("--local-prefill-min-cached must be > 0")
    if args.local_prefill_chunk_tokens < 1:
        raise ValueError("--local-prefill-chunk-tokens must be >= 1")
    local = LocalPrefill(args.local_prefill_max_tokens, args.local_prefill_min_cached)
    autoscale = autoscale_from_args(args)
    return ClusterSpec(
        engine=engine,
        num_prefill=args.prefill,
        num_decode=args.decode,
        redis_url="" if args.no_redis else args.redis_url,
        policy=args.policy,
        max_migrations=args.max_migrations,
        local_prefill_max_tokens=args.local_prefill_max_tokens,
        local_prefill_min_cached=args.local_prefill_min_cached,
        decode_prefill_chunk_tokens=args.local_prefill_chunk_tokens if local.enabled else None,
        autoscale=autoscale,
        threads_per_worker=args.threads_per_worker,
        ray_address=args.ray_address,
    )


def serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    spec = spec_from_args(args)
    options = router_options(args)  # a bad key file or certificate: refused before Ray starts
    return asyncio.run(_serve(spec, options, args.host, args.http_port, args.grpc_port))


async def _serve(
    spec: ClusterSpec, options: RouterOptions, host: str, http_port: int, grpc_port: int
) -> int:
    from router.metrics import RouterMetrics
    from router.tokenizer import RouterTokenizer

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    cluster = LocalCluster(spec)
    servers = None
    try:
        await cluster.start(progress=_say)
        metrics = RouterMetrics()
        cluster.backend.metrics = metrics
        tokenizer = RouterTokenizer(cluster.model.checkpoint_dir)
        servers = options.build_servers(cluster.backend, tokenizer, metrics)
        await servers.start(host, http_port, grpc_port)
        http_url, grpc_address = servers.http_url(host), servers.grpc_address(host)
        cluster.backend.membership.router = RouterStatus(
            cluster.backend.router_id, http_url, grpc_address
        )
        cluster_address.record_local(_ray_address(), http_url, grpc_address)
        _say(f"kvrelay: serving {cluster.model.model_id}")
        _say(f"  HTTP (OpenAI)  {http_url}")
        _say(f"  gRPC           {grpc_address}")
        for line in options.describe():
            _say(line)
        _say("  `kvrelay status` / `kvrelay scale --decode N` from another shell; Ctrl-C to stop")
        await stop.wait()
        _say("kvrelay: shutting down")
    finally:
        cluster_address.forget_local()
        if servers is not None:
            await servers.stop()
        await cluster.close()
    _say("kvrelay: stopped")
    return 0


def _ray_address() -> str:
    import ray

    return ray.get_runtime_context().gcs_address


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
