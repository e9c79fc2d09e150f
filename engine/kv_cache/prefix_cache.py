"""PrefixCache: finding and committing cached blocks by content over the device pool and the host
tier. It owns no table of its own: the hash -> block index is BlockPool's and HostTier's; here are
the rules that read and write them (chained hashes of a request's full blocks, the longest cached
prefix in both tiers, a partly matching block under the last one, committing a computed block).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.kv_cache.block_pool import BlockPool, KVBlock
from engine.kv_cache.disk_tier import DiskTier
from engine.kv_cache.file_stage import FileStage
from engine.kv_cache.hashing import hash_blocks, root_hash
from engine.kv_cache.host_tier import HostTier
from engine.kv_cache.load_gate import LoadGate
from engine.kv_cache.owed_copies import OwedCopies
from engine.kv_cache.salt_index import SaltIndex
from engine.kv_cache.shared_store import ASK_AHEAD
from engine.step.request import Request


@dataclass(frozen=True)
class PrefixMatch:
    """Cached blocks covering the longest known prefix of a request's tokens; partial_src: a
    cached block whose first num_partial_tokens tokens continue it (copied into a fresh block)."""

    blocks: list[KVBlock] = field(default_factory=list)
    num_tokens: int = 0  # full blocks' tokens (both tiers) + num_partial_tokens
    partial_src: KVBlock | None = None
    num_partial_tokens: int = 0
    host_hashes: tuple[int, ...] = ()  # the full blocks after `blocks` found in the host tier
    # the full blocks after those, read from the disk tier (or the cluster-shared store below it)
    disk_hashes: tuple[int, ...] = ()
    # reads behind the step still in flight for this prefix: then the match is not to be taken
    # (the request waits), and these are every disk or shared block of it, to hold meanwhile
    pending_hashes: tuple[int, ...] = ()


NO_MATCH = PrefixMatch()


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens a and b share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class PrefixCache:
    """Invariant: a block is committed under the hash of its own tokens chained to its
    predecessors' (salted by the request's cache_salt and the model id), so a match returns only
    blocks whose KV is that of the prompt's leading tokens."""

    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        model_id: str,
        partial_reuse_min_tokens: int,
        host_tier: HostTier | None,
        owed: OwedCopies,
        disk_tier: DiskTier | None = None,
        salts: SaltIndex | None = None,
    ):
        """salts: where each salted block's salt is recorded (kvrelay kv evict --salt)."""
        self.pool = pool
        self.salts = salts
        self.block_size = block_size
        self.model_id = model_id
        self.partial_reuse_min_tokens = partial_reuse_min_tokens
        self.host_tier = host_tier
        self.disk_tier = disk_tier
        self.owed = owed
        # whether a file tier's hits are worth reading back (None: always; the engine sets it)
        self.gate: LoadGate | None = None

    def update_hashes(self, req: Request) -> None:
        """Extend req.block_hashes to every full block of its real tokens (all_token_ids: a
        pending token has no id, so no hash covers it)."""
        if len(req.block_hashes) < len(req.all_token_ids) // self.block_size:
            req.block_hashes = hash_blocks(
                req.all_token_ids, self.block_size, self.model_id, req.cache_salt, req.block_hashes
            )

    def match(self, req: Request, partial: bool = False) -> PrefixMatch:
        """Longest cached prefix, leaving at least the last token to compute (it yields logits).

        partial: past the full blocks, also the cached block under the last one whose tokens
        match the prompt's next ones longest (at least partial_reuse_min_tokens of them)."""
        if not self.pool.enable_caching:
            return NO_MATCH
        self.update_hashes(req)
        max_blocks = (req.num_tokens - 1) // self.block_size
        blocks = []
        for block_hash in req.block_hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            blocks.append(block)
        host: list[int] = []
        if self.host_tier is not None:
            for block_hash in req.block_hashes[len(blocks) : max_blocks]:
                if not self.host_tier.has(block_hash):
                    break
                host.append(block_hash)
        disk: list[int] = []
        pending = False
        chain = req.block_hashes[len(blocks) + len(host) : max_blocks]
        if self.disk_tier is not None and chain:  # each block's file read and checked
            disk_tier = self.disk_tier
            shared = disk_tier.shared  # a block this worker's disk lacks: the shared store's
            # how many of each tier's hits not in hand are read back (None: all): asked at its
            # first one (a block staged or being read is taken: its cost is paid)
            reads_left: dict[FileStage, int | None] = {}
            num_from_store = 0
            for i, block_hash in enumerate(chain):
                tier = disk_tier if disk_tier.has(block_hash) else shared
                if tier is None:
                    break
                if not tier.in_hand(block_hash):
                    if tier not in reads_left:
                        gate = self.gate
                        reads_left[tier] = None if gate is None else gate.blocks_to_read(tier)
                    left = reads_left[tier]
                    if left is not None:
                        if left <= 0:
                            break
                        reads_left[tier] = left - 1
                if tier is disk_tier:
                    staged = disk_tier.fetch(block_hash)
                else:  # a slow store is asked behind the step, a hit run's next blocks along
                    assert shared is not None
                    ahead = chain[i + 1 : i + 1 + min(ASK_AHEAD, 2 * num_from_store)]
                    present = shared.lookup(block_hash, ahead)
                    if present is None:  # the request waits for the answer, as for a read
                        pending = True
                        disk.append(block_hash)
                        break
                    if not present:
                        break
                    staged = shared.fetch(block_hash)
                    num_from_store += 1
                if staged is False:
                    break
                pending = pending or staged is None
                disk.append(block_hash)
        if pending:
            return PrefixMatch(pending_hashes=tuple(disk))
        num_full = (len(blocks) + len(host) + len(disk)) * self.block_size
        tiers = {"host_hashes": tuple(host), "disk_hashes": tuple(disk)}
        if not partial or self.partial_reuse_min_tokens < 1:
            return PrefixMatch(blocks, num_full, **tiers)
        chain = [*(b.block_hash for b in blocks), *host, *disk]
        parent = chain[-1] if chain else root_hash(self.model_id, req.cache_salt)
        assert parent is not None
        wanted = req.all_token_ids[num_full : min(num_full + self.block_size, req.num_tokens - 1)]
        src, num_same = None, self.partial_reuse_min_tokens - 1
        for child in self.pool.children(parent, wanted):
            same = common_prefix_len(child.token_ids, wanted)
            if same > num_same:
                src, num_same = child, same
        if src is None:
            return PrefixMatch(blocks, num_full, **tiers)
        return PrefixMatch(blocks, num_full + num_same, src, num_same, **tiers)

    def commit(self, req: Request, block: KVBlock, i: int) -> None:
        """Make block i of req findable: its hash, and with partial reuse on, its tokens under
        its parent (a block committed here is copied into the host tier behind the step)."""
        parent = req.block_hashes[i - 1] if i else None
        if self.partial_reuse_min_tokens < 1:
            self.pool.cache_block(block, req.block_hashes[i], parent)
        else:
            key = parent if parent is not None else root_hash(self.model_id, req.cache_salt)
            tokens = tuple(req.all_token_ids[i * self.block_size : (i + 1) * self.block_size])
            self.pool.cache_block(block, req.block_hashes[i], parent, tokens, key)
        if req.cache_salt and self.salts is not None:
            root = root_hash(self.model_id, req.cache_salt)
            self.salts.record(req.block_hashes[i], root, self.held)
        self.owed.committed(block)

    def held(self, block_hash: int) -> bool:
        """Whether any tier of this worker holds the block (the shared store aside)."""
        return (
            self.pool.lookup(block_hash) is not None
            or (self.host_tier is not None and self.host_tier.has(block_hash))
            or (self.disk_tier is not None and self.disk_tier.has(block_hash))
        )
