"""RouterServers: the HTTP and gRPC front ends of one Frontend, started and stopped together;
owns the two servers (`kvrelay serve` runs them until Ctrl-C)."""

from __future__ import annotations

import logging

from router.frontend import Frontend
from router.grpc_server import GrpcServer
from router.http_server import HttpServer

logger = logging.getLogger(__name__)


class RouterServers:
    """Build inside the serving event loop; ports 0 pick free ones (read them after start)."""

    def __init__(self, frontend: Frontend):
        self.frontend = frontend
        self.http = HttpServer(frontend)
        self.grpc = GrpcServer(frontend)

    async def start(self, host: str = "127.0.0.1", http_port: int = 0, grpc_port: int = 0) -> None:
        await self.http.start(host, http_port)
        try:
            await self.grpc.start(host, grpc_port)
        except BaseException:
            await self.http.stop()
            raise
        logger.info(
            "serving %s: HTTP on %s:%d, gRPC on %s:%d",
            self.frontend.model_id,
            host,
            self.http.port,
            host,
            self.grpc.port,
        )

    async def stop(self, grace_s: float = 1.0) -> None:
        try:
            await self.grpc.stop(grace_s)
        finally:
            await self.http.stop()
