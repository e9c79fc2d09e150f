"""Where the unit tests of the engine's Triton kernels run them, and the mark that skips them
where they cannot run; owns no state. On a GPU the kernels are compiled for it; on the CPU they
run in Triton's interpreter, which tests/conftest.py turns on (TRITON_INTERPRET=1)."""

from __future__ import annotations

import os

import pytest
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
needs_triton_kernels = pytest.mark.skipif(
    DEVICE.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
    reason="on the CPU, Triton kernels run only in its interpreter (tests/conftest.py sets it)",
)
