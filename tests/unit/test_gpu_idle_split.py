"""bench.lib.gpu_timing's arithmetic on made-up kernel spans: the gaps where no span runs
(overlapping and nested spans merged), their split into gaps between steps (the longest,
one per step boundary) and gaps inside steps, their sums by the spans on either side, and one
layer's kernel timeline from replays of a graph, and the kinds kernels are counted under.
Pure functions: no GPU."""

from __future__ import annotations

import pytest

from bench.lib.gpu_timing import (
    gaps_by_neighbours,
    idle_gaps,
    kernel_kind,
    layer_timeline,
    split_idle,
)


def test_gaps_skip_overlapping_and_nested_spans() -> None:
    spans = [(10.0, 20.0), (0.0, 5.0), (12.0, 15.0), (18.0, 25.0), (27.0, 30.0)]
    assert idle_gaps(spans) == [5.0, 2.0]  # 5..10 and 25..27; 10..25 is one merged busy span


def test_the_longest_gaps_are_the_step_boundaries() -> None:
    # three steps: inside each two 1-unit gaps; between them host gaps of 6 and 4 units
    spans = [(0, 10), (11, 20), (21, 30), (36, 40), (41, 50), (51, 60), (64, 70), (71, 80)]
    spans += [(81, 90)]
    gaps = idle_gaps([(float(a), float(b)) for a, b in spans])
    split = split_idle(gaps, num_steps=3)
    assert split["between_steps"] == pytest.approx((6 + 4) / 3)
    assert split["within_steps"] == pytest.approx(6 / 3)
    assert split["idle"] == pytest.approx(split["between_steps"] + split["within_steps"])


def test_one_step_has_no_boundary() -> None:
    assert split_idle([1.0, 2.0], num_steps=1) == {
        "idle": 3.0,
        "between_steps": 0.0,
        "within_steps": 3.0,
    }


def test_gaps_are_summed_by_the_kernels_on_either_side() -> None:
    spans = [
        (0.0, 10.0, "graph"),
        (2.0, 4.0, "inside"),  # ends before "graph" does: not what ran last before the gap
        (12.0, 13.0, "copy"),  # 2 us after "graph"
        (13.0, 20.0, "graph"),  # no gap after "copy"
        (22.0, 30.0, "copy"),  # 2 us after "graph" again
        (35.0, 36.0, "sample"),  # 5 us after "copy"
    ]
    pairs = gaps_by_neighbours(spans, num_steps=2)
    assert [(p["before"], p["after"], p["count"]) for p in pairs] == [
        ("copy", "sample", 1),
        ("graph", "copy", 2),
    ]
    assert pairs[1]["ms_per_step"] == 2.0 * 2 / 2 / 1e3 and pairs[1]["largest_us"] == 2.0


def made_up_replays(iters: int, layers: int) -> list[tuple[float, float, str]]:
    """iters replays of: embed, layers x (gemv 10 us, rope 2 us, attn 5 us), norm; 1 us gaps
    except attn -> next gemv, which overlap by 0.5 us."""
    spans: list[tuple[float, float, str]] = []
    clock = 0.0
    for _ in range(iters):
        order = [("embed", 3.0, 1.0)]
        order += [("gemv", 10.0, 1.0), ("rope", 2.0, 1.0), ("attn", 5.0, -0.5)] * layers
        order += [("norm", 1.0, 1.0)]
        for name, length, gap in order:
            spans.append((clock, clock + length, name))
            clock += length + gap
    return spans


def test_layer_timeline_finds_the_period_and_each_kernels_time() -> None:
    timeline = layer_timeline(made_up_replays(iters=3, layers=12), iters=3)
    by_name = {row["kernel"]: row for row in timeline}
    assert len(timeline) == 3
    assert by_name["gemv"]["us"] == pytest.approx(10.0)
    assert by_name["attn"]["gap_after_us"] == pytest.approx(-0.5)
    assert by_name["rope"]["gap_after_us"] == pytest.approx(1.0)
    assert by_name["gemv"]["share_us"] == pytest.approx(10.0 - 0.5)  # overlaps attn before it
    assert by_name["rope"]["share_us"] == pytest.approx(1.0 + 2.0)
    assert sum(row["share_us"] for row in timeline) == pytest.approx(18.5)  # a layer, gaps in


def test_layer_timeline_without_a_period_is_empty() -> None:
    spans = [(float(i), i + 0.5, f"k{i}") for i in range(40)]
    assert layer_timeline(spans, iters=1) == []


def test_layer_timeline_refuses_spans_that_are_not_whole_equal_replays() -> None:
    spans = made_up_replays(iters=3, layers=12)
    assert layer_timeline(spans, iters=0) == []
    assert layer_timeline(spans[:3], iters=1) == []  # too few to have a middle
    assert layer_timeline(spans[:-1], iters=3) == []  # a replay cut short
    odd = [(a, b, "memset" if i == 50 else name) for i, (a, b, name) in enumerate(spans)]
    assert layer_timeline(odd, iters=3) == []  # the second replay ran another kernel


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("fp8_dot_rows_kernel", "matmul"),  # the FP8 few-row products are Triton kernels
        ("fused_gemv", "matmul"),
        ("nvjet_tst_128x64_64x5_1x2_h_bz_coopA_TNN", "matmul"),
        ("BatchDecodeWithPagedKVCacheKernel", "attention"),
        ("kernel_mha", "attention"),
        ("Memcpy HtoD (Pinned -> Device)", "copy"),
        ("rope_write_kv", "elementwise/other"),
        ("silu_and_mul_rms", "elementwise/other"),
    ],
)
def test_kernels_are_counted_under_their_kind(name: str, kind: str) -> None:
    assert kernel_kind(name) == kind
