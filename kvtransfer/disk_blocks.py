"""DiskBlockFiles: a worker's KV block files on local disk, written and read through NIXL's file
backend (POSIX). It owns the NIXL agent of the disk tier, one registered staging row and the
on-disk format; which blocks the tier keeps is engine/kv_cache/disk_tier.py's.

Format (one file per block, so a block is published, replaced and evicted alone, by an atomic
rename or unlink, and a shared directory can hold many workers' blocks without a free-space
map): `ROOT/<layout key>/<chained block hash>.kvb`, a HEADER_BYTES header then the block's KV
(every layer, the engine's [num_layers, 2, num_kv_heads, block_size, head_dim] row) at offset
HEADER_BYTES (aligned for O_DIRECT / GDS). The header: magic, format version, block hash
(chained from root_hash(model, cache_salt): content-addressed, salts never share a file), layout
key, payload length and xxh3-64 checksum, the layout as JSON, and a checksum of the header
itself; its last 16 bytes, outside that checksum, are a hint (HINT: the block's retention
priority and its cache_salt's chain root, which eviction, a warm restart and `kvrelay kv evict
--salt` read; never read by a load; a file written before the hint held the salt reads as
(0, 0): found by `--prefix-of`, not by `--salt`), tagged by the 8 bytes before it
(PRIORITY_TAG: the priority is recorded, and rewritten when it changes; untagged disk-tier files
recorded none). A file is written under a temporary name and renamed
(the shared store: linked) into place once complete.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import socket
import struct
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import xxhash

from kvtransfer.base import KVTransferError
from kvtransfer.nixl_agent import import_nixl_api

FORMAT_VERSION = 1
MAGIC = b"KVRDISK1"
HEADER_BYTES = 4096
SUFFIX = ".kvb"
_FIXED = struct.Struct("<8sIIQQQQI")  # magic, version, header len, hash, layout, len, sum, json
# the header's last bytes, outside its checksum: (retention priority, salt root) for eviction
HINT = struct.Struct("<qQ")
# just before the hint: a tag saying its priority is the block's (disk-tier files written before
# 2026-12-07 left zeros there and a priority of 0 in the hint: no priority was recorded)
PRIORITY_TAG = b"KVRPRIO1"
_TAGGED = struct.Struct("<8sq")  # the tag, then the hint's priority (the salt root follows)
_TAGGED_AT = HEADER_BYTES - HINT.size - len(PRIORITY_TAG)
_AGENT_SEQ = [0]
_HOST = socket.gethostname()  # temporary names are unique across the hosts of a shared store


@dataclass(frozen=True)
class DiskLayout:
    """What a block file's bytes mean: blocks of another model or layout are never loaded."""

    model_id: str
    num_layers: int
    num_kv_heads: int
    block_size: int
    head_dim: int
    dtype: str

    @classmethod
    def of(cls, model_id: str, kv_cache: torch.Tensor) -> DiskLayout:
        """From the engine's KV cache [num_blocks, num_layers, 2, heads, block_size, dim]."""
        if kv_cache.dim() != 6 or kv_cache.shape[2] != 2:
            raise ValueError(
                "kv_cache must be [num_blocks, num_layers, 2, num_kv_heads, block_size, "
                f"head_dim], got shape {tuple(kv_cache.shape)}"
            )
        _, layers, _, heads, block_size, dim = kv_cache.shape
        dtype = str(kv_cache.dtype).removeprefix("torch.")
        return cls(model_id, layers, heads, block_size, dim, dtype)

    @property
    def key(self) -> str:
        """The layout's directory name: 16 hex digits of its hash."""
        text = json.dumps(asdict(self) | {"format": FORMAT_VERSION}, sort_keys=True)
        return f"{xxhash.xxh3_64_intdigest(text.encode()):016x}"

    @property
    def row_shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.num_kv_heads, self.block_size, self.head_dim)


class BlockFileError(Exception):
    """A block file that must not be loaded (missing, truncated, another layout, corrupt)."""


@dataclass(frozen=True)
class ScanResult:
    """What a directory held at start: the usable blocks' hashes (oldest first) and what was
    set aside."""

    hashes: list[int]
    num_invalid: int  # removed: a bad header, a truncated file, a stale temporary file
    num_other_layouts: int  # files under other layout keys (another model or layout): ignored
    # each usable block's recorded retention priority (absent: its file records none)
    priorities: dict[int, int] = field(default_factory=dict)


