"""RecentLatencies (router/recent_latency.py) and combined_attainment: what a router reports of
its recent requests against the objectives, and one fraction over several routers."""

from __future__ import annotations

import pytest

from common.cluster_state import SloAttainment, combined_attainment
from common.placement_rules import SloTargets
from router.recent_latency import RecentLatencies

SLO = SloTargets(ttft_ms=500, tpot_ms=50)


def test_fractions_of_recent_requests_meeting_each_objective() -> None:
    recent = RecentLatencies(window_s=10)
    recent.record(0.0, 0.2, 0.04)  # meets both
    recent.record(1.0, 0.9, 0.03)  # late first token
    recent.record(2.0, 0.1, 0.08)  # slow tokens
    recent.record(3.0, 0.3, None)  # one token: judged on TTFT only
    got = recent.attainment(3.0, SLO)
    assert got == SloAttainment(4, pytest.approx(3 / 4), 3, pytest.approx(2 / 3))
    assert recent.attainment(3.0, SloTargets()) is None  # no objectives: nothing to report


def test_requests_older_than_the_window_leave_it() -> None:
    recent = RecentLatencies(window_s=5)
    recent.record(0.0, 0.9, 0.09)
    recent.record(4.0, 0.1, 0.01)
    assert recent.attainment(4.0, SLO).ttft == pytest.approx(0.5)
    assert recent.attainment(6.0, SLO) == SloAttainment(1, 1.0, 1, 1.0)
    assert recent.attainment(20.0, SLO) == SloAttainment(0, None, 0, None)


def test_routers_reports_combine_weighted_by_their_counts() -> None:
    reports = [SloAttainment(30, 1.0, 30, 0.5), SloAttainment(10, 0.0, 0, None)]
    assert combined_attainment(reports, "ttft") == pytest.approx(0.75)
    assert combined_attainment(reports, "tpot") == pytest.approx(0.5)
    assert combined_attainment([SloAttainment()], "ttft") is None
    assert combined_attainment([], "tpot") is None
