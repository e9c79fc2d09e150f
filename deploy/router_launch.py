"""Building one router against a running cluster (holds no state): its ClusterBackend from the
controller's RouterConfig, its Redis index reader and its membership sync with the controller.
`kvrelay serve` builds one in-process; `kvrelay router` builds more, in their own processes."""

from __future__ import annotations

import time
import uuid

from common.cluster_state import RouterConfig, RouterStatus, SloAttainment
from common.worker_actors import ControllerActor
from router.cluster_backend import ClusterBackend
from router.membership import MembershipSync
from router.policy import make_prefill_policy
from router.prefix_index import PrefixIndex
from router.worker_set import WorkerSet


async def build_backend(
    controller: ControllerActor,
    http_url: str = "",
    grpc_address: str = "",
    router_id: str | None = None,
) -> tuple[ClusterBackend, RouterConfig]:
    """A ClusterBackend whose WorkerSet has synced once with the controller (sync keeps going)."""
    config: RouterConfig = await controller.router_config.remote()
    model = config.model
    router_id = router_id or f"router-{uuid.uuid4().hex[:8]}"
    workers = WorkerSet()
    index = None
    if config.redis_url:
        index = PrefixIndex(config.redis_url, model.model_id, shared_store=config.shared_store)
    if index is not None:
        await index.probe()  # a refused password or TLS setup is logged now, not per request
    backend = ClusterBackend(
        model.model_id,
        model.max_model_len,
        model.vocab_size,
        model.block_size,
        workers,
        index,
        make_prefill_policy(config.policy),
        router_id=router_id,
        max_migrations=config.max_migrations,
        local_prefill=config.local_prefill,
        slo=config.slo,
    )
    sync = MembershipSync(controller, workers, RouterStatus(router_id, http_url, grpc_address))

    def attainment() -> SloAttainment | None:
        metrics = backend.metrics
        slo = backend.placer.slo  # the objectives this router places for
        if metrics is None:
            return None
        return metrics.recent_of(model.model_id).attainment(time.monotonic(), slo)

    sync.report_attainment = attainment
    sync.report_queue = lambda: () if backend.metrics is None else backend.metrics.totals().queue
    sync.on_dead = backend.lost_worker  # its streams end and it leaves the index too
    await sync.sync_once()
    sync.start()
    backend.membership = sync
    return backend, config
