"""Workers sharing a GPU (--gpus-per-worker F): the flag's checks, how many GPUs a pool needs,
the Ray actor options and engine share each worker gets, and the device pick and GPU check of
the embedded cluster (against a stub of Ray's resource view: no Ray is started here)."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from deploy.cli import build_parser
from deploy.local_cluster import ClusterSpec, LocalCluster
from deploy.serve import spec_from_args
from deploy.worker_launch import (
    WorkerTemplate,
    actor_options,
    check_gpus_per_worker,
    gpus_needed,
    worker_engine_config,
    workers_per_gpu,
)
from engine.config import EngineConfig, SchedulerConfig


def parse(*argv: str):
    return spec_from_args(build_parser().parse_args(["serve", *argv]))


@pytest.mark.parametrize("bad", [0.0, -0.5, 1.5])
def test_a_worker_gets_at_most_one_gpu_and_more_than_none(bad: float) -> None:
    with pytest.raises(ValueError, match=r"--gpus-per-worker must be in \(0, 1\]"):
        check_gpus_per_worker(bad)
    with pytest.raises(ValueError, match="--gpus-per-worker"):
        ClusterSpec(gpus_per_worker=bad)


def test_gpus_a_pool_needs() -> None:
    assert [workers_per_gpu(f) for f in (1.0, 0.5, 0.4, 1 / 3, 0.3333, 0.25)] == [1, 2, 2, 3, 3, 4]
    assert gpus_needed(2, 1.0) == 2
    assert gpus_needed(2, 0.5) == 1  # a prefill and a decode worker on one card
    assert gpus_needed(3, 0.5) == 2
    assert gpus_needed(5, 0.4) == 3  # 2 per card: 5 * 0.4 = 2 GPUs would not hold them


def test_each_worker_gets_its_part_of_the_card() -> None:
    engine = EngineConfig(device="cuda")
    half = WorkerTemplate(engine, None, gpus_per_worker=0.5)
    options = actor_options("decode", "d0", half)
    assert options["num_gpus"] == 0.5 and options["resources"] == {"decode_pool": 1}
    assert options["name"] == "d0"
    for role in ("prefill", "decode"):
        assert worker_engine_config(role, half).gpu_share == 0.5
    whole = WorkerTemplate(engine, None, gpus_per_worker=1.0)
    assert worker_engine_config("prefill", whole) is engine
    cpu = WorkerTemplate(EngineConfig(), None)
    assert actor_options("prefill", "p0", cpu)["num_gpus"] == 0.0
    assert worker_engine_config("prefill", cpu).gpu_share == 1.0


def test_a_decode_budget_without_a_batch_limit_keeps_the_default() -> None:
    engine = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=None))
    template = WorkerTemplate(engine, None, decode_prefill_chunk_tokens=256)
    scheduler = worker_engine_config("decode", template).scheduler
    assert (scheduler.max_num_seqs, scheduler.max_num_batched_tokens) == (64, 64 + 256)


def test_serve_flags() -> None:
    spec = parse("--device", "cuda", "--gpus-per-worker", "0.5", "--gpu-memory-utilization", "0.8")
    assert spec.gpus_per_worker == 0.5
    assert spec.worker_gpus("cuda") == 0.5 and spec.worker_gpus("cpu") == 0.0
    assert spec.engine.gpu_memory_utilization == 0.8
    default = parse()
    assert default.gpus_per_worker is None and default.worker_gpus("cuda") == 1.0
    assert default.engine.gpu_memory_utilization == 0.9
    assert default.engine.cache.kv_cache_memory_bytes is None  # sized by memory on CUDA
    assert default.engine.scheduler.max_num_seqs is None  # picked for the pool
    fixed = parse("--kv-cache-gib", "2", "--max-num-seqs", "8")
    assert fixed.engine.cache.kv_cache_memory_bytes == 2 << 30
    assert fixed.engine.scheduler.max_num_seqs == 8


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--gpus-per-worker", "0"], "--gpus-per-worker must be in"),
        (["--gpus-per-worker", "2"], "--gpus-per-worker must be in"),
        (["--device", "cpu", "--gpus-per-worker", "0.5"], "applies to CUDA workers"),
        (["--gpu-memory-utilization", "0"], "--gpu-memory-utilization must be in"),
        (["--gpu-memory-utilization", "1.2"], "--gpu-memory-utilization must be in"),
        (["--kv-cache-gib", "0"], "--kv-cache-gib must be > 0"),
    ],
)
def test_bad_serve_flags_are_refused(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse(*argv)


def fake_ray(num_gpus: float) -> SimpleNamespace:
    return SimpleNamespace(cluster_resources=lambda: {"GPU": num_gpus})


def test_device_auto_counts_shared_gpus() -> None:
    said: list[str] = []
    one_card = fake_ray(1.0)
    assert LocalCluster(ClusterSpec(gpus_per_worker=0.5))._pick_device(one_card, said.append) == (
        "cuda"
    )
    assert "0.5 GPU each" in said[-1]
    assert LocalCluster(ClusterSpec())._pick_device(one_card, said.append) == "cpu"
    assert "2 workers at one each need 2 GPUs, Ray has 1" in said[-1]
    assert LocalCluster(ClusterSpec())._pick_device(fake_ray(0), said.append) == "cpu"
    assert "no GPU visible to Ray" in said[-1]


def test_device_cuda_refuses_more_workers_than_the_gpus_hold() -> None:
    spec = ClusterSpec(engine=EngineConfig(device="cuda"), num_prefill=2, num_decode=1)
    with pytest.raises(ValueError, match="3 CUDA workers at 1 GPU each need 3 GPUs; Ray sees 2"):
        LocalCluster(spec)._check_gpus(fake_ray(2.0))
    LocalCluster(replace(spec, gpus_per_worker=0.5))._check_gpus(fake_ray(2.0))  # 2 per card
