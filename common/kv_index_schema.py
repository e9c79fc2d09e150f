"""The Redis layout of the cluster KV index (DESIGN §4) and its Lua scripts; holds no state.

Keys of one model (`{model}` is a literal Redis Cluster hash tag, so every key of a model lives
in one slot and the scripts below stay valid on a cluster):
    kvr:{model}:b:{hash}      SET   worker ids holding that block (hash as engine hash_hex) in
                                    device memory, and "{worker}#h" for those holding it in
                                    their host tier, "{worker}#d" in their disk tier (one
                                    member per tier); shared TTL (below)
    kvr:{model}:wb:{worker}   SET   block hashes (hex) a worker holds, for cleanup; "{hex}#h"
                                    for its host tier, "{hex}#d" for its disk tier; TTL
                                    BLOCKS_TTL_FACTOR x the HASH's, refreshed with it
                                    (whoever finds the HASH expired can still remove the
                                    worker's block entries meanwhile)
    kvr:{model}:w:{worker}    HASH  role, actor_name, nixl_agent, state, WorkerLoad fields,
                                    epoch; TTL
    kvr:{model}:shared        SET   block hashes (hex) in the cluster-shared KV store, which any
                                    worker loads: added by the worker that published one,
                                    removed by whichever removes its file; blocks TTL from the
                                    last add
    kvr:{model}:workers       SET   worker ids ever registered (membership is the live w: HASH;
                                    an id whose HASH expired is dead and gets forgotten);
                                    shared TTL
Shared keys (block SETs, the registry) are written by several workers: each writer makes the
key live at least its own blocks TTL (BLOCKS_TTL_FACTOR x its HASH's) from now and never
shortens a longer one, so a shared key expires when the last of its writers' TTLs runs out. A
block SET is kept alive by the writes of its block and, for blocks held long, by each worker's
refresh of all its block SETs every half blocks TTL (KVPublisher). So nothing in Redis outlives
its workers without a TTL, and no key of a live worker expires.
Needs Redis >= 6.2 (SMISMEMBER).
"""

from __future__ import annotations

import dataclasses

from common.messages import WorkerInfo, WorkerLoad
from engine.kv_cache.hashing import hash_hex

KEY_PREFIX = "kvr"
LOAD_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(WorkerLoad))
_BAD_ID_CHARS = frozenset("{}*?[]\\ \t\r\n#")
HOST = "#h"  # the suffix of a host-tier member: "{worker}#h" in a block SET, "{hex}#h" in wb:
DISK = "#d"  # the suffix of a disk-tier member, likewise
BLOCKS_TTL_FACTOR = 60  # a wb: SET lives this many times its worker HASH's TTL past the last write


ID_RULE = "non-empty UTF-8 text with no braces, brackets, '*', '?', '#', backslashes or whitespace"


def _check_id(kind: str, value: str) -> str:
    if not value or _BAD_ID_CHARS & set(value) or not _is_utf8(value):
        raise ValueError(f"{kind} {value!r} must be {ID_RULE}")
    return value


def _is_utf8(value: str) -> bool:
    """False for a str holding lone surrogates (a JSON escape of half a character, a byte
    of argv that is not UTF-8): Redis keys and file headers cannot encode it."""
    try:
        value.encode()
    except UnicodeEncodeError:
        return False
    return True


def check_model_id(model_id: str) -> str:
    """model_id, or ValueError when it cannot name keys (see ID_RULE)."""
    return _check_id("model id", model_id)


def model_prefix(model_id: str) -> str:
    return f"{KEY_PREFIX}:{{{_check_id('model id', model_id)}}}"


def block_key_prefix(model_id: str) -> str:
    """Block keys are this prefix + hash_hex(hash) (the scripts build them from it)."""
    return f"{model_prefix(model_id)}:b:"


def block_key(model_id: str, block_hash: int) -> str:
    return block_key_prefix(model_id) + hash_hex(block_hash)


def worker_blocks_key(model_id: str, worker_id: str) -> str:
    return f"{model_prefix(model_id)}:wb:{_check_id('worker id', worker_id)}"


def worker_key_prefix(model_id: str) -> str:
    return f"{model_prefix(model_id)}:w:"


def worker_key(model_id: str, worker_id: str) -> str:
    return worker_key_prefix(model_id) + _check_id("worker id", worker_id)


def registry_key(model_id: str) -> str:
    return f"{model_prefix(model_id)}:workers"


def shared_key(model_id: str) -> str:
    """The SET of block hashes (hex) in the cluster-shared KV store: any worker loads them."""
    return f"{model_prefix(model_id)}:shared"


def worker_fields(
    role: str, actor_name: str, nixl_agent: str, load: WorkerLoad, state: str = "joining"
) -> dict[str, str | int]:
    """The worker HASH's fields (str -> str | int) as HSET takes them."""
    fields: dict[str, str | int] = {"role": role, "actor_name": actor_name}
    fields["nixl_agent"] = nixl_agent
    fields["state"] = state
    fields.update(dataclasses.asdict(load))
    return fields


