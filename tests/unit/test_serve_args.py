"""`kvrelay serve` flags map onto the engine and cluster configs."""

from __future__ import annotations

from pathlib import Path

import pytest

from deploy.cli import build_parser, main
from deploy.serve import placement_lines, spec_from_args


def parse(*argv: str):
    return spec_from_args(build_parser().parse_args(["serve", *argv]))


def test_defaults_pick_dtype_and_backend_by_device() -> None:
    spec = parse()
    assert spec.engine.device == "auto"  # LocalCluster picks cuda when Ray has a GPU per worker
    assert spec.engine.dtype == "auto"
    assert spec.engine.attention_backend == "auto"
    assert spec.engine.cuda_graph is True
    assert spec.engine.cache.kv_cache_dtype == "auto"
    assert spec.engine.async_scheduling is None  # on where decode runs through CUDA graphs
    assert spec.engine.warm_up is None  # on where the engine runs on CUDA
    assert (spec.num_prefill, spec.num_decode) == (1, 1)


def test_gpu_flags() -> None:
    spec = parse(
        "--device", "cuda", "--dtype", "bfloat16", "--attention-backend", "flashinfer",
        "--no-cuda-graph", "--no-async-scheduling", "--prefill", "2", "--load-format", "dummy",
        "--kv-cache-dtype", "fp8", "--no-warm-up",
    )  # fmt: skip
    assert spec.engine.device == "cuda"
    assert spec.engine.dtype == "bfloat16"
    assert spec.engine.attention_backend == "flashinfer"
    assert spec.engine.cuda_graph is False
    assert spec.num_prefill == 2
    assert spec.engine.load_format == "dummy"
    assert spec.engine.cache.kv_cache_dtype == "fp8"
    assert spec.engine.async_scheduling is False
    assert spec.engine.warm_up is False


def test_bad_values_are_refused() -> None:
    with pytest.raises(SystemExit):
        parse("--dtype", "int8")
    with pytest.raises(SystemExit):
        parse("--kv-cache-dtype", "int4")
    with pytest.raises(ValueError, match=r"--decode must be in \[1, 1024\]"):
        parse("--decode", "0")
    with pytest.raises(ValueError, match=r"--decode must be in \[1, 1024\], got 1000000000"):
        parse("--decode", "1000000000")  # a typo's billion workers would have been started
    with pytest.raises(ValueError, match=r"--prefill must be in \[0, 1024\]"):
        parse("--prefill", "-1")


def test_prefill_0_is_aggregated_on_the_whole_gpu() -> None:
    spec = parse("--prefill", "0", "--device", "cuda")
    assert (spec.num_prefill, spec.num_decode) == (0, 1)
    # One GPU: the decode worker alone takes the card's whole budget (no half-card share).
    assert spec.gpus_per_worker is None and spec.worker_gpus("cuda") == 1.0
    assert spec.num_ranks == 1
    # Its steps are the engine's own (no decode-side chunk), and the rule's prediction of a
    # local prompt's TTFT uses that budget.
    assert spec.decode_prefill_chunk_tokens is None
    assert spec.local_prefill.chunk_tokens == spec.engine.scheduler.max_num_batched_tokens
    chunked = parse("--prefill", "0", "--local-prefill-chunk-tokens", "8192")
    assert chunked.decode_prefill_chunk_tokens == chunked.local_prefill.chunk_tokens == 8192
    # Its decode pool may still autoscale; the prefill pool stays at 0.
    scaled = parse("--prefill", "0", "--decode", "2", "--autoscale-decode", "1:3")
    assert scaled.autoscale is not None
    assert scaled.autoscale.min_size["prefill"] == scaled.autoscale.max_size["prefill"] == 0
    with pytest.raises(ValueError, match="--prefill 0 is outside --autoscale-prefill"):
        parse("--prefill", "0", "--autoscale-prefill", "1:2")
    # What serve prints at start.
    assert any("the decode workers compute every prompt" in line for line in placement_lines(spec))
    assert placement_lines(parse()) == []


