"""Streaming clients for the kvrelay router (HTTP/SSE with aiohttp, gRPC with grpc.aio) and the
per-request record they fill in. Each client owns its connection (session or channel); times
are time.perf_counter() seconds. Only loopback addresses are accepted.
"""

from __future__ import annotations

import asyncio
import json
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import grpc

from router.pb import kvrelay_pb2 as pb
from router.pb import kvrelay_pb2_grpc as pb_grpc

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})


@dataclass(frozen=True)
class BenchRequest:
    """One request to send: token ids (or text for chat), how many tokens to generate."""

    index: int
    prompt_ids: tuple[int, ...]
    max_tokens: int
    group: int = -1  # shared-prefix group, -1 for none
    text: str | None = None  # chat endpoint: the user message (decoded prompt_ids)
    conversation: int = -1  # multi-turn: the conversation, -1 for none
    turn: int = 0  # multi-turn: the turn's index in its conversation


@dataclass
class RequestResult:
    """What one request measured. token_times are seconds after start, one per streamed chunk
    that carried output; chunk_tokens is how many tokens each chunk carried (HTTP: 1 assumed);
    output_ids the generated token ids (gRPC only: HTTP streams carry text), output_text the
    generated text (HTTP only: the streamed deltas joined)."""

    index: int
    group: int
    start: float = 0.0
    ok: bool = False
    error: str = ""
    token_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    e2e_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    expected_output_tokens: int = 0
    finish_reason: str | None = None
    conversation: int = -1
    turn: int = 0
    output_ids: list[int] = field(default_factory=list)
    output_text: str = ""

    @classmethod
    def unsent(cls, request: BenchRequest, error: str) -> RequestResult:
        """The failed row of a request that never ran (cancelled, or its conversation stopped)."""
        return cls(
            request.index,
            request.group,
            error=error,
            expected_output_tokens=request.max_tokens,
            conversation=request.conversation,
            turn=request.turn,
        )

    @property
    def ttft_s(self) -> float | None:
        return self.token_times[0] if self.token_times else None

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first."""
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def itls_s(self) -> list[float]:
        """Every inter-token gap; a chunk of k tokens contributes k gaps of (its gap / k)."""
        gaps: list[float] = []
        for i in range(1, len(self.token_times)):
            k = max(1, self.chunk_tokens[i])
            gaps.extend([(self.token_times[i] - self.token_times[i - 1]) / k] * k)
        return gaps


def check_loopback(host: str) -> None:
    if host not in LOOPBACK_HOSTS:
        raise ValueError(f"refusing to target {host!r}: this benchmark only talks to 127.0.0.1")


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # greedy by default
    ignore_eos: bool = True
    seed: int | None = None


class Client(ABC):
    """Sends one request, streams its output, never raises: failures land in the result."""

    def __init__(self, sampling: Sampling, timeout_s: float):
        self.sampling = sampling
        self.timeout_s = timeout_s

    async def send(self, request: BenchRequest) -> RequestResult:
        result = RequestResult(
            request.index,
            request.group,
            expected_output_tokens=request.max_tokens,
            conversation=request.conversation,
            turn=request.turn,
        )
        result.start = time.perf_counter()
        try:
            async with asyncio.timeout(self.timeout_s):
                await self._stream(request, result)
            result.ok = result.error == "" and result.output_tokens > 0
        except TimeoutError:
            result.error = f"timed out after {self.timeout_s:.0f} s"
        except (aiohttp.ClientError, grpc.aio.AioRpcError, OSError, ValueError) as e:
            result.error = f"{type(e).__name__}: {e}"
        result.e2e_s = time.perf_counter() - result.start
        return result

    def _on_tokens(self, result: RequestResult, num_tokens: int) -> None:
        result.token_times.append(time.perf_counter() - result.start)
        result.chunk_tokens.append(num_tokens)

    @abstractmethod
    async def _stream(self, request: BenchRequest, result: RequestResult) -> None: ...

    @abstractmethod
    async def close(self) -> None: ...


class HttpClient(Client):
    """OpenAI /v1/completions (token-id prompts) or /v1/chat/completions, stream=true."""

    def __init__(
        self,
        url: str,
        model: str,
        sampling: Sampling,
        timeout_s: float,
        chat: bool = False,
        api_key: str | None = None,
    ):
        super().__init__(sampling, timeout_s)
        parts = urlsplit(url)
        check_loopback(parts.hostname or "")
        base = url.rstrip("/")
        base = base if base.endswith("/v1") else f"{base}/v1"
        self.endpoint = f"{base}/chat/completions" if chat else f"{base}/completions"
        self.model = model
        self.chat = chat
        connector = aiohttp.TCPConnector(limit=0, force_close=False)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        self.session = aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=None), headers=headers
        )

    def _body(self, request: BenchRequest) -> dict[str, Any]:
        s = self.sampling
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": request.max_tokens,
            "temperature": float(s.temperature),
            "ignore_eos": s.ignore_eos,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if s.seed is not None:
            body["seed"] = s.seed
        if self.chat:
            body["messages"] = [{"role": "user", "content": request.text or ""}]
        else:
            body["prompt"] = list(request.prompt_ids)
        return body

    async def _stream(self, request: BenchRequest, result: RequestResult) -> None:
        async with self.session.post(self.endpoint, json=self._body(request)) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return
            data_lines: list[str] = []
            async for raw in resp.content:  # one line per iteration
                line = raw.decode().rstrip("\r\n")
                if line.startswith("data:"):
                    data_lines.append(line[5:].lstrip(" "))
                elif line == "" and data_lines:
                    if not self._on_event("\n".join(data_lines), result):
                        return
                    data_lines = []
            if data_lines:
                self._on_event("\n".join(data_lines), result)

    def _on_event(self, data: str, result: RequestResult) -> bool:
        """Handle one SSE event; False after [DONE] or an error."""
        if data == "[DONE]":
            return False
        event = json.loads(data)
        if "error" in event:
            result.error = str(event["error"].get("message", event["error"]))
            return False
        for choice in event.get("choices") or []:
            text = choice.get("delta", {}).get("content") if self.chat else choice.get("text")
            if text:
                self._on_tokens(result, 1)
                result.output_text += text
            if choice.get("finish_reason"):
                result.finish_reason = choice["finish_reason"]
        if usage := event.get("usage"):
            result.prompt_tokens = usage["prompt_tokens"]
            result.output_tokens = usage["completion_tokens"]
            details = usage.get("prompt_tokens_details") or {}
            result.cached_tokens = details.get("cached_tokens") or 0
        return True

    async def close(self) -> None:
        await self.session.close()


_FINISH = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length"}
_FINISH[pb.FINISH_REASON_ABORT] = "abort"


class GrpcClient(Client):
    """kvrelay.v1.KVRelay/Generate with token-id input; the stream carries the output's ids."""

    def __init__(self, target: str, sampling: Sampling, timeout_s: float):
        super().__init__(sampling, timeout_s)
        check_loopback(target.rsplit(":", 1)[0].strip("[]"))
        self.channel = grpc.aio.insecure_channel(target)
        self.stub = pb_grpc.KVRelayStub(self.channel)

    def _message(self, request: BenchRequest) -> pb.GenerateRequest:
        s = self.sampling
        sampling = pb.SamplingParams(
            max_tokens=request.max_tokens, temperature=s.temperature, ignore_eos=s.ignore_eos
        )
        if s.seed is not None:
            sampling.seed = s.seed
        return pb.GenerateRequest(token_ids=pb.TokenIds(ids=request.prompt_ids), sampling=sampling)

    async def _stream(self, request: BenchRequest, result: RequestResult) -> None:
        num_tokens = 0
        async for msg in self.stub.Generate(self._message(request), timeout=self.timeout_s):
            if msg.token_ids:
                self._on_tokens(result, len(msg.token_ids))
                num_tokens += len(msg.token_ids)
                result.output_ids.extend(msg.token_ids)
            if msg.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                result.finish_reason = _FINISH.get(msg.finish_reason, str(msg.finish_reason))
            if msg.HasField("usage"):
                result.prompt_tokens = msg.usage.prompt_tokens
                result.cached_tokens = msg.usage.cached_prompt_tokens
                result.output_tokens = msg.usage.completion_tokens
        if result.output_tokens == 0:
            result.output_tokens = num_tokens

    async def close(self) -> None:
        await self.channel.close()


