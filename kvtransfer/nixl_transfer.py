"""NixlTransfer: KVTransfer over a NIXL agent with the UCX backend.

Owns the NIXL agent, the registration of this side's KV tensor, the table of known peers
(name -> metadata) and the reads in flight (xfer_id -> NIXL handles, deadline, state).
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from kvtransfer.base import (
    AgentMetadata,
    KVTransfer,
    KVTransferError,
    Notification,
    TransferHandle,
    TransferState,
)
from kvtransfer.handshake import PROTOCOL_VERSION, check_compatible, compat_hash, head_sources
from kvtransfer.layout import (
    Descriptor,
    DescriptorPairs,
    block_descriptors,
    head_slice_descriptors,
    split_descriptors,
)
from kvtransfer.nixl_agent import (
    BACKEND,
    DEFAULT_PROGRESS_DELAY_US,
    MEM_TYPES,
    check_kv_tensor,
    configure_ucx,
    make_agent,
)

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 30.0
DEFAULT_MIN_PART_BYTES = 16 << 20


@dataclass
class _Read:
    """One read in flight (mutable, private to NixlTransfer): one NIXL READ per part."""

    xfers: list[Any]  # nixl_xfer_handles not yet released
    pending: list[Any]  # the parts not yet seen DONE
    peer: str
    deadline: float
    notif_msg: bytes = b""  # sent on its own once every part is DONE (reads of 2+ parts)
    state: TransferState = TransferState.PENDING
    failure: str | None = None


def _desc_array(descs: list[Descriptor]) -> np.ndarray:
    return np.array(descs, dtype=np.uint64).reshape(-1, 3)


class NixlTransfer(KVTransfer):
    """KVTransfer through one NIXL agent (UCX backend); CPU (DRAM) and CUDA (VRAM) tensors.

    The agent is created in `register`, once the tensor's device (and so UCX_TLS) is known.
    Each `read` coalesces adjacent blocks, then posts up to `max_parts_per_read` concurrent
    NIXL READs of nearly equal bytes (layout.split_descriptors; meant for transports that
    spread concurrent copies; on one H200 pair's cuda_ipc it gained nothing, so the default is
    one). With one part, the notification rides on the READ; with several, it is sent with
    `send_notif` once `poll` has seen every part DONE.
    """

    def __init__(
        self,
        model_id: str,
        agent_name: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        progress_delay_us: int = DEFAULT_PROGRESS_DELAY_US,
        max_parts_per_read: int = 1,
        min_part_bytes: int = DEFAULT_MIN_PART_BYTES,
        progress_thread: bool = True,
    ) -> None:
        """timeout_s: deadline of each read; progress_delay_us, progress_thread: see
        nixl_agent.make_agent; a read is split into at most max_parts_per_read parts of at
        least min_part_bytes."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if max_parts_per_read < 1:
            raise ValueError(f"max_parts_per_read must be >= 1, got {max_parts_per_read}")
        if min_part_bytes < 0:
            raise ValueError(f"min_part_bytes must be >= 0, got {min_part_bytes}")
        self.model_id = model_id
        self.agent_name = agent_name or f"kvrelay-{uuid.uuid4().hex[:12]}"
        self.timeout_s = timeout_s
        self.progress_delay_us = progress_delay_us
        self.max_parts_per_read = max_parts_per_read
        self.min_part_bytes = min_part_bytes
        self.progress_thread = progress_thread  # False only where nothing reads from us
        self._agent: Any = None  # nixl_agent
        self._reg_descs: Any = None
        self._reg_host_descs: Any = None
        self._kv_tensor: torch.Tensor | None = None
        self._host_tensor: torch.Tensor | None = None
        self._meta: AgentMetadata | None = None
        self._peers: dict[str, AgentMetadata] = {}
        self._reads: dict[int, _Read] = {}
        self._next_xfer_id = 0

    @property
    def num_open_handles(self) -> int:
        """Reads issued and not yet released (0 when nothing leaks)."""
        return len(self._reads)

    # -- setup -------------------------------------------------------------------------------

    def register(  # type: ignore[override]
        self, kv_tensor: torch.Tensor, host_tensor: torch.Tensor | None = None
    ) -> None:
        if self._meta is not None:
            raise RuntimeError(f"agent {self.agent_name!r} already registered a KV tensor")
        device_kind, device_id = check_kv_tensor(kv_tensor)
        configure_ucx(device_kind)
        mem_type = MEM_TYPES[device_kind]
        base_addr = kv_tensor.data_ptr()
        num_bytes = kv_tensor.numel() * kv_tensor.element_size()
        # UCX registers VRAM in the current CUDA context: make it the tensor's device's.
        on_device = torch.cuda.device(device_id) if device_kind == "cuda" else nullcontext()
        try:
            with on_device:
                self._agent = make_agent(
                    self.agent_name, self.progress_delay_us, self.progress_thread
                )
                self._reg_descs = self._agent.register_memory(
                    [(base_addr, num_bytes, device_id, "")], mem_type, backends=[BACKEND]
                )
                if host_tensor is not None:
                    host_bytes = host_tensor.numel() * host_tensor.element_size()
                    self._reg_host_descs = self._agent.register_memory(
                        [(host_tensor.data_ptr(), host_bytes, 0, "")], "DRAM", backends=[BACKEND]
                    )
            nixl_md = self._agent.get_agent_metadata()
        except KVTransferError:
            raise
        except Exception as e:
            self._agent = None
            raise KVTransferError(
                f"NIXL could not register {num_bytes} B of {mem_type} "
                f"for {self.agent_name!r}: {e!r}"
            ) from e
        self._kv_tensor = kv_tensor  # keep the memory alive while registered
        self._host_tensor = host_tensor
        self._meta = _describe(self.agent_name, self.model_id, kv_tensor, bytes(nixl_md))
        if host_tensor is not None:
            self._meta = replace(
                self._meta,
                host_base_addr=host_tensor.data_ptr(),
                host_num_blocks=int(host_tensor.shape[0]),
            )

    def metadata(self) -> AgentMetadata:
        return self._require_meta()

    def set_layout(
        self,
        tp_size: int,
        kv_head_start: int,
        num_model_kv_heads: int,
        rank_agents: Sequence[AgentMetadata] = (),
    ) -> None:
        """A tensor-parallel rank's cache: it holds block_shape[2] of the model's
        num_model_kv_heads KV heads from kv_head_start; rank 0's carries its other ranks'
        agents (registered in their own processes), which peers read their heads from."""
        meta = self._require_meta()
        heads = meta.block_shape[2]
        if not 0 <= kv_head_start <= num_model_kv_heads - heads:
            raise ValueError(
                f"KV heads [{kv_head_start}, {kv_head_start + heads}) are not within the "
                f"model's {num_model_kv_heads}"
            )
        meta = replace(
            meta,
            tp_size=tp_size,
            kv_head_start=kv_head_start,
            num_model_kv_heads=num_model_kv_heads,
            rank_agents=tuple(rank_agents),
        )
        self._meta = replace(
            meta,
            compat_hash=compat_hash(
                meta.model_id, meta.dtype, meta.block_size, meta.model_block_shape
            ),
        )

    def set_kv_scales(self, kv_scales: Sequence[tuple[float, float]]) -> None:
        """The per-layer (k_scale, v_scale) this side's fp8 blocks are stored with."""
        scales = tuple((float(k), float(v)) for k, v in kv_scales)
        self._meta = replace(self._require_meta(), kv_scales=scales)

    def add_peer(self, meta: AgentMetadata) -> str:
        local = self._require_meta()
        check_compatible(local, meta)
        name = meta.agent_name
        if name == self.agent_name:
            raise ValueError(f"cannot add agent {name!r} as its own peer")
        known = self._peers.get(name)
        if known == meta:
            return name
        if known is not None:  # same name, new metadata: the peer restarted
            self.remove_peer(name)
        connected: list[str] = []
        try:
            for rank in meta.ranks:  # a TP peer: every rank's agent (each its own heads)
                loaded = self._agent.add_remote_agent(rank.nixl_metadata)
                loaded = loaded.decode() if isinstance(loaded, bytes) else loaded
                connected.append(loaded)
                if loaded != rank.agent_name:
                    raise KVTransferError(
                        f"NIXL metadata names agent {loaded!r}, expected {rank.agent_name!r}"
                    )
                self._agent.make_connection(rank.agent_name, backends=[BACKEND])
        except Exception as e:
            for agent in connected:
                try:
                    self._agent.remove_remote_agent(agent)
                except Exception as remove_error:
                    logger.warning("NIXL could not remove agent %r: %r", agent, remove_error)
            if isinstance(e, KVTransferError):
                raise
            raise KVTransferError(
                f"could not connect to peer {name!r} ({meta.device_kind}, "
                f"UCX_TLS={os.environ.get('UCX_TLS')!r}): {e!r}"
            ) from e
        self._peers[name] = meta
        return name

    def remove_peer(self, peer: str) -> None:
        if peer not in self._peers:
            raise ValueError(f"unknown peer {peer!r}")
        for read in self._reads.values():
            if read.peer == peer and read.state is TransferState.PENDING:
                self._fail(read, f"peer {peer!r} was removed")
        for rank in self._peers.pop(peer).ranks:
            try:
                self._agent.remove_remote_agent(rank.agent_name)
            except Exception as e:
                logger.warning("NIXL could not remove peer %r: %r", rank.agent_name, e)

    # -- reads -------------------------------------------------------------------------------

    def read(
        self,
        peer: str,
        remote_block_ids: Sequence[int],
        local_block_ids: Sequence[int],
        notif_msg: bytes = b"",
        num_remote_host: int = 0,
    ) -> TransferHandle:
        local = self._require_meta()
        remote = self._peers.get(peer)
        if remote is None:
            raise ValueError(f"unknown peer {peer!r}; call add_peer with its metadata first")
        h = num_remote_host
        if not 0 <= h <= min(len(remote_block_ids), len(local_block_ids)):
            raise ValueError(f"num_remote_host {h} is out of range")
        if h and not all(rank.host_num_blocks for rank in remote.ranks):
            raise ValueError(f"peer {peer!r} registered no host tier to read from")
        if remote.ranks != (remote,) or local.kv_heads != remote.kv_heads:
            parts = self._head_slice_parts(local, local_block_ids, remote, remote_block_ids, h)
            return self._start(peer, parts, notif_msg, len(local_block_ids))
        parts: list[tuple[DescriptorPairs, str, str]] = []
        num_descs = 0  # coalesced, before any cutting into parts
        if h:  # one part from the peer's host memory
            host_pairs = block_descriptors(
                local.region(), local_block_ids[:h], remote.host_region(), remote_block_ids[:h]
            )
            parts.append((host_pairs, "DRAM", peer))
            num_descs += len(host_pairs[0])
        if h < len(local_block_ids) or not h:
            local_descs, remote_descs = block_descriptors(
                local.region(), local_block_ids[h:], remote.region(), remote_block_ids[h:]
            )
            device_parts = split_descriptors(
                local_descs,
                remote_descs,
                self.max_parts_per_read,
                local.block_bytes,
                self.min_part_bytes,
            )
            parts += [(pair, MEM_TYPES[remote.device_kind], peer) for pair in device_parts]
            num_descs += len(local_descs)
        return self._start(peer, parts, notif_msg, len(local_block_ids), num_descs)

    def _head_slice_parts(
        self,
        local: AgentMetadata,
        local_block_ids: Sequence[int],
        remote: AgentMetadata,
        remote_block_ids: Sequence[int],
        num_host: int = 0,
    ) -> list[tuple[DescriptorPairs, str, str]]:
        """One part a remote rank and memory: the (block, layer, k|v) slices of the heads it
        holds that this side holds too (handshake.head_sources), straight into this side's
        blocks; the first num_host remote ids are slots of that rank's own host tier (DRAM),
        the rest its device blocks."""
        parts = []
        for rank, heads in head_sources(local, remote):
            spans = [(rank.region(), MEM_TYPES[rank.device_kind], slice(num_host, None))]
            if num_host:
                spans.insert(0, (rank.host_region(), "DRAM", slice(0, num_host)))
            for region, mem_type, span in spans:
                if not local_block_ids[span]:
                    continue
                pairs = head_slice_descriptors(
                    local.region(),
                    local.kv_heads,
                    local_block_ids[span],
                    region,
                    rank.kv_heads,
                    remote_block_ids[span],
                    heads,
                    local.block_shape[0],
                )
                parts.append((pairs, mem_type, rank.agent_name))
        return parts

    def _start(
        self,
        peer: str,
        parts: list[tuple[DescriptorPairs, str, str]],
        notif_msg: bytes,
        num_blocks: int,
        num_descs: int | None = None,
    ) -> TransferHandle:
        """Post one READ a part; notif_msg goes to peer with the only part, or on its own
        once every part is done."""
        if num_descs is None:
            num_descs = sum(len(pairs[0]) for pairs, _, _ in parts)
        one_part = len(parts) == 1 and parts[0][2] == peer
        xfers = self._init_xfers(parts, notif_msg if one_part else b"", num_blocks)
        read = _Read(
            xfers,
            list(xfers),
            peer,
            deadline=time.monotonic() + self.timeout_s,
            notif_msg=b"" if one_part else notif_msg,
        )
        self._post(read)
        handle = TransferHandle(self._next_xfer_id, peer, num_blocks, num_descs)
        self._next_xfer_id += 1
        self._reads[handle.xfer_id] = read
        return handle

    def poll(self, handle: TransferHandle) -> TransferState:
        read = self._get_read(handle)
        if read.state is not TransferState.PENDING:
            return read.state
        for xfer in list(read.pending):
            try:
                status = self._agent.check_xfer_state(xfer)
            except Exception as e:
                self._fail(read, f"NIXL transfer error: {e!r}")
                return read.state
            if status == "DONE":
                read.pending.remove(xfer)
            elif status == "ERR":
                self._fail(read, "NIXL reported a transfer error")
                return read.state
        if not read.pending:
            self._complete(read)
        elif time.monotonic() > read.deadline:
            self._fail(read, f"timed out after {self.timeout_s} s")
        return read.state

    def failure_reason(self, handle: TransferHandle) -> str | None:
        return self._get_read(handle).failure

    def release(self, handle: TransferHandle) -> None:
        read = self._get_read(handle)
        errors, cancelled = [], False
        for xfer in list(read.xfers):  # every part, even after one fails
            try:
                xfer.release()  # cancels a transfer still in flight
            except Exception as e:
                errors.append(e)
                continue
            read.xfers.remove(xfer)
            if xfer in read.pending:
                read.pending.remove(xfer)
                cancelled = True
        if errors:
            if cancelled and read.state is TransferState.PENDING:  # it can no longer complete
                self._fail(read, "partly cancelled by a release that failed")
            raise KVTransferError(
                f"NIXL could not release/cancel {len(errors)} part(s) of the read from "
                f"{handle.peer!r} (its local blocks may still be written; release again "
                f"later): {errors[0]!r}"
            ) from errors[0]
        del self._reads[handle.xfer_id]

    def notify(self, peer: str, msg: bytes) -> None:
        if peer not in self._peers:
            raise ValueError(f"unknown peer {peer!r}; call add_peer with its metadata first")
        try:
            # No backend argument: NIXL's wrapper passes it to genNotif in a form it refuses.
            self._agent.send_notif(peer, msg)
        except Exception as e:
            raise KVTransferError(f"could not notify {peer!r}: {e!r}") from e

    def get_notifs(self) -> list[Notification]:
        if self._agent is None:
            return []
        notifs = self._agent.get_new_notifs()
        return [
            Notification(peer.decode() if isinstance(peer, bytes) else peer, bytes(msg))
            for peer, msgs in notifs.items()
            for msg in msgs
        ]

    def close(self) -> None:
        if self._agent is None:
            return
        for xfer_id in list(self._reads):
            for xfer in self._reads.pop(xfer_id).xfers:
                try:
                    xfer.release()
                except Exception as e:
                    logger.warning("%r: read %d not released: %r", self.agent_name, xfer_id, e)
        for peer in list(self._peers):
            self.remove_peer(peer)
        try:
            self._agent.deregister_memory(self._reg_descs, backends=[BACKEND])
            if self._reg_host_descs is not None:
                self._agent.deregister_memory(self._reg_host_descs, backends=[BACKEND])
        except Exception as e:
            logger.warning("closing %r: deregister failed: %r", self.agent_name, e)
        self._agent = self._reg_descs = self._reg_host_descs = None
        self._kv_tensor = self._host_tensor = None

    # -- helpers -----------------------------------------------------------------------------

    def _require_meta(self) -> AgentMetadata:
        if self._meta is None or self._agent is None:
            raise RuntimeError(f"agent {self.agent_name!r}: no KV tensor registered, or closed")
        return self._meta

    def _get_read(self, handle: TransferHandle) -> _Read:
        read = self._reads.get(handle.xfer_id)
        if read is None:
            raise ValueError(f"unknown or already released transfer handle {handle}")
        return read

    def _init_xfers(
        self,
        parts: list[tuple[DescriptorPairs, str, str]],
        notif_msg: bytes,
        num_blocks: int,
    ) -> list[Any]:
        """One NIXL READ handle per part (not posted), each with the remote memory type and
        agent it reads; none is left behind if one is refused."""
        local_mem = MEM_TYPES[self._require_meta().device_kind]
        xfers: list[Any] = []
        peer = parts[0][2] if parts else ""
        try:
            for (local_descs, remote_descs), remote_mem, peer in parts:
                xfers.append(
                    self._agent.initialize_xfer(
                        "READ",
                        self._agent.get_xfer_descs(_desc_array(local_descs), local_mem),
                        self._agent.get_xfer_descs(_desc_array(remote_descs), remote_mem),
                        peer,
                        notif_msg,
                        backends=[BACKEND],
                    )
                )
        except Exception as e:
            for xfer in xfers:
                try:
                    xfer.release()
                except Exception as release_error:
                    logger.warning("%r: unposted READ not released: %r", peer, release_error)
            raise KVTransferError(
                f"NIXL refused a READ of {num_blocks} blocks from {peer!r}: {e!r}"
            ) from e
        return xfers

    def _post(self, read: _Read) -> None:
        """Post every part; a part that fails to post fails the read (release cancels it)."""
        for xfer in read.xfers:
            try:
                status = self._agent.transfer(xfer)
            except Exception as e:
                self._fail(read, f"posting the READ failed: {e!r}")
                return
            if status == "ERR":
                self._fail(read, "NIXL reported an error posting the READ")
                return
            if status == "DONE":
                read.pending.remove(xfer)
        if not read.pending:
            self._complete(read)

    def _complete(self, read: _Read) -> None:
        """Every part is DONE: send the notification a split read could not carry, then DONE."""
        if read.notif_msg:
            try:
                # No backend argument: NIXL's wrapper passes it to genNotif in a form it refuses.
                self._agent.send_notif(read.peer, read.notif_msg)
            except Exception as e:
                self._fail(read, f"the read completed but notifying {read.peer!r} failed: {e!r}")
                return
        read.state = TransferState.DONE

    def _fail(self, read: _Read, reason: str) -> None:
        read.state = TransferState.FAILED
        read.failure = reason
        logger.warning("agent %r: read failed: %s", self.agent_name, reason)


def _describe(agent_name: str, model_id: str, kv: torch.Tensor, nixl_md: bytes) -> AgentMetadata:
    """This side's AgentMetadata for a registered (already validated) KV tensor."""
    device_kind, device_id = check_kv_tensor(kv)
    dtype = str(kv.dtype).removeprefix("torch.")
    block_shape = tuple(int(d) for d in kv.shape[1:])
    block_size = block_shape[3]  # [L, 2, Hkv, block_size, D]
    # (set_layout recomputes the hash over every KV head of the model for a TP rank)
    return AgentMetadata(
        agent_name=agent_name,
        protocol_version=PROTOCOL_VERSION,
        compat_hash=compat_hash(model_id, dtype, block_size, block_shape),
        model_id=model_id,
        dtype=dtype,
        block_size=block_size,
        block_shape=block_shape,
        nixl_metadata=nixl_md,
        base_addr=kv.data_ptr(),
        num_blocks=int(kv.shape[0]),
        block_bytes=kv[0].numel() * kv.element_size(),
        device_kind=device_kind,
        device_id=device_id,
    )
