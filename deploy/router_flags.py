"""The router flags `kvrelay serve` and `kvrelay router` share (request bound, body limit, API keys,
TLS, the drain on Ctrl-C, the OTLP endpoint of traces) and the RouterOptions they become, read
and checked before any process starts. Holds no state."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from deploy.flag_types import non_negative_float, positive_float, positive_int
from deploy.serve_stop import DEFAULT_DRAIN_S
from router.admission import DEFAULT_MAX_QUEUED_REQUESTS
from router.tenant_limits import (
    LIMIT_NAMES,
    LIMIT_TITLES,
    NO_LIMITS,
    TenantLimits,
    check_limit,
)

if TYPE_CHECKING:  # the servers' modules load only when a router starts (the CLI stays light)
    from router.access import ApiKeys
    from router.backend import Backend
    from router.metrics import RouterMetrics
    from router.serve import RouterServers
    from router.tls import ServerTLS
    from router.tokenizer import RouterTokenizer


@dataclass(frozen=True)
class RouterOptions:
    max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS
    api_keys: ApiKeys | None = None  # None: every caller is admitted, cache_salt as sent
    tls: ServerTLS | None = None  # None: plain HTTP and gRPC
    max_body_mib: float | None = None  # None: derived from the context length (request_size.py)
    drain_s: float = DEFAULT_DRAIN_S  # on Ctrl-C / SIGTERM: how long open requests may finish
    default_limits: TenantLimits = NO_LIMITS  # --rate-limit-*: a tenant's unless its own
    otlp_endpoint: str | None = None  # the router's traces go there (None: tracing off)
    default_max_tokens: int | None = None  # a request's max_tokens when it sets none (None: the
    # context its prompt leaves)
    max_running_requests: int = 0  # sent on to the cluster at once; 0: no bound (fair_queue.py)

    def access_digest(self) -> str | None:
        """Who is admitted and at what rates, as one digest (None: every caller, no keys): the
        keys' digests and tenants, each tenant's class and limits, the default limits."""
        keys = self.api_keys
        if keys is None:
            return None
        import hashlib
        import json

        rules = {
            "keys": sorted(keys.tenant_by_digest.items()),
            "limits": sorted((t, repr(limits)) for t, limits in keys.limits_by_tenant.items()),
            "classes": sorted((t, repr(kind)) for t, kind in keys.class_by_tenant.items()),
            "default": repr(self.default_limits),
        }
        return hashlib.sha256(json.dumps(rules, sort_keys=True).encode()).hexdigest()

    def check_access(self, cluster_digest: str | None) -> None:
        """A router joining a cluster serves the same API keys and per-key limits as its serve:
        ValueError naming the flags when it does not (without them it would admit any caller, or
        let one past its limits; with keys of its own on an open cluster it is only stricter)."""
        mine = self.access_digest()
        if cluster_digest is None or mine == cluster_digest:
            return
        if mine is None:
            raise ValueError(
                "this cluster's `kvrelay serve` admits API keys only (--api-keys or --api-key): "
                "start this router with the same keys (and --rate-limit-* flags); without them "
                "it would admit every caller"
            )
        raise ValueError(
            "this router's API keys or --rate-limit-* flags differ from its cluster's "
            "`kvrelay serve`: give it the same ones (a router with other keys or limits would "
            "let some callers in, or past their limits, that the others refuse)"
        )

    @property
    def has_limits(self) -> bool:
        """Some tenant has a per-key limit (these need the cluster's Redis)."""
        keys = self.api_keys
        return keys is not None and (bool(keys.limits_by_tenant) or self.default_limits.any)

    def build_servers(
        self,
        backend: Backend,
        tokenizer: RouterTokenizer,
        metrics: RouterMetrics,
        redis_url: str | None = None,
        router_id: str | None = None,
        tokenizers: Mapping[str, RouterTokenizer] | None = None,
    ) -> RouterServers:
        """The Frontend over `backend` and its two servers (build inside the serving loop). With
        API keys and a Redis, each tenant's usage is counted there and its limits kept; with an
        OTLP endpoint, this process traces its requests from now on (close_servers sends the
        last spans); tokenizers: a ModelsBackend's other models' (router/served_models.py)."""
        from common import tracing
        from router.frontend import Frontend
        from router.rate_limits import RateLimiter
        from router.serve import RouterServers

        limiter = None
        keys = self.api_keys
        if keys is not None and redis_url:
            limiter = RateLimiter(
                redis_url, keys.limits_by_tenant, self.default_limits, metrics, router_id=router_id
            )
        elif self.has_limits:
            raise ValueError("per-key limits need the cluster's Redis (this one runs without)")

        tracing.configure(self.otlp_endpoint, "kvrelay-router")
        frontend = Frontend(
            backend,
            tokenizer,
            metrics,
            max_queued_requests=self.max_queued_requests,
            api_keys=self.api_keys,
            max_body_mib=self.max_body_mib,
            limiter=limiter,
            max_running_requests=self.max_running_requests,
            tokenizers=tokenizers,
            max_tokens_cap=self.default_max_tokens,
        )
        return RouterServers(frontend, self.tls)

    def describe(self) -> list[str]:
        """What `kvrelay serve` / `kvrelay router` print under the addresses."""
        lines = [f"  admission      at most {self.max_queued_requests} requests, then 503"]
        if self.max_running_requests:
            lines.append(
                f"  queue          {self.max_running_requests} running at once of each "
                f"priority or above ({2 * self.max_running_requests} in all), the rest by "
                "priority and fair share"
            )
        if self.max_body_mib is not None:
            lines.append(f"  body limit     {self.max_body_mib:g} MiB, then 413")
        if self.tls is not None:
            lines.append(f"  TLS            {self.tls.cert_file}")
        if self.api_keys is not None:
            keys = self.api_keys
            lines.append(f"  API keys       {keys.num_keys} keys, {len(keys.tenants)} tenants")
            limited = len(keys.limits_by_tenant)
            if limited or self.default_limits.any:
                default = self.default_limits.describe()
                lines.append(f"  per-key limits {limited} tenants their own, default {default}")
        if self.otlp_endpoint is not None:
            lines.append(f"  traces         OTLP/HTTP to {self.otlp_endpoint}")
        return lines


def add_router_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--default-max-tokens",
        type=int,
        default=None,
        metavar="N",
        help="max_tokens of a request that sets none (default: the context its prompt leaves); "
        "what per-key token limits charge such a request",
    )
    p.add_argument(
        "--max-queued-requests",
        type=int,
        default=DEFAULT_MAX_QUEUED_REQUESTS,
        metavar="N",
        help="requests this router holds at once, queued or running (default "
        f"{DEFAULT_MAX_QUEUED_REQUESTS}); one more gets HTTP 503 + Retry-After / gRPC "
        "RESOURCE_EXHAUSTED at once",
    )
    p.add_argument(
        "--max-running-requests",
        type=int,
        default=0,
        metavar="N",
        help="requests of one `priority` or higher this router sends on to the cluster at "
        "once, twice that in all (lower ones running never hold a higher one back); the "
        "others wait in its "
        "queue, higher `priority` first and tenants sharing by their keys' weights (deficit "
        "round robin over prompt + max_tokens); 0 (default): no bound, every request goes on "
        "at once and only the workers order by priority",
    )
    p.add_argument(
        "--max-body-mib",
        type=float,
        default=None,
        metavar="MIB",
        help="the largest request body read, HTTP or gRPC; a larger one gets HTTP 413 / gRPC "
        "RESOURCE_EXHAUSTED naming the limit (default: 32 bytes a token of context, at least "
        "4 MiB)",
    )
    p.add_argument(
        "--api-keys",
        default=None,
        metavar="FILE",
        help="require an API key: FILE has one `KEY TENANT [rps=R tpm=N streams=N] "
        "[class=interactive|batch] [weight=N]` per line (# comments; the columns are the "
        "tenant's per-key limits and traffic class); each tenant's prefix cache is kept apart, its "
        "class caps its priority and its weight is its share of the queue (default: no keys)",
    )
    p.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help="require this one API key of every client, as vLLM's --api-key (one tenant, "
        "`default`; it shows in the process list: a --api-keys file does not)",
    )
    for name in LIMIT_NAMES:
        p.add_argument(
            f"--rate-limit-{name}",
            type=positive_float if name == "rps" else positive_int,
            default=None,
            metavar="N",
            help=f"needs --api-keys: each tenant's {LIMIT_TITLES[name]} unless its key line "
            f"sets `{name}=N`; shared by every router through Redis, then HTTP 429 + "
            "Retry-After / gRPC RESOURCE_EXHAUSTED (default: no limit)",
        )
    p.add_argument(
        "--tls-cert",
        default=None,
        metavar="FILE",
        help="PEM certificate chain: serve HTTPS and gRPC over TLS only (needs --tls-key)",
    )
    p.add_argument("--tls-key", default=None, metavar="FILE", help="the certificate's PEM key")
    p.add_argument(
        "--drain-seconds",
        type=non_negative_float,
        default=DEFAULT_DRAIN_S,
        metavar="S",
        help="on Ctrl-C or SIGTERM: refuse new requests (503) at once, let open ones finish for "
        'up to S seconds, then end each with finish_reason "abort" (gRPC FINISH_REASON_ABORT) '
        "and stop; a second Ctrl-C ends them at once. If `kvrelay serve`'s embedded Ray "
        "cluster is lost, /ready and new requests answer 503 for S seconds before it exits with "
        "status 1",
    )
    p.add_argument(
        "--otlp-endpoint",
        default=None,
        metavar="URL",
        help="export OpenTelemetry traces of every request over OTLP/HTTP to this collector "
        "(e.g. http://localhost:4318; /v1/traces is added to a bare URL): the router's spans, "
        "and with `serve` its workers' (prefill queue and compute, KV handoff, decode); a "
        "client's W3C traceparent header (gRPC metadata) becomes the trace's parent and each "
        "answer names its request's span in one (default: no tracing, nothing measured)",
    )


