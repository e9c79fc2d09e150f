"""The operator commands' pure parts: scale arguments, the status table, finding the local
cluster's address (no Ray, no model)."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import pytest

from common.cluster_state import (
    ClassQueue,
    ClusterStatus,
    DecodeStats,
    KVEvictRequest,
    LeakCheck,
    PoolStatus,
    PrefillStats,
    RedisStatus,
    RouterStatus,
    ScaleRequest,
    Transition,
    WorkerState,
    WorkerStatus,
)
from common.messages import WorkerLoad
from deploy.cli import main
from deploy.ops_cli import (
    add_ops_parsers,
    evict_request,
    format_evicted,
    format_status,
    kv_evict,
    salt_warning,
    tenant_warning,
)
from engine.kv_cache.tier_stats import TierStats
from router.access import tenant_cache_salt
from router.rate_limit_schema import TenantUsage


def test_scale_request_keeps_only_the_pools_given_and_refuses_bad_sizes() -> None:
    assert ScaleRequest(decode=3).sizes() == {"decode": 3}
    assert ScaleRequest(prefill=0, decode=2).sizes() == {"prefill": 0, "decode": 2}
    with pytest.raises(ValueError, match=r"--prefill must be in \[0, 1024\]"):
        ScaleRequest(prefill=-1).sizes()
    with pytest.raises(ValueError, match=r"--decode must be in \[1, 1024\] .*, got 1000000000"):
        ScaleRequest(decode=10**9).sizes()  # a typo's billion workers
    with pytest.raises(ValueError, match=r"--decode must be in \[1, 1024\]"):  # one range said
        ScaleRequest(prefill=1, decode=0).sizes()


def test_status_says_when_the_decode_workers_compute_every_prompt() -> None:
    decode = WorkerStatus("d0", "decode", WorkerState.READY, (Transition(WorkerState.READY, 1.0),))
    pools = (PoolStatus("prefill", 0, ()), PoolStatus("decode", 1, (decode,)))
    text = format_status(ClusterStatus("m", pools, (), RedisStatus("", False, 0)))
    assert "prefill pool: 0 ready of 0 wanted" in text
    assert "no prefill worker: the decode workers compute every prompt" in text


def test_scale_without_a_pool_is_a_clear_error(capsys) -> None:
    assert main(["scale"]) == 2
    assert "give --prefill N, --decode M or both" in capsys.readouterr().err
    for timeout in ("-5", "nan", "inf"):  # nan never timed out
        assert main(["scale", "--decode", "1", "--timeout", timeout]) == 2
        assert "--timeout must be a positive number" in capsys.readouterr().err


def test_evicting_an_empty_prompts_blocks_is_refused(capsys) -> None:
    """It exited 0 dropping nothing."""
    assert main(["kv", "evict", "--prefix-of", ""]) == 2
    assert "--prefix-of must not be empty" in capsys.readouterr().err


def status_with(workers: tuple[WorkerStatus, ...]) -> ClusterStatus:
    pools = (PoolStatus("prefill", 1, workers[:1]), PoolStatus("decode", 2, workers[1:]))
    routers = (RouterStatus("router-1", "http://h:8000/v1", "h:50051", 1.0),)
    return ClusterStatus("m", pools, routers, RedisStatus("redis://:***@h:6379/0", True, 3))


def test_status_shows_each_routers_queue_by_class() -> None:
    queue = (ClassQueue("interactive", 0, 2), ClassQueue("batch", queued=7, running=3))
    router = RouterStatus("router-1", "http://h:8000/v1", "h:50051", 1.0, queue=queue)
    status = replace(status_with(()), routers=(router, RouterStatus("router-2")))
    lines = format_status(status).splitlines()
    at = lines.index("  router-1  http http://h:8000/v1  grpc h:50051")
    assert lines[at + 1] == "    queue: interactive 0 queued 2 running, batch 7 queued 3 running"
    assert lines[at + 2].startswith("  router-2")  # no queue reported: no line
    assert status.to_json_dict()["routers"][0]["queue"][1] == {
        "kind": "batch", "queued": 7, "running": 3,
    }  # fmt: skip


def test_status_table_shows_state_load_hit_rate_and_transfer_rate() -> None:
    load = WorkerLoad(running=2, waiting=1, free_blocks=60, total_blocks=100)
    prefill = WorkerStatus(
        "p0", "prefill", WorkerState.READY, (Transition(WorkerState.READY, 1.0),), "10.0.0.1",
        stats=PrefillStats(WorkerState.READY, load, num_prompt_tokens=200, num_cached_tokens=50),
    )  # fmt: skip
    decode = WorkerStatus(
        "d0", "decode", WorkerState.READY, (), "10.0.0.2",
        stats=DecodeStats(
            WorkerState.READY, load, num_transferred_bytes=4_000_000, transfer_seconds=2.0
        ),
    )  # fmt: skip
    gone = WorkerStatus(
        "d1", "decode", WorkerState.GONE, (Transition(WorkerState.GONE, 2.0, "drained, exited"),),
        exit_check=LeakCheck(100, 100),
    )  # fmt: skip
    text = format_status(status_with((prefill, decode, gone)))
    assert "decode pool: 1 ready of 2 wanted" in text
    assert "running 2 waiting 1, KV 40/100 blocks, prefix hits 25%" in text
    assert "KV transfer 2.0 MB/s" in text
    assert "drained, exited" in text
    assert "router-1  http http://h:8000/v1  grpc h:50051" in text
    assert "redis: redis://:***@h:6379/0 reachable, 3 workers" in text
    as_json = status_with((prefill, decode, gone)).to_json_dict()
    assert as_json["pools"][0]["workers"][0]["stats"]["prefix_hit_rate"] == 0.25
    assert as_json["pools"][1]["workers"][1]["exit_check"]["num_free_blocks"] == 100
    json.dumps(as_json)  # plain JSON types only


def test_status_shows_each_kv_tier_size_use_and_hit_rate() -> None:
    tiers = (
        TierStats("device", 100, 80, 40, 10, 0, 0.0),
        TierStats("host", 50, 50, 30, 15, 15 * 1000, 0.0, recent_load_s=0.00004),
        TierStats("disk", 1000, 300, 15, 5, 5_000_000, 0.01, 2, 0, 7, 0.0004, writes_dropped=3),
        TierStats("shared", 5000, 700, 10, 0, 0, 0.0, write_failures=3),
    )
    load = WorkerLoad(free_blocks=20, total_blocks=100)
    worker = WorkerStatus(
        "p0", "prefill", WorkerState.READY, (), "10.0.0.1",
        stats=PrefillStats(WorkerState.READY, load, tiers=tiers),
    )  # fmt: skip
    status = status_with((worker,))
    text = format_status(status)
    assert (
        "tiers: device 80/100 blocks, hits 25%; host 50/50 blocks, hits 50% (0.0 MB loaded),"
        " copy back 40 us a block;" in text
    )
    assert (
        "disk 300/1000 blocks, hits 33% (5.0 MB loaded, 2.00 ms a block on average, 0.40 lately),"
        " 2 bad files, 3 blocks not stored (its writer fell behind), 7 "
        "prompts' hits computed again (reading was the slower)" in text
    )
    assert "shared 700/5000 blocks, hits 0%, 3 writes refused" in text
    raw = status.to_json_dict()["pools"][0]["workers"][0]["stats"]["tiers"]
    assert raw[3]["tier"] == "shared" and raw[3]["capacity_blocks"] == 5000
    assert raw[0]["hit_rate"] == 0.25
    json.dumps(raw)


def test_kv_evict_sends_a_tenants_salt_or_a_prompt_and_reports_each_worker() -> None:
    parser = argparse.ArgumentParser()
    add_ops_parsers(parser.add_subparsers())
    args = parser.parse_args(["kv", "evict", "--tenant", "team-a", "--prefix-of", "Hi there"])
    assert args.func is kv_evict
    request = evict_request(args)
    assert request == KVEvictRequest("Hi there", tenant_cache_salt("team-a", None))
    assert evict_request(parser.parse_args(["kv", "evict", "--salt", "s1"])).cache_salt == "s1"
    with pytest.raises(ValueError, match="--prefix-of TEXT, --salt S"):
        evict_request(parser.parse_args(["kv", "evict"]))
    text = format_evicted({"p0": {"device": 3, "disk": 5, "shared": 8}, "d0": "RayActorError: x"})
    assert "p0: blocks dropped: device 3, disk 5, shared 8" in text
    assert "d0: error: RayActorError: x" in text
    assert format_evicted({}) == "no worker answered: nothing evicted"


def test_kv_evict_warns_of_a_tenant_the_cluster_has_not_seen() -> None:
    used = [TenantUsage("team-a", "none", 0, {}), TenantUsage("team-b", "none", 1, {})]
    assert tenant_warning("team-a", used) is None
    typo = tenant_warning("team-c", used)
    assert typo is not None and "'team-c' has no usage" in typo and "team-a, team-b" in typo
    keyless = tenant_warning("team-a", [])  # served without --api-keys (it dropped 0, silent)
    assert keyless is not None and "--api-keys" in keyless and "--salt" in keyless
    assert tenant_warning("team-a", "keys: Redis did not answer") is None  # cannot tell


def test_kv_evict_warns_of_a_salt_alone_on_a_keyed_cluster() -> None:
    """--salt S on a cluster served with API keys dropped nothing, silently (each block is
    salted by its tenant with S): a warning says to pass --tenant."""
    warning = salt_warning("s1", keyed=True)
    assert warning is not None and "--tenant T" in warning
    assert "--salt alone" in warning
    assert salt_warning("s1", keyed=False) is None  # open cluster: S is the salt
    prefix_only = salt_warning(None, keyed=True)  # --prefix-of alone: no tenant's blocks either
    assert prefix_only is not None and "--prefix-of without --tenant" in prefix_only
    assert salt_warning(None, keyed=False) is None
