"""engine/pdl.py's settings: KVRELAY_PDL and KVRELAY_PDL_PREFETCH_MIB are read as documented,
bad values are refused by the variable's name, and nothing off a CUDA GPU launches with PDL."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from engine import pdl


@pytest.fixture(autouse=True)
def fresh_settings() -> Iterator[None]:
    pdl.wanted.cache_clear()
    pdl.prefetch_bytes.cache_clear()
    yield
    pdl.wanted.cache_clear()
    pdl.prefetch_bytes.cache_clear()


def test_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(pdl.ENV, raising=False)
    monkeypatch.delenv(pdl.PREFETCH_ENV, raising=False)
    assert pdl.wanted() is True
    assert pdl.prefetch_bytes() == pdl.PREFETCH_MIB_DEFAULT << 20


def test_turned_off_and_sized(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(pdl.ENV, "0")
    monkeypatch.setenv(pdl.PREFETCH_ENV, " 4 ")
    assert pdl.wanted() is False
    assert pdl.prefetch_bytes() == 4 << 20


@pytest.mark.parametrize("value", ["yes", "2", ""])
def test_bad_switch_names_the_variable(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(pdl.ENV, value)
    with pytest.raises(ValueError, match=pdl.ENV):
        pdl.wanted()


@pytest.mark.parametrize("value", ["-1", "1.5", "4096", "lots", "\u00b2"])
def test_bad_prefetch_names_the_variable(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(pdl.PREFETCH_ENV, value)
    with pytest.raises(ValueError, match=pdl.PREFETCH_ENV):
        pdl.prefetch_bytes()


def test_never_off_a_cuda_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(pdl.ENV, "1")
    assert not pdl.enabled(torch.device("cpu"))
