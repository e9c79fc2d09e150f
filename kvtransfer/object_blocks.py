"""ObjectBlockFiles: the cluster-shared KV store's blocks as objects of an S3-compatible store,
written and read through NIXL's object backend (OBJ). It owns its NIXL agent, one registered
staging buffer (a whole object: header then KV) and a small one for eviction hints; the bucket
is the store, and which blocks it holds is whatever objects are under its prefix.

The same bytes as a disk tier block file (kvtransfer/disk_blocks.py: header, checksums, hint),
as object `<prefix>/<layout key>/<chained block hash>.kvb`. One writer a block: a writer asks
whether the object exists (HEAD) and PUTs it whole otherwise; a PUT is atomic (a reader never
sees part of one), so two writers racing on one block leave one whole copy, either's (both hold
that block's KV). A read fetches the whole object into a zeroed buffer and checks header and
payload checksum (a truncated object reads as zeros past its end: a checksum mismatch). Age is
the object's LastModified (publish time: S3 has no access time, so a hit does not refresh it).
Listing and deletion, which NIXL's backend does not do, go through kvtransfer/s3_control.py.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import itertools
import logging
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import torch

from kvtransfer.base import KVTransferError
from kvtransfer.disk_blocks import (
    HEADER_BYTES,
    HINT,
    SUFFIX,
    BlockFileError,
    BlockFormat,
    DiskLayout,
    _checksum,
    transfer_once,
)
from kvtransfer.nixl_agent import import_nixl_api
from kvtransfer.s3_control import S3Control, S3Location
from kvtransfer.shared_blocks import SharedEntry

log = logging.getLogger(__name__)

BACKEND = "OBJ"
# After a HEAD that fails (the store did not answer), it is not asked again this long: lookups
# miss and publishes are refused at once instead of each waiting out the SDK's retries.
DOWN_S = 30.0
# The AWS SDK's default (legacy) retries wait ~25 s for a store that refuses connections; the
# standard mode gives up after 3 attempts (~1 s). The user's own setting wins.
SDK_RETRY_MODE = "standard"
_AGENT_SEQ = itertools.count(1)
_SHIM_SOURCE = Path(__file__).parent / "csrc" / "cuobj_loader_shim.cpp"
_CUOBJ = "libcuobjclient.so.1"
_plugin_lock = threading.Lock()
_plugin_ready = False


class ObjectBlockFiles(BlockFormat):
    """Block objects of one layout under an S3 location. Synchronous: each call returns once
    its request is done. OSError for a store that cannot be reached or refuses a write."""

    AGENT_PREFIX = "kvrelay-object"

    def __init__(
        self, location: S3Location, layout: DiskLayout, dtype: torch.dtype, cache_dir: Path
    ):
        """cache_dir: kvrelay's cache (Settings.cache_dir), where a stand-in for NIXL's OBJ
        plugin dependency is built when the host lacks it (make_object_agent)."""
        super().__init__(layout, dtype)
        self.location = location
        self.control = S3Control(location)
        self.key_prefix = location.key(layout.key) + "/"
        self.dir = f"{location.url}/{layout.key} at {location.endpoint}"  # for log lines
        self._buf = torch.zeros(self.file_bytes, dtype=torch.uint8)
        self._payload = self._buf[HEADER_BYTES:].view(dtype).view(layout.row_shape)
        self._hint = torch.zeros(HINT.size, dtype=torch.uint8)
        self._name = f"{self.AGENT_PREFIX}-{os.getpid()}-{next(_AGENT_SEQ)}"
        self._agent = make_object_agent(self._name, location, cache_dir)
        self._agent.register_memory(self._buf)
        self._agent.register_memory(self._hint)
        self._buf_descs = self._agent.get_xfer_descs(self._buf)
        self._hint_descs = self._agent.get_xfer_descs(self._hint)
        self._dev_ids = itertools.count(1)
        self._down_until = 0.0  # time.monotonic() before which the store is not asked

    def key(self, block_hash: int) -> str:
        return f"{self.key_prefix}{block_hash:016x}{SUFFIX}"

    def exists(self, block_hash: int) -> bool:
        """Whether the store has the block's object (False too when it cannot be asked: a
        lookup misses, a publish then fails and says why; the store is then not asked for
        DOWN_S)."""
        if time.monotonic() < self._down_until:
            return False
        try:
            found = self._agent.query_memory([(0, 0, 0, self.key(block_hash))], BACKEND, "OBJ")
        except Exception:  # NIXL raises its own types; an unreachable store is a miss
            self._down_until = time.monotonic() + DOWN_S
            return False
        return found[0] is not None

    def _check_up(self) -> None:
        if time.monotonic() < self._down_until:
            raise OSError(
                errno.EHOSTDOWN,
                f"a HEAD request to the object store at {self.location.endpoint} failed "
                f"(unreachable, or the credentials refused); asked again within {DOWN_S:.0f} s",
            )

    def publish(
        self, block_hash: int, row: torch.Tensor, priority: int, salt_root: int = 0
    ) -> bool:
        """Put row as block_hash's object unless one is there: True when this call wrote it.
        Raises OSError when the store refused it or did not answer (nothing is left behind: a
        PUT is whole)."""
        if self.exists(block_hash):
            return False
        self._check_up()
        self._payload.copy_(row)
        header = self._header(block_hash, _checksum(self._payload))
        raw = self._buf[:HEADER_BYTES]
        raw.zero_()
        raw[: len(header)] = torch.frombuffer(bytearray(header), dtype=torch.uint8)
        hint = HINT.pack(priority, salt_root)
        raw[HEADER_BYTES - HINT.size :] = torch.frombuffer(bytearray(hint), dtype=torch.uint8)
        self._transfer("WRITE", self._buf_descs, block_hash, 0, self.file_bytes)
        return True

    def read(self, block_hash: int) -> torch.Tensor:
        """block_hash's KV, checked against its header (a fresh CPU tensor). Raises
        BlockFileError for an object that must not be loaded (missing, truncated, corrupt)."""
        name = self.key(block_hash).rpartition("/")[2]
        self._buf.zero_()  # an object shorter than a block leaves zeros, never another's bytes
        try:
            self._transfer("READ", self._buf_descs, block_hash, 0, self.file_bytes)
        except OSError as e:
            raise BlockFileError(f"{name}: missing or unreadable ({e})") from e
        raw = self._buf[:HEADER_BYTES].numpy().tobytes()
        want_sum = self._check_header(raw, block_hash, name)
        if _checksum(self._payload) != want_sum:
            raise BlockFileError(f"{name}: payload checksum mismatch")
        return self._payload.clone()

    def remove(self, block_hash: int) -> None:
        self.control.delete(self.key(block_hash))

    def hint(self, block_hash: int) -> tuple[int, int] | None:
        """The object's eviction hint (priority, salt root); None when it cannot be read."""
        try:
            self._transfer(
                "READ", self._hint_descs, block_hash, HEADER_BYTES - HINT.size, HINT.size
            )
        except OSError:
            return None
        return HINT.unpack(self._hint.numpy().tobytes())

    def entries(self) -> list[SharedEntry]:
        """Every block object of this layout now (any order): one listing, then each one's
        hint (a ranged read of 16 bytes). Raises OSError when the store cannot be listed."""
        self._check_up()
        found = []
        for obj in self.control.list(self.key_prefix):
            name = obj.key[len(self.key_prefix) :]
            if "/" in name or not name.endswith(SUFFIX):
                continue
            try:
                block_hash = int(name.removesuffix(SUFFIX), 16)
            except ValueError:
                continue
            priority, salt_root = (
                self.hint(block_hash) if obj.size == self.file_bytes else None
            ) or (0, 0)
            found.append(SharedEntry(priority, obj.mtime, block_hash, salt_root))
        return found

    def _transfer(self, op: str, local: Any, block_hash: int, offset: int, length: int) -> None:
        """local (a registered buffer's descriptors) to (WRITE: the whole object) or from
        (READ: length bytes at offset) block_hash's object."""
        key = self.key(block_hash)
        dev_id = next(self._dev_ids)
        try:
            transfer_once(
                self._agent, self._name, op, local, BACKEND, (0, offset + length, dev_id, key),
                (offset, length, dev_id), f"NIXL OBJ {op} of {key} failed", quiet_release=True,
            )  # fmt: skip
        except OSError:
            raise
        except Exception as e:  # NIXL raises its own types (a missing object, a refusal)
            raise OSError(errno.EIO, f"NIXL OBJ {op} of {key} failed: {e}") from e


