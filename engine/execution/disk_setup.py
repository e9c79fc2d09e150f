"""Builds an engine's disk KV tier (and the cluster-shared store below it) at start: its files
(kvtransfer/disk_blocks.py, through NIXL's POSIX backend; the shared store's objects, for an
object store, through its OBJ backend) over the engine's KV layout, its size bound, the reader
of its prefix hits behind the step (a files object of its own: its own NIXL agent and staging
row; an engine of one rank), the shared store's reader and publisher (one files object each),
and the blocks a previous run left in its directory (a warm restart): the folder it claims under
disk_kv_path, which no other live worker holds (kvtransfer/disk_claims.py; a tensor-parallel
engine's ranks keep their files in the folder rank 0 claimed). Owns no state: the KV manager
keeps the tier.
"""

from __future__ import annotations

import logging
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.config import CacheConfig, StartRefused, is_object_store
from engine.kv_cache.block_pool import DEFAULT_PRIORITY
from engine.kv_cache.block_publishes import BlockPublishes, Published, PublishJob
from engine.kv_cache.block_reads import BlockReads
from engine.kv_cache.disk_tier import DiskTier
from engine.kv_cache.shared_store import SharedStore
from engine.parallel.disk_ranks import RankDisk, RankedBlockFiles, rank_disk_path
from kvtransfer.disk_blocks import BlockFileError, DiskBlockFiles, DiskLayout
from kvtransfer.disk_claims import MAX_FOLDERS, claim_folder, claimed_folder, release_folder
from kvtransfer.object_blocks import ObjectBlockFiles
from kvtransfer.s3_control import S3Location
from kvtransfer.shared_blocks import SharedBlockFiles

if TYPE_CHECKING:
    from engine.execution.block_copies import BlockCopies
    from engine.parallel.leader import Leader
    from engine.parallel.tensor_parallel import TensorParallel

log = logging.getLogger(__name__)

# The shared store's publishes queued behind the step hold a copy of their block each, this
# many bytes at most (past it a block is not published: its queue says the store is too slow).
MAX_QUEUED_PUBLISH_BYTES = 256 << 20
# The disk tier's writes queued behind the step, likewise: a prompt's spill comes at once (on an
# H100 with the 8B shape a 2,700-token prompt spilled ~170 blocks of 2 MiB), and a block past
# the queue is not stored, nor then are the prefix hits after it.
MAX_QUEUED_WRITE_BYTES = 1 << 30


