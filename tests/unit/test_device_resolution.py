"""Device and dtype names resolve as documented ("auto" follows what torch can see)."""

from __future__ import annotations

import pytest
import torch

from engine.execution.backend_builder import resolve_device, resolve_dtype


def test_auto_device_follows_cuda_availability() -> None:
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    assert resolve_device("cpu") == torch.device("cpu")


def test_auto_dtype_is_bf16_on_cuda_fp32_elsewhere() -> None:
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    with pytest.raises(ValueError, match="dtype must be"):
        resolve_dtype("int8", torch.device("cpu"))
