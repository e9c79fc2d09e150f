"""Does a per-step host -> GPU copy wait for the GPU? Host time of one non-blocking copy queued
behind a ~50 ms kernel, from pageable memory against engine.host_tensors.copy_from_host (which
page-locks copies from PAGE_LOCK_FROM_BYTES up), at the sizes of a step's tables (a batch-768
XQA page table is ~300 KB, a 16,384-token step's input rows 512 KiB).

Run on a GPU: python -m bench.host_copy_bench [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from engine.host_tensors import copy_from_host

SIZES_KIB = (16, 64, 256, 1024, 4096)
SLEEP_CYCLES = 100_000_000  # ~50 ms on an H200's 1.98 GHz clock


def one_copy(num_bytes: int, engine_path: bool) -> dict[str, float | bool]:
    host = torch.arange(num_bytes // 4, dtype=torch.int32)
    dst = torch.empty_like(host, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    slept = torch.cuda.Event()
    slept.record()
    start = time.perf_counter()
    if engine_path:
        copy_from_host(dst, host)
    else:
        dst.copy_(host, non_blocking=True)
    seconds = time.perf_counter() - start
    waited = slept.query()
    torch.cuda.synchronize()
    assert torch.equal(dst.cpu(), host)
    return {"host_ms": seconds * 1e3, "waited_for_gpu": waited}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    one_copy(1 << 20, True)  # warm: CUDA context, the caching host allocator
    one_copy(1 << 20, False)
    rows = []
    for kib in SIZES_KIB:
        for engine_path in (False, True):
            trials = [one_copy(kib << 10, engine_path) for _ in range(5)]
            row = {
                "kib": kib,
                "source": "engine path" if engine_path else "pageable",
                "host_ms_median": sorted(t["host_ms"] for t in trials)[2],
                "waited_for_gpu": sum(bool(t["waited_for_gpu"]) for t in trials),
            }
            rows.append(row)
            print(
                f"{kib:>5} KiB {row['source']:>11}: host {row['host_ms_median']:7.3f} ms, "
                f"waited for the queued kernel in {row['waited_for_gpu']}/5",
                flush=True,
            )
    if args.json:
        env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
        with open(args.json, "w") as f:
            json.dump({"env": env, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
