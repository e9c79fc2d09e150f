"""`kvrelay scale`, `kvrelay status`, `kvrelay kv evict` and `kvrelay router`: operator commands
against a running cluster's controllers (through Ray; one per served model); a router stops as
serve's does, draining on Ctrl-C or SIGTERM (deploy/serve_stop.py). Holds no state."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import sys
import time
from typing import TYPE_CHECKING, Any, TypeVar

from common.cluster_state import (
    ClusterStatus,
    KVEvictRequest,
    RouterConfig,
    ScaleRequest,
    WorkerStats,
    WorkerStatus,
    format_queue,
)
from common.worker_actors import ControllerActor
from deploy import cluster_address
from deploy.flag_types import add_http_port, port
from deploy.router_flags import RouterOptions, add_router_flags, router_options
from deploy.serve_ports import check_ports, start_servers
from engine.kv_cache.tier_stats import TierStats

if TYPE_CHECKING:
    from router.rate_limit_schema import TenantUsage

ADDRESS_HELP = (
    "Ray cluster address (host:port of its GCS, or 'auto'); default: the cluster of the "
    "`kvrelay serve` running on this machine (refused when several run: give --name)"
)
NAME_HELP = "the local `kvrelay serve` of this --name (its HTTP port when it was given none)"
T = TypeVar("T")
STATUS_TIMEOUT_S = 60.0  # `kvrelay status` (and finding a one-model cluster's id): the bound
MODEL_HELP = "the served model whose pools to act on (needed when the cluster serves several)"


def add_ops_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("scale", help="resize the prefill and/or decode pool (of one model)")
    p.add_argument("--model", default=None, help=MODEL_HELP)
    p.add_argument(
        "--prefill",
        type=int,
        default=None,
        help="prefill workers wanted (0: the decode workers compute every prompt, aggregated)",
    )
    p.add_argument("--decode", type=int, default=None, help="decode workers wanted")
    p.add_argument("--no-wait", action="store_true", help="return at once")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds to wait (default 1800)")
    _add_target(p)
    p.set_defaults(func=scale)

    p = sub.add_parser("status", help="the pools, their workers, the routers and Redis")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument(
        "--keys",
        action="store_true",
        help="also each API-key tenant's usage, live streams, refusals and limits (from Redis)",
    )
    p.add_argument("--model", default=None, help="only this served model's (default: every one)")
    _add_target(p)
    p.set_defaults(func=status)

    p = sub.add_parser("kv", help="the cluster's KV cache: evict")
    kv = p.add_subparsers(dest="kv_command", required=True)
    p = kv.add_parser(
        "evict",
        help="drop a tenant's or a prompt's blocks from every worker's tiers and the shared store",
    )
    p.add_argument("--model", default=None, help="only this served model's (default: every one)")
    p.add_argument("--salt", default=None, help="the cache_salt the blocks were computed under")
    p.add_argument(
        "--tenant",
        default=None,
        help="a tenant of --api-keys: its salt (with --salt: that client salt of the tenant)",
    )
    p.add_argument(
        "--prefix-of",
        default=None,
        metavar="TEXT",
        help="only this prompt's blocks (tokenized as a completion prompt), under the salt given",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    _add_target(p)
    p.set_defaults(func=kv_evict)

    p = sub.add_parser("router", help="one more router (HTTP + gRPC) for the running cluster")
    p.add_argument(
        "--host", default="127.0.0.1", help="address the servers bind (default: %(default)s)"
    )
    add_http_port(
        p,
        "0 picks a free port (default: %(default)s, the port of a `kvrelay serve` on this "
        "machine too: give another one beside it)",
    )
    p.add_argument(
        "--grpc-port", type=port, default=50051, help="0 picks a free port (default: %(default)s)"
    )
    _add_target(p)
    add_router_flags(p)
    p.set_defaults(func=router)


def _add_target(p: argparse.ArgumentParser) -> None:
    """Which cluster: --address of its Ray, or --name of a local serve (default: the only one)."""
    target = p.add_mutually_exclusive_group()
    target.add_argument("--address", default=None, help=ADDRESS_HELP)
    target.add_argument("--name", default=None, help=NAME_HELP)


def _controllers(args: argparse.Namespace) -> dict[str, ControllerActor]:
    """Model id -> its controller: every model's, or --model's alone; a single-model
    cluster's id is asked for."""
    from deploy.controller import find_controller, find_controllers

    cluster_address.connect(args.address, args.name)
    found = find_controllers()
    if not found:
        find_controller()  # raises, saying what to do
    if "" in found:  # one model: its controller has the plain name
        import ray

        only = found[""]
        try:
            found = {ray.get(only.status.remote(False), timeout=STATUS_TIMEOUT_S).model_id: only}
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(
                f"the controller did not answer within {STATUS_TIMEOUT_S:g} s"
            ) from None
    return pick_models(found, getattr(args, "model", None))


