"""Every KV tier on the host-tier bench's shared-prefix workload (bench/host_tier_bench.py: K
system prompts asked in turn, R rounds, one at a time) with a working set past the device pool
and the host tier: device only, + host, + disk, then a second worker (empty device, host and
disk) over the shared store the first published. Prints prompt tokens computed, TTFT p50 and
each tier's hits. Owns no state (its disk directories, and the shared one unless
--shared-kv-path names a store, are temporary).

    python -m bench.kv_tiers_bench [--json out.json]
    python -m bench.kv_tiers_bench --rows shared --shared-kv-path s3://BUCKET/PREFIX \
        --shared-kv-endpoint http://127.0.0.1:8333    # the shared rows on an object store
    python -m bench.kv_tiers_bench --kv-tier-reads always   # every file tier hit read back
    python -m bench.kv_tiers_bench --rows disk --kv-tier-reads always --switch-interval-ms 0.5
        # does a read wait for the GIL? (the engine thread and the tier readers share it)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from bench.host_tier_bench import add_workload_flags, run
from bench.lib.run_report import report_header, write_report
from engine.config import FILE_TIER_READS


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_flags(p, rounds=2, host_kv_gib=0.03, host_help="default: ~40 SmolLM2 blocks")
    p.add_argument("--disk-kv-gib", type=float, default=1.0)
    p.add_argument("--shared-kv-gib", type=float, default=1.0)
    p.add_argument(
        "--shared-kv-path",
        default=None,
        help="the shared store: a directory or s3://BUCKET/PREFIX (default: a temporary "
        "directory); an empty one, or the second worker's row counts the first's blocks too",
    )
    p.add_argument("--shared-kv-endpoint", default=None, help="an s3:// store's endpoint URL")
    p.add_argument(
        "--rows",
        choices=("all", "shared", "disk"),
        default="all",
        help="shared: the two shared rows; disk: the + disk row alone",
    )
    p.add_argument(
        "--switch-interval-ms",
        type=float,
        default=None,
        help="sys.setswitchinterval for this process, in ms (default: Python's 5): how long a "
        "tier's reader thread may wait for the GIL while the engine thread holds it",
    )
    p.add_argument(
        "--kv-tier-reads",
        choices=FILE_TIER_READS,
        default="measured",
        help="the file tiers' hits: measured (serve's default) or always read back",
    )
    p.add_argument("--prompts-json", help="also write the prompts' token ids (for a vLLM peer)")
    args = p.parse_args()
    args.profile = None
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    host = int(args.host_kv_gib * (1 << 30))
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvrelay-tiers-") as tmp:
        root = Path(tmp)
        disk = {
            "disk_kv_cache_bytes": int(args.disk_kv_gib * (1 << 30)),
            "file_tier_reads": args.kv_tier_reads,
        }
        shared = {
            "shared_kv_cache_bytes": int(args.shared_kv_gib * (1 << 30)),
            "shared_kv_path": args.shared_kv_path or str(root / "shared"),
        }
        if args.shared_kv_endpoint:
            shared["shared_kv_endpoint"] = args.shared_kv_endpoint
        runs = [
            ("device only", 0, {}),
            ("+ host", host, {}),
            ("+ disk", host, disk | {"disk_kv_path": str(root / "disk")}),
            ("+ shared: first worker", host, disk | {"disk_kv_path": str(root / "a")} | shared),
            ("+ shared: second worker", host, disk | {"disk_kv_path": str(root / "b")} | shared),
        ]
        if args.rows == "shared":
            runs = runs[3:]
        elif args.rows == "disk":
            runs = runs[2:3]
        for name, host_bytes, tiers in runs:
            row = {"run": name, **run(args, host_bytes, copy_rates=False, **tiers)}
            rows.append(row)
            brief = {k: row[k] for k in ("run", "prompt_tokens_computed", "ttft_p50_ms")}
            hits = {t["tier"]: t["hit_blocks"] for t in row["tiers"]}
            read_ms = {  # a block's read and check, where a file tier read any
                t["tier"]: round(1e3 * t["load_s"] / t["hit_blocks"], 3)
                for t in row["tiers"]
                if t.get("load_s") and t["hit_blocks"]
            }
            print(json.dumps(brief | {"hit_blocks": hits, "ms_a_block": read_ms}), flush=True)
    report = report_header("python -m bench.kv_tiers_bench " + json.dumps(vars(args)))
    write_report(args.json, {**report, "rows": rows})


if __name__ == "__main__":
    main()
