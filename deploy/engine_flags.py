"""The engine flags of `kvrelay serve` (model, KV cache, scheduler, device, kernels) and the
EngineConfig every worker's engine gets from them. Holds no state."""

from __future__ import annotations

import argparse
import re

from common.kv_index_schema import ID_RULE, check_model_id
from deploy.flag_types import finite_float, non_negative_float, non_negative_int, positive_int
from deploy.speculative_flags import add_speculative_flags, speculative_from_args
from deploy.worker_launch import check_gpus_per_worker
from engine.config import (
    DEFAULT_MODEL,
    FILE_TIER_READS,
    KV_CACHE_DTYPES,
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
)
from engine.quant.config import QUANTIZATION_FLAGS, QUANTIZATION_HELP, quantization_from_flag

MAX_SERVED_NAME = 255  # characters, as a folder's name (the id goes into block file headers)


def add_model_args(p: argparse.ArgumentParser, several: bool = False) -> None:
    """The model, as a positional argument (as `vllm serve MODEL`) or --model; several: --model
    may be repeated, one model each (`kvrelay serve`: each gets pools of its own)."""
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        metavar="MODEL",
        help=f"model name, .gguf file or HF folder (default: {DEFAULT_MODEL})",
    )
    text = "MODEL as a flag (default: the positional MODEL's; given both, they must agree)"
    if several:
        text += (
            "; repeated, several models side by side, each with its own --prefill / --decode "
            "pools, index namespace and metrics label, sharing the engine flags (a request's "
            "`model` picks its pools; the first is the default)"
        )
    p.add_argument(
        "--model",
        dest="model_flag",
        default=None,
        action="append" if several else "store",
        metavar="MODEL",
        help=text,
    )


def models_from_args(args: argparse.Namespace) -> list[str]:
    """The models of MODEL and --model (repeated: several); ValueError when MODEL is given
    beside a first --model that differs."""
    flags = args.model_flag
    flags = [] if flags is None else [flags] if isinstance(flags, str) else list(flags)
    if args.model and flags and args.model != flags[0]:
        raise ValueError(f"the model is given twice, as {args.model!r} and --model {flags[0]!r}")
    models = flags or [args.model or DEFAULT_MODEL]
    repeated = next((m for i, m in enumerate(models) if m in models[:i]), None)
    if repeated is not None:
        raise ValueError(f"--model {repeated!r} is given more than once")
    return models


def model_from_args(args: argparse.Namespace) -> str:
    """The (first) model of MODEL or --model; ValueError when both are given and differ."""
    return models_from_args(args)[0]


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--served-model-name",
        default=None,
        metavar="NAME",
        help="the id clients name the model by: a request's `model`, /v1/models, the metrics' "
        "`model` label and the index namespace (default: the folder's name or the .gguf "
        "file's stem; one model only: with several, each gets its own in --models-file flags)",
    )
    p.add_argument(
        "--block-size",
        type=positive_int,
        default=16,
        help="tokens a KV block holds (a power of two)",
    )
    p.add_argument(
        "--kv-cache-gib",
        type=finite_float,
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
        type=non_negative_float,
        default=0.0,
        help="a host-memory tier of each worker's prefix cache (pinned on CUDA): blocks evicted "
        "from the device pool are kept there and copied back on a prefix hit (default 0: none)",
    )
    p.add_argument(
        "--disk-kv-gib",
        type=non_negative_float,
        default=0.0,
        help="a disk tier of each worker's prefix cache, files under --disk-kv-path: blocks "
        "evicted from the host tier (or the device pool) are written there, loaded back on a "
        "prefix hit and found again after a restart (default 0: none)",
    )
    p.add_argument(
        "--disk-kv-path",
        default=None,
        metavar="DIR",
        help="the disk tier's directory (local NVMe): each worker keeps its files in a folder "
        "of its own there (the first no live worker holds: DIR, then DIR/worker1, ...), so a "
        "restarted worker takes over the files a stopped one left; needs --disk-kv-gib",
    )
    p.add_argument(
        "--kv-tier-reads",
        choices=FILE_TIER_READS,
        default=None,
        help="a disk tier's or the shared store's prefix hits (needs --disk-kv-gib): "
        "measured (default) reads them back while reading a block is no slower than computing "
        "its tokens (the engine's recent prefill rate), else computes them, says so in the log "
        "and counts them in status; always reads every hit back (less compute, a longer TTFT "
        "where reads are the slower)",
    )
    p.add_argument(
        "--shared-kv-gib",
        type=non_negative_float,
        default=0.0,
        help="a cluster-shared KV store under --shared-kv-path, bounded to this size for all "
        "workers together: each block reaching a disk tier is published there once, and any "
        "worker loads a published prefix instead of computing it (default 0: none; needs "
        "--disk-kv-gib)",
    )
    p.add_argument(
        "--shared-kv-path",
        default=None,
        metavar="DIR|s3://BUCKET/PREFIX",
        help="the shared store, the same for every worker: a directory (a shared filesystem) "
        "or an S3-compatible object store (NIXL's object backend; credentials from "
        "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, region from AWS_REGION); needs "
        "--shared-kv-gib",
    )
    p.add_argument(
        "--shared-kv-endpoint",
        default=None,
        metavar="URL",
        help="the object store's endpoint for an s3:// --shared-kv-path, e.g. "
        "http://minio:9000 (default: AWS_ENDPOINT_URL, else AWS S3 itself)",
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
        type=non_negative_int,
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
        type=positive_int,
        default=None,
        help="sequences a worker runs at once (default: 64 for a fixed-size pool, as on CPU; for a "
        "pool sized by GPU memory one per 1024 tokens it holds, at most 1024)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=positive_int,
        default=2048,
        help="tokens a worker computes in one step (prompt chunks and decodes together)",
    )
    p.add_argument(
        "--max-model-len",
        type=positive_int,
        default=None,
        help="the longest prompt + output a request may have (default: the model's context)",
    )
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
        "--no-warm-up",
        action="store_true",
        help="serve at once: skip the start-up warm-up that runs prompts of every step size "
        "through a CUDA engine so that its kernels load before the first request",
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