def pick_models(found: dict[str, T], model: str | None) -> dict[str, T]:
    """Of model id -> controller, --model's alone (every one when None); ValueError naming
    the served models when it is not one of them."""
    if model is None:
        return found
    if model not in found:
        served = ", ".join(repr(m) for m in found)
        raise ValueError(f"--model {model!r} is not served by this cluster; it serves {served}")
    return {model: found[model]}


def only_model(found: dict[str, T]) -> T:
    """The one controller a command acts on; ValueError asking for --model when there are
    several."""
    if len(found) > 1:
        served = ", ".join(repr(m) for m in found)
        raise ValueError(f"this cluster serves several models ({served}): give --model M")
    return next(iter(found.values()))


def _controller(args: argparse.Namespace) -> ControllerActor:
    """The one controller the command acts on: --model's, or the cluster's only one."""
    return only_model(_controllers(args))


# ---- scale ---------------------------------------------------------------------------------
def scale(args: argparse.Namespace) -> int:
    request = ScaleRequest(prefill=args.prefill, decode=args.decode)
    if not request.sizes():
        raise ValueError("give --prefill N, --decode M or both")
    if not 0 < args.timeout < math.inf:
        raise ValueError(f"--timeout must be a positive number of seconds, got {args.timeout}")
    return asyncio.run(_scale(request, _controller(args), args))


async def _scale(
    request: ScaleRequest, controller: ControllerActor, args: argparse.Namespace
) -> int:
    from ray.exceptions import RayTaskError

    from deploy.progress import ScaleFailed, ask_status, follow

    started = time.monotonic()
    try:
        before = await ask_status(controller, args.timeout, args.timeout)
        seen = {
            (w.worker_id, i)
            for pool in before.pools
            for w in pool.workers
            for i in range(len(w.transitions))
        }
        try:
            left = args.timeout - (time.monotonic() - started)
            sizes = await asyncio.wait_for(controller.scale.remote(request), max(left, 0.001))
        except RayTaskError as e:  # refused (a size the machine cannot hold, ...): its words
            if isinstance(e.cause, ValueError):
                raise ValueError(str(e.cause)) from None
            raise
        except TimeoutError:
            raise TimeoutError(f"the controller did not answer within {args.timeout:g} s") from None
        of = f" of {args.model}" if args.model else ""
        _say(f"kvrelay: pools wanted{of}: " + ", ".join(f"{r} {n}" for r, n in sizes.items()))
        if args.no_wait:
            return 0
        left = args.timeout - (time.monotonic() - started)
        wanted = request.sizes()
        final = await follow(controller, _say, left, seen, wanted, said_s=args.timeout)
    except (ScaleFailed, TimeoutError) as e:
        _say(f"error: {e}")
        return 1
    ready = ", ".join(f"{p.role} {p.num_ready}" for p in final.pools)
    _say(f"kvrelay: pools at their size ({ready}) after {time.monotonic() - started:.1f} s")
    return 0


# ---- kv evict ------------------------------------------------------------------------------
def evict_request(args: argparse.Namespace) -> KVEvictRequest:
    """The request `kvrelay kv evict` sends (a tenant's salt as its router computes it)."""
    salt = args.salt
    if args.tenant is not None:
        from router.access import tenant_cache_salt

        salt = tenant_cache_salt(args.tenant, args.salt)
    return KVEvictRequest(args.prefix_of, salt)


def kv_evict(args: argparse.Namespace) -> int:
    request = evict_request(args)
    controllers = list(_controllers(args).values())  # every model's, or --model's
    config = asyncio.run(_router_config(controllers[0]))  # a salt its blocks may not have
    if args.tenant is not None:
        warning = tenant_warning(args.tenant, key_usage(config.redis_url))
    else:
        warning = salt_warning(args.salt, config.access_digest is not None)
    if warning:
        print(warning, file=sys.stderr)

    async def evict() -> dict[str, dict[str, int] | str]:
        answers: dict[str, dict[str, int] | str] = {}
        for each in await asyncio.gather(*(c.evict_kv.remote(request) for c in controllers)):
            answers.update(each)  # worker ids name their model when there are several
        return answers

    answers = asyncio.run(evict())
    if args.json:
        print(json.dumps(answers, indent=2))
    else:
        print(format_evicted(answers))
    return 1 if any(isinstance(a, str) for a in answers.values()) else 0