class BlockFormat:
    """A block file's bytes for one layout: its size, header and checks (the disk tier's
    files and the shared store's files or objects). Owns no state beyond the layout."""

    def __init__(self, layout: DiskLayout, dtype: torch.dtype):
        self.layout = layout
        self.payload_bytes = math.prod(layout.row_shape) * dtype.itemsize
        self.file_bytes = HEADER_BYTES + self.payload_bytes
        self._layout_json = json.dumps(asdict(layout), sort_keys=True).encode()
        self._layout_id = int(layout.key, 16)
        if _FIXED.size + len(self._layout_json) + 8 + HINT.size > HEADER_BYTES:
            raise ValueError(f"model_id too long for a block file header: {layout.model_id!r}")

    def _header(self, block_hash: int, payload_sum: int) -> bytes:
        fixed = _FIXED.pack(
            MAGIC,
            FORMAT_VERSION,
            HEADER_BYTES,
            block_hash,
            self._layout_id,
            self.payload_bytes,
            payload_sum,
            len(self._layout_json),
        )
        body = fixed + self._layout_json
        return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))

    def _check_header(self, raw: bytes, block_hash: int | None, name: str) -> int:
        """The payload's checksum, once the header is whole and this layout's (and block_hash's
        when given); else BlockFileError naming what differs."""
        if len(raw) < _FIXED.size:
            raise BlockFileError(f"{name}: truncated header")
        magic, version, header_len, got_hash, layout_id, length, payload_sum, json_len = (
            _FIXED.unpack_from(raw)
        )
        if magic != MAGIC or version != FORMAT_VERSION or header_len != HEADER_BYTES:
            raise BlockFileError(f"{name}: not a version {FORMAT_VERSION} KV block file")
        end = _FIXED.size + json_len
        if end + 8 > len(raw):
            raise BlockFileError(f"{name}: truncated header")
        (header_sum,) = struct.unpack_from("<Q", raw, end)
        if xxhash.xxh3_64_intdigest(raw[:end]) != header_sum:
            raise BlockFileError(f"{name}: header checksum mismatch")
        if layout_id != self._layout_id or raw[_FIXED.size : end] != self._layout_json:
            raise BlockFileError(f"{name}: another model or KV layout")
        if length != self.payload_bytes:
            raise BlockFileError(f"{name}: payload of {length} bytes, want {self.payload_bytes}")
        if block_hash is not None and got_hash != block_hash:
            raise BlockFileError(f"{name}: holds block {got_hash:016x}")
        return payload_sum


