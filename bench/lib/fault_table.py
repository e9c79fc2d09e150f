"""The fault bench's markdown: one row per injected fault, then each fault's errors and what
the injection did (pure: phase summaries in, text out)."""

from __future__ import annotations

from typing import Any

HEADER = (
    "| fault | load requests | completed | token-exact | migrated | failed (clear error) | hung "
    "| blocks in use after | stranded blocks (max sampled) | workers died -> replaced by "
    "| injected requests |",
    "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |",
)


def _gone(phase: dict[str, Any]) -> str:
    gone = ", ".join(f"{w['worker_id']} ({w['note']})" for w in phase["workers_left"])
    joined = ", ".join(phase["workers_joined"])
    return f"{gone} -> {joined or 'none'}" if gone else "-"


def _count(num: int, noun: str) -> str:
    return f"{num} {noun}" + ("" if num == 1 else "s")


def _injected(phase: dict[str, Any]) -> str:
    injected = phase["injection"].get("injected", "-")
    if phase["orphans_aborted"]:
        injected += f"; decode workers aborted {phase['orphans_aborted']} orphans"
    return injected


def row(phase: dict[str, Any]) -> str:
    blocks = phase["blocks_in_use"] + phase["requests_left_on_workers"]
    cells = [
        phase["title"],
        phase["requests"],
        phase["completed"],
        f"{phase['exact']}/{phase['completed']}",
        phase["migrated"],
        phase["failed"],
        phase["hung"],
        f"{blocks} ({phase['workers_checked']} workers)",
        f"{phase['stranded_max']} ({phase['stranded_samples']} samples)",
        _gone(phase),
        _injected(phase),
    ]
    return "| " + " | ".join(str(c) for c in cells) + " |"


def details(phase: dict[str, Any]) -> list[str]:
    injection = phase["injection"]
    did = injection.get("did") or injection.get("injection_error", "")
    line = f"- **{phase['title']}**: {did}."
    extra = []
    if injection.get("watched"):
        num, exact = len(injection["watched"]), injection["watched_completed_exact"]
        failed = injection.get("watched_failed", 0)
        said = f"of the {_count(num, 'load request')} it hit, {exact} completed token-exact"
        extra.append(said + (f" and {failed} failed (below)" if failed else ""))
    if phase["recomputed"]:
        extra.append(f"decode workers recomputed {_count(phase['recomputed'], 'prompt')}")
    if phase["orphans_aborted"]:
        orphans = _count(phase["orphans_aborted"], "orphaned request")
        extra.append(f"decode workers aborted {orphans} once their router stopped polling")
    if phase["blocks_held"]:
        extra.append(f"{_count(phase['blocks_held'], 'block')} still leased")
    extra.append(f"every block free {phase['all_free_after_s']} s after the pools settled")
    said = "; ".join(extra)
    line += f" {said[0].upper()}{said[1:]}."
    out = [line]
    for error, count in phase["errors"].items():
        out.append(f"  - {count} x `{error}`")
    for key in ("not_exact", "failed_with_a_wrong_token"):
        if phase[key]:
            out.append(f"  - {key.replace('_', ' ')}: {', '.join(phase[key])}")
    for case in injection.get("unclear", []):
        out.append(f"  - not a clear 400: {case}")
    return out


def markdown(phases: list[dict[str, Any]]) -> str:
    lines = [*HEADER, *(row(p) for p in phases), ""]
    for phase in phases:
        lines += details(phase)
    return "\n".join(lines) + "\n"
