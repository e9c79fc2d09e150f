"""PoolProfile: one model + GPU's per-worker capacity of each pool, as measured by
bench/pool_profile.py; owns no state beyond the frozen measured points it interpolates.

The JSON format (version 1; extra keys are ignored, "measured" is free-form provenance):

    {
      "version": 1,
      "model": "SmolLM2-135M-Instruct",       # what was measured (shown, not checked)
      "device": "cpu, 2 threads",
      "prefill": {
        "points": [                            # >= 2, distinct prompt_len
          {"prompt_len": 128, "tokens_per_s": 2100.0},
          {"prompt_len": 1024, "tokens_per_s": 1800.0}
        ]
      },
      "decode": {
        "points": [                            # a full grid: every batch x every context
          {"batch": 1, "context": 256, "step_ms": 30.0},
          {"batch": 8, "context": 256, "step_ms": 45.0}
        ],
        "max_batch": 64,                       # sequences one decode worker runs at once
        "kv_capacity_tokens": 131072           # KV cache of one decode worker, in tokens
      },
      "measured": {"date_utc": "...", "command": "..."}
    }

prefill `tokens_per_s`: prompt tokens per second of one prompt of that length prefilled alone
on one worker (conservative: the engine packs short prompts together). decode `step_ms`: one
engine step of a decode worker running `batch` sequences whose context is about `context`
tokens. Between points the time is interpolated linearly; below the first point it is the
first point's; above the last it follows the last two points' slope (never dropping).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VERSION = 1


@dataclass(frozen=True)
class PoolProfile:
    model: str
    device: str
    prefill_lens: tuple[int, ...]  # increasing
    prefill_ms: tuple[float, ...]  # time of one prompt of each length, alone
    decode_batches: tuple[int, ...]  # increasing
    decode_contexts: tuple[int, ...]  # increasing
    decode_step_ms: tuple[tuple[float, ...], ...]  # [batch index][context index]
    max_batch: int
    kv_capacity_tokens: int

    def prefill_time_ms(self, num_tokens: float) -> float:
        """Milliseconds one worker takes to compute `num_tokens` prompt tokens of one request."""
        return interpolate(self.prefill_lens, self.prefill_ms, num_tokens)

    def decode_step_time_ms(self, batch: float, context: float) -> float:
        """Milliseconds of one decode step at `batch` sequences of about `context` tokens."""
        return interpolate(self.decode_batches, self._steps_at(context), batch)

    def steady_batch(self, tokens_per_ms: float, context: float) -> float | None:
        """The least batch b with b == tokens_per_ms * decode_step_time_ms(b, context): the
        running batch of a worker asked for that many output tokens per ms (Little's law);
        None when no batch keeps up."""
        return least_fixed_point(self.decode_batches, self._steps_at(context), tokens_per_ms)

    def _steps_at(self, context: float) -> list[float]:
        return [interpolate(self.decode_contexts, row, context) for row in self.decode_step_ms]


def interpolate(xs: Sequence[int], ys: Sequence[float], x: float) -> float:
    """Piecewise linear through (xs, ys), xs increasing: ys[0] below xs[0], the last segment's
    slope past xs[-1] (never below ys[-1]); a single point is a constant."""
    if x <= xs[0] or len(xs) == 1:
        return ys[0]
    for i in range(1, len(xs)):
        if x <= xs[i]:
            frac = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
            return ys[i - 1] + frac * (ys[i] - ys[i - 1])
    slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
    return max(ys[-1], ys[-1] + slope * (x - xs[-1]))


def load_profile(path: str | Path) -> PoolProfile:
    """Read and validate a profile file (ValueError naming the file and the field)."""
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"profile {path}: not JSON ({e})") from None
    try:
        return parse_profile(data)
    except ValueError as e:
        raise ValueError(f"profile {path}: {e}") from None


def parse_profile(data: Any) -> PoolProfile:
    """Validate a profile's JSON value; a ValueError names the first bad field."""
    if not isinstance(data, dict):
        raise ValueError("the profile must be a JSON object")
    if data.get("version") != VERSION:
        raise ValueError(f"version: expected {VERSION}, got {data.get('version')!r}")
    prefill = _object(data, "prefill", "prefill")
    decode = _object(data, "decode", "decode")
    lens, rates = _prefill_points(_points(prefill, "prefill.points"))
    batches, contexts, grid = _decode_grid(_points(decode, "decode.points"))
    return PoolProfile(
        model=str(data.get("model", "")),
        device=str(data.get("device", "")),
        prefill_lens=lens,
        prefill_ms=tuple(1000.0 * n / rate for n, rate in zip(lens, rates, strict=True)),
        decode_batches=batches,
        decode_contexts=contexts,
        decode_step_ms=grid,
        max_batch=_positive_int(decode.get("max_batch"), "decode.max_batch"),
        kv_capacity_tokens=_positive_int(
            decode.get("kv_capacity_tokens"), "decode.kv_capacity_tokens"
        ),
    )


def _object(data: dict[str, Any], key: str, name: str) -> dict[str, Any]:
    value = data.get(key)
    if not isinstance(value, dict):
        raise ValueError(f"{name}: expected an object, got {type(value).__name__}")
    return value


def _points(section: dict[str, Any], name: str) -> list[dict[str, Any]]:
    points = section.get("points")
    if not isinstance(points, list) or not all(isinstance(p, dict) for p in points):
        raise ValueError(f"{name}: expected a list of objects")
    return points


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected a positive integer, got {value!r}")
    return value


def _positive_number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"{name}: expected a positive number, got {value!r}")
    if value == float("inf"):
        raise ValueError(f"{name}: expected a finite number, got {value!r}")
    return float(value)