# The engine's fields a refusal (a config's, a worker's start) may name, as the flags that set them
FLAG_OF_FIELD = {
    "host_kv_cache_bytes": "--host-kv-gib",
    "keep_on_host": "--host-leases",
    "disk_kv_cache_bytes": "--disk-kv-gib",
    "disk_kv_path": "--disk-kv-path",
    "shared_kv_cache_bytes": "--shared-kv-gib",
    "shared_kv_path": "--shared-kv-path",
    "shared_kv_endpoint": "--shared-kv-endpoint",
    "file_tier_reads": "--kv-tier-reads",
    "kv_cache_dtype": "--kv-cache-dtype",
    "block_size": "--block-size",
    "partial_reuse_min_tokens": "--partial-reuse-min-tokens",
    "max_num_batched_tokens": "--max-num-batched-tokens",
    "max_num_seqs": "--max-num-seqs",
    "max_model_len": "--max-model-len",
}
_FIELD = re.compile(r"\b(?:cache\.|scheduler\.)?(" + "|".join(FLAG_OF_FIELD) + r")\b")


def as_flags(message: str) -> str:
    """message with the engine's field names it holds written as serve's flags."""
    return _FIELD.sub(lambda m: FLAG_OF_FIELD[m.group(1)], message)


def engine_from_args(args: argparse.Namespace) -> EngineConfig:
    """Every worker's engine; a bad size or fraction is refused naming its flag."""
    name = args.served_model_name
    if name is not None:
        try:
            check_model_id(name)
            if len(name) > MAX_SERVED_NAME:  # a folder's name is bounded so (block file headers)
                raise ValueError(name)
        except ValueError:
            raise ValueError(
                f"--served-model-name {name[:40]!r}{'...' if len(name) > 40 else ''}: wants "
                f"{ID_RULE}, at most {MAX_SERVED_NAME} characters"
            ) from None
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
    if args.kv_tier_reads is not None and not args.disk_kv_gib:
        raise ValueError(
            f"--kv-tier-reads {args.kv_tier_reads} needs --disk-kv-gib: it says how a disk "
            "tier's and the shared store's prefix hits are read back"
        )
    kv_bytes = None if args.kv_cache_gib is None else int(args.kv_cache_gib * (1 << 30))
    try:
        return _engine(args, kv_bytes)
    except ValueError as e:  # the config's refusal names its fields: here, the flags
        raise ValueError(as_flags(str(e))) from None


def _engine(args: argparse.Namespace, kv_bytes: int | None) -> EngineConfig:
    return EngineConfig(
        model=model_from_args(args),
        served_model_name=args.served_model_name,
        cache=CacheConfig(
            block_size=args.block_size,
            kv_cache_memory_bytes=kv_bytes,
            kv_cache_dtype=args.kv_cache_dtype,
            partial_reuse_min_tokens=args.partial_reuse_min_tokens,
            host_kv_cache_bytes=int(args.host_kv_gib * (1 << 30)),
            keep_on_host=args.host_leases,
            disk_kv_cache_bytes=int(args.disk_kv_gib * (1 << 30)),
            disk_kv_path=args.disk_kv_path,
            shared_kv_cache_bytes=int(args.shared_kv_gib * (1 << 30)),
            shared_kv_path=args.shared_kv_path,
            shared_kv_endpoint=args.shared_kv_endpoint,
            file_tier_reads=args.kv_tier_reads or "measured",
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
        warm_up=False if args.no_warm_up else None,
        load_format=args.load_format,
        quantization=quantization_from_flag(args.quantization),
        gpu_memory_utilization=args.gpu_memory_utilization,
        speculative=speculative_from_args(args),
    )
