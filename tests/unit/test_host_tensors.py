"""engine/host_tensors.py without a GPU: index tables built through numpy, the page-lock
threshold from KVRELAY_PAGE_LOCK_FROM_BYTES (default, a value, a bad value refused by name), and
small host tensors left as they are below it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from engine import host_tensors


@pytest.fixture(autouse=True)
def fresh_threshold() -> Iterator[None]:
    host_tensors.page_lock_from_bytes.cache_clear()
    yield
    host_tensors.page_lock_from_bytes.cache_clear()


def test_index_tensor_on_the_host() -> None:
    table = host_tensors.index_tensor([3, 1, 2], torch.int32)
    assert table.dtype == torch.int32 and table.tolist() == [3, 1, 2]


def test_threshold_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(host_tensors.PAGE_LOCK_ENV, raising=False)
    assert host_tensors.page_lock_from_bytes() == host_tensors.PAGE_LOCK_FROM_BYTES
    host_tensors.page_lock_from_bytes.cache_clear()
    monkeypatch.setenv(host_tensors.PAGE_LOCK_ENV, "0")
    assert host_tensors.page_lock_from_bytes() == 0


@pytest.mark.parametrize("value", ["-1", "1MiB", "", "\u00b2"])
def test_bad_threshold_names_the_variable(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(host_tensors.PAGE_LOCK_ENV, value)
    with pytest.raises(ValueError, match=host_tensors.PAGE_LOCK_ENV):
        host_tensors.page_lock_from_bytes()


def test_small_tables_stay_pageable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(host_tensors.PAGE_LOCK_ENV, raising=False)
    table = torch.arange(1000)
    assert host_tensors.page_locked(table) is table
