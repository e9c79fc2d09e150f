"""The decode step's Triton kernels built for the H200 (sm_90) on the CPU, in one child process
(tests/hopper_compile.py: Triton's interpreter, which tests/conftest.py turns on here, makes
functions that cannot be compiled): fp8_dot_rows, the bf16 path's fused GEMVs, RoPE + the KV
write over a bf16 and an fp8 cache, and the FP8 path's add + RMSNorm + quantize. Each must
compile through ptxas, fit an SM's shared memory and spill no registers to local memory; the
FP8 products must stream their weight tiles through the software pipeline (asynchronous
copies). Runtime behaviour is the interpreter's tests' and the GPU's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.hopper_compile import CASES, HOPPER_SHARED_LIMIT, have_hopper_compiler

pytestmark = pytest.mark.skipif(not have_hopper_compiler(), reason="needs triton's NVIDIA backend")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def built() -> dict[str, dict[str, Any]]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton 3.9's default, without its warning
    done = subprocess.run(
        [sys.executable, "-m", "tests.hopper_compile"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_builds_for_hopper(built: dict[str, dict[str, Any]], case: str) -> None:
    got = built[case]
    assert "error" not in got, got.get("error")
    assert got["shared"] <= HOPPER_SHARED_LIMIT
    assert got["local_bytes"] == 0, f"{got['registers']} registers a thread, and spills"
    assert got["pdl"] > 0, "PDL's wait is in"
    if case.startswith("fp8_"):
        assert got["pipelined_loads"] > 0, "the weight tiles are not loaded ahead"
    if "silu" in case:
        assert got["exp2"] > 0, "the SiLU's exponential"
