"""The pool planner (deploy/planner.py) and its profiles (deploy/profile.py), on the hand-made
profile tests/unit/data/pool_profile_8b_like.json: which pool a workload needs more of, sizes
that never fall as the rate rises, the infeasible cases and what they name, the queueing and
Little's-law arithmetic, recorded serve_bench traces and the profile's validation."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import pytest

from deploy.planner import (
    Plan,
    RecordedRequest,
    Slo,
    Workload,
    plan,
    predict_decode,
    predict_prefill,
    records_from_report,
    workload_from_records,
)
from deploy.profile import interpolate, least_fixed_point, load_profile, parse_profile

PROFILE_PATH = Path(__file__).parent / "data" / "pool_profile_8b_like.json"
PROFILE = load_profile(PROFILE_PATH)
SLO = Slo(ttft_ms=500.0, tpot_ms=30.0)


def raw_profile() -> dict[str, Any]:
    return json.loads(PROFILE_PATH.read_text())


def sizes(result: Plan) -> tuple[int, int]:
    return result.prefill.num_workers, result.decode.num_workers


# ---- recommendations ---------------------------------------------------------------------
def test_a_prefill_heavy_workload_wants_more_prefill_workers() -> None:
    result = plan(PROFILE, Workload(rate=8.0, input_len=4096, output_len=16), SLO)
    assert result.feasible
    assert sizes(result) == (3, 1)
    assert result.prefill.ttft_ms <= SLO.ttft_ms and result.prefill.utilisation <= 0.8


def test_a_decode_heavy_workload_wants_more_decode_workers() -> None:
    workload = Workload(rate=8.0, input_len=256, output_len=1024, cached_fraction=0.5)
    result = plan(PROFILE, workload, SLO)
    assert result.feasible
    assert sizes(result) == (1, 3)
    assert result.decode.tpot_ms <= SLO.tpot_ms and result.decode.utilisation <= 0.8


@pytest.mark.parametrize(
    "shape",
    [(4096, 16, 0.0), (256, 1024, 0.5), (1024, 256, 0.3), (8192, 64, 0.9), (128, 128, 0.0)],
)
def test_doubling_the_rate_never_recommends_fewer_workers(shape: tuple[int, int, float]) -> None:
    input_len, output_len, cached = shape
    rate, before = 0.25, (1, 1)
    while rate < 200:
        result = plan(PROFILE, Workload(rate, input_len, output_len, cached), SLO, max_workers=64)
        now = sizes(result)
        assert now[0] >= before[0] and now[1] >= before[1], f"rate {rate}: {before} -> {now}"
        before, rate = now, rate * 2


def test_more_headroom_never_recommends_fewer_workers() -> None:
    workload = Workload(rate=20.0, input_len=1024, output_len=256, cached_fraction=0.3)
    loose, tight = plan(PROFILE, workload, SLO, 64, 1.0), plan(PROFILE, workload, SLO, 64, 0.5)
    assert tight.prefill.num_workers >= loose.prefill.num_workers
    assert tight.decode.num_workers >= loose.decode.num_workers
    assert tight.num_workers > loose.num_workers


def test_a_cached_prefix_needs_fewer_prefill_workers() -> None:
    cold = plan(PROFILE, Workload(16.0, 4096, 64), SLO)
    warm = plan(PROFILE, Workload(16.0, 4096, 64, cached_fraction=0.75), SLO)
    assert warm.prefill.num_workers < cold.prefill.num_workers


# ---- infeasible ----------------------------------------------------------------------------
def test_a_prompt_too_long_for_the_ttft_objective_alone_is_infeasible() -> None:
    result = plan(PROFILE, Workload(1.0, 8192, 16), Slo(ttft_ms=300.0, tpot_ms=30.0))
    assert not result.feasible
    assert [f.objective for f in result.failures] == ["ttft"]
    assert "512 ms alone" in result.failures[0].message


def test_a_tpot_objective_below_one_decode_step_is_infeasible() -> None:
    result = plan(PROFILE, Workload(1.0, 512, 64), Slo(ttft_ms=500.0, tpot_ms=5.0))
    assert [f.objective for f in result.failures] == ["tpot"]
    assert "even at batch 1" in result.failures[0].message


def test_a_rate_beyond_max_workers_names_each_failing_pool() -> None:
    result = plan(PROFILE, Workload(400.0, 2048, 512), SLO, max_workers=8)
    assert [f.objective for f in result.failures] == ["ttft", "tpot"]
    assert all("even 7" in f.message for f in result.failures)
    assert math.isinf(result.prefill.ttft_ms)  # saturated: the queue grows without bound
    # Each pool fits on its own, but not both within max_workers.
    both = plan(PROFILE, Workload(80.0, 1024, 256, 0.3), SLO, max_workers=10)  # 5 + 8
    assert [f.objective for f in both.failures] == ["max_workers"]
    assert "= 13 GPUs, more than max_workers 10" in both.failures[0].message


def test_a_request_larger_than_a_decode_workers_kv_is_infeasible() -> None:
    result = plan(PROFILE, Workload(0.1, 150_000, 60_000), Slo(1e6, 1e3))
    assert [f.objective for f in result.failures] == ["tpot"]
    assert "KV capacity" in result.failures[0].message


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="rate"):
        Workload(0.0, 100, 10)
    with pytest.raises(ValueError, match="cached_fraction"):
        Workload(1.0, 100, 10, cached_fraction=1.5)
    with pytest.raises(ValueError, match="max_workers"):
        plan(PROFILE, Workload(1.0, 100, 10), SLO, max_workers=1)
    with pytest.raises(ValueError, match="utilisation_target"):
        plan(PROFILE, Workload(1.0, 100, 10), SLO, utilisation_target=0.0)


# ---- the arithmetic ------------------------------------------------------------------------
def test_prefill_prediction_is_md1() -> None:
    # 1024 uncached tokens: 32 + (512 / 1536) * (113.8 - 32) ms on the profile's pieces.
    workload = Workload(rate=10.0, input_len=2048, output_len=16, cached_fraction=0.5)
    p = predict_prefill(PROFILE, workload, 2)
    service = 32.0 + (1024 - 512) / (2048 - 512) * (PROFILE.prefill_ms[2] - 32.0)
    rho = 10.0 / 2 * service / 1000
    assert p.service_ms == pytest.approx(service)
    assert p.utilisation == pytest.approx(rho)
    assert p.ttft_ms == pytest.approx(service + rho * service / (2 * (1 - rho)))


def test_decode_batch_solves_littles_law() -> None:
    workload = Workload(rate=30.0, input_len=1024, output_len=256)
    d = predict_decode(PROFILE, workload, 4)
    assert d.batch == pytest.approx(30.0 * 256 * d.tpot_ms / 1000 / 4)
    context = 1024 + 128
    assert d.tpot_ms == pytest.approx(PROFILE.decode_step_time_ms(d.batch, context))
    assert d.kv_fraction == pytest.approx(d.batch * context / 200_000)
    assert predict_decode(PROFILE, workload, 1).batch == math.inf  # one worker cannot keep up


def test_interpolation_and_fixed_point() -> None:
    xs, ys = (1, 8, 32), (8.0, 9.0, 12.0)
    assert interpolate(xs, ys, 0.5) == 8.0  # below the first point: the first point's
    assert interpolate(xs, ys, 20) == pytest.approx(10.5)
    assert interpolate(xs, ys, 64) == pytest.approx(16.0)  # the last piece's slope
    assert interpolate(xs, (8.0, 9.0, 7.0), 64) == 7.0  # never dropping past the last point
    x = least_fixed_point(xs, ys, 1.0)  # x == 9 + (x - 8) / 8 on the piece from 8 to 32
    assert x == pytest.approx(64 / 7) and x == pytest.approx(interpolate(xs, ys, x))
    assert least_fixed_point(xs, ys, 0.1) == pytest.approx(0.8)  # on the first, flat piece
    assert least_fixed_point(xs, ys, 8.0) is None  # 8 * step(x) > x for every x


# ---- recorded traces -----------------------------------------------------------------------
def serve_bench_report(num: int, gap_s: float) -> dict[str, Any]:
    rows = [
        {
            "index": i,
            "ok": i != 3,
            "send_s": i * gap_s,
            "prompt_tokens": 1000 if i != 3 else 0,
            "cached_tokens": 250,
            "output_tokens": 100 if i != 3 else 0,
        }
        for i in range(num)
    ]
    rows.append({"index": num, "ok": False, "send_s": None})  # never sent
    return {"model": "m", "summary": {}, "requests": rows}


def test_a_serve_bench_report_becomes_a_workload() -> None:
    report = serve_bench_report(11, 0.5)
    records = records_from_report(report)
    assert len(records) == 11 and records[3] == RecordedRequest(1.5, 0, 250, 0, False)
    workload = workload_from_records(records)
    assert workload == Workload(rate=2.0, input_len=1000, output_len=100, cached_fraction=0.25)
    several = {"runs": [serve_bench_report(5, 1.0), serve_bench_report(9, 0.25)]}
    assert workload_from_records(records_from_report(several)).rate == pytest.approx(4.0)
    assert workload_from_records(records_from_report(several, 0)).rate == pytest.approx(1.0)
    tuples = [RecordedRequest(*row) for row in [(0.0, 512, 0, 64), (2.0, 1536, 512, 192)]]
    assert workload_from_records(tuples) == Workload(0.5, 1024, 128, 0.25)


def test_bad_traces_are_refused() -> None:
    with pytest.raises(ValueError, match="requests"):
        records_from_report({"summary": {}})
    with pytest.raises(ValueError, match="no run 5"):
        records_from_report({"runs": [serve_bench_report(3, 1.0)]}, 5)
    with pytest.raises(ValueError, match=r"requests\[0\]"):
        records_from_report({"requests": [{"send_s": 0.0, "prompt_tokens": "many"}]})
    with pytest.raises(ValueError, match="at least 2"):
        workload_from_records([RecordedRequest(0.0, 10, 0, 10)])
    with pytest.raises(ValueError, match="all arrive at once"):
        workload_from_records([RecordedRequest(1.0, 10, 0, 10)] * 3)


# ---- profile validation --------------------------------------------------------------------
@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.update(version=2), "version"),
        (lambda d: d.pop("decode"), "decode: expected an object"),
        (lambda d: d["decode"].pop("kv_capacity_tokens"), "decode.kv_capacity_tokens"),
        (lambda d: d["decode"].update(max_batch=0), "decode.max_batch"),
        (lambda d: d["prefill"]["points"][1].update(tokens_per_s=-1), r"points\[1\].tokens_per_s"),
        (lambda d: d["prefill"].update(points=d["prefill"]["points"][:1]), "at least 2 points"),
        (lambda d: d["prefill"]["points"][1].update(prompt_len=128), "appears twice"),
        (lambda d: d["decode"]["points"].pop(3), "no point for batch 8, context 4096"),
        (lambda d: d["decode"]["points"][0].pop("step_ms"), r"decode.points\[0\].step_ms"),
    ],
)
def test_a_bad_profile_names_its_field(edit: Any, message: str) -> None:
    data = copy.deepcopy(raw_profile())
    edit(data)
    with pytest.raises(ValueError, match=message):
        parse_profile(data)


def test_load_profile_names_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "p.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match=f"profile {bad}: not JSON"):
        load_profile(bad)
    bad.write_text(json.dumps({**raw_profile(), "prefill": []}))
    with pytest.raises(ValueError, match=f"profile {bad}: prefill"):
        load_profile(bad)
    assert PROFILE.prefill_ms[0] == pytest.approx(16.0)  # 128 tokens at 8000 tokens/s
    assert PROFILE.decode_step_time_ms(8, 2304) == pytest.approx(10.0)