def make_object_agent(name: str, location: S3Location, cache_dir: Path) -> Any:
    """A NIXL agent with only the OBJ backend, for location's bucket and endpoint (path-style
    addressing); the plugin's dependency made loadable first (built under cache_dir when the
    host lacks it). Credentials: the AWS SDK's own chain (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY
    / AWS_SESSION_TOKEN, a profile, an instance role); kvrelay never reads them into a message
    or a log line."""
    _load_plugin_dependency(cache_dir)
    os.environ.setdefault("AWS_RETRY_MODE", SDK_RETRY_MODE)  # read when the client is made
    api = import_nixl_api()
    scheme, _, _ = location.endpoint.partition("://")
    params = {
        "bucket": location.bucket,
        "endpoint_override": location.endpoint,
        "scheme": scheme,
        "region": location.region,
        "use_virtual_addressing": "false",
    }
    try:
        agent = api.nixl_agent(name, api.nixl_agent_config(backends=[]))
        agent.create_backend(BACKEND, params)
    except Exception as e:  # NIXL raises its own types
        raise KVTransferError(
            f"NIXL's object backend (OBJ) did not start for {location.url} at "
            f"{location.endpoint}: {e!r} (NIXL_LOG_LEVEL=INFO says why a plugin did not load)"
        ) from e
    return agent