def build_disk_tier(
    cache: CacheConfig,
    model_id: str,
    kv_cache: torch.Tensor,
    record_events: bool,
    cache_dir: Path,
    leader: Leader | None = None,
) -> DiskTier | None:
    """The disk tier cache asks for (None without one), holding the blocks already in its
    directory whose header is this model's and KV layout's. leader: rank 0 of a tensor-
    parallel engine, whose followers keep their heads of each block in files of their own
    (engine/parallel/disk_ranks.py)."""
    if not cache.disk_kv_cache_bytes:
        return None
    assert cache.disk_kv_path is not None
    folder = claim_folder(cache.disk_kv_path)
    if leader is not None:  # the followers wait for it (build_rank_disk) before all else
        leader.tp.min_over_ranks(folder)
    try:  # a tier that is not built gives its folder back
        path = rank_disk_path(str(claimed_folder(cache.disk_kv_path, folder)), 0)
        files = DiskBlockFiles(path, DiskLayout.of(model_id, kv_cache), kv_cache.dtype)
        num_blocks = cache.disk_kv_cache_bytes // files.file_bytes
        if num_blocks < 1:
            raise StartRefused(
                f"disk_kv_cache_bytes: {cache.disk_kv_cache_bytes} bytes hold no block file "
                f"({files.file_bytes} bytes each)"
            )
        ranked = None if leader is None else RankedBlockFiles(files, leader, BlockFileError)
        tier = DiskTier(
            num_blocks,
            files if ranked is None else ranked,
            record_events,
            read_errors=(BlockFileError, OSError),
            block_bytes=files.payload_bytes,
        )
    except BaseException:
        release_folder(cache.disk_kv_path)
        raise
    tier.give_back_folder = partial(release_folder, cache.disk_kv_path)
    found = files.scan()
    kept = tier.adopt(found.hashes, lambda h: found.priorities.get(h, DEFAULT_PRIORITY))
    if ranked is not None:  # every rank reads its heads when matched (no reads behind the step)
        tier.listener = ranked
        ranked.keep_only(tier.cached_hashes())
    else:
        reader = DiskBlockFiles(path, files.layout, kv_cache.dtype)
        tier.reads = BlockReads(reader.read, "kvrelay-disk-read")
        writer = DiskBlockFiles(path, files.layout, kv_cache.dtype)
        tier.writes = BlockPublishes(
            partial(_write_block, writer),
            _own_copy,
            max(1, MAX_QUEUED_WRITE_BYTES // files.payload_bytes),
            "kvrelay-disk-write",
            "disk KV tier: %d block writes queued, the disk takes them slower than blocks leave "
            "the host tier; blocks past that are not stored (recomputed when needed) while this "
            "lasts",
        )
    log.info(
        "disk KV tier at %s: %d blocks of %d bytes at most; found %d blocks of this model and "
        "layout (%d kept), removed %d invalid files, ignored %d of other models or layouts",
        files.dir,
        num_blocks,
        files.file_bytes,
        len(found.hashes),
        kept,
        found.num_invalid,
        found.num_other_layouts,
    )
    if cache.shared_kv_cache_bytes:
        tier.shared = build_shared_store(cache, files.layout, kv_cache, cache_dir)
        tier.shared.record_events = record_events
    return tier


def build_rank_disk(
    cache: CacheConfig, rank: int, model_id: str, copies: BlockCopies, tp: TensorParallel
) -> RankDisk | None:
    """A tensor-parallel follower's files of its heads of rank 0's disk tier blocks (None
    without a disk tier), under rank<rank> of the folder rank 0 claimed (told over tp)."""
    if not cache.disk_kv_cache_bytes:
        return None
    assert cache.disk_kv_path is not None
    folder = tp.min_over_ranks(MAX_FOLDERS)  # rank 0's claim (build_disk_tier)
    layout = DiskLayout.of(model_id, copies.kv_cache)
    path = rank_disk_path(str(claimed_folder(cache.disk_kv_path, folder)), rank)
    files = DiskBlockFiles(path, layout, copies.kv_cache.dtype)
    return RankDisk(files, copies, (BlockFileError, OSError))


def build_shared_store(
    cache: CacheConfig, layout: DiskLayout, kv_cache: torch.Tensor, cache_dir: Path
) -> SharedStore:
    """The cluster-shared store cache asks for: the layout's directory under shared_kv_path,
    or its objects under an s3:// shared_kv_path."""
    files = shared_files(cache, layout, kv_cache.dtype, cache_dir)
    num_blocks = cache.shared_kv_cache_bytes // files.file_bytes
    if num_blocks < 1:
        raise StartRefused(
            f"shared_kv_cache_bytes: {cache.shared_kv_cache_bytes} bytes hold no block file "
            f"({files.file_bytes} bytes each)"
        )
    store = SharedStore(
        num_blocks, files, read_errors=(BlockFileError, OSError), block_bytes=files.payload_bytes
    )
    reader = shared_files(cache, layout, kv_cache.dtype, cache_dir)
    store.reads = BlockReads(reader.read, "kvrelay-shared-read", exists=reader.exists)
    writer = shared_files(cache, layout, kv_cache.dtype, cache_dir)
    store.writes = BlockPublishes(
        partial(store.bound.publish, writer),
        _own_copy,
        max(1, MAX_QUEUED_PUBLISH_BYTES // files.payload_bytes),
        "kvrelay-shared-publish",
    )
    log.info(
        "shared KV store at %s: %d blocks of %d bytes at most (all workers), %d there now",
        files.dir,
        num_blocks,
        files.file_bytes,
        store.num_files,
    )
    return store


def _write_block(files: DiskBlockFiles, job: PublishJob) -> Published:
    """One disk tier write behind the step, on the writer's own files (OSError: refused)."""
    try:
        files.write(job.block_hash, job.row, job.salt_root, job.priority)  # type: ignore[arg-type]
    except OSError as e:
        return Published(job.block_hash, False, e, ())
    return Published(job.block_hash, True, None, ())


def _own_copy(row: object) -> torch.Tensor:
    """A block's KV row (a host slot's, or a device block's once its step is done) as a CPU
    tensor of its own, for a publish behind the step."""
    assert isinstance(row, torch.Tensor)
    return row.to("cpu", copy=True)


def shared_files(
    cache: CacheConfig, layout: DiskLayout, dtype: torch.dtype, cache_dir: Path
) -> SharedBlockFiles | ObjectBlockFiles:
    """The shared store's backend (shared_store.SharedFiles): block files in a shared
    directory, or block objects in an S3-compatible store."""
    assert cache.shared_kv_path is not None
    if is_object_store(cache.shared_kv_path):
        location = S3Location.parse(cache.shared_kv_path, cache.shared_kv_endpoint)
        return ObjectBlockFiles(location, layout, dtype, cache_dir)
    return SharedBlockFiles(cache.shared_kv_path, layout, dtype)