class DiskBlockFiles(BlockFormat):
    """Block files of one layout under root (created if absent). The I/O is synchronous: each
    call returns once NIXL's transfer is done."""

    AGENT_PREFIX = "kvrelay-disk"

    def __init__(self, root: str | Path, layout: DiskLayout, dtype: torch.dtype):
        super().__init__(layout, dtype)
        self.root = Path(root)
        self.dir = self.root / layout.key
        self.dir.mkdir(parents=True, exist_ok=True)
        self._staging = torch.empty((1, *layout.row_shape), dtype=dtype)
        api = import_nixl_api()
        _AGENT_SEQ[0] += 1
        self._name = f"{self.AGENT_PREFIX}-{os.getpid()}-{_AGENT_SEQ[0]}"
        try:
            self._agent = api.nixl_agent(self._name, api.nixl_agent_config(backends=["POSIX"]))
        except Exception as e:  # NIXL raises its own types
            raise KVTransferError(f"NIXL's POSIX backend is not available: {e}") from e
        self._agent.register_memory(self._staging)
        self._row_descs = self._agent.get_xfer_descs(self._staging)

    def path(self, block_hash: int) -> Path:
        return self.dir / f"{block_hash:016x}{SUFFIX}"

    # ---- write and read ------------------------------------------------------------------
    def write(
        self, block_hash: int, row: torch.Tensor, salt_root: int = 0, priority: int = 0
    ) -> None:
        """Publish row (one block's KV) as block_hash's file. salt_root: its cache_salt's chain
        root (0: none), kept for `kvrelay kv evict --salt`; priority: its retention priority,
        which a warm restart adopts it at. Raises OSError (ENOSPC for a full disk) with
        nothing left behind."""
        tmp = self.write_temp(block_hash, row, priority=priority, salt_root=salt_root)
        try:
            os.replace(tmp, self.path(block_hash))
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def write_temp(
        self,
        block_hash: int,
        row: torch.Tensor,
        priority: int = 0,
        salt_root: int = 0,
        durable: bool = False,
    ) -> Path:
        """row (one block's KV) as a whole block file under a temporary name of this process's
        (the caller renames or links it into place). priority, salt_root: the eviction hint
        kept in the header's last bytes, outside its checksum (only eviction reads it, never a
        load). durable: fsync before returning. Raises OSError with nothing left behind."""
        staged = self._staging[0]
        staged.copy_(row)
        header = self._header(block_hash, _checksum(staged))
        tmp = self.dir / f".{block_hash:016x}.{_HOST}-{self._name}.tmp"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            try:
                os.posix_fallocate(fd, 0, self.file_bytes)
                os.pwrite(fd, header, 0)
                hint = PRIORITY_TAG + HINT.pack(priority, salt_root)
                os.pwrite(fd, hint, HEADER_BYTES - len(hint))
                self._transfer("WRITE", fd)
                if durable:
                    os.fsync(fd)
            finally:
                os.close(fd)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return tmp

    def read(self, block_hash: int) -> torch.Tensor:
        """block_hash's KV, checked against its header (a fresh CPU tensor). Raises
        BlockFileError for a file that must not be loaded."""
        path = self.path(block_hash)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError as e:
            raise BlockFileError(f"{path.name}: missing") from e
        try:
            size = os.fstat(fd).st_size
            if size != self.file_bytes:
                raise BlockFileError(
                    f"{path.name}: {size} bytes, a block file has {self.file_bytes}"
                )
            want_sum = self._check_header(os.pread(fd, HEADER_BYTES, 0), block_hash, path.name)
            self._transfer("READ", fd)
        finally:
            os.close(fd)
        if _checksum(self._staging[0]) != want_sum:
            raise BlockFileError(f"{path.name}: payload checksum mismatch")
        return self._staging[0].clone()

    def remove(self, block_hash: int) -> None:
        self.path(block_hash).unlink(missing_ok=True)

    def set_priority(self, block_hash: int, priority: int) -> None:
        """Record a new retention priority in the block's file (raised or lowered after it was
        written; a warm restart adopts it); nothing when the file is not there (yet)."""
        try:
            fd = os.open(self.path(block_hash), os.O_WRONLY)
        except OSError:
            return
        try:
            os.pwrite(fd, _TAGGED.pack(PRIORITY_TAG, priority), _TAGGED_AT)
        finally:
            os.close(fd)

    def hint(self, block_hash: int) -> tuple[int, int] | None:
        """The file's eviction hint (priority, salt root); None when it is gone."""
        try:
            fd = os.open(self.path(block_hash), os.O_RDONLY)
        except OSError:
            return None
        try:
            raw = os.pread(fd, HINT.size, HEADER_BYTES - HINT.size)
        finally:
            os.close(fd)
        return HINT.unpack(raw) if len(raw) == HINT.size else None

    def _transfer(self, op: str, fd: int) -> None:
        """The staging row to (WRITE) or from (READ) the payload of the open file fd."""
        region = (HEADER_BYTES, self.payload_bytes, fd)
        transfer_once(
            self._agent, self._name, op, self._row_descs, "FILE", (*region, ""), region,
            f"NIXL POSIX {op} of a KV block file failed",
        )  # fmt: skip

    # ---- warm restart ---------------------------------------------------------------------
    def scan(self) -> ScanResult:
        """The blocks already here whose header is this layout's and whose size is whole
        (oldest first, by modification time); others here are removed. Payload checksums are
        checked when a block is loaded."""
        found: list[tuple[float, int]] = []
        priorities: dict[int, int] = {}
        num_invalid = 0
        for path in self.dir.iterdir():
            if not path.name.endswith(SUFFIX):
                if path.name.endswith(".tmp"):  # a write cut short (a crash)
                    path.unlink(missing_ok=True)
                    num_invalid += 1
                continue
            try:
                block_hash = int(path.name.removesuffix(SUFFIX), 16)
                stat = path.stat()
                if stat.st_size != self.file_bytes:
                    raise BlockFileError(f"{path.name}: {stat.st_size} bytes")
                with path.open("rb") as f:
                    header = f.read(HEADER_BYTES)
                self._check_header(header, block_hash, path.name)
            except (ValueError, BlockFileError, OSError):
                path.unlink(missing_ok=True)
                num_invalid += 1
                continue
            found.append((stat.st_mtime, block_hash))
            recorded = _recorded(header[_TAGGED_AT : _TAGGED_AT + _TAGGED.size])
            if recorded is not None:
                priorities[block_hash] = recorded
        others = [p for p in self.root.iterdir() if p.is_dir() and p.name != self.layout.key]
        num_other = sum(1 for d in others for p in d.iterdir() if p.name.endswith(SUFFIX))
        return ScanResult([h for _, h in sorted(found)], num_invalid, num_other, priorities)


def _recorded(raw: bytes) -> int | None:
    """The priority in a tagged hint's bytes (clamped to 0..100: outside the checksum), or
    None when untagged (recorded none)."""
    if len(raw) != _TAGGED.size:
        return None
    tag, priority = _TAGGED.unpack(raw)
    return min(100, max(0, priority)) if tag == PRIORITY_TAG else None


def _checksum(row: torch.Tensor) -> int:
    return xxhash.xxh3_64_intdigest(row.contiguous().view(torch.uint8).numpy().data)


def transfer_once(
    agent: Any,
    agent_name: str,
    op: str,
    local: Any,
    backend: str,
    registered: tuple[int, int, int, str],
    region: tuple[int, int, int],
    failed: str,
    quiet_release: bool = False,
) -> None:
    """One NIXL transfer, waited for, between local (a registered buffer's descriptors) and
    region (offset, length, dev id) of backend's memory `registered` (registered for it alone:
    a file's fd, an object's key). OSError(EIO, failed) when NIXL reports it failed;
    quiet_release: an error releasing the transfer's handle is not raised."""
    reg = agent.register_memory([registered], backend)
    handle = None
    try:
        remote = agent.get_xfer_descs([region], backend)
        handle = agent.initialize_xfer(op, local, remote, agent_name)
        state = agent.transfer(handle)
        while state not in ("DONE", "ERR"):
            state = agent.check_xfer_state(handle)
        if state == "ERR":
            raise OSError(errno.EIO, failed)
    finally:
        if handle is not None:
            with contextlib.suppress(*((Exception,) if quiet_release else ())):
                agent.release_xfer_handle(handle)
        agent.deregister_memory(reg)