def _prefill_points(points: list[dict[str, Any]]) -> tuple[tuple[int, ...], tuple[float, ...]]:
    if len(points) < 2:
        raise ValueError(f"prefill.points: need at least 2 points, got {len(points)}")
    measured: dict[int, float] = {}
    for i, point in enumerate(points):
        n = _positive_int(point.get("prompt_len"), f"prefill.points[{i}].prompt_len")
        if n in measured:
            raise ValueError(f"prefill.points[{i}].prompt_len: {n} appears twice")
        measured[n] = _positive_number(
            point.get("tokens_per_s"), f"prefill.points[{i}].tokens_per_s"
        )
    lens = tuple(sorted(measured))
    return lens, tuple(measured[n] for n in lens)


def _decode_grid(
    points: list[dict[str, Any]],
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[tuple[float, ...], ...]]:
    measured: dict[tuple[int, int], float] = {}
    for i, point in enumerate(points):
        key = (
            _positive_int(point.get("batch"), f"decode.points[{i}].batch"),
            _positive_int(point.get("context"), f"decode.points[{i}].context"),
        )
        if key in measured:
            raise ValueError(f"decode.points[{i}]: batch {key[0]}, context {key[1]} appears twice")
        measured[key] = _positive_number(point.get("step_ms"), f"decode.points[{i}].step_ms")
    batches = tuple(sorted({b for b, _ in measured}))
    contexts = tuple(sorted({c for _, c in measured}))
    if len(batches) < 2:
        raise ValueError(f"decode.points: need at least 2 batch sizes, got {list(batches)}")
    for b in batches:
        for c in contexts:
            if (b, c) not in measured:
                raise ValueError(f"decode.points: no point for batch {b}, context {c} (a grid)")
    return batches, contexts, tuple(tuple(measured[b, c] for c in contexts) for b in batches)


def least_fixed_point(xs: Sequence[int], ys: Sequence[float], k: float) -> float | None:
    """The least x >= 0 with x == k * interpolate(xs, ys, x), for k >= 0 and ys > 0, solved on
    each linear piece in turn; None when there is none (k * f(x) stays above x for every x)."""
    slope_last = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) if len(xs) > 1 else 0.0
    pieces = [(0.0, float(xs[0]), ys[0], 0.0)]
    for i in range(1, len(xs)):
        slope = (ys[i] - ys[i - 1]) / (xs[i] - xs[i - 1])
        pieces.append((float(xs[i - 1]), float(xs[i]), ys[i - 1], slope))
    pieces.append((float(xs[-1]), float("inf"), ys[-1], max(0.0, slope_last)))
    for low, high, y, slope in pieces:
        # On this piece f(x) = y + slope * (x - low), so x = k * f(x) is linear in x.
        denominator = 1.0 - k * slope
        if denominator == 0.0:
            continue  # parallel: no single crossing on this piece
        x = k * (y - slope * low) / denominator
        if low - 1e-9 <= x <= high + 1e-9:
            return max(x, 0.0)
    return None
