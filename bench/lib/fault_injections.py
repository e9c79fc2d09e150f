"""The faults bench/faults.py injects, one function each (state: none of their own; each acts
on the FaultRun it is given and returns what it did). Kills and freezes are signals to a
worker's process (its pid from the controller): SIGKILL is a crash, SIGSTOP / SIGCONT a stall.
Where a kill must land at a given moment of a request's life (in prefill, handed off but not
yet read), workers are stopped first so that moment holds still, then the victim is killed.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections import Counter
from typing import Any

from bench.lib.fault_run import Fault, FaultRun
from bench.lib.malformed import malformed_requests, send_malformed
from bench.lib.router_process import RouterProcess
from bench.lib.steady_load import HttpClient, RequestRecord

FREEZE_S = 10.0
ROUTER_FREEZE_S = 15.0  # past the decode workers' 10 s wait for a router's polls
REDIS_DOWN_S = 10.0
NUM_ABORTS = 100
NUM_LONG_STREAMS = 2  # through the router that is killed; outlive its silence timeout
LONG_STREAM_TOKENS = 400
ABORT_WAVE = 10  # storm requests in flight at once


async def nothing(run: FaultRun) -> dict[str, Any]:
    return {"did": "nothing (the control row)"}


async def kill_prefill_in_prefill(run: FaultRun) -> dict[str, Any]:
    """Both prefill workers stall; the first one given a new request is killed with its
    requests in prefill (before any handle returns), the other resumes."""
    backend = run.backend
    pids = await run.pids("prefill")
    earlier = set(backend.last_placements)
    for pid in pids.values():
        os.kill(pid, signal.SIGSTOP)
    try:
        new = await run.until(lambda: [r for r in backend.last_placements if r not in earlier], "")
        victim = backend.last_placements[new[0]]
        await asyncio.sleep(1.0)  # a few more requests queue on both
        placed = dict(backend.last_placements)
        on_victim = [r for r, w in placed.items() if w == victim and r not in earlier]
        os.kill(pids[victim], signal.SIGKILL)
    finally:
        for pid in pids.values():
            os.kill(pid, signal.SIGCONT)
    return {
        "did": f"killed {victim} with {_count(len(on_victim), 'request')} in prefill on it",
        "victim": victim,
        "watched": on_victim,
    }


async def kill_prefill_after_handoff(run: FaultRun) -> dict[str, Any]:
    """A decode worker stalls; once a request's handle is handed to it (its blocks not read
    yet), the prefill worker holding those blocks is killed and the decode worker resumes: its
    pull finds the holder dead."""
    backend = run.backend
    decode_id, decode_pid = sorted((await run.pids("decode")).items())[0]
    earlier = {r.req_id for r in run.in_flight() if backend.decode_worker_of(r.req_id)}
    os.kill(decode_pid, signal.SIGSTOP)
    try:

        def handed() -> list[str]:
            return [
                r.req_id
                for r in run.in_flight()
                if r.req_id not in earlier and backend.decode_worker_of(r.req_id) == decode_id
            ]

        req_id = (await run.until(handed, "a handoff to the stalled decode worker"))[0]
        holder = backend.last_placements[req_id]
        os.kill((await run.pids("prefill"))[holder], signal.SIGKILL)
    finally:
        os.kill(decode_pid, signal.SIGCONT)
    return {
        "did": f"killed {holder} after it handed {req_id} to {decode_id} (not yet read)",
        "victim": holder,
        "decode_worker": decode_id,
        "watched": [req_id],
    }


async def kill_decode_with_streams(run: FaultRun) -> dict[str, Any]:
    """Once both decode workers stream requests, the one with more streams is killed."""
    backend = run.backend

    def streams() -> Counter[str] | None:
        on = Counter(
            w for r in run.in_flight() if (w := backend.decode_worker_of(r.req_id)) is not None
        )
        return on if len(on) >= 2 else None

    on = await run.until(streams, "streams on both decode workers")
    victim, num_streams = on.most_common(1)[0]
    streaming = [r.req_id for r in run.in_flight() if backend.decode_worker_of(r.req_id) == victim]
    os.kill((await run.pids("decode"))[victim], signal.SIGKILL)
    everywhere = ", ".join(f"{n} on {w}" for w, n in sorted(on.items()))
    return {
        "did": f"killed {victim} streaming {_count(num_streams, 'request')} ({everywhere})",
        "victim": victim,
        "streams": dict(on),
        "watched": streaming,
    }


async def redis_down(run: FaultRun) -> dict[str, Any]:
    backend, redis = run.backend, run.cluster.redis
    unavailable = backend.num_index_unavailable
    redis.stop()
    try:
        await asyncio.sleep(REDIS_DOWN_S)
    finally:
        redis.start()
    back = time.monotonic()
    workers = len(run.cluster.prefill_actors) + len(run.cluster.decode_actors)

    async def whole() -> None:
        while True:
            try:
                if len(await backend.index.live_workers()) == workers:
                    return
            except Exception:  # still reconnecting
                pass
            await asyncio.sleep(0.1)

    await asyncio.wait_for(whole(), 60.0)
    by_load = backend.num_index_unavailable - unavailable
    return {
        "did": f"Redis down {REDIS_DOWN_S:.0f} s ({by_load} placements by load alone), then "
        f"back; every worker re-published within {time.monotonic() - back:.1f} s",
        "placements_by_load_alone": by_load,
    }


async def kill_router(run: FaultRun) -> dict[str, Any]:
    """An extra HTTP load (half the rate) goes through a `kvrelay router` process, with
    NUM_LONG_STREAMS long streams decoding when it is SIGKILLed (its decode workers must abort
    them once it stops polling); a new router process takes the load over."""
    import ray

    address = ray.get_runtime_context().gcs_address
    rate = run.settings.rate / 2
    routers: list[RouterProcess] = []
    clients: list[HttpClient] = []
    run.on_end(lambda: _close(routers, clients))

    def router_client(router: RouterProcess, max_tokens: int) -> HttpClient:
        clients.append(HttpClient(router.base_url, run.model, run.prompts, max_tokens))
        return clients[-1]

    routers.append(first := RouterProcess(address, run.log_dir / "router-a.log"))
    await first.wait_ready()
    load = run.add_load(router_client(first, run.params.max_tokens), rate, "http-a")
    long_client = router_client(first, LONG_STREAM_TOKENS)
    long = [RequestRecord(f"long{i}", i, time.time()) for i in range(NUM_LONG_STREAMS)]
    streams = [asyncio.create_task(long_client.send(r)) for r in long]
    await asyncio.sleep(run.settings.pre_s)
    await run.until(lambda: all(r.first for r in long), "the long streams decoding")
    cut = [r.req_id for r in load.in_flight()]
    load.stop()
    first.kill()
    await asyncio.gather(*streams)
    routers.append(second := RouterProcess(address, run.log_dir / "router-b.log"))
    up_s = await second.wait_ready()
    run.add_load(router_client(second, run.params.max_tokens), rate, "http-b")
    return {
        "did": f"SIGKILLed a router process serving an HTTP load of {rate:g} req/s "
        f"({_count(len(cut), 'request')} of it in flight) and {NUM_LONG_STREAMS} long streams; "
        f"a new router process took the load over {up_s:.1f} s later",
        "injected": f"{NUM_LONG_STREAMS} long streams cut by the kill",
        "long_streams": [r.error for r in long],
        "watched": cut,
    }


async def freeze_router(run: FaultRun) -> dict[str, Any]:
    """An extra HTTP load (half the rate) and NUM_LONG_STREAMS long streams go through a
    `kvrelay router` process that is SIGSTOPped for ROUTER_FREEZE_S, longer than the decode
    workers wait for its polls, then SIGCONT: the workers abort its requests (ending each
    with a resumable error), and the router, running again, migrates them."""
    import ray

    address = ray.get_runtime_context().gcs_address
    rate = run.settings.rate / 2
    clients: list[HttpClient] = []
    router = RouterProcess(address, run.log_dir / "router-frozen.log")
    run.on_end(lambda: _close([router], clients))
    await router.wait_ready()
    clients.append(HttpClient(router.base_url, run.model, run.prompts, run.params.max_tokens))
    load = run.add_load(clients[-1], rate, "http-frozen")
    clients.append(HttpClient(router.base_url, run.model, run.prompts, LONG_STREAM_TOKENS))
    long = [RequestRecord(f"long{i}", i, time.time()) for i in range(NUM_LONG_STREAMS)]
    streams = [asyncio.create_task(clients[-1].send(r)) for r in long]
    await asyncio.sleep(run.settings.pre_s)
    await run.until(lambda: all(r.first for r in long), "the long streams decoding")
    hit = [r.req_id for r in load.in_flight()]
    router.proc.send_signal(signal.SIGSTOP)
    try:
        await asyncio.sleep(ROUTER_FREEZE_S)
    finally:
        router.proc.send_signal(signal.SIGCONT)
    await asyncio.gather(*streams)
    resumed = router.log_path.read_text().count("migrating it")
    ended = [r.error or f"{r.finish_reason} after {len(r.text)} characters" for r in long]
    return {
        "did": f"SIGSTOP a router process serving an HTTP load of {rate:g} req/s "
        f"({_count(len(hit), 'request')} of it in flight) and {NUM_LONG_STREAMS} long streams "
        f"for {ROUTER_FREEZE_S:.0f} s, then SIGCONT; its log shows {resumed} migrations",
        "injected": f"{NUM_LONG_STREAMS} long streams: " + "; ".join(ended),
        "long_streams": [r.error for r in long],
        "watched": hit,
        "migrated_by_router_process": resumed,
    }


async def _close(routers: list[RouterProcess], clients: list[HttpClient]) -> None:
    for client in clients:
        await client.close()
    for router in routers:
        router.kill()


async def freeze(run: FaultRun, role: str) -> dict[str, Any]:
    """SIGSTOP one worker for FREEZE_S, then SIGCONT: the decode worker streaming the most
    requests, or the first prefill worker."""
    backend = run.backend
    if role == "decode":

        def streams() -> Counter[str]:
            return Counter(w for r in run.in_flight() if (w := backend.decode_worker_of(r.req_id)))

        victim = (await run.until(streams, "a stream")).most_common(1)[0][0]
    else:
        victim = sorted(run.cluster.prefill_actors)[0]
    pid = (await run.pids(role))[victim]
    os.kill(pid, signal.SIGSTOP)
    try:
        hit = _on_worker(run, victim, role)  # streaming there when it stopped
        await asyncio.sleep(FREEZE_S)
        hit |= _on_worker(run, victim, role)  # and what was placed there meanwhile
    finally:
        os.kill(pid, signal.SIGCONT)
    what = "streaming" if role == "decode" else "in prefill on it"
    return {
        "did": f"SIGSTOP {victim} for {FREEZE_S:.0f} s, then SIGCONT ({_count(len(hit), 'request')}"
        f" {what})",
        "victim": victim,
        "watched": sorted(hit),
    }


def _on_worker(run: FaultRun, worker_id: str, role: str) -> set[str]:
    backend = run.backend
    if role == "decode":
        return {
            r.req_id for r in run.in_flight() if backend.decode_worker_of(r.req_id) == worker_id
        }
    return {
        r.req_id
        for r in run.in_flight()
        if backend.last_placements.get(r.req_id) == worker_id
        and backend.decode_worker_of(r.req_id) is None
    }


def _count(num: int, noun: str) -> str:
    return f"{num} {noun}" + ("" if num == 1 else "s")


async def freeze_decode(run: FaultRun) -> dict[str, Any]:
    return await freeze(run, "decode")


async def freeze_prefill(run: FaultRun) -> dict[str, Any]:
    return await freeze(run, "prefill")


async def abort_storm(run: FaultRun) -> dict[str, Any]:
    """NUM_ABORTS HTTP streams to the in-process router, ABORT_WAVE at a time, each closing
    its connection after two chunks of text."""
    import aiohttp

    url = f"{run.http_base}/v1/completions"
    outcomes: Counter[str] = Counter()

    async def one(session: aiohttp.ClientSession, i: int) -> str:
        body = {
            "model": run.model,
            "prompt": list(run.prompts[i % len(run.prompts)]),
            "max_tokens": 500,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        num_chunks = 0
        try:
            async with session.post(url, json=body) as response:
                async for line in response.content:
                    if line.startswith(b"data: {"):
                        num_chunks += bool(json.loads(line[6:])["choices"][0].get("text"))
                    if num_chunks == 2:
                        response.close()  # the client leaves mid-stream
                        return "left mid-stream"
            return "ended before leaving"
        except aiohttp.ClientError as e:
            return f"error: {type(e).__name__}: {e}"

    async with aiohttp.ClientSession() as session:
        for wave in range(0, NUM_ABORTS, ABORT_WAVE):
            outcomes.update(
                await asyncio.gather(*(one(session, wave + k) for k in range(ABORT_WAVE)))
            )
    left = outcomes["left mid-stream"]
    return {
        "did": f"{left} of {NUM_ABORTS} HTTP streams left mid-stream, {ABORT_WAVE} at a time",
        "injected": f"{left}/{NUM_ABORTS} aborted mid-stream",
        "storm": dict(outcomes),
    }


async def malformed(run: FaultRun) -> dict[str, Any]:
    result = await send_malformed(run.http_base, malformed_requests(run.model))
    named, sent = result["num_refused_naming_the_field"], result["num_sent"]
    return {
        "did": f"{sent} malformed requests at once: {named} got a 400 naming the field",
        "injected": f"{named}/{sent} got a 400 naming the field",
        **result,
    }


FAULTS = [
    Fault("none", "no fault (control)", nothing),
    Fault("prefill-before", "kill a prefill worker before the pull", kill_prefill_in_prefill),
    Fault("prefill-after", "kill a prefill worker after handing off", kill_prefill_after_handoff),
    Fault("decode", "kill a decode worker with streams on both", kill_decode_with_streams),
    Fault("redis", f"Redis down {REDIS_DOWN_S:.0f} s, then back", redis_down),
    Fault("router", "kill a router (its HTTP load moves to a new one)", kill_router),
    Fault("freeze-router", f"freeze a router {ROUTER_FREEZE_S:.0f} s", freeze_router),
    Fault("freeze-decode", f"freeze a decode worker {FREEZE_S:.0f} s", freeze_decode),
    Fault("freeze-prefill", f"freeze a prefill worker {FREEZE_S:.0f} s", freeze_prefill),
    Fault("aborts", f"abort storm ({NUM_ABORTS} mid-stream)", abort_storm),
    Fault("malformed", "50 malformed HTTP requests", malformed),
]
