"""Batch-1 decode runs side by side: reads the `b1_<row>_<setting>.json` files that
`bench/gpu_session.sh b1-variants` writes (bench.gpu_engine_bench's `decode_b1`) and prints,
for each row (bf16, fp8w), one line a setting (graph replay, its roofline, the ratio against
the issue's target, engine step, kernels a replay) and each setting's kernels of a layer, in
order, with their shares. Owns no state; needs no GPU.

    python -m bench.b1_report DIR [DIR ...] [--markdown]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

# the issue's targets for the graph replay against its roofline, by row (b1-variants' rows)
TARGETS = {"bf16": 1.2, "fp8w": 1.3}
KERNEL_CHARS = 36  # a kernel's name in the layer table, cut to this


def load_runs(folders: list[Path]) -> list[dict[str, Any]]:
    """One entry a b1_*.json with a decode_b1 result (row, setting, the result), each row's
    defaults first."""
    runs = []
    for folder in folders:
        for path in sorted(folder.glob("b1_*.json")):
            row, _, setting = path.stem.removeprefix("b1_").partition("_")
            if row not in TARGETS:  # another bench's b1_*.json (older rounds named theirs so)
                print(f"{path}: not a b1-variants run (row {row!r}), left out")
                continue
            try:
                result = json.loads(path.read_text())["decode_b1"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                print(f"{path}: no decode_b1 result ({type(exc).__name__}: {exc})")
                continue
            runs.append({"row": row, "setting": setting or "defaults", "b1": result})
    return sorted(runs, key=lambda run: (run["row"], run["setting"] != "defaults"))


def summary_line(run: dict[str, Any]) -> list[str]:
    """The cells of a setting's line: replay, roofline, ratio (and its target), step, kernels."""
    b1 = run["b1"]
    replay, roofline = b1["graph_replay_ms"], b1["graph_roofline_ms"]
    ratio = replay / roofline
    target = TARGETS[run["row"]]
    verdict = (
        " meets" if ratio <= target else f" misses {target}x by {replay - target * roofline:.3f} ms"
    )
    kernels = b1.get("profile", {}).get("kernels_per_iter")
    return [
        run["setting"],
        f"{replay:.3f}",
        f"{roofline:.3f}",
        f"{ratio:.3f}x{verdict}",
        f"{b1['engine_step_ms_median']:.3f}",
        "" if kernels is None else f"{kernels:.0f}",
    ]


def layer_kernels(runs: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """A layer's kernels in order, the settings side by side: line i holds each setting's i-th
    kernel and its share in us, from RoPE on. Settings can differ in kernels (and one kernel
    can serve several projections), so each cell names its kernel rather than lining up by
    name."""
    timelines = [
        from_rope(run["b1"].get("profile", {}).get("layer_timeline") or []) for run in runs
    ]
    depth = max((len(timeline) for timeline in timelines), default=0)
    rows = []
    for i in range(depth):
        cells = [str(i + 1)]
        for timeline in timelines:
            step = timeline[i] if i < len(timeline) else None
            cells.append(
                "" if step is None else f"{step['kernel'][:KERNEL_CHARS]} {step['share_us']:.1f}"
            )
        rows.append(cells)
    totals = [f"{sum(k['share_us'] for k in t):.1f}" if t else "" for t in timelines]
    rows.append(["layer", *totals])
    return ["#", *(run["setting"] for run in runs)], rows


def from_rope(timeline: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A layer's kernels turned to start at RoPE + KV write (a timeline starts wherever the
    replay's middle fell), so that every setting's layer lines up from the same kernel."""
    start = next((i for i, k in enumerate(timeline) if "rope" in k["kernel"].lower()), 0)
    return timeline[start:] + timeline[:start]


def table(header: list[str], rows: list[list[str]], markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
        return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])
    widths = [max(len(str(c)) for c in column) for column in zip(header, *rows, strict=True)]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        for line in [header, *rows]
    )


def report(runs: list[dict[str, Any]], markdown: bool = False) -> str:
    """Every row's settings and their layer shares, as text (or markdown) tables."""
    parts = []
    for row in dict.fromkeys(run["row"] for run in runs):
        mine = [run for run in runs if run["row"] == row]
        header = ["setting", "replay ms", "roofline ms", "replay / roofline", "step ms", "kernels"]
        parts.append(f"batch-1 decode, {row}")
        parts.append(table(header, [summary_line(run) for run in mine], markdown))
        parts.append(f"a layer's kernels in order, share in us, {row}")
        parts.append(table(*layer_kernels(mine), markdown))
    return "\n\n".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", type=Path)
    parser.add_argument("--markdown", action="store_true", help="markdown tables")
    args = parser.parse_args()
    runs = load_runs(args.folders)
    if not runs:
        folders = ", ".join(map(str, args.folders))
        raise SystemExit(f"no b1_*.json with a decode_b1 result in {folders}")
    print(report(runs, args.markdown))


if __name__ == "__main__":
    main()