def _load_plugin_dependency(cache_dir: Path) -> None:
    """Make NIXL's OBJ plugin loadable: it links libcuobjclient.so.1 (NVIDIA's GPUDirect object
    client, for its accelerated engine only), which a host without GPUDirect storage lacks.
    The real library when it loads, else the stand-in (csrc/cuobj_loader_shim.cpp, every call
    failing), built once per cache_dir with g++."""
    global _plugin_ready
    with _plugin_lock:
        if _plugin_ready:
            return
        try:
            ctypes.CDLL(_CUOBJ, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            ctypes.CDLL(str(build_shim(cache_dir)), mode=ctypes.RTLD_GLOBAL)
        _plugin_ready = True


def build_shim(cache: Path) -> Path:
    """The stand-in library under cache (built there with g++ unless it is there already)."""
    source = _SHIM_SOURCE.read_bytes()
    lib = cache / f"cuobjclient-shim-{hashlib.sha256(source).hexdigest()[:12]}.so"
    if lib.exists():
        return lib
    compiler = shutil.which("g++")
    if compiler is None:
        raise KVTransferError(
            f"NIXL's OBJ plugin needs {_CUOBJ}, which is not installed, and g++ (to build its "
            "stand-in) is not on PATH: install g++ (make deps does)"
        )
    cache.mkdir(parents=True, exist_ok=True)
    tmp = lib.with_suffix(f".{os.getpid()}.tmp")
    command = [compiler, "-O1", "-shared", "-fPIC", f"-Wl,-soname,{_CUOBJ}", "-o", str(tmp)]
    try:
        subprocess.run([*command, str(_SHIM_SOURCE)], check=True, capture_output=True)
        os.replace(tmp, lib)
    except subprocess.CalledProcessError as e:
        raise KVTransferError(
            f"building the {_CUOBJ} stand-in failed: {e.stderr.decode(errors='replace')}"
        ) from e
    finally:
        tmp.unlink(missing_ok=True)
    log.info("built a %s stand-in for NIXL's OBJ plugin at %s", _CUOBJ, lib)
    return lib