def parse_worker(worker_id: str, fields: dict[str, str]) -> WorkerInfo:
    """A WorkerInfo from a worker HASH read back (decoded strings; missing loads are 0)."""
    load = WorkerLoad(**{name: int(fields.get(name, 0)) for name in LOAD_FIELDS})
    return WorkerInfo(
        worker_id=worker_id,
        role=fields.get("role", ""),
        actor_name=fields.get("actor_name", ""),
        nixl_agent=fields.get("nixl_agent", ""),
        load=load,
        state=fields.get("state", "joining"),
    )


# Longest-prefix overlap, shared by both read scripts, as the engine matches a prefix: leading
# blocks in device memory, then the blocks after them in the host tier, then those after them
# in the disk tier. ids: candidate worker ids; block keys are KEYS[first..#KEYS] in chain order.
# A worker's count stops at its first block held in no tier (or in a faster tier only, after a
# slower one), and the loop stops at the first block no remaining candidate holds (one
# SMISMEMBER per block). Returns a flat list: device, host, disk counts, for each id in order.
_LUA_OVERLAP = """
local function overlap(first, ids)
  local device, host, disk, alive = {}, {}, {}, {}
  for i = 1, #ids do device[i] = 0; host[i] = 0; disk[i] = 0; alive[i] = i end
  for k = first, #KEYS do
    if #alive == 0 then break end
    local args = {}
    for j = 1, #alive do
      args[3 * j - 2] = ids[alive[j]]
      args[3 * j - 1] = ids[alive[j]] .. '#h'
      args[3 * j] = ids[alive[j]] .. '#d'
    end
    local hits = redis.call('SMISMEMBER', KEYS[k], unpack(args))
    local still = {}
    for j = 1, #alive do
      local i = alive[j]
      if host[i] == 0 and disk[i] == 0 and hits[3 * j - 2] == 1 then
        device[i] = device[i] + 1
        still[#still + 1] = i
      elseif disk[i] == 0 and hits[3 * j - 1] == 1 then
        host[i] = host[i] + 1
        still[#still + 1] = i
      elseif hits[3 * j] == 1 then
        disk[i] = disk[i] + 1
        still[#still + 1] = i
      end
    end
    alive = still
  end
  local counts = {}
  for i = 1, #ids do
    counts[3 * i - 2] = device[i]; counts[3 * i - 1] = host[i]; counts[3 * i] = disk[i]
  end
  return counts
end
"""

# KEYS: block keys; ARGV: worker ids -> (device, host, disk) counts, flat, in ARGV order.
OVERLAP_SCRIPT = _LUA_OVERLAP + "return overlap(1, ARGV)\n"

# KEYS[1]: registry, KEYS[2..]: block keys; ARGV[1]: worker key prefix, ARGV[2]: role ('' = all).
# -> {live ids, their HGETALL lists, their overlap counts, dead ids (registered, HASH expired)}.
VIEW_SCRIPT = (
    _LUA_OVERLAP
    + """
local ids, rows, dead = {}, {}, {}
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local row = redis.call('HGETALL', ARGV[1] .. id)
  if #row == 0 then
    dead[#dead + 1] = id
  elseif ARGV[2] == '' or redis.call('HGET', ARGV[1] .. id, 'role') == ARGV[2] then
    ids[#ids + 1] = id
    rows[#rows + 1] = row
  end
end
return {ids, rows, overlap(2, ids), dead}
"""
)

# Block SETs a delta keeps alive at most (one SSCAN page): a worker's periodic refresh of its
# block SETs is spread over its calls, a page each, so no script run blocks Redis for long (100k
# block SETs kept in one run took ~0.3 s on a 2-core machine, every other client waiting).
KEEP_PAGE = 2000

# A shared key lives at least `ttl` ms from now, a longer TTL kept (PTTL is -1 for a key with
# none, -2 for a missing one, which PEXPIRE leaves missing); and every block SET a worker's
# blocks SET names (its members with the '#h' / '#d' of a host / disk tier entry cut off)
# likewise, all at once (keep_blocks, after a full publish that wrote them all anyway) or a page
# from an SSCAN cursor (keep_page, which returns the next cursor: '0' once the whole SET was
# walked).
_LUA_KEEP = """
local function keep(key, ttl)
  if redis.call('PTTL', key) < ttl then redis.call('PEXPIRE', key, ttl) end
end
local function keep_members(prefix, members, ttl)
  for _, h in ipairs(members) do
    local tier = string.sub(h, -2)
    if tier == '#h' or tier == '#d' then h = string.sub(h, 1, -3) end
    keep(prefix .. h, ttl)
  end
end
local function keep_blocks(prefix, blocks_key, ttl)
  keep_members(prefix, redis.call('SMEMBERS', blocks_key), ttl)
end
local function keep_page(prefix, blocks_key, ttl, cursor, count)
  local page = redis.call('SSCAN', blocks_key, cursor, 'COUNT', count)
  keep_members(prefix, page[2], ttl)
  return page[1]
end
"""


