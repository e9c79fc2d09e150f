"""The Redis key layout and worker HASH encoding of the KV index (pure, no Redis)."""

from __future__ import annotations

import pytest

from common import kv_index_schema as schema
from common.messages import WorkerInfo, WorkerLoad


def test_keys_share_the_model_hash_tag() -> None:
    model = "org/model:v1"
    keys = [
        schema.block_key(model, 255),
        schema.worker_blocks_key(model, "p0"),
        schema.worker_key(model, "p0"),
        schema.registry_key(model),
    ]
    assert keys == [
        "kvr:{org/model:v1}:b:00000000000000ff",
        "kvr:{org/model:v1}:wb:p0",
        "kvr:{org/model:v1}:w:p0",
        "kvr:{org/model:v1}:workers",
    ]
    assert schema.worker_keys(model, "p0") == keys[2:0:-1] + keys[3:]


@pytest.mark.parametrize("bad", ["", "a b", "x{y}", "w*", "q?", "r[1]"])
def test_ids_that_would_break_keys_or_scans_are_refused(bad: str) -> None:
    with pytest.raises(ValueError):
        schema.worker_key("model", bad)
    with pytest.raises(ValueError):
        schema.registry_key(bad)


def test_worker_fields_round_trip_through_string_values() -> None:
    load = WorkerLoad(running=1, waiting=2, free_blocks=3, total_blocks=4, queued_tokens=5)
    fields = schema.worker_fields("decode", "actor", "agent", load, "draining")
    as_read = {name: str(value) for name, value in fields.items()} | {"epoch": "x:1"}
    assert schema.parse_worker("d0", as_read) == WorkerInfo(
        "d0", "decode", "actor", "agent", load, state="draining"
    )
    assert schema.parse_worker("d1", {"role": "decode"}).state == "joining"  # until it says
    assert schema.parse_worker("d1", {"role": "decode"}).load == WorkerLoad()
