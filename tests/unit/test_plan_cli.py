"""`kvrelay plan` (deploy/plan_cli.py) through the `kvrelay` entry point on the hand-made
profile fixture: the table and the command to run, --json, a recorded serve_bench trace, an
infeasible SLO (exit 1, naming the objective), bad arguments (exit 2), a warning when the profile
is of another model than --model, and a profile that bench/pool_profile.py measures on a tiny
model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deploy.cli import main
from deploy.plan_cli import profile_is_of

PROFILE = str(Path(__file__).parent / "data" / "pool_profile_8b_like.json")
SLO = ["--slo-ttft-ms", "500", "--slo-tpot-ms", "30"]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["plan", "--profile", PROFILE, *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_described_workload_prints_sizes_and_what_to_run(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = run(capsys, "--rate", "8", "--input-len", "4096", "--output-len", "16", *SLO)
    assert code == 0
    assert "workload (described): 8.00 req/s, 4096 prompt tokens (0% cached)" in out
    prefill = next(line for line in out.splitlines() if line.startswith("prefill"))
    assert prefill.split()[1] == "3" and "TTFT" in prefill
    assert "run: kvrelay scale --prefill 3 --decode 1  (4 workers)" in out


def test_the_command_names_the_model_asked_for(capsys: pytest.CaptureFixture[str]) -> None:
    """A cluster serving several models refuses `kvrelay scale` without --model."""
    argv = ["--rate", "8", "--input-len", "4096", "--output-len", "16", *SLO]
    code, out, err = run(capsys, *argv, "--model", "chat model")
    assert code == 0
    assert "run: kvrelay scale --model 'chat model' --prefill 3 --decode 1" in out
    # the profile measured another model: said, the plan still made (its figures are shown)
    assert "measured 'synthetic, shaped like an 8B model (tests only)', not 'chat model'" in err
    code, out, _ = run(capsys, *argv, "--model", "chat", "--json")
    assert json.loads(out)["command"] == "kvrelay scale --model chat --prefill 3 --decode 1"


def test_a_profile_of_the_model_asked_for_plans_without_a_warning() -> None:
    assert profile_is_of("Qwen/Qwen3-8B", "qwen3-8b")
    assert profile_is_of("/models/Qwen3-8B/", "Qwen3-8B")
    assert profile_is_of("SmolLM2-135M-Instruct", "smollm2-135m-instruct")
    assert not profile_is_of("Qwen/Qwen3-8B", "Qwen3-32B")


def test_json_output(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--rate", "8", "--input-len", "256", "--output-len", "1024", "--cached-fraction"]
    code, out, _ = run(capsys, *argv, "0.5", *SLO, "--json")
    assert code == 0
    report = json.loads(out)
    assert report["feasible"] and report["command"] == "kvrelay scale --prefill 1 --decode 3"
    assert report["decode"]["num_workers"] == 3 and report["decode"]["tpot_ms"] <= 30
    assert report["workload"] == {
        "source": "described",
        "rate": 8.0,
        "input_len": 256.0,
        "output_len": 1024.0,
        "cached_fraction": 0.5,
    }


def test_a_recorded_trace(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    row = {"ok": True, "prompt_tokens": 4096, "cached_tokens": 0, "output_tokens": 16}
    rows = [{**row, "send_s": i * 0.125} for i in range(33)]  # 8 a second for 4 s
    trace = tmp_path / "serve_bench.json"
    trace.write_text(json.dumps({"model": "m", "summary": {}, "requests": rows}))
    code, out, _ = run(capsys, "--trace", str(trace), *SLO)
    assert code == 0
    assert f"workload (recorded: 33 requests in {trace}): 8.00 req/s" in out
    assert "run: kvrelay scale --prefill 3 --decode 1" in out


def test_an_infeasible_slo_exits_1_naming_the_objective(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--rate", "1", "--input-len", "512", "--output-len", "64", "--slo-ttft-ms", "500"]
    code, out, _ = run(capsys, *argv, "--slo-tpot-ms", "5", "--json")
    assert code == 1
    report = json.loads(out)
    assert not report["feasible"] and report["command"] is None
    assert [f["objective"] for f in report["failures"]] == ["tpot"]
    code, out, _ = run(capsys, "--rate", "400", "--input-len", "2048", "--output-len", "256", *SLO)
    assert code == 1
    assert "no pool sizes within --max-workers 16 meet the SLO" in out
    assert "ttft: even 15 prefill workers" in out and "TTFT unbounded" in out


def test_bad_arguments_exit_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = run(capsys, "--rate", "8", *SLO)
    assert code == 2 and "give --rate, --input-len and --output-len" in err
    code, _, err = run(capsys, "--rate", "8", "--trace", str(tmp_path / "t.json"), *SLO)
    assert code == 2 and "not both" in err
    argv = ["--rate", "2", "--input-len", "100", "--output-len", "10", "--trace-run", "5", *SLO]
    code, _, err = run(capsys, *argv)
    assert code == 2 and "--trace-run picks a run of --trace's report: give --trace too" in err
    bad = tmp_path / "profile.json"
    bad.write_text(json.dumps({"version": 1, "prefill": {"points": []}, "decode": {}}))
    argv = ["--rate", "1", "--input-len", "1", "--output-len", "1", *SLO]
    code = main(["plan", "--profile", str(bad), *argv])
    assert code == 2 and "prefill.points" in capsys.readouterr().err


def test_a_measured_profile_feeds_the_planner(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # bench/pool_profile.py on a tiny random-weight model (seconds on CPU): what it writes,
    # `kvrelay plan` reads. Its figures are not checked (performance lives in bench/).
    from bench.pool_profile import main as measure

    out = tmp_path / "tiny.json"
    argv = ["--shape", "tiny-llama", "--threads", "1", "--kv-cache-gib", "0.25", "--out"]
    assert measure([*argv, str(out), "--prompt-lens", "16", "64", "--context-lens", "32"]) == 0
    profile = json.loads(out.read_text())
    assert [p["prompt_len"] for p in profile["prefill"]["points"]] == [16, 64]
    assert len(profile["decode"]["points"]) == 3  # batches 1, 4, 8 at one context
    capsys.readouterr()
    argv = ["--rate", "1", "--input-len", "64", "--output-len", "16"]
    code = main(
        ["plan", "--profile", str(out), *argv, "--slo-ttft-ms", "1e4", "--slo-tpot-ms", "1e3"]
    )
    assert code == 0 and "run: kvrelay scale" in capsys.readouterr().out
