"""Where a kvrelay router's prompts were prefilled: kvrelay_prefills_total by its `where` label,
read from the router's /metrics (remote, local_short, local_cached, local_slo). Owns no state.
"""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

PREFILLS_METRIC = "kvrelay_prefills"


def prefill_counts(url: str, timeout: float = 5.0) -> dict[str, float] | None:
    """{where: prompts} from `url`/metrics (several comma-separated urls: their sums); None
    when a server exposes no kvrelay_prefills (another server, e.g. vLLM) or cannot be read (a
    benchmark's cross-check, never its error)."""
    if "," in url:
        parts = [prefill_counts(u, timeout) for u in url.split(",")]
        if any(p is None for p in parts):
            return None
        total: dict[str, float] = {}
        for part in parts:
            for where, count in (part or {}).items():
                total[where] = total.get(where, 0.0) + count
        return dict(sorted(total.items()))
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/metrics", timeout=timeout) as reply:
            text = reply.read().decode()
    except OSError:
        return None
    return counts_in(text)


def counts_in(text: str) -> dict[str, float] | None:
    """kvrelay_prefills_total by `where` in a Prometheus text exposition; None when absent."""
    for family in text_string_to_metric_families(text):
        if family.name == PREFILLS_METRIC:
            return {s.labels["where"]: s.value for s in family.samples if s.name.endswith("_total")}
    return None


def counts_between(
    before: dict[str, float] | None, after: dict[str, float] | None
) -> dict[str, float] | None:
    """Prompts prefilled between two reads, by where (None unless both reads worked)."""
    if before is None or after is None:
        return None
    return {where: after[where] - before.get(where, 0.0) for where in sorted(after)}
