"""bench/lib/prefill_counts: kvrelay_prefills_total by `where`, from a router's real exposition."""

from bench.lib.prefill_counts import counts_between, counts_in
from router.metrics import RouterMetrics


def test_counts_by_where_from_the_router_metrics() -> None:
    metrics = RouterMetrics()
    before = counts_in(metrics.render().decode())
    assert before == {}  # the family is there, no prefill observed yet
    for where in ("remote", "remote", "local_cached", "local_slo"):
        metrics.observe_prefill(where)
    after = counts_in(metrics.render().decode())
    assert after == {"remote": 2.0, "local_cached": 1.0, "local_slo": 1.0}
    metrics.observe_prefill("remote")
    later = counts_in(metrics.render().decode())
    assert counts_between(after, later) == {"local_cached": 0.0, "local_slo": 0.0, "remote": 1.0}
    assert counts_between(before, after) == {"local_cached": 1.0, "local_slo": 1.0, "remote": 2.0}


def test_another_server_has_no_counts() -> None:
    vllm_like = "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 3.0\n"
    assert counts_in(vllm_like) is None
    assert counts_between(None, {"remote": 1.0}) is None
