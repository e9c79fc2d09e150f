"""--quantization on `kvrelay serve` and `kvrelay generate` reaches EngineConfig; FP8 on CPU is
refused with the clear error before any model is loaded."""

from __future__ import annotations

import pytest

from deploy.cli import build_parser, main
from deploy.serve import spec_from_args


def test_serve_flag_reaches_the_engine_config() -> None:
    parser = build_parser()
    assert spec_from_args(parser.parse_args(["serve"])).engine.quantization is None
    spec = spec_from_args(parser.parse_args(["serve", "--quantization", "fp8"]))
    assert spec.engine.quantization == "fp8"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--quantization", "int8"])


def test_generate_flag_and_cpu_refusal(capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(
        ["generate", "hi", "--quantization", "fp8", "--device", "cuda"]
    )
    assert (args.quantization, args.device) == ("fp8", "cuda")
    assert main(["generate", "hi", "--quantization", "fp8"]) == 2  # generate runs on cpu
    assert "FP8 weights need a CUDA GPU" in capsys.readouterr().err