async def _router_config(controller: ControllerActor) -> RouterConfig:
    return await controller.router_config.remote()


def salt_warning(salt: str | None, keyed: bool) -> str | None:
    """A line when --tenant is not given on a cluster served with API keys, whose requests'
    blocks are salted by their tenant (with their cache_salt): --salt S, or --prefix-of alone
    (the blocks of no salt), drops none of them."""
    if not keyed:
        return None
    given = "--salt alone" if salt is not None else "--prefix-of without --tenant"
    return (
        "kvrelay: warning: this cluster's serve has API keys, so each request's blocks are "
        f"salted by its tenant together with its cache_salt: {given} matches none of them; "
        "pass --tenant T (with --salt or --prefix-of, or alone for all of that tenant's blocks)"
    )


def tenant_warning(tenant: str, usage: list[TenantUsage] | str) -> str | None:
    """A line when --tenant names no tenant whose usage this cluster's Redis holds (a typo, or
    a cluster served without API keys, whose blocks are salted by cache_salt alone); None when
    it does, or when the usage could not be read."""
    if isinstance(usage, str) or tenant in {row.tenant for row in usage}:
        return None
    if not usage:
        return (
            f"kvrelay: warning: no tenant has used this cluster (`kvrelay status --keys` lists "
            f"none), so {tenant!r} likely holds no blocks: do its routers run with "
            "--api-keys? Without API keys, requests' blocks are salted by their cache_salt "
            "alone: pass --salt"
        )
    known = ", ".join(sorted(row.tenant for row in usage)[:10])
    return (
        f"kvrelay: warning: tenant {tenant!r} has no usage in this cluster's Redis (idle a week, "
        f"or a misspelt name; `kvrelay status --keys` lists {len(usage)}: {known})"
    )


def format_evicted(answers: dict[str, dict[str, int] | str]) -> str:
    if not answers:
        return "no worker answered: nothing evicted"
    lines = []
    for worker_id, answer in sorted(answers.items()):
        if isinstance(answer, str):
            lines.append(f"{worker_id}: error: {answer}")
        else:
            counts = ", ".join(f"{tier} {n}" for tier, n in answer.items())
            lines.append(f"{worker_id}: blocks dropped: {counts}")
    return "\n".join(lines)


# ---- status --------------------------------------------------------------------------------
def status(args: argparse.Namespace) -> int:
    """One model's status as before; several models' one after another (--json: a list)."""
    controllers = list(_controllers(args).values())

    async def fetch() -> tuple[list[ClusterStatus], str]:
        config = await controllers[0].router_config.remote() if args.keys else None
        statuses = await asyncio.gather(*(c.status.remote(True) for c in controllers))
        return list(statuses), config.redis_url if config else ""

    try:
        statuses, redis_url = asyncio.run(asyncio.wait_for(fetch(), STATUS_TIMEOUT_S))
    except TimeoutError:  # cli.main: "error: ...", exit 1
        raise TimeoutError(f"the controller did not answer within {STATUS_TIMEOUT_S:g} s") from None
    keys = key_usage(redis_url) if args.keys else None  # the tenants' usage: one Redis, every model
    if args.json:
        shown = [s.to_json_dict() for s in statuses]
        if keys is not None:
            rows = keys if isinstance(keys, str) else [row._asdict() for row in keys]
            for body in shown:
                body["keys"] = rows
        print(json.dumps(shown[0] if len(shown) == 1 else shown, indent=2))
    else:
        print("\n\n".join(format_status(s) for s in statuses))
        if keys is not None:
            print(keys if isinstance(keys, str) else format_key_usage(keys))
    return 0


def key_usage(redis_url: str) -> list[TenantUsage] | str:
    """Each tenant's counters from Redis, or one line saying why there are none."""
    import redis

    from router.rate_limit_schema import read_usage

    if not redis_url:
        return "keys: no Redis, so no per-key usage"
    client = redis.Redis.from_url(redis_url, decode_responses=True, socket_timeout=2.0)
    try:
        return read_usage(client, time.time())
    except (redis.RedisError, OSError) as e:
        return f"keys: Redis did not answer ({type(e).__name__}: {e})"
    finally:
        client.close()


