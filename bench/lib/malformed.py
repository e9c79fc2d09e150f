"""Malformed OpenAI requests for fault benches (stateless): bad fields, wrong types and
too-long prompts on both endpoints, each with the field its HTTP 400 must name, and a sender
that checks the answers."""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass
from typing import Any

LONG_TEXT = "many words " * 5000  # over SmolLM2's 8192-token context

# (field, a bad value; DELETE: the field left out): refused on both endpoints
DELETE = object()
SHARED: list[tuple[str, Any]] = [
    ("max_tokens", "ten"),
    ("max_tokens", -3),
    ("max_tokens", 0),
    ("max_tokens", 1.5),
    ("temperature", "hot"),
    ("temperature", -1.0),
    ("top_p", 0),
    ("top_p", 1.5),
    ("top_k", -7),
    ("min_p", 2.0),
    ("seed", "abc"),
    ("seed", 2**70),
    ("stop_token_ids", [10**9]),
    ("stop", [""]),
    ("n", 17),  # n is 1..16
    ("stream", "yes"),
    ("model", "gpt-4o"),
    ("model", 5),  # left out, `model` is the served one: not refused
    ("logit_bias", {"1": 500}),  # a bias is in [-100, 100]
    ("presence_penalty", 3.0),  # [-2, 2]
]
CHAT_ONLY: list[tuple[str, Any, str]] = [  # (field set, value, the param named)
    ("messages", [], "messages"),
    ("messages", "Hello", "messages"),
    ("messages", [{"content": "Hello"}], "messages.0.role"),
    ("messages", [{"role": "user", "content": 5}], "messages.0.content"),
    ("messages", [{"role": "user", "content": LONG_TEXT}], "messages"),
]
COMPLETIONS_ONLY: list[tuple[str, Any, str]] = [
    ("prompt", LONG_TEXT, "prompt"),
    ("prompt", [5, 10**9], "prompt"),
    ("prompt", DELETE, "prompt"),
    ("logprobs", 30, "logprobs"),  # 0..20
]


@dataclass(frozen=True)
class Malformed:
    path: str  # /v1/chat/completions or /v1/completions
    body: dict[str, Any]
    field: str  # what the 400 must name


def _with(base: dict[str, Any], name: str, value: Any) -> dict[str, Any]:
    body = dict(base)
    if value is DELETE:
        del body[name]
    else:
        body[name] = value
    return body


def malformed_requests(model: str) -> list[Malformed]:
    """50 requests: 20 shared cases on each endpoint, 5 only the chat endpoint has, 5 only
    completions."""
    chat = {"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8}
    completion = {"model": model, "prompt": "Hello", "max_tokens": 8}
    out = []
    for path, base in (("/v1/chat/completions", chat), ("/v1/completions", completion)):
        out += [Malformed(path, _with(base, name, value), name) for name, value in SHARED]
    out += [Malformed("/v1/chat/completions", _with(chat, n, v), f) for n, v, f in CHAT_ONLY]
    out += [
        Malformed("/v1/completions", _with(completion, n, v), f) for n, v, f in COMPLETIONS_ONLY
    ]
    return out


async def send_malformed(base_url: str, requests: list[Malformed]) -> dict[str, Any]:
    """Send them all at once; counts of clear refusals (400 naming the field) and the rest."""
    import aiohttp

    async def one(session: aiohttp.ClientSession, case: Malformed) -> tuple[int, Any]:
        async with session.post(base_url + case.path, json=case.body) as reply:
            try:
                return reply.status, await reply.json()
            except (aiohttp.ContentTypeError, ValueError):
                return reply.status, await reply.text()

    async with aiohttp.ClientSession() as session:
        answers = await asyncio.gather(*(one(session, c) for c in requests))
    refused, unclear = 0, []
    for case, (status, body) in zip(requests, answers, strict=True):
        error = body.get("error", {}) if isinstance(body, dict) else {}
        if status == 400 and error.get("param") == case.field and error.get("message"):
            refused += 1
        else:
            unclear.append({"case": f"{case.path} {case.field}", "status": status, "body": body})
    messages = Counter(
        str(b.get("error", {}).get("message", ""))[:80] for _, b in answers if isinstance(b, dict)
    )
    return {
        "num_sent": len(requests),
        "num_refused_naming_the_field": refused,
        "unclear": unclear,
        "sample_errors": [m for m, _ in messages.most_common(5)],
    }
