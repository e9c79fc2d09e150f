"""What vLLM and SGLang users expect of the command line: `kvrelay serve MODEL`, `kvrelay
--version`, help and a shown default on every serve flag, and `kvrelay bench` (serve_bench's
flags, from any folder)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from deploy.cli import build_parser, main
from deploy.serve_flags import spec_from_args
from engine.config import DEFAULT_MODEL


def serve_parser() -> argparse.ArgumentParser:
    [sub] = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices["serve"]


def test_every_serve_flag_has_help_that_shows_its_default() -> None:
    parser = serve_parser()
    formatter = parser._get_formatter()
    actions = [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]
    assert len(actions) > 40
    for action in actions:
        name = action.option_strings[0] if action.option_strings else action.dest
        assert action.help, f"{name} has no help"
        if action.nargs == 0:  # an on/off flag: off unless given
            continue
        shown = formatter._expand_help(action)
        assert "default" in shown.lower(), f"{name}: {shown!r} shows no default"
    text = " ".join(parser.format_help().split())
    assert "OpenAI HTTP port (0: a free one) (default: 8000)" in text
    assert f"(default: {DEFAULT_MODEL})" in text


def parse_serve(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def test_the_model_is_a_positional_argument_or_the_flag() -> None:
    assert spec_from_args(parse_serve()).engine.model == DEFAULT_MODEL
    assert spec_from_args(parse_serve("m.gguf")).engine.model == "m.gguf"
    assert spec_from_args(parse_serve("--prefill", "2", "m.gguf")).engine.model == "m.gguf"
    assert spec_from_args(parse_serve("--model", "m.gguf")).engine.model == "m.gguf"
    assert spec_from_args(parse_serve("m.gguf", "--model", "m.gguf")).engine.model == "m.gguf"
    with pytest.raises(ValueError, match="given twice, as 'a' and --model 'b'"):
        spec_from_args(parse_serve("a", "--model", "b"))


def test_serve_refuses_two_models_before_starting_anything(capsys) -> None:
    assert main(["serve", "a", "--model", "b"]) == 2
    assert "error: the model is given twice" in capsys.readouterr().err


def test_serve_checks_its_name_and_stats_interval(capsys: pytest.CaptureFixture[str]) -> None:
    for bad in ("-1", "nan"):
        with pytest.raises(SystemExit) as done:
            parse_serve("--log-stats-interval", bad)
        assert done.value.code == 2
        assert "argument --log-stats-interval: must be" in capsys.readouterr().err
    assert parse_serve().log_stats_interval == 10.0
    assert main(["serve", "--name", "../x"]) == 2


def test_version_is_the_installed_packages(capsys) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"kvrelay {metadata.version('kvrelay')}"


def kvrelay(cwd: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    """The CLI in its own process, run from a folder outside the checkout."""
    return subprocess.run(
        [sys.executable, "-m", "deploy.cli", *argv],
        cwd=cwd, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_bench_is_serve_bench_with_its_flags_from_any_folder(tmp_path: Path) -> None:
    shown = kvrelay(tmp_path, "bench", "--help")
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith("usage: kvrelay bench")
    for flag in ("--launch", "--num-requests", "--rate", "--workload", "--slo-ttft-ms"):
        assert flag in shown.stdout
    refused = kvrelay(tmp_path, "bench", "--rate", "0")
    assert refused.returncode == 2
    assert "--num-requests must be >= 1 and --rate > 0" in refused.stderr
    listed = kvrelay(tmp_path, "--help")
    assert "bench" in listed.stdout and "serve_bench" in listed.stdout


def test_a_reader_that_leaves_early_gets_no_traceback() -> None:
    """`kvrelay status | head -4`: the command's output meets a closed pipe; it exits 141 (as a
    shell reports a command its reader cut off) with no BrokenPipeError traceback."""
    code = """if True:
        import argparse, os, sys
        from deploy import cli
        read, write = os.pipe()
        os.close(read)  # the reader is gone
        os.dup2(write, 1)
        class Parser:
            def parse_args(self, argv):
                return argparse.Namespace(func=lambda args: print("line\\n" * 1000) or 0)
        cli.build_parser = Parser
        sys.exit(cli.main(["status"]))
    """
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=120
    )
    assert done.returncode == 141, done.stderr
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr
