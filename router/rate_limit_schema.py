"""The Redis layout of the per-key limits (DESIGN §4) and its Lua scripts; holds no state.

Keys of one tenant (`{tenant}` is a Redis Cluster hash tag: a tenant's keys share one slot, so
one script run reads and writes them all atomically), shared by every router of the cluster and
by every model it serves:
    kvr:lim:{tenant}:rps      HASH  tokens, ts: the requests-per-second bucket (capacity
                                    max(1, rps), refilled at rps a second); TTL: the time it
                                    takes to refill from empty, plus a minute
    kvr:lim:{tenant}:tpm      HASH  tokens, ts: the tokens-per-minute bucket (capacity tpm,
                                    refilled at tpm / 60 a second); TTL likewise
    kvr:lim:{tenant}:streams  ZSET  one member a request in flight ("{router}/{req_id}"),
                                    scored by its lease's end (unix seconds): a router renews its
                                    members' leases while they run, so a dead router's expire;
                                    TTL 2 leases, renewed with them
    kvr:lim:{tenant}:usage    HASH  requests, prompt_tokens, completion_tokens, refused_rps,
                                    refused_tpm, refused_streams (running counts), limits (the
                                    text of the limits last applied); TTL USAGE_TTL_S, renewed
                                    at each write (`kvrelay status --keys` reads these)
Times are the routers' clocks (unix seconds, given to the scripts): a bucket never moves
backwards, so a router whose clock lags only waits longer.
"""

from __future__ import annotations

from typing import NamedTuple

import redis

LIMITS_PREFIX = "kvr:lim:"
USAGE_TTL_S = 7 * 24 * 3600  # a tenant idle a week loses its usage counts
USAGE_FIELDS = (
    "requests",
    "prompt_tokens",
    "completion_tokens",
    "refused_rps",
    "refused_tpm",
    "refused_streams",
)


def tenant_prefix(tenant: str) -> str:
    if not tenant or set("{}*?[]\\ \t\r\n") & set(tenant):
        raise ValueError(f"tenant {tenant!r} must be non-empty with no braces, globs or spaces")
    return f"{LIMITS_PREFIX}{{{tenant}}}"


class TenantKeys(NamedTuple):
    rps: str
    tpm: str
    streams: str
    usage: str

    @classmethod
    def of(cls, tenant: str) -> TenantKeys:
        prefix = tenant_prefix(tenant)
        return cls(f"{prefix}:rps", f"{prefix}:tpm", f"{prefix}:streams", f"{prefix}:usage")


# A token bucket read at `now`: refilled for the time since its ts (never past its capacity,
# never backwards), then the wait for `cost` tokens: 0 when they are there, -1 when the bucket
# can never hold them. A missing bucket is full.
_LUA_BUCKET = """
local now = tonumber(ARGV[1])
local function refill(key, cap, rate)
  local v = redis.call('HMGET', key, 'tokens', 'ts')
  local tokens, ts = tonumber(v[1]), tonumber(v[2])
  if tokens == nil or ts == nil then return cap, now end
  if now > ts then return math.min(cap, tokens + (now - ts) * rate), now end
  return tokens, ts
end
local function wait_for(tokens, cap, rate, cost)
  if cost > cap then return -1 end
  if cost <= tokens then return 0 end
  return (cost - tokens) / rate
end
local function store(key, tokens, ts, cap, rate)
  redis.call('HSET', key, 'tokens', tokens, 'ts', ts)
  redis.call('EXPIRE', key, math.ceil(cap / rate) + 60)
end
"""

