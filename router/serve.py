"""RouterServers: the HTTP and gRPC front ends of one Frontend, started and stopped together,
over TLS when given a ServerTLS; owns the two servers (`kvrelay serve` runs them until Ctrl-C)."""

from __future__ import annotations

import logging

from router.frontend import Frontend
from router.grpc_server import GrpcServer
from router.http_server import HttpServer
from router.tls import ServerTLS

logger = logging.getLogger(__name__)


class BindFailed(OSError):
    """One of the servers cannot listen on its address (the port is taken, the host is not
    this machine's or does not resolve)."""

    def __init__(self, server: str, host: str, port: int, why: str):
        super().__init__(f"the {server} server cannot listen on {host}:{port}: {why}")
        self.server, self.host, self.port, self.why = server, host, port, why


class RouterServers:
    """Build inside the serving event loop; ports 0 pick free ones (read them after start)."""

    def __init__(self, frontend: Frontend, tls: ServerTLS | None = None):
        self.frontend = frontend
        self.tls = tls
        self.http = HttpServer(frontend, tls.ssl_context() if tls else None)
        self.grpc = GrpcServer(frontend, tls.grpc_credentials() if tls else None)

    async def start(self, host: str = "127.0.0.1", http_port: int = 0, grpc_port: int = 0) -> None:
        """Bind and start both; BindFailed naming the server whose address cannot be bound."""
        try:
            await self.http.start(host, http_port)
        except OSError as e:  # taken, or a host that does not resolve (socket.gaierror)
            raise BindFailed("HTTP", host, http_port, e.strerror or str(e)) from e
        try:
            await self.grpc.start(host, grpc_port)
        except BaseException as e:
            await self.http.stop()
            if isinstance(e, RuntimeError) and "bind" in str(e).lower():  # grpc's "Failed to bind"
                raise BindFailed(
                    "gRPC", host, grpc_port, "address in use or not this host's"
                ) from e
            raise
        logger.info(
            "serving %s: %s, gRPC%s on %s:%d%s",
            ", ".join(self.frontend.model_ids()),
            self.http_url(host),
            " (TLS)" if self.tls else "",
            host,
            self.grpc.port,
            ", API keys required" if self.frontend.api_keys else "",
        )

    def http_url(self, host: str) -> str:
        """The OpenAI base URL clients use (https:// under TLS); call after start()."""
        scheme = "https" if self.tls else "http"
        return f"{scheme}://{host}:{self.http.port}/v1"

    def grpc_address(self, host: str) -> str:
        return f"{host}:{self.grpc.port}"

    async def stop(self, grace_s: float = 1.0) -> None:
        try:
            await self.grpc.stop(grace_s)
        finally:
            await self.http.stop()
            if self.frontend.limiter is not None:
                await self.frontend.limiter.close()
