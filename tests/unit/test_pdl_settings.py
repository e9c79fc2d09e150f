"""engine/execution/pdl.py: nothing off a CUDA GPU launches with PDL (on a GPU it is on where the
card and Triton have it; tests/gpu/test_pdl.py)."""

from __future__ import annotations

import torch

from engine.execution import pdl


def test_never_off_a_cuda_gpu() -> None:
    assert not pdl.enabled(torch.device("cpu"))
