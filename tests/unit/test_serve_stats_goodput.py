"""serve_bench's goodput: a request is good when it completed within the TTFT and TPOT SLO."""

from __future__ import annotations

import pytest

from bench.lib.serve_client import RequestResult
from bench.lib.serve_stats import Slo, format_table, goodput, meets_slo, per_turn, summarize

SLO = Slo(ttft_ms=100.0, tpot_ms=10.0)


def make_result(
    ttft_s: float = 0.05,
    tpot_s: float = 0.005,
    output_tokens: int = 5,
    ok: bool = True,
    turn: int = 0,
    prompt_tokens: int = 10,
    cached_tokens: int = 0,
) -> RequestResult:
    """A finished request: first token at ttft_s, then one token every tpot_s."""
    times = [ttft_s + i * tpot_s for i in range(output_tokens)] if ok else []
    return RequestResult(
        index=0,
        group=-1,
        ok=ok,
        error="" if ok else "boom",
        token_times=times,
        chunk_tokens=[1] * len(times),
        e2e_s=times[-1] if times else 0.0,
        prompt_tokens=prompt_tokens,
        cached_tokens=cached_tokens,
        output_tokens=output_tokens if ok else 0,
        expected_output_tokens=output_tokens,
        turn=turn,
    )


def test_a_request_within_both_objectives_is_good() -> None:
    assert meets_slo(make_result(ttft_s=0.05, tpot_s=0.005), SLO)
    exact = Slo(ttft_ms=125.0, tpot_ms=15.625)  # binary fractions: no rounding at the bounds
    assert meets_slo(make_result(ttft_s=0.125, tpot_s=0.015625), exact)  # the bounds pass


def test_slow_first_token_or_slow_decode_or_failure_is_not_good() -> None:
    assert not meets_slo(make_result(ttft_s=0.101), SLO)
    assert not meets_slo(make_result(tpot_s=0.0101), SLO)
    assert not meets_slo(make_result(ok=False), SLO)


def test_a_one_token_output_is_judged_on_ttft_alone() -> None:
    one = make_result(ttft_s=0.09, output_tokens=1)
    assert one.tpot_s is None
    assert meets_slo(one, SLO)
    assert not meets_slo(make_result(ttft_s=0.2, output_tokens=1), SLO)


def test_goodput_counts_good_requests_over_the_duration_and_all_requests() -> None:
    results = [make_result(), make_result(), make_result(ttft_s=1.0), make_result(ok=False)]
    good = goodput(results, duration_s=4.0, slo=SLO)
    assert good.num_good == 2
    assert good.goodput_req_s == pytest.approx(0.5)
    assert good.slo_attainment == pytest.approx(0.5)  # the failed request counts against it


def test_goodput_of_nothing_is_zero() -> None:
    assert goodput([], 0.0, SLO) == (0, 0.0, 0.0)
    assert goodput([make_result()], 0.0, SLO).goodput_req_s == 0.0


def test_the_summary_carries_goodput_and_the_slo_and_the_table_leads_with_it() -> None:
    summary = summarize([make_result(), make_result(tpot_s=0.05)], 2.0, SLO)
    assert summary["slo"] == {"ttft_ms": 100.0, "tpot_ms": 10.0}
    assert (summary["num_good"], summary["goodput_req_s"]) == (1, pytest.approx(0.5))
    assert summary["slo_attainment"] == pytest.approx(0.5)
    assert summary["completed"] == 2
    assert "per_turn" not in summary  # single-turn runs
    lines = format_table(summary, "title").splitlines()
    assert lines[1].startswith("goodput 0.50 req/s: 1/2 requests (50.0%)")
    assert "TTFT <= 100 ms, TPOT <= 10 ms" in lines[1]


def test_the_default_slo_is_stated() -> None:
    assert summarize([make_result()], 1.0)["slo"] == {"ttft_ms": 2000.0, "tpot_ms": 100.0}


def test_multi_turn_summaries_add_per_turn_figures() -> None:
    results = [
        make_result(ttft_s=0.2, turn=0, prompt_tokens=100),
        make_result(ttft_s=0.4, turn=0, prompt_tokens=100),
        make_result(ttft_s=0.1, turn=1, prompt_tokens=200, cached_tokens=150),
        make_result(ok=False, turn=1),
    ]
    rows = summarize(results, 1.0, SLO)["per_turn"]
    assert rows == per_turn(results)
    assert [row["turn"] for row in rows] == [0, 1]
    assert [row["completed"] for row in rows] == [2, 1]
    assert rows[0]["ttft_p50_ms"] == pytest.approx(300.0)
    assert rows[1]["ttft_p50_ms"] == pytest.approx(100.0)
    assert rows[1]["prefix_hit_rate"] == pytest.approx(0.75)
    assert rows[1]["mean_prompt_tokens"] == pytest.approx(200.0)


def test_plots_add_goodput_against_rate_and_the_pool_sizes(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    from bench.lib.pool_watch import PoolSample, parse_line
    from bench.lib.serve_plots import PlotRun, RunWindow, write_plots

    runs = []
    for rate, ttft_s in ((1.0, 0.05), (4.0, 0.5)):
        results = [make_result(ttft_s=ttft_s), make_result(ttft_s=ttft_s, output_tokens=1)]
        runs.append(PlotRun(rate, results, summarize(results, 2 / rate, SLO)))
    line = (
        '{"pools": {"prefill": {"ready": 1, "desired": 1}, "decode": {"ready": 1, "desired": 2}}}'
    )
    samples = [parse_line(line, 0.0), PoolSample(1.0, 1, 2, 1, 2)]
    assert samples[0] == PoolSample(0.0, 1, 1, 1, 2)
    assert parse_line('{"error": "no cluster found"}', 0.0) == "no cluster found"
    windows = [RunWindow("1 req/s", 0.0, 0.5), RunWindow("4 req/s", 0.6, 1.0)]
    paths = write_plots(tmp_path / "run.json", runs, "t", SLO, samples, windows)
    names = sorted(path.name for path in paths)
    assert "run.goodput_vs_rate.png" in names and "run.pool_sizes.png" in names
    assert "run.tpot_cdf.png" in names and "run.ttft_cdf.png" in names
    assert all(path.stat().st_size > 0 for path in paths)
