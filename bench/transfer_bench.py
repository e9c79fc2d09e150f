"""KV block transfer bandwidth: NixlTransfer READ between two processes vs a torch copy in one.

A holder process (the prefill side) registers a KV tensor of random blocks; this process (the
decode side) registers an empty one and pulls `--blocks-per-read` blocks per READ, either
adjacent (coalesced into one descriptor) or every other block (one descriptor per block).
Next to each it times a plain torch copy of the same bytes inside this process (with --device
cuda, a peer copy from the holder's GPU to the reader's). Prints GB/s
(median over --iters); owns no state beyond the two tensors. Progress goes to stderr.
`--parts N` lets the reader split each READ into up to N concurrent NIXL READs of >= 1 MiB.

    python -m bench.transfer_bench [--num-blocks 512] [--blocks-per-read 128] [--iters 20]
        [--device cpu|cuda] [--parts 1] [--progress-delay-us 100] [--reader-polls-only]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from kvtransfer.nixl_agent import DEFAULT_PROGRESS_DELAY_US
from kvtransfer.nixl_transfer import NixlTransfer

MODEL_ID = "bench-model"
SEED = 1234
MIN_PART_BYTES = 1 << 20


@dataclass(frozen=True)
class Result:
    name: str
    num_blocks: int
    num_descs: int
    bytes_per_op: int
    median_s: float
    parts: int = 0  # max_parts_per_read of the NIXL reader (0: a torch copy)
    progress_delay_us: int = 0

    @property
    def gb_per_s(self) -> float:
        return self.bytes_per_op / self.median_s / 1e9


def make_kv(args: argparse.Namespace, device: str, fill: bool) -> torch.Tensor:
    shape = (
        args.num_blocks,
        args.num_layers,
        2,
        args.num_kv_heads,
        args.block_size,
        args.head_dim,
    )
    dtype = getattr(torch, args.dtype)
    if not fill:
        return torch.zeros(shape, dtype=dtype, device=device)
    gen = torch.Generator().manual_seed(SEED)
    return torch.randn(shape, generator=gen).to(dtype=dtype, device=device)


def holder_main(conn: Connection, args: argparse.Namespace) -> None:
    """The prefill side: register random blocks, publish metadata, stay up until told."""
    torch.set_num_threads(1)
    device = f"cuda:{args.holder_gpu}" if args.device == "cuda" else "cpu"
    kv = make_kv(args, device, fill=True)
    with NixlTransfer(
        MODEL_ID, "bench-holder", progress_delay_us=args.progress_delay_us
    ) as transfer:
        transfer.register(kv)
        conn.send(transfer.metadata())
        conn.recv()  # "stop"


def median_time(op: Callable[[], None], iters: int, sync: Callable[[], None]) -> float:
    times = []
    for _ in range(iters):
        sync()
        start = time.perf_counter()
        op()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench(args: argparse.Namespace) -> list[Result]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    holder = ctx.Process(target=holder_main, args=(child, args), daemon=True)
    holder.start()
    device = f"cuda:{args.reader_gpu}" if args.device == "cuda" else "cpu"
    if args.device == "cuda":
        torch.cuda.set_device(device)

    def sync() -> None:
        if args.device == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.synchronize(f"cuda:{args.holder_gpu}")

    n = args.blocks_per_read
    if 2 * n > args.num_blocks:
        raise SystemExit("--blocks-per-read must be at most half of --num-blocks")
    patterns = {
        "adjacent": (list(range(n)), list(range(n))),
        "every-other": (list(range(0, 2 * n, 2)), list(range(n))),
    }
    results: list[Result] = []
    try:
        kv = make_kv(args, device, fill=False)
        reader = NixlTransfer(
            MODEL_ID,
            "bench-reader",
            progress_delay_us=args.progress_delay_us,
            max_parts_per_read=args.parts,
            min_part_bytes=MIN_PART_BYTES,
            progress_thread=not args.reader_polls_only,
        )
        with reader as transfer:
            transfer.register(kv)
            if not parent.poll(120):
                raise SystemExit("holder did not start")
            peer = transfer.add_peer(parent.recv())
            block_bytes = transfer.metadata().block_bytes
            for name, (remote_ids, local_ids) in patterns.items():
                descs = [0]

                def read(
                    remote_ids: list[int] = remote_ids,
                    local_ids: list[int] = local_ids,
                    descs: list[int] = descs,
                ) -> None:
                    handle = transfer.read(peer, remote_ids, local_ids)
                    transfer.wait(handle, poll_interval_s=0)
                    transfer.release(handle)
                    descs[0] = handle.num_descs

                read()  # warm up: connection, registration caches
                seconds = median_time(read, args.iters, sync)
                label = f"nixl {name} x{args.parts} d{args.progress_delay_us}"
                label += " poll" if args.reader_polls_only else ""
                results.append(
                    Result(
                        label,
                        n,
                        descs[0],
                        n * block_bytes,
                        seconds,
                        args.parts,
                        args.progress_delay_us,
                    )
                )
                print(f"{label}: {n} blocks in {seconds * 1e3:.2f} ms", file=sys.stderr)
            check_bytes(args, kv, patterns["every-other"])
        parent.send("stop")
        holder.join(30)
        results += torch_copies(args, device, patterns, block_bytes, sync)
    finally:
        if holder.is_alive():
            holder.kill()
            holder.join(10)
    return results


def check_bytes(args: argparse.Namespace, kv: torch.Tensor, ids: tuple[list, list]) -> None:
    """The last READ must have landed the holder's bytes (regenerated from the same seed)."""
    expected = make_kv(args, "cpu", fill=True)[ids[0]]
    if not torch.equal(kv[ids[1]].cpu(), expected):
        raise SystemExit("transferred blocks differ from the holder's")


