"""bench.gpu_goodput_bench's server layouts and flag checks (pure functions; the GPU runs are
issue 17's): which servers each setup starts on how many GPUs, with which GPU flags and
CUDA_VISIBLE_DEVICES, and the refusals of settings that would make the comparison unfair."""

from __future__ import annotations

import pytest

from bench.gpu_goodput_bench import build_parser, check_args, layouts, setup_flags

SHARED = ["--gpus-per-worker", "0.5"]


def parse(*flags: str):
    args = build_parser().parse_args([*flags, "--json-dir", "/tmp/unused"])
    check_args(args)
    return args


def test_one_gpu_is_shared_by_both_workers_in_either_setup() -> None:
    args = parse()
    assert layouts(args, "aggregated") == layouts(args, "disaggregated") == [(1, 1, SHARED, {})]


def test_two_gpus_one_worker_a_gpu_against_two_one_gpu_servers(monkeypatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    args = parse("--gpus", "2", "--server-args", "--kv-cache-gib 40")
    assert layouts(args, "disaggregated") == [(1, 1, [], {"CUDA_VISIBLE_DEVICES": "0,1"})]
    assert layouts(args, "aggregated") == [
        (1, 1, SHARED, {"CUDA_VISIBLE_DEVICES": "0"}),
        (1, 1, SHARED, {"CUDA_VISIBLE_DEVICES": "1"}),
    ]


def test_four_of_the_visible_gpus_three_prefill_workers(monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7,0")
    args = parse("--gpus", "4", "--prefill-workers", "3", "--server-args", "--kv-cache-gib 40")
    assert layouts(args, "disaggregated") == [(3, 1, [], {"CUDA_VISIBLE_DEVICES": "4,5,6,7"})]
    assert [env for *_, env in layouts(args, "aggregated")] == [
        {"CUDA_VISIBLE_DEVICES": g} for g in ("4", "5", "6", "7")
    ]
    cpu = parse("--gpus", "2", "--device", "cpu", "--server-args", "--kv-cache-gib 1")
    assert layouts(cpu, "aggregated") == [(1, 1, [], {}), (1, 1, [], {})]


def test_the_objectives_reach_the_aggregated_servers_only_when_asked() -> None:
    assert "--slo-ttft-ms" in setup_flags(parse(), "disaggregated")
    assert "--slo-ttft-ms" not in setup_flags(parse(), "aggregated")
    assert "--slo-ttft-ms" in setup_flags(parse("--aggregated-slo"), "aggregated")


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--gpus", "0"], "--gpus must be >= 1"),
        (["--gpus", "2", "--prefill-workers", "2"], "--prefill-workers must be 1..1"),
        (["--gpus", "2"], "needs --server-args '--kv-cache-gib G'"),
    ],
)
def test_settings_that_cannot_be_compared_are_refused(flags: list[str], message: str) -> None:
    with pytest.raises(SystemExit, match=message):
        parse(*flags)
