"""engine/execution/host_tensors.py without a GPU: index tables built through numpy, and small host
tensors (below the page-lock threshold, 1 MiB) left as they are."""

from __future__ import annotations

import torch

from engine.execution import host_tensors


def test_index_tensor_on_the_host() -> None:
    table = host_tensors.index_tensor([3, 1, 2], torch.int32)
    assert table.dtype == torch.int32 and table.tolist() == [3, 1, 2]


def test_the_threshold_is_one_mib() -> None:
    assert host_tensors.PAGE_LOCK_FROM_BYTES == 1 << 20


def test_small_tables_stay_pageable() -> None:
    table = torch.arange(1000)
    assert host_tensors.page_locked(table) is table
