"""The autoscaler's decisions on load traces (deploy/autoscale.py; pure, no clock): a small
simulated pool follows each decision (a new worker is ready some seconds later, a drained one
leaves at once) and the tests check the sizes it goes through: it grows under a queue, shrinks
after, never flips 2 <-> 1, waits out cooldowns, warm-ups and partial windows, and stays within
min..max; an SLO-attainment signal grows a busy pool that misses its objective and holds a
shrink while it does."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from deploy.autoscale import AutoscaleConfig, Autoscaler, Decision, PoolSample, slo_attainment

CONFIG = AutoscaleConfig(
    min_size={"prefill": 1, "decode": 1},
    max_size={"prefill": 3, "decode": 3},
    window_s=10.0,
    cooldown_s=20.0,
    warmup_s=5.0,
    target_queued_tokens=1000,
    target_batch=8,
)
STARTUP_S = 8.0  # a new worker turns ready this long after the decision


def sample(
    role: str, at: float, n: int, load: int, ready_at: float | None, attained: float | None = None
) -> PoolSample:
    if role == "prefill":
        return PoolSample(
            at, role, n, queued_tokens=load, newest_ready_at=ready_at, slo_attainment=attained
        )
    return PoolSample(
        at,
        role,
        n,
        running=load,
        total_blocks=100 * n,
        newest_ready_at=ready_at,
        slo_attainment=attained,
    )


Attainment = Callable[[float, int], float | None]  # (time, ready workers) -> SLO attainment


def simulate(
    role: str,
    load: Callable[[float], int],
    seconds: int,
    start: int,
    config: AutoscaleConfig = CONFIG,
    attainment: Attainment | None = None,
    ready_at: float | None = None,
) -> list[tuple[float, int]]:
    """One sample a second of a pool that starts with `start` ready workers (the newest turned
    ready at `ready_at`) under `load(t)`; returns each decision as (time, new size)."""
    scaler = Autoscaler(config)
    n, joining = start, []
    decisions = []
    for t in range(seconds):
        now = float(t)
        for when in [w for w in joining if w <= now]:
            joining.remove(when)
            n, ready_at = n + 1, when
        attained = attainment(now, n) if attainment else None
        scaler.observe(sample(role, now, n, load(now), ready_at, attained))
        decision = scaler.decide(role, now)
        if decision is None:
            continue
        scaler.changed(role, now)
        decisions.append((now, decision.size))
        if decision.size > n + len(joining):
            joining.append(now + STARTUP_S)
        else:
            n = decision.size  # drained and gone
    return decisions


def test_a_queue_grows_the_prefill_pool_up_to_max() -> None:
    # 5000 queued tokens: 5x the target on one worker, 2.5x on two, 1.7x on three (the max).
    # The second worker is ready at 18 and warm at 23: the next full window ends at 33.
    assert simulate("prefill", lambda t: 5000, 120, 1) == [(10.0, 2), (33.0, 3)]


def test_load_that_ends_shrinks_the_pool_step_by_step() -> None:
    def load(t: float) -> int:
        return 5000 if t < 60 else 0

    assert simulate("prefill", load, 150, 1) == [(10.0, 2), (33.0, 3), (70.0, 2), (90.0, 1)]


def test_no_flip_between_two_and_one() -> None:
    # 9 requests: 0.56 of the target on two decode workers, 1.12 on one. A rule that shrank on
    # the present pressure alone would drop to one, then grow back, again and again.
    assert simulate("decode", lambda t: 9, 300, 2) == []
    assert simulate("decode", lambda t: 9, 300, 1) == [(10.0, 2)]
    # 3 requests: 0.38 even on one worker: it shrinks, once.
    assert simulate("decode", lambda t: 3, 300, 2) == [(10.0, 1)]


def test_a_burst_shorter_than_the_window_changes_nothing() -> None:
    def load(t: float) -> int:
        return 5000 if 20 <= t < 28 else 0

    assert simulate("prefill", load, 100, 1) == []


def test_warm_up_cooldown_and_a_partial_window_hold_decisions() -> None:
    scaler = Autoscaler(CONFIG)
    for t in range(30):  # a worker turned ready 2 s before each sample: still warming up
        scaler.observe(sample("decode", float(t), 1, 40, ready_at=t - 2.0))
        assert scaler.decide("decode", float(t)) is None
    scaler = Autoscaler(CONFIG)
    for t in range(9):
        scaler.observe(sample("decode", float(t), 1, 40, None))
        assert scaler.decide("decode", float(t)) is None, "not a full window yet"
    scaler.observe(sample("decode", 10.0, 1, 40, None))
    assert scaler.decide("decode", 10.0) is not None
    scaler.changed("decode", 10.0)  # an operator's `kvrelay scale` counts as a change too
    for t in range(11, 30):
        scaler.observe(sample("decode", float(t), 1, 40, None))
        assert scaler.decide("decode", float(t)) is None, "within the cooldown"


def test_kv_use_and_handoff_backlog_count_as_decode_pressure() -> None:
    scaler = Autoscaler(CONFIG)
    full = PoolSample(0.0, "decode", 2, used_blocks=180, total_blocks=200)
    assert scaler.pressure(full) == pytest.approx(0.9 / 0.8)
    assert scaler.pressure(full, num_workers=1) == pytest.approx(1.8 / 0.8)
    backlog = PoolSample(0.0, "decode", 2, total_blocks=200, backlog_blocks=1024)
    assert scaler.pressure(backlog) == pytest.approx(1024 / (2 * 256))
    assert scaler.pressure(PoolSample(0.0, "prefill", 0, queued_tokens=1)) == float("inf")


def test_a_decision_names_its_reason_and_bad_configs_are_refused() -> None:
    scaler = Autoscaler(CONFIG)
    for t in range(11):
        scaler.observe(PoolSample(float(t), "prefill", 1, queued_tokens=3000))
    decision = scaler.decide("prefill", 10.0)
    assert isinstance(decision, Decision) and decision.size == 2
    assert "pressure 3.00 > 1" in decision.reason
    with pytest.raises(ValueError, match="min <= max"):
        AutoscaleConfig(min_size={"prefill": 2, "decode": 1}, max_size={"prefill": 1, "decode": 1})
    with pytest.raises(ValueError, match="shrink_below < grow_above"):
        AutoscaleConfig(shrink_below=1.5)


def test_samples_at_uneven_times_still_make_full_windows() -> None:
    # A real controller samples about once a second, never on exact boundaries.
    scaler = Autoscaler(CONFIG)
    times = [t + 0.37 * (t % 3) for t in range(15)]
    decisions = []
    for at in times:
        scaler.observe(PoolSample(at, "prefill", 1, queued_tokens=5000))
        if scaler.decide("prefill", at) is not None:
            decisions.append(at)
    assert decisions and decisions[0] >= 10.0


# ---- SLO attainment --------------------------------------------------------------------------
def misses_with_one_worker(now: float, n: int) -> float:
    """5 running requests: TPOT misses for 40% of them on one worker, 3% on two."""
    return 0.6 if n == 1 else 0.97


def test_missed_slo_grows_a_busy_pool_once() -> None:
    # 5 requests: pressure 0.62 on one worker, under the grow line; the SLO misses say grow.
    assert simulate("decode", lambda t: 5, 600, 1, attainment=misses_with_one_worker) == [(10.0, 2)]
    assert simulate("decode", lambda t: 5, 600, 1) == [], "no attainment: as before"


def test_missed_slo_on_an_idle_pool_grows_nothing() -> None:
    # 2 requests: pressure 0.25, below shrink_below: more workers would not help, and would go.
    assert simulate("decode", lambda t: 2, 600, 1, attainment=lambda now, n: 0.5) == []


def test_no_shrink_while_the_slo_is_missed() -> None:
    # 3 requests on two workers: one would do (pressure 0.38), unless the SLO is being missed.
    assert simulate("decode", lambda t: 3, 600, 2, attainment=lambda now, n: 0.8) == []
    assert simulate("decode", lambda t: 3, 600, 2, attainment=lambda now, n: 0.95) == [(10.0, 1)]


def test_attainment_must_be_low_for_the_whole_window() -> None:
    def gaps(now: float, n: int) -> float | None:
        return None if int(now) % 4 == 0 else 0.6  # nothing finished in some seconds

    assert simulate("decode", lambda t: 5, 600, 1, attainment=gaps) == []
    scaler = Autoscaler(CONFIG)
    for t in range(11):
        scaler.observe(sample("decode", float(t), 1, 5, None, attained=0.7 if t else 0.95))
    assert scaler.decide("decode", 10.0) is None, "one sample met the target"
    scaler.observe(sample("decode", 11.0, 1, 5, None, attained=0.7))
    decision = scaler.decide("decode", 11.0)
    assert decision is not None and decision.size == 2
    assert decision.reason == "SLO attainment 70% < 90%"


def test_slo_attainment_helper_and_config() -> None:
    assert slo_attainment([], 100.0) is None
    assert slo_attainment([50.0, 100.0, 150.0, 400.0], 100.0) == 0.5
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="target_attainment"):
            AutoscaleConfig(target_attainment=bad)


def test_a_prefill_pool_of_none_stays_none_and_divides_nothing() -> None:
    """--prefill 0 (aggregated decode workers) with --autoscale-decode: prefill 0..0."""
    config = AutoscaleConfig(
        min_size={"prefill": 0, "decode": 1},
        max_size={"prefill": 0, "decode": 3},
        window_s=2.0,
        cooldown_s=0.0,
        warmup_s=0.0,
    )
    with pytest.raises(ValueError, match="need 1 <= min <= max for prefill"):
        AutoscaleConfig(min_size={"prefill": 0, "decode": 1}, max_size={"prefill": 2, "decode": 3})
    with pytest.raises(ValueError, match="need 1 <= min <= max for decode"):
        AutoscaleConfig(min_size={"prefill": 0, "decode": 0}, max_size={"prefill": 0, "decode": 3})
    scaler = Autoscaler(config)
    assert scaler.pressure(PoolSample(0.0, "prefill", 0, queued_tokens=5000)) == float("inf")
    # An operator's `kvrelay scale --prefill 1`: neither grown past 0..0 nor shrunk to 0.
    for at in range(4):
        scaler.observe(PoolSample(float(at), "prefill", 1, queued_tokens=10**6 * (at % 2)))
    assert scaler.decide("prefill", 3.0) is None
    for at in range(4, 8):
        scaler.observe(PoolSample(float(at), "prefill", 1))
    assert scaler.decide("prefill", 7.0) is None


def test_a_pool_not_autoscaled_keeps_the_size_it_is_given() -> None:
    """serve --autoscale-decode alone: an operator's `kvrelay scale --prefill 2` is not undone
    (the prefill pool's bounds are only its starting size's)."""
    decode_only = AutoscaleConfig(
        min_size={"prefill": 1, "decode": 1},
        max_size={"prefill": 1, "decode": 3},
        window_s=10.0,
        cooldown_s=20.0,
        autoscaled=("decode",),
    )
    assert simulate("prefill", lambda t: 0, 120, 2, decode_only) == []  # idle, 2 > max: kept
    assert simulate("prefill", lambda t: 5000, 120, 1, decode_only) == []
    assert simulate("decode", lambda t: 0, 120, 3, decode_only) == [(10.0, 2), (30.0, 1)]
    with pytest.raises(ValueError, match="pools are"):
        AutoscaleConfig(autoscaled=("router",))