def torch_copies(
    args: argparse.Namespace,
    device: str,
    patterns: dict[str, tuple[list, list]],
    block_bytes: int,
    sync: Callable[[], None],
) -> list[Result]:
    """The same bytes copied by torch inside one process, as the ceiling to compare with: from
    the holder's GPU to the reader's (a peer copy) with --device cuda."""
    src = make_kv(args, f"cuda:{args.holder_gpu}" if args.device == "cuda" else device, fill=True)
    dst = make_kv(args, device, fill=False)
    n = args.blocks_per_read
    results = []
    for name, (remote_ids, local_ids) in patterns.items():
        remote = torch.tensor(remote_ids, device=device)
        local = torch.tensor(local_ids, device=device)
        if name == "adjacent":

            def op() -> None:
                dst[:n].copy_(src[:n])
        else:

            def op(remote: torch.Tensor = remote, local: torch.Tensor = local) -> None:
                dst.index_copy_(0, local, src.index_select(0, remote.to(src.device)).to(device))

        op()
        seconds = median_time(op, args.iters, sync)
        results.append(Result(f"torch {name}", n, 0, n * block_bytes, seconds))
    return results


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--num-blocks", type=int, default=512, help="blocks in each KV tensor")
    p.add_argument("--blocks-per-read", type=int, default=128)
    p.add_argument("--iters", type=int, default=20)
    # Default block geometry: SmolLM2-135M (30 layers, 3 KV heads, head_dim 64), bf16.
    p.add_argument("--num-layers", type=int, default=30)
    p.add_argument("--num-kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--holder-gpu", type=int, default=0)
    p.add_argument("--reader-gpu", type=int, default=0)
    p.add_argument("--progress-delay-us", type=int, default=DEFAULT_PROGRESS_DELAY_US)
    p.add_argument(
        "--parts", type=int, default=1, help="max concurrent NIXL READs per read (>= 1 MiB each)"
    )
    p.add_argument(
        "--reader-polls-only",
        action="store_true",
        help="no NIXL progress thread on the reading side: its polling progresses UCX",
    )
    p.add_argument("--json", type=Path, help="also write the results here")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    results = bench(args)
    block_bytes = results[0].bytes_per_op // results[0].num_blocks
    print(
        f"# {platform.node()} {platform.processor() or platform.machine()}, torch "
        f"{torch.__version__}, device {args.device}; block {block_bytes / 1024:.0f} KiB, "
        f"{args.blocks_per_read} blocks ({results[0].bytes_per_op / 2**20:.1f} MiB) per op"
    )
    print(f"{'op':<28}{'descs':>6}{'ms':>10}{'GB/s':>10}")
    for r in results:
        descs = str(r.num_descs) if r.num_descs else "-"
        print(f"{r.name:<28}{descs:>6}{r.median_s * 1e3:>10.2f}{r.gb_per_s:>10.2f}")
    if args.json:
        rows = [asdict(r) | {"gb_per_s": r.gb_per_s} for r in results]
        report = {"args": vars(args) | {"json": str(args.json)}, "results": rows}
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
