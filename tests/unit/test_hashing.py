"""Block hashes: stable across processes, chained, salted, and torch-free."""

from __future__ import annotations

import subprocess
import sys

from engine.kv_cache.hashing import hash_blocks, hash_hex, root_hash


def test_only_full_blocks_are_hashed():
    assert len(hash_blocks(list(range(47)), 16, "m")) == 2
    assert len(hash_blocks(list(range(48)), 16, "m")) == 3
    assert hash_blocks(list(range(15)), 16, "m") == []


def test_chaining_makes_position_matter():
    a = hash_blocks([1] * 16 + [2] * 16, 16, "m")
    b = hash_blocks([3] * 16 + [2] * 16, 16, "m")
    assert a[1] != b[1], "same block after a different prefix must hash differently"


def test_salt_and_model_isolate():
    tokens = list(range(32))
    base = hash_blocks(tokens, 16, "m")
    assert hash_blocks(tokens, 16, "m", cache_salt="tenant-a") != base
    assert hash_blocks(tokens, 16, "other-model") != base
    assert hash_blocks(tokens, 16, "m", cache_salt="tenant-a") == hash_blocks(
        tokens, 16, "m", cache_salt="tenant-a"
    )


def test_incremental_extension_equals_full():
    tokens = list(range(100))
    head = hash_blocks(tokens[:40], 16, "m")
    assert hash_blocks(tokens, 16, "m", start_hashes=head) == hash_blocks(tokens, 16, "m")


def test_stable_across_processes_and_no_torch():
    code = (
        "import sys; from engine.kv_cache.hashing import hash_blocks;"
        "print(hash_blocks(list(range(32)), 16, 'm', 's')[-1]);"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    assert int(out[0]) == hash_blocks(list(range(32)), 16, "m", "s")[-1]
    assert out[1] == "False", "hashing must not import torch (the router uses it)"


def test_hex_form():
    assert len(hash_hex(root_hash("m"))) == 16
