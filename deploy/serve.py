"""`kvrelay serve`: an embedded cluster (local Ray, local redis-server unless --redis-url, N prefill
and M decode workers) behind the router's HTTP and gRPC servers, until Ctrl-C or SIGTERM (a
drain with a deadline, deploy/serve_stop.py) or until its Ray cluster is lost (exit status 1).
Owns no state beyond the running servers; every process it started is stopped on exit."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from dataclasses import replace

from common.cluster_state import RouterStatus
from deploy import cluster_address
from deploy.local_cluster import ClusterSpec, LocalCluster
from deploy.progress import ScaleFailed
from deploy.router_flags import RouterOptions, router_options
from deploy.serve_flags import check_models, check_tier_paths, serve_name, spec_from_args
from deploy.serve_ports import check_ports, start_servers
from deploy.serve_stop import (
    INTERRUPTED,
    StartInterrupted,
    StopSignals,
    close_servers,
    drain,
    refuse_while_lost,
    start_unless_stopped,
    until_stop_or_lost,
)


def serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    spec = spec_from_args(args)
    if spec.ray_address == "local":  # a model this machine lacks: refused before Ray starts
        try:
            check_models(spec)
        except (FileNotFoundError, ValueError) as e:  # one the models file names: it says so
            where = f"--models-file {args.models_file}: " if args.models_file else ""
            raise type(e)(f"{where}{e}") from None
        check_tier_paths(spec)  # a tier folder that cannot be made or written: the same
    options = router_options(args)  # a bad key file or certificate: refused before Ray starts
    spec = replace(spec, access_digest=options.access_digest())  # routers that join: the same
    if options.has_limits and args.no_redis:
        raise ValueError("per-key limits (the key file's columns, --rate-limit-*) need Redis")
    name = serve_name(args)
    if name is not None:
        cluster_address.check_free(name)  # a name a running serve has: refused before Ray starts
    check_ports(args.host, args.http_port, args.grpc_port)  # taken, or a bad --host: ditto
    try:
        return asyncio.run(
            _serve(
                spec,
                options,
                args.host,
                args.http_port,
                args.grpc_port,
                name,
                args.log_stats_interval,
            )
        )
    except ScaleFailed as e:  # the workers cannot start (a model only they would have, ...)
        _say(f"error: the workers did not start: {e}")
        return 1


async def _serve(
    spec: ClusterSpec,
    options: RouterOptions,
    host: str,
    http_port: int,
    grpc_port: int,
    name: str | None,
    stats_interval_s: float,
) -> int:
    from router.metrics import RouterMetrics
    from router.stats_log import StatsLog
    from router.tokenizer import RouterTokenizer

    signals = StopSignals()
    signals.install()
    cluster = LocalCluster(spec)
    servers = stats_log = recorded = redis_keeper = None
    status = 0
    try:
        # Ctrl-C / SIGTERM while it starts: cancelled, and what started stops (below)
        await start_unless_stopped(signals, cluster.start(_say, on_ray_init=signals.install))
        signals.install()  # ray.init() took SIGTERM for itself (a Ray this serve did not start)
        metrics = RouterMetrics()
        cluster.backend.metrics = metrics
        tokenizers = {m: RouterTokenizer(s.checkpoint_dir) for m, s in cluster.models.items()}
        tokenizer = tokenizers[cluster.model.model_id]
        servers = options.build_servers(
            cluster.backend,
            tokenizer,
            metrics,
            cluster.redis_url,
            cluster.router_id,
            tokenizers,
        )
        await start_servers(servers, host, http_port, grpc_port)  # taken since: one line
        http_url, grpc_address = servers.http_url(host), servers.grpc_address(host)
        for backend in cluster.backends.values():  # each model's controller lists the router
            await backend.membership.announce(
                RouterStatus(backend.router_id, http_url, grpc_address)
            )
        if signals.stop.is_set():  # came while the servers started
            raise StartInterrupted
        name = name or str(servers.http.port)
        cluster_address.record_local(name, _ray_address(), http_url, grpc_address)
        recorded = name
        stats_log = StatsLog(
            metrics, cluster.backend.refresh_metrics, stats_interval_s, cluster.known_workers
        )
        stats_log.start()
        redis_keeper = asyncio.create_task(cluster.keep_redis(_say))
        _say(f"kvrelay: serving {', '.join(cluster.models)}")
        _say(f"  HTTP (OpenAI)  {http_url}")
        _say(f"  gRPC           {grpc_address}")
        _say(f"  name           {name} (`kvrelay status --name {name}` when several run)")
        for line in [*options.describe(), *placement_lines(spec)]:
            _say(line)
        scale = (
            "`kvrelay scale --decode N`"
            if len(cluster.models) == 1
            else "`kvrelay scale --model M --decode N`"
        )
        _say(f"  `kvrelay status` / {scale} from another shell; Ctrl-C to stop")
        lost = await until_stop_or_lost(signals, cluster.lost)
        if lost is None:
            admission = servers.frontend.admission
            await drain(cluster.backend, admission, options.drain_s, signals.now, _say)
        else:
            status = 1
            await refuse_while_lost(cluster.backend, lost, options.drain_s, signals.now, _say)
    except StartInterrupted:
        status = INTERRUPTED
        _say("kvrelay: start-up interrupted; stopping what started")
    finally:
        if redis_keeper is not None:
            redis_keeper.cancel()
        if stats_log is not None:
            await stats_log.close()
        if recorded is not None:
            cluster_address.forget_local(recorded)
        if servers is not None:
            await close_servers(servers)
        await cluster.close()
    _say(
        {
            0: "kvrelay: stopped",
            INTERRUPTED: "kvrelay: stopped (start-up was interrupted)",
        }.get(status, "kvrelay: stopped (the Ray cluster was lost)")
    )
    return status


def placement_lines(spec: ClusterSpec) -> list[str]:
    """What `kvrelay serve` prints of its conditional-prefill rule and objectives."""
    lines = []
    rule, slo = spec.local_prefill, spec.slo
    if spec.num_prefill == 0:
        lines.append("  aggregated     no prefill pool: the decode workers compute every prompt")
    elif rule.enabled:
        when = []
        if rule.max_uncached_tokens:
            when.append(f"<= {rule.max_uncached_tokens} uncached tokens")
        if rule.min_cached_fraction <= 1:
            when.append(f">= {rule.min_cached_fraction:g} of the prompt cached")
        if rule.on_slo_miss:
            when.append("the prefill pool would miss the TTFT objective")
        lines.append(f"  local prefill  on a decode worker when {' or '.join(when)}")
    if slo.enabled:
        goals = [f"{name} {ms:g} ms" for name, ms in (("TTFT", slo.ttft_ms), ("TPOT", slo.tpot_ms))]
        goals = [g for g, ms in zip(goals, (slo.ttft_ms, slo.tpot_ms), strict=True) if ms > 0]
        lines.append(f"  objectives     {', '.join(goals)}; overload: {slo.overload}")
    return lines


def _ray_address() -> str:
    import ray

    return ray.get_runtime_context().gcs_address


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
