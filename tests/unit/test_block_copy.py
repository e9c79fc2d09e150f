"""can_run_ahead: which owed block copies may run on the copy-back stream beside the step in
flight."""

from __future__ import annotations

from engine.kv_cache.block_copy import BlockCopy, can_run_ahead


def test_host_tier_copies_run_ahead():
    copies = [
        BlockCopy(3, 7, "to_host"),
        BlockCopy(7, 5, "from_host"),
        BlockCopy(2, 6, "from_host"),
    ]
    assert can_run_ahead(copies, freed={9, 7})  # 7 is a host slot here, not a device block


def test_a_device_copy_keeps_the_batch_on_the_steps_stream():
    """A partial block's or a fork's source may be written by the step in flight, and the batch
    must keep its order (a later copy back may overwrite an evicted source)."""
    assert not can_run_ahead([BlockCopy(1, 2, "from_host"), BlockCopy(4, 1)], freed=set())


def test_a_block_freed_after_the_launch_keeps_the_batch_on_the_steps_stream():
    """The step in flight may still write its pending token into a block freed since: a copy
    back into it, or an offload reading it, must run after that step."""
    assert not can_run_ahead([BlockCopy(0, 5, "from_host")], freed={5})
    assert not can_run_ahead([BlockCopy(5, 0, "to_host")], freed={5})


def test_nothing_owed_runs_nothing_ahead():
    assert not can_run_ahead([], freed=set())