def router_options(args: argparse.Namespace) -> RouterOptions:
    """RouterOptions from the flags; ValueError naming the flag (or the key file's line)."""
    from common.tracing import check_endpoint
    from router.access import ApiKeys
    from router.request_size import check_max_body_mib
    from router.tls import ServerTLS

    if args.max_queued_requests < 1:
        raise ValueError(f"--max-queued-requests must be >= 1, got {args.max_queued_requests}")
    check_max_body_mib(args.max_body_mib)
    if args.otlp_endpoint is not None:
        check_endpoint(args.otlp_endpoint)
    if args.default_max_tokens is not None and args.default_max_tokens < 1:
        raise ValueError(f"--default-max-tokens must be >= 1, got {args.default_max_tokens}")
    if args.max_running_requests < 0:
        raise ValueError(f"--max-running-requests must be >= 0, got {args.max_running_requests}")
    if not args.drain_seconds >= 0:  # NaN too
        raise ValueError(f"--drain-seconds must be >= 0, got {args.drain_seconds:g}")
    defaults = {}
    for name in LIMIT_NAMES:
        try:
            defaults[name] = check_limit(name, getattr(args, f"rate_limit_{name}"))
        except ValueError as e:
            raise ValueError(f"--rate-limit-{e}") from None
    default_limits = TenantLimits(**defaults)  # type: ignore[arg-type]
    if args.api_keys and args.api_key:
        raise ValueError("give --api-keys FILE or --api-key KEY, not both")
    if default_limits.any and not (args.api_keys or args.api_key):
        raise ValueError(
            "--rate-limit-* needs --api-keys or --api-key (the limits are each tenant's)"
        )
    keys = None
    if args.api_keys:
        keys = ApiKeys.load(args.api_keys)
    elif args.api_key is not None:
        keys = ApiKeys.single(args.api_key)
    return RouterOptions(
        default_limits=default_limits,
        max_queued_requests=args.max_queued_requests,
        api_keys=keys,
        tls=ServerTLS.load(args.tls_cert, args.tls_key),
        max_body_mib=args.max_body_mib,
        drain_s=args.drain_seconds,
        otlp_endpoint=args.otlp_endpoint,
        max_running_requests=args.max_running_requests,
        default_max_tokens=args.default_max_tokens,
    )