def format_key_usage(rows: list[TenantUsage]) -> str:
    """A table, one row a tenant: requests admitted, tokens, live streams, refusals by limit and
    the limits its routers last applied."""
    head = ("tenant", "requests", "prompt tok", "output tok", "streams", "refused rps/tpm/streams")
    table = [(*head, "limits")]
    for row in rows:
        c = row.counts
        refused = f"{c['refused_rps']}/{c['refused_tpm']}/{c['refused_streams']}"
        cells = (c["requests"], c["prompt_tokens"], c["completion_tokens"], row.num_streams)
        table.append((row.tenant, *map(str, cells), refused, row.limits or "none"))
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    lines = [f"keys: {len(rows)} tenants"]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in table]
    return "\n".join(line.rstrip() for line in lines)


def format_status(current: ClusterStatus) -> str:
    lines = [f"model {current.model_id or '(not loaded yet)'}"]
    if current.error:
        lines.append(f"error: {current.error}")
    prefill_ready = sum(p.num_ready for p in current.pools if p.role == "prefill")
    for pool in current.pools:
        line = f"{pool.role} pool: {pool.num_ready} ready of {pool.desired} wanted"
        lines.append(f"{line} ({pool.autoscale})" if pool.autoscale else line)
        if pool.role == "decode" and not prefill_ready and pool.num_ready:
            lines.append("  (no prefill worker: the decode workers compute every prompt)")
        for worker in pool.workers:
            lines.append("  " + _worker_line(worker))
            if worker.state.value != "gone":  # a tensor-parallel worker's ranks
                lines.extend(f"    {place}" for place in worker.ranks)
    lines.append(f"routers: {len(current.routers)}")
    for r in current.routers:
        lines.append(f"  {r.router_id}  http {r.http_url or '-'}  grpc {r.grpc_address or '-'}")
        if r.queue:
            lines.append(f"    queue: {format_queue(r.queue)}")
    redis = current.redis
    if not redis.url:
        lines.append("redis: none (routing by load)")
    else:
        state = "reachable" if redis.reachable else f"UNREACHABLE ({redis.error})"
        lines.append(f"redis: {redis.url} {state}, {redis.num_registered_workers} workers")
    return "\n".join(lines)


def _worker_line(worker: WorkerStatus) -> str:
    head = f"{worker.worker_id:<22} {worker.state.value:<9} {worker.node_ip or '-':<15}"
    if worker.state.value == "gone":
        last = worker.transitions[-1].note if worker.transitions else ""
        return f"{head} {last}"
    stats = worker.stats
    if stats is None:
        note = worker.transitions[-1].note if worker.transitions else ""
        return f"{head} {note}"
    load = stats.load
    used = load.total_blocks - load.free_blocks
    parts = [
        f"running {load.running} waiting {load.waiting}",
        f"KV {used}/{load.total_blocks} blocks",
    ]
    if stats.prefix_hit_rate is not None:
        parts.append(f"prefix hits {stats.prefix_hit_rate:.0%}")
    if stats.num_host_offloaded_blocks or stats.num_host_hit_blocks:
        parts.append(f"host tier {stats.num_host_hit_blocks} hit blocks")
    if stats.num_disk_stored_blocks or stats.num_disk_cached_blocks:
        parts.append(_disk_tier(stats))
    if stats.transfer_bytes_per_s is not None:
        parts.append(f"KV transfer {stats.transfer_bytes_per_s / 1e6:.1f} MB/s")
    line = f"{head} " + ", ".join(parts)
    if len(stats.tiers) > 1:  # a tier past the device: one line of every tier
        line += "\n    tiers: " + "; ".join(_tier(t) for t in stats.tiers)
    return line


def _tier(tier: TierStats) -> str:
    """A KV tier's size and use, hit rate, loads (MB, ms a block: on average and lately), bad
    files, refused writes."""
    rate = "-" if tier.hit_rate is None else f"{tier.hit_rate:.0%}"
    text = f"{tier.tier} {tier.used_blocks}/{tier.capacity_blocks} blocks, hits {rate}"
    if tier.load_bytes:
        text += f" ({tier.load_bytes / 1e6:.1f} MB loaded"
        if tier.load_s and tier.hit_blocks:
            text += f", {tier.load_s * 1e3 / tier.hit_blocks:.2f} ms a block"
            if tier.recent_load_s:  # what the read gate weighs now: the mean hides a change
                text += f" on average, {tier.recent_load_s * 1e3:.2f} lately"
        text += ")"
    if tier.tier == "host" and tier.recent_load_s:
        text += f", copy back {tier.recent_load_s * 1e6:.0f} us a block"
    if tier.bad_files:
        text += f", {tier.bad_files} bad files"
    if tier.write_failures:
        text += f", {tier.write_failures} writes refused"
    if tier.writes_dropped:
        text += f", {tier.writes_dropped} blocks not stored (its writer fell behind)"
    if tier.passed_over:
        text += f", {tier.passed_over} prompts' hits computed again (reading was the slower)"
    return text