# KEYS: rps, tpm, streams, usage of one tenant.
# ARGV: now, member, lease end, rps capacity, rps rate, tpm capacity, tpm rate, tpm cost,
#       streams limit, usage TTL, limits text. A capacity or limit of 0: no limit of that kind.
# -> {1, '', '0'} admitted (every bucket charged, the member added, `requests` counted), or
#    {0, limit name, wait seconds as text ('-1': never)} with nothing charged (`refused_*`
#    counted). Expired stream members are dropped first.
ADMIT_SCRIPT = (
    _LUA_BUCKET
    + """
local member, lease_end = ARGV[2], tonumber(ARGV[3])
local rps_cap, rps_rate = tonumber(ARGV[4]), tonumber(ARGV[5])
local tpm_cap, tpm_rate, tpm_cost = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
local max_streams, usage_ttl = tonumber(ARGV[9]), tonumber(ARGV[10])
redis.call('HSET', KEYS[4], 'limits', ARGV[11])
redis.call('EXPIRE', KEYS[4], usage_ttl)
local function refuse(name, wait)
  redis.call('HINCRBY', KEYS[4], 'refused_' .. name, 1)
  return {0, name, tostring(wait)}
end
local rps_tokens, rps_ts, tpm_tokens, tpm_ts
if rps_cap > 0 then
  rps_tokens, rps_ts = refill(KEYS[1], rps_cap, rps_rate)
  local wait = wait_for(rps_tokens, rps_cap, rps_rate, 1)
  if wait ~= 0 then return refuse('rps', wait) end
end
if tpm_cap > 0 then
  tpm_tokens, tpm_ts = refill(KEYS[2], tpm_cap, tpm_rate)
  local wait = wait_for(tpm_tokens, tpm_cap, tpm_rate, tpm_cost)
  if wait ~= 0 then return refuse('tpm', wait) end
end
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', '(' .. ARGV[1])
if max_streams > 0 and redis.call('ZCARD', KEYS[3]) >= max_streams then
  return refuse('streams', 1)
end
if rps_cap > 0 then store(KEYS[1], rps_tokens - 1, rps_ts, rps_cap, rps_rate) end
if tpm_cap > 0 then store(KEYS[2], tpm_tokens - tpm_cost, tpm_ts, tpm_cap, tpm_rate) end
redis.call('ZADD', KEYS[3], lease_end, member)
redis.call('EXPIRE', KEYS[3], math.ceil(2 * (lease_end - now)) + 1)
redis.call('HINCRBY', KEYS[4], 'requests', 1)
return {1, '', '0'}
"""
)

# KEYS: tpm, streams, usage of one tenant.
# ARGV: now, member, tokens to give back, tpm capacity, tpm rate, prompt tokens, completion
#       tokens, usage TTL. Removes the member, gives the tpm bucket back what was charged beyond
#       the request's use (never past its capacity), counts the tokens. -> 1 if the member was
#       there.
RELEASE_SCRIPT = (
    _LUA_BUCKET
    + """
local refund, tpm_cap, tpm_rate = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
if refund > 0 and tpm_cap > 0 then
  local tokens, ts = refill(KEYS[1], tpm_cap, tpm_rate)
  store(KEYS[1], math.min(tpm_cap, tokens + refund), ts, tpm_cap, tpm_rate)
end
redis.call('HINCRBY', KEYS[3], 'prompt_tokens', ARGV[6])
redis.call('HINCRBY', KEYS[3], 'completion_tokens', ARGV[7])
redis.call('EXPIRE', KEYS[3], tonumber(ARGV[8]))
return redis.call('ZREM', KEYS[2], ARGV[2])
"""
)


class TenantUsage(NamedTuple):
    """One tenant's counters as `kvrelay status --keys` shows them."""

    tenant: str
    limits: str
    num_streams: int  # requests in flight now (live leases)
    counts: dict[str, int]  # USAGE_FIELDS -> value


def read_usage(client: redis.Redis, now: float) -> list[TenantUsage]:
    """Every tenant's usage HASH and live stream count, sorted by tenant (a SCAN: for operators,
    not for the request path). `client` decodes responses."""
    rows = []
    for key in client.scan_iter(match=f"{LIMITS_PREFIX}{{*}}:usage", count=500):
        tenant = key[len(LIMITS_PREFIX) + 1 : -len("}:usage")]
        fields = client.hgetall(key)
        streams = client.zcount(TenantKeys.of(tenant).streams, now, "+inf")
        counts = {name: int(fields.get(name, 0)) for name in USAGE_FIELDS}
        rows.append(TenantUsage(tenant, fields.get("limits", ""), int(streams), counts))
    return sorted(rows)