def test_prefill_0_with_half_a_gpu_is_warned(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING"):
        parse("--prefill", "0", "--device", "cuda", "--gpus-per-worker", "0.5")
    assert "leaves part of each GPU idle" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        parse("--prefill", "0", "--decode", "2", "--device", "cuda", "--gpus-per-worker", "0.5")
    assert "idle" not in caplog.text  # two on one card fill it


def test_migration_budget_flag() -> None:
    assert parse().max_migrations == 2
    assert parse("--max-migrations", "0").max_migrations == 0
    with pytest.raises(ValueError, match="--max-migrations must be >= 0"):
        parse("--max-migrations", "-1")


def test_conditional_prefill_flags() -> None:
    off = parse()
    assert (off.local_prefill.enabled, off.decode_prefill_chunk_tokens) == (False, None)
    on = parse("--local-prefill-max-tokens", "128", "--local-prefill-min-cached", "0.8")
    rule = on.local_prefill
    assert (rule.max_uncached_tokens, rule.min_cached_fraction) == (128, 0.8)
    assert rule.chunk_tokens == 256
    assert on.decode_prefill_chunk_tokens == 256  # the decode workers' chunk, only when on
    chunked = parse("--local-prefill-min-cached", "0.9", "--local-prefill-chunk-tokens", "64")
    assert chunked.decode_prefill_chunk_tokens == 64
    with pytest.raises(ValueError, match="--local-prefill-max-tokens must be >= 0"):
        parse("--local-prefill-max-tokens", "-1")
    with pytest.raises(ValueError, match="--local-prefill-chunk-tokens must be >= 1"):
        parse("--local-prefill-max-tokens", "8", "--local-prefill-chunk-tokens", "0")
    with pytest.raises(ValueError, match="--local-prefill-on-slo-miss needs --slo-ttft-ms"):
        parse("--local-prefill-on-slo-miss")


def test_slo_flags() -> None:
    assert not parse().slo.enabled
    spec = parse("--slo-ttft-ms", "800", "--slo-tpot-ms", "40", "--local-prefill-on-slo-miss")
    assert (spec.slo.ttft_ms, spec.slo.tpot_ms, spec.slo.overload) == (800, 40, "queue")
    assert spec.local_prefill.on_slo_miss and spec.decode_prefill_chunk_tokens == 256
    assert parse("--slo-ttft-ms", "800", "--slo-overload", "shed").slo.overload == "shed"
    assert parse("--slo-tpot-ms", "40", "--slo-overload", "place").slo.overload == "place"
    with pytest.raises(ValueError, match="--slo-overload shed needs an objective"):
        parse("--slo-overload", "shed")  # taken and ignored before
    for bad in ("-5", "nan", "inf"):  # refused while parsing (deploy/flag_types.py)
        with pytest.raises(SystemExit):
            parse("--slo-tpot-ms", bad)


def test_autoscale_flags() -> None:
    assert parse().autoscale is None
    spec = parse("--decode", "2", "--autoscale-decode", "1:4")
    assert spec.autoscale is not None
    assert spec.autoscale.min_size == {"prefill": 1, "decode": 1}
    assert spec.autoscale.max_size == {"prefill": 1, "decode": 4}  # prefill stays at 1
    assert spec.autoscale.autoscaled == ("decode",)  # the prefill pool keeps the size it is given
    with pytest.raises(ValueError, match=r"MIN <= MAX <= 1024, got '1:2000'"):
        parse("--autoscale-decode", "1:2000")
    with pytest.raises(ValueError, match="--decode 5 is outside --autoscale-decode 1:4"):
        parse("--decode", "5", "--autoscale-decode", "1:4")
    with pytest.raises(ValueError, match="--autoscale-prefill wants MIN:MAX"):
        parse("--autoscale-prefill", "3")
    with pytest.raises(ValueError, match="--autoscale-prefill wants MIN:MAX"):
        parse("--autoscale-prefill", "0:2")


@pytest.fixture(autouse=True)
def nothing_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """A command line these tests pass through main() must never start a cluster or router."""

    def started(args) -> int:
        raise AssertionError(f"kvrelay {args.command} would have started")

    monkeypatch.setattr("deploy.cli.serve", started)
    monkeypatch.setattr("deploy.ops_cli.router", started)


def refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """What the CLI prints for a flag value refused while parsing (exit status 2): one line."""
    with pytest.raises(SystemExit) as done:
        main(list(argv))
    assert done.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines  # no usage block, no traceback
    return lines[0]


@pytest.mark.parametrize("command", ["serve", "router"])
def test_ports_outside_1_to_65535_are_refused_naming_the_flag(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    for flag in ("--http-port", "--grpc-port"):
        for bad in ("99999", "65536", "70000", "-5", "x"):
            line = refused(capsys, command, flag, bad)
            assert f"argument {flag}" in line and bad in line  # "--http-port/--port": vLLM's
    args = build_parser().parse_args([command, "--http-port", "0", "--grpc-port", "65535"])
    assert (args.http_port, args.grpc_port) == (0, 65535)  # 0: a free port, as --help says


@pytest.mark.parametrize(
    ("flag", "bad", "says"),
    [
        ("--max-model-len", "-3", "must be >= 1, got -3"),
        ("--max-model-len", "0", "must be >= 1, got 0"),
        ("--kv-cache-gib", "inf", "must be a finite number, got 'inf'"),
        ("--kv-cache-gib", "nan", "must be a finite number, got 'nan'"),
        ("--host-kv-gib", "-1", "must be >= 0, got -1"),
        ("--disk-kv-gib", "nan", "finite"),
        ("--shared-kv-gib", "inf", "finite"),
        ("--max-num-seqs", "0", "must be >= 1"),
        ("--max-num-batched-tokens", "-1", "must be >= 1"),
        ("--partial-reuse-min-tokens", "-1", "must be >= 0"),
        ("--block-size", "-16", "must be >= 1"),
        ("--threads-per-worker", "0", "must be >= 1"),
        ("--log-stats-interval", "inf", "finite"),
        ("--slo-ttft-ms", "nan", "finite"),
        ("--local-prefill-min-cached", "nan", "finite"),
        ("--rate-limit-rps", "nan", "finite"),
        ("--rate-limit-tpm", "1.5", "whole number"),
    ],
)
def test_bad_numbers_are_refused_while_parsing_naming_the_flag(
    flag: str, bad: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    line = refused(capsys, "serve", flag, bad)
    assert line.startswith(f"kvrelay serve: error: argument {flag}: ")
    assert says in line


def test_a_models_files_bad_number_names_its_entry_and_flag(tmp_path: Path) -> None:
    models = tmp_path / "models.yaml"
    models.write_text("models:\n  - model: default\n    flags: {kv_cache_gib: inf}\n")
    with pytest.raises(ValueError, match="--kv-cache-gib: must be a finite number"):
        parse("--models-file", str(models))


@pytest.mark.parametrize(
    ("flag", "bad"),
    [
        ("--gpu-memory-utilization", "nan"),
        ("--gpu-memory-utilization", "inf"),
        ("--gpus-per-worker", "nan"),
        ("--gpus-per-worker", "inf"),
        ("--kv-cache-gib", "0"),
    ],
)
def test_range_checked_floats_refuse_nan_and_inf_naming_the_flag(flag: str, bad: str) -> None:
    with pytest.raises(ValueError, match=f"^{flag} must be"):  # main(): one line, exit 2
        parse(flag, bad)
