"""share_plan_buffers: the graph decode wrappers plan into one int workspace and one pinned host
copy (stand-in objects with FlashInfer's attribute names; no GPU)."""

from __future__ import annotations

from types import SimpleNamespace

from engine.attention.flashinfer_backend import share_plan_buffers


def wrapper(tag: str) -> SimpleNamespace:
    return SimpleNamespace(
        _int_workspace_buffer=f"{tag}-int", _pin_memory_int_workspace_buffer=f"{tag}-pinned"
    )


def test_wrappers_share_the_first_ones_buffers() -> None:
    owner, others = wrapper("a"), [wrapper("b"), wrapper("c")]
    share_plan_buffers(owner, owner)
    for other in others:
        share_plan_buffers(other, owner)
    assert {w._int_workspace_buffer for w in (owner, *others)} == {"a-int"}
    assert {w._pin_memory_int_workspace_buffer for w in (owner, *others)} == {"a-pinned"}


def test_a_wrapper_without_those_buffers_keeps_its_own() -> None:
    owner, other = wrapper("a"), SimpleNamespace(_int_workspace_buffer="b-int")
    share_plan_buffers(other, owner)
    assert other._int_workspace_buffer == "b-int"
