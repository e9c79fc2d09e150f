"""The router flags `kvrelay serve` and `kvrelay router` share (request bound, body limit, API keys,
TLS, the drain on Ctrl-C) and the RouterOptions they become, read and checked before any process
starts. Holds no state."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from deploy.serve_stop import DEFAULT_DRAIN_S
from router.admission import DEFAULT_MAX_QUEUED_REQUESTS

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

    def build_servers(
        self,
        backend: Backend,
        tokenizer: RouterTokenizer,
        metrics: RouterMetrics,
        tokenizers: Mapping[str, RouterTokenizer] | None = None,
    ) -> RouterServers:
        """The Frontend over `backend` and its two servers (build inside the serving loop);
        tokenizers: a ModelsBackend's other models' (router/served_models.py)."""
        from router.frontend import Frontend
        from router.serve import RouterServers

        frontend = Frontend(
            backend,
            tokenizer,
            metrics,
            max_queued_requests=self.max_queued_requests,
            api_keys=self.api_keys,
            max_body_mib=self.max_body_mib,
            tokenizers=tokenizers,
        )
        return RouterServers(frontend, self.tls)

    def describe(self) -> list[str]:
        """What `kvrelay serve` / `kvrelay router` print under the addresses."""
        lines = [f"  admission      at most {self.max_queued_requests} requests, then 503"]
        if self.max_body_mib is not None:
            lines.append(f"  body limit     {self.max_body_mib:g} MiB, then 413")
        if self.tls is not None:
            lines.append(f"  TLS            {self.tls.cert_file}")
        if self.api_keys is not None:
            keys = self.api_keys
            lines.append(f"  API keys       {keys.num_keys} keys, {len(keys.tenants)} tenants")
        return lines


def add_router_flags(p: argparse.ArgumentParser) -> None:
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
        help="require an API key: FILE has one `KEY TENANT` per line (# comments); each "
        "tenant's prefix cache is kept apart (default: no keys)",
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
        type=float,
        default=DEFAULT_DRAIN_S,
        metavar="S",
        help="on Ctrl-C or SIGTERM: refuse new requests (503) at once, let open ones finish for "
        'up to S seconds, then end each with finish_reason "abort" (gRPC FINISH_REASON_ABORT) '
        "and stop; a second Ctrl-C ends them at once. If `kvrelay serve`'s embedded Ray "
        "cluster is lost, /ready and new requests answer 503 for S seconds before it exits with "
        "status 1",
    )


def router_options(args: argparse.Namespace) -> RouterOptions:
    """RouterOptions from the flags; ValueError naming the flag (or the key file's line)."""
    from router.access import ApiKeys
    from router.request_size import check_max_body_mib
    from router.tls import ServerTLS

    if args.max_queued_requests < 1:
        raise ValueError(f"--max-queued-requests must be >= 1, got {args.max_queued_requests}")
    check_max_body_mib(args.max_body_mib)
    if not args.drain_seconds >= 0:  # NaN too
        raise ValueError(f"--drain-seconds must be >= 0, got {args.drain_seconds:g}")
    return RouterOptions(
        max_queued_requests=args.max_queued_requests,
        api_keys=ApiKeys.load(args.api_keys) if args.api_keys else None,
        tls=ServerTLS.load(args.tls_cert, args.tls_key),
        max_body_mib=args.max_body_mib,
        drain_s=args.drain_seconds,
    )
