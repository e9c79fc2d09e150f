"""gRPC's standard services beside KVRelay: grpc.health.v1 health checking, SERVING only while
every pool has a ready worker (owns the task that keeps the status current for Watch), and
server reflection (v1alpha) listing KVRelay, health and reflection itself."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from router.backend import Backend
from router.pb import kvrelay_pb2 as pb
from router.readiness import check_readiness

logger = logging.getLogger(__name__)

RELAY_SERVICE = pb.DESCRIPTOR.services_by_name["KVRelay"].full_name  # "kvrelay.v1.KVRelay"
HEALTH_SERVICE = health.SERVICE_NAME
REFLECTION_SERVICE = reflection.SERVICE_NAME
CHECKED_SERVICES = ("", RELAY_SERVICE)  # "": the server as a whole
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class BackendHealth(health.aio.HealthServicer):
    """Check asks the backend at each call; Watch streams see changes within interval_s."""

    def __init__(self, backend: Backend, interval_s: float = 1.0):
        super().__init__()
        self.backend = backend
        self.interval_s = interval_s
        self._task: asyncio.Task[None] | None = None

    async def refresh(self) -> bool:
        """Set every checked service from the backend's readiness; returns whether ready."""
        ready = (await check_readiness(self.backend)).ready
        for service in CHECKED_SERVICES:
            await self.set(service, SERVING if ready else NOT_SERVING)
        return ready

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        await self.refresh()  # the answer is the backend's state now, not a second old
        return await super().Check(request, context)

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.create_task(self._keep_current(), name="grpc-health")

    async def stop(self) -> None:
        """NOT_SERVING from now on (a graceful stop), and the refresh task ends."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self.enter_graceful_shutdown()

    async def _keep_current(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.refresh()
            except Exception:
                logger.exception("refreshing the gRPC health status failed")


def add_standard_services(server: grpc.aio.Server, backend: Backend) -> BackendHealth:
    """Health checking and reflection on `server`; start() the returned servicer with it."""
    servicer = BackendHealth(backend)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    names = (RELAY_SERVICE, HEALTH_SERVICE, REFLECTION_SERVICE)
    reflection.enable_server_reflection(names, server)
    return servicer