def _disk_tier(stats: WorkerStats) -> str:
    """A worker's disk tier: blocks held, blocks loaded back (and their bytes), bad files,
    writes the disk refused."""
    text = (
        f"disk tier {stats.num_disk_cached_blocks} blocks, {stats.num_disk_hit_blocks} hit "
        f"blocks ({stats.num_disk_hit_bytes / 1e6:.1f} MB loaded)"
    )
    if stats.num_disk_bad_files:
        text += f", {stats.num_disk_bad_files} bad files"
    if stats.num_disk_write_failures:
        text += f", {stats.num_disk_write_failures} writes refused"
    return text


# ---- router --------------------------------------------------------------------------------
def router(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    options = router_options(args)  # a bad key file or certificate: refused before connecting
    cluster_address.resolve(args.address, args.name)  # no such serve: said before the ports
    check_ports(args.host, args.http_port, args.grpc_port)  # taken, or a bad --host: ditto
    controllers = list(_controllers(args).values())  # every model's: this router serves all
    return asyncio.run(_router(controllers, options, args.host, args.http_port, args.grpc_port))


async def _router(
    controllers: list[ControllerActor],
    options: RouterOptions,
    host: str,
    http_port: int,
    grpc_port: int,
) -> int:
    import uuid

    from common.cluster_state import RouterStatus
    from deploy.serve_stop import (
        INTERRUPTED,
        StartInterrupted,
        StopSignals,
        close_servers,
        drain,
        start_unless_stopped,
    )
    from router.metrics import RouterMetrics
    from router.served_models import ModelsBackend
    from router.tokenizer import RouterTokenizer

    signals = StopSignals()
    signals.install()  # after ray.init() (in _controllers), which took SIGTERM for itself
    router_id = f"router-{uuid.uuid4().hex[:8]}"
    built: list = []
    try:  # Ctrl-C / SIGTERM while it starts: cancelled, and what started stops
        await start_unless_stopped(signals, _build_backends(controllers, router_id, built))
    except StartInterrupted:
        for each, _ in built:
            await _close_backend(each)
        _say("kvrelay: router start-up interrupted; stopped")
        return INTERRUPTED
    backends = {config.model.model_id: b for b, config in built}
    tokenizers = {
        config.model.model_id: RouterTokenizer(config.model.checkpoint_dir) for _, config in built
    }
    backend = built[0][0] if len(built) == 1 else ModelsBackend(backends)
    servers = None
    try:
        for _, config in built:  # the serve's API keys and limits, or it would be a way around
            options.check_access(config.access_digest)
        metrics = RouterMetrics()
        backend.metrics = metrics
        tokenizer = tokenizers[backend.model_id]
        servers = options.build_servers(
            backend, tokenizer, metrics, built[0][1].redis_url, router_id, tokenizers
        )
        await start_servers(servers, host, http_port, grpc_port)  # taken since: one line
        if signals.stop.is_set():  # came while the servers started
            raise StartInterrupted
        http_url, grpc_address = servers.http_url(host), servers.grpc_address(host)
        for each in backends.values():  # each model's controller lists the router
            await each.membership.announce(RouterStatus(router_id, http_url, grpc_address))
        _say(f"kvrelay: router {router_id} serving {', '.join(backends)}")
        _say(f"  HTTP (OpenAI)  {http_url}")
        _say(f"  gRPC           {grpc_address}")
        for line in options.describe():
            _say(line)
        await signals.stop.wait()
        await drain(backend, servers.frontend.admission, options.drain_s, signals.now, _say)
    except StartInterrupted:
        _say("kvrelay: router start-up interrupted; stopped")
        return INTERRUPTED
    finally:
        if servers is not None:
            await close_servers(servers)
        await _close_backend(backend)
    _say("kvrelay: router stopped")
    return 0


async def _build_backends(controllers: list[ControllerActor], router_id: str, built: list) -> None:
    """Each model's backend, appended to `built` as it is made (a start-up cut short closes
    those made); one that fails closes the others and raises."""
    from deploy.router_launch import build_backend

    try:
        for controller in controllers:
            built.append(await build_backend(controller, router_id=router_id))
    except Exception:  # one model's failed: the others' pollers and index end too
        for each, _ in built:
            await _close_backend(each)
        built.clear()
        raise


async def _close_backend(backend: Any) -> None:
    """Stop a router backend's membership sync and pollers, then close its index."""
    await backend.close()
    if backend.index is not None:
        await backend.index.close()


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