# One engine step's writes, applied only if the worker HASH carries the writer's epoch (so a
# delta that timed out and reached Redis late, after a resync, is dropped, not applied).
# KEYS: worker HASH, worker blocks SET, registry; ARGV: block key prefix, worker id, epoch,
# ttl ms, refresh (an SSCAN cursor of the worker's blocks SET: keep that page's block SETs alive
# too, '0' to start; '' for none), n, then n field/value pairs for the HASH, then (op, hash
# hex) pairs, op '+' or '-' (device) or 'h+' / 'h-' (host tier) or 'd+' / 'd-' (disk tier). A
# block SET written to ('+') is kept alive for the blocks TTL. Returns {1, the next cursor ('0':
# the walk is over; '' when no refresh was asked)}, or 0 when the HASH is missing or has another
# epoch (resync).
def delta_script(page: int = KEEP_PAGE) -> str:
    """DELTA_SCRIPT keeping `page` block SETs alive a run (tests take a small page)."""
    return (
        _LUA_KEEP
        + """
    if redis.call('HGET', KEYS[1], 'epoch') ~= ARGV[3] then return 0 end
    local blocks_ttl = tonumber(ARGV[4]) * BLOCKS_TTL_FACTOR
    local last = 6 + 2 * tonumber(ARGV[6])
    for i = last + 1, #ARGV - 1, 2 do
      local h = ARGV[i + 1]
      local op, member, entry = ARGV[i], ARGV[2], h
      local tier = string.sub(op, 1, 1)
      if tier == 'h' or tier == 'd' then
        op, member, entry = string.sub(op, 2), ARGV[2] .. '#' .. tier, h .. '#' .. tier
      end
      if op == '+' then
        redis.call('SADD', ARGV[1] .. h, member)
        keep(ARGV[1] .. h, blocks_ttl)
        redis.call('SADD', KEYS[2], entry)
      else
        redis.call('SREM', ARGV[1] .. h, member)
        redis.call('SREM', KEYS[2], entry)
      end
    end
    local cursor = ''
    if ARGV[5] ~= '' then cursor = keep_page(ARGV[1], KEYS[2], blocks_ttl, ARGV[5], KEEP_PAGE) end
    redis.call('HSET', KEYS[1], unpack(ARGV, 7, last))
    redis.call('PEXPIRE', KEYS[1], ARGV[4])
    redis.call('PEXPIRE', KEYS[2], blocks_ttl)
    redis.call('SADD', KEYS[3], ARGV[2])
    keep(KEYS[3], blocks_ttl)
    return {1, cursor}
    """.replace("BLOCKS_TTL_FACTOR", str(BLOCKS_TTL_FACTOR)).replace("KEEP_PAGE", str(page))
    )


DELTA_SCRIPT = delta_script()

# After a full publish (in its MULTI): every block SET of the worker and the registry live at
# least the blocks TTL. KEYS: worker blocks SET, registry; ARGV: block key prefix, blocks TTL ms.
KEEP_SCRIPT = (
    _LUA_KEEP
    + """
keep_blocks(ARGV[1], KEYS[1], tonumber(ARGV[2]))
keep(KEYS[2], tonumber(ARGV[2]))
return 1
"""
)

# Remove a worker's blocks from the index. KEYS: worker HASH, worker blocks SET, registry;
# ARGV: block key prefix, worker id, mode. mode 'dead': only if the HASH has expired, and drop
# the id from the registry; 'withdraw': unconditionally, HASH and registry entry too;
# 'resync': unconditionally, blocks only (the caller re-adds its full state in the same MULTI).
# Returns the number of blocks removed, or -1 when mode 'dead' found the worker alive.
FORGET_SCRIPT = """
if ARGV[3] == 'dead' and redis.call('EXISTS', KEYS[1]) == 1 then return -1 end
local hashes = redis.call('SMEMBERS', KEYS[2])
for _, h in ipairs(hashes) do
  local tier = string.sub(h, -2)
  if tier == '#h' or tier == '#d' then
    redis.call('SREM', ARGV[1] .. string.sub(h, 1, -3), ARGV[2] .. tier)
  else
    redis.call('SREM', ARGV[1] .. h, ARGV[2])
  end
end
redis.call('DEL', KEYS[2])
if ARGV[3] ~= 'resync' then redis.call('SREM', KEYS[3], ARGV[2]) end
if ARGV[3] == 'withdraw' then redis.call('DEL', KEYS[1]) end
return #hashes
"""


def worker_keys(model_id: str, worker_id: str) -> list[str]:
    """KEYS for DELTA_SCRIPT and FORGET_SCRIPT: worker HASH, worker blocks SET, registry."""
    return [
        worker_key(model_id, worker_id),
        worker_blocks_key(model_id, worker_id),
        registry_key(model_id),
    ]
