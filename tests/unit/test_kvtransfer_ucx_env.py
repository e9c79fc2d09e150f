"""kvtransfer.nixl_agent.configure_ucx: the UCX transports kvrelay picks, and the user's win."""

from __future__ import annotations

import os

import pytest
import torch

from kvtransfer import nixl_agent
from kvtransfer.nixl_agent import UCX_TLS_CPU, UCX_TLS_GPU, configure_ucx


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("UCX_TLS", raising=False)
    monkeypatch.delenv("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", raising=False)
    monkeypatch.setattr(nixl_agent, "_ucx_tls_set_by_us", None)


def test_picks_transports_for_the_machine() -> None:
    expected = UCX_TLS_GPU if torch.cuda.is_available() else UCX_TLS_CPU
    assert configure_ucx("cpu") == expected
    assert os.environ["UCX_TLS"] == expected
    assert "tcp" in expected  # NIXL's UCX backend wires up through it


def test_cuda_tensor_gets_cuda_transports_and_ipc_get() -> None:
    assert configure_ucx("cuda") == UCX_TLS_GPU
    assert os.environ["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] == "y"


def test_user_choice_is_never_touched(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UCX_TLS", "tcp,self")
    monkeypatch.setenv("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "n")
    assert configure_ucx("cuda") == "tcp,self"
    assert os.environ["UCX_TLS"] == "tcp,self"
    assert os.environ["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] == "n"


def test_own_choice_can_be_revised() -> None:
    configure_ucx("cpu")
    assert configure_ucx("cuda") == UCX_TLS_GPU
