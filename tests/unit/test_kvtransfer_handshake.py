"""kvtransfer.handshake: compat hash stability and refusal messages (pure Python, no NIXL)."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from kvtransfer.base import AgentMetadata
from kvtransfer.handshake import (
    PROTOCOL_VERSION,
    IncompatiblePeerError,
    check_compatible,
    compat_hash,
)

BLOCK_SHAPE = (2, 2, 2, 4, 8)  # num_layers, K/V, num_kv_heads, block_size, head_dim


def make_meta(name: str = "a", **changes: object) -> AgentMetadata:
    fields = dict(
        model_id="tiny",
        dtype="float32",
        block_size=4,
        block_shape=BLOCK_SHAPE,
    )
    fields.update(changes)  # type: ignore[arg-type]
    meta = AgentMetadata(
        agent_name=name,
        protocol_version=PROTOCOL_VERSION,
        compat_hash=compat_hash(
            fields["model_id"], fields["dtype"], fields["block_size"], fields["block_shape"]
        ),
        nixl_metadata=b"",
        base_addr=0,
        num_blocks=64,
        block_bytes=4 * 2 * 2 * 4 * 2 * 8,
        device_kind="cpu",
        device_id=0,
        **fields,  # type: ignore[arg-type]
    )
    return meta


def test_compat_hash_is_stable_and_sensitive() -> None:
    h = compat_hash("tiny", "float32", 4, BLOCK_SHAPE)
    assert h == compat_hash("tiny", "float32", 4, list(BLOCK_SHAPE))
    assert len(h) == 32 and int(h, 16) >= 0
    assert h != compat_hash("tiny", "bfloat16", 4, BLOCK_SHAPE)
    assert h != compat_hash("other", "float32", 4, BLOCK_SHAPE)


def test_same_config_is_compatible() -> None:
    check_compatible(make_meta("a"), make_meta("b"))


@pytest.mark.parametrize(
    ("changes", "field", "label"),
    [
        ({"model_id": "other"}, "model_id", "model"),
        ({"dtype": "bfloat16"}, "dtype", "dtype"),
        ({"block_size": 8}, "block_size", "block size"),
        ({"block_shape": (3, 2, 4, 2, 8)}, "block_shape", "layout"),
    ],
)
def test_mismatch_names_the_field(changes: dict, field: str, label: str) -> None:
    with pytest.raises(IncompatiblePeerError, match=label) as info:
        check_compatible(make_meta("a"), make_meta("b", **changes))
    assert field in info.value.differences
    assert isinstance(info.value, ValueError)


def test_protocol_version_mismatch() -> None:
    remote = dataclasses.replace(make_meta("b"), protocol_version=PROTOCOL_VERSION + 1)
    with pytest.raises(IncompatiblePeerError, match="protocol version"):
        check_compatible(make_meta("a"), remote)


def test_hash_alone_differing_is_refused() -> None:
    remote = dataclasses.replace(make_meta("b"), compat_hash="0" * 32)
    with pytest.raises(IncompatiblePeerError, match="compat hash"):
        check_compatible(make_meta("a"), remote)


def test_metadata_and_error_survive_pickle() -> None:
    meta = make_meta("a")
    assert pickle.loads(pickle.dumps(meta)) == meta
    err = IncompatiblePeerError("nope", ("model_id",))
    back = pickle.loads(pickle.dumps(err))
    assert str(back) == "nope" and back.differences == ("model_id",)
