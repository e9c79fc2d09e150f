"""Several models behind one router: ModelsBackend owns only the map of model id to that model's
backend (each keeps its own pools, worker set, index namespace and streams), and a request goes
to the backend its `model` names, the first model being the default; ModelRoute is one model as
the Frontend sees it (backend, tokenizer, tokenizing pool)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from common.messages import GenerateRequest, TokenDelta
from common.placement_rules import SloTargets
from engine.finish_reason import FinishReason
from router.backend import Backend
from router.metrics import RouterMetrics
from router.prompt_encoder import PromptEncoder
from router.readiness import empty_pools
from router.tokenizer import RouterTokenizer


class ModelsBackend(Backend):
    """Invariant: a request only ever reaches the backend of its own model; the default model's
    figures (model_id, max_model_len, vocab_size) answer for the whole when one is asked."""

    def __init__(self, backends: Mapping[str, Backend]):
        if not backends:
            raise ValueError("ModelsBackend needs at least one model")
        self.backends: dict[str, Backend] = dict(backends)
        default = next(iter(self.backends.values()))
        self.model_id = next(iter(self.backends))
        self.max_model_len = default.max_model_len
        self.vocab_size = default.vocab_size
        self.max_choices = min(b.max_choices for b in self.backends.values())
        self.index = None  # each model's backend has (and closes) its own index reader
        self._metrics: RouterMetrics | None = None

    def of(self, model: str) -> Backend:
        """The backend of `model` ("": the default's); KeyError for one not served."""
        return self.backends[model or self.model_id]

    # ---- Backend ---------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        try:
            backend = self.of(request.model)
        except KeyError:  # the Frontend refuses unknown models first; this is a stray caller
            yield TokenDelta(
                request.req_id,
                (),
                True,
                FinishReason.ERROR,
                error=f"model {request.model!r} is not served here",
            )
            return
        async for delta in backend.generate(request):
            yield delta

    def objectives(self, model: str) -> SloTargets:
        return self.of(model).objectives(model)

    async def abort(self, req_id: str) -> None:
        """Every model's backend hears it (a backend that does not know the id does nothing)."""
        await asyncio.gather(*(b.abort(req_id) for b in self.backends.values()))

    async def health(self) -> dict[str, object]:
        """ok when every model can serve; each model's fields as "{model}/{field}" (flat, as
        /health and gRPC Health show them), and the reason (for /ready) naming the models that
        cannot."""
        answers = await asyncio.gather(*(b.health() for b in self.backends.values()))
        details = dict(zip(self.backends, answers, strict=True))
        status: dict[str, object] = {"ok": all(bool(a.get("ok")) for a in answers)}
        down = [
            f"model {model!r}: {a.get('reason') or empty_pools(a) or 'cannot serve'}"
            for model, a in details.items()
            if not a.get("ok")
        ]
        if down:
            status["reason"] = "; ".join(down)
        fields = {f"{m}/{k}": v for m, a in details.items() for k, v in a.items() if k != "ok"}
        return {**status, **fields}

    async def refresh_metrics(self) -> None:
        """Each model's workers' stats into the one registry: the series of one model's workers
        are not dropped by another's refresh (each keeps only what it asked, so they are asked
        together and the collector keeps their union)."""
        if self._metrics is None:
            return
        await asyncio.gather(*(b.check_redis() for b in self._cluster_backends()))
        answers = await asyncio.gather(*(b.worker_stats() for b in self._cluster_backends()))
        answered = {worker_id: got for answer in answers for worker_id, got in answer.items()}
        for worker_id, (role, stats) in answered.items():
            self._metrics.worker_stats.update(worker_id, role, stats)
        self._metrics.worker_stats.keep_only(set(answered))

    # ---- what serve and the stop path call on a ClusterBackend, for every model ------------
    @property
    def metrics(self) -> RouterMetrics | None:
        return self._metrics

    @metrics.setter
    def metrics(self, metrics: RouterMetrics | None) -> None:
        self._metrics = metrics
        if metrics is not None:
            metrics.per_model = True  # each model's controller hears its own attainment
        for backend in self.backends.values():
            backend.metrics = metrics  # type: ignore[attr-defined]

    def stop_taking(self, reason: str) -> None:
        for backend in self._cluster_backends():
            backend.stop_taking(reason)

    def end_streams(self, reason: str, finish_reason: FinishReason = FinishReason.ABORT) -> int:
        return sum(b.end_streams(reason, finish_reason) for b in self._cluster_backends())

    def lose_cluster(self, reason: str) -> None:
        for backend in self._cluster_backends():
            backend.lose_cluster(reason)

    async def close(self) -> None:
        for backend in self._cluster_backends():
            await backend.close()
            if backend.index is not None:
                await backend.index.close()

    def _cluster_backends(self) -> list[Any]:
        return list(self.backends.values())


@dataclass(frozen=True)
class ModelRoute:
    """One served model as the Frontend sees it: its backend and its tokenizer's pool."""

    model_id: str
    backend: Backend
    tokenizer: RouterTokenizer
    encoder: PromptEncoder


def model_routes(
    backend: Backend, tokenizer: RouterTokenizer, tokenizers: Mapping[str, RouterTokenizer]
) -> dict[str, ModelRoute]:
    """Model id -> its route, the default first: a ModelsBackend's models (each with its
    tokenizer from `tokenizers`, the default's `tokenizer` if left out), else `backend`'s one."""
    if not isinstance(backend, ModelsBackend):
        return {backend.model_id: _route(backend.model_id, backend, tokenizer)}
    routes = {}
    for model_id, each in backend.backends.items():
        own = tokenizer if model_id == backend.model_id else tokenizers.get(model_id)
        if own is None:
            raise ValueError(f"no tokenizer given for model {model_id!r}")
        routes[model_id] = _route(model_id, each, own)
    return routes


def _route(model_id: str, backend: Backend, tokenizer: RouterTokenizer) -> ModelRoute:
    return ModelRoute(model_id, backend, tokenizer, PromptEncoder(tokenizer, backend.max_model_len))
