"""`kvrelay serve` flags map onto the engine and cluster configs."""

from __future__ import annotations

import pytest

from deploy.cli import build_parser
from deploy.serve import spec_from_args


def parse(*argv: str):
    return spec_from_args(build_parser().parse_args(["serve", *argv]))


def test_defaults_pick_dtype_and_backend_by_device() -> None:
    spec = parse()
    assert spec.engine.device == "auto"  # LocalCluster picks cuda when Ray has a GPU per worker
    assert spec.engine.dtype == "auto"
    assert spec.engine.attention_backend == "auto"
    assert spec.engine.cuda_graph is True
    assert (spec.num_prefill, spec.num_decode) == (1, 1)


def test_gpu_flags() -> None:
    spec = parse(
        "--device", "cuda", "--dtype", "bfloat16", "--attention-backend", "flashinfer",
        "--no-cuda-graph", "--prefill", "2", "--load-format", "dummy",
    )  # fmt: skip
    assert spec.engine.device == "cuda"
    assert spec.engine.dtype == "bfloat16"
    assert spec.engine.attention_backend == "flashinfer"
    assert spec.engine.cuda_graph is False
    assert spec.num_prefill == 2
    assert spec.engine.load_format == "dummy"


def test_bad_values_are_refused() -> None:
    with pytest.raises(SystemExit):
        parse("--dtype", "int8")
    with pytest.raises(ValueError, match="--prefill and --decode"):
        parse("--decode", "0")