class SpreadClient:
    """Several servers behind one client, as a load balancer with session affinity spreads
    them: each conversation (a single-turn workload: each request) goes to one server, chosen
    round-robin by its number."""

    def __init__(self, clients: Sequence[Client]):
        if not clients:
            raise ValueError("SpreadClient needs at least one client")
        self.clients = list(clients)

    def client_for(self, request: BenchRequest) -> Client:
        key = request.conversation if request.conversation >= 0 else request.index
        return self.clients[key % len(self.clients)]

    async def send(self, request: BenchRequest) -> RequestResult:
        return await self.client_for(request).send(request)

    async def close(self) -> None:
        """Close every client, even when one of them fails to close (then raise its error)."""
        errors = await asyncio.gather(*(c.close() for c in self.clients), return_exceptions=True)
        for error in errors:
            if isinstance(error, BaseException):
                raise error


async def served_model_id(url: str, api_key: str | None = None) -> str:
    """The first model /v1/models lists (asked with api_key when given)."""
    check_loopback(urlsplit(url).hostname or "")
    base = url.rstrip("/")
    base = base if base.endswith("/v1") else f"{base}/v1"
    timeout = aiohttp.ClientTimeout(total=10)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    async with (
        aiohttp.ClientSession(timeout=timeout, headers=headers) as session,
        session.get(f"{base}/models") as resp,
    ):
        resp.raise_for_status()
        return (await resp.json())["data"][0]["id"]


async def grpc_model_id(target: str) -> str:
    """The first model ListModels lists."""
    check_loopback(target.rsplit(":", 1)[0].strip("[]"))
    async with grpc.aio.insecure_channel(target) as channel:
        response = await pb_grpc.KVRelayStub(channel).ListModels(pb.ListModelsRequest(), timeout=10)
        return response.models[0].id
