"""Tensor-parallel workers' pure parts: `kvrelay serve --tp / --prefill-tp / --decode-tp`, a pool's
ranks in its workers' engine configs and placement-group bundles, and `kvrelay status` listing
each worker's ranks (no Ray, no model)."""

from __future__ import annotations

import pytest

from common.cluster_state import (
    ClusterStatus,
    PoolStatus,
    RankPlace,
    RedisStatus,
    Transition,
    WorkerState,
    WorkerStatus,
)
from deploy.cli import build_parser
from deploy.ops_cli import format_status
from deploy.serve_flags import spec_from_args
from deploy.worker_launch import WorkerTemplate, rank_bundles, worker_engine_config
from engine.config import EngineConfig


def spec(*argv: str):
    return spec_from_args(build_parser().parse_args(["serve", "--device", "cpu", *argv]))


def test_serve_tp_sets_both_pools_and_each_pool_flag_overrides_it() -> None:
    assert (spec().prefill_tp, spec().decode_tp) == (1, 1)
    assert (spec("--tp", "2").prefill_tp, spec("--tp", "2").decode_tp) == (2, 2)
    both = spec("--tp", "2", "--decode-tp", "1")
    assert (both.prefill_tp, both.decode_tp) == (2, 1)
    sized = spec("--prefill", "2", "--prefill-tp", "2", "--decode-tp", "4")
    assert (sized.num_ranks, sized.num_cpu_slots) == (8, 9)  # an embedded Ray: a CPU a rank
    with pytest.raises(ValueError, match="--decode-tp must be >= 1, got 0"):
        spec("--decode-tp", "0")


def test_what_a_tp_workers_engine_refuses_is_refused_before_ray_starts(tmp_path) -> None:
    tiers = ("--disk-kv-gib", "1", "--disk-kv-path", str(tmp_path / "d"))
    tiers += ("--shared-kv-gib", "1", "--shared-kv-path", str(tmp_path / "s"))
    assert spec(*tiers).decode_tp == 1
    with pytest.raises(ValueError, match=r"--decode-tp 2: .*--shared-kv-gib"):
        spec(*tiers, "--decode-tp", "2")
    with pytest.raises(ValueError, match=r"^--tp 3: .*--shared-kv-gib"):  # as the user set it
        spec(*tiers, "--tp", "3")


def test_a_pools_ranks_are_its_workers_engine_size_and_bundles() -> None:
    engine = EngineConfig(model="m", device="cpu")
    template = WorkerTemplate(engine, None, prefill_tp=2)
    assert worker_engine_config("prefill", template).tensor_parallel_size == 2
    assert worker_engine_config("decode", template) is engine  # TP 1: the template's as it is
    assert rank_bundles("prefill", template) == [{"prefill_pool": 1.0, "CPU": 1.0}, {"CPU": 1.0}]
    gpu = WorkerTemplate(engine, None, gpus_per_worker=1.0, decode_tp=3)
    assert rank_bundles("decode", gpu) == [{"decode_pool": 1.0, "GPU": 1.0}] + [{"GPU": 1.0}] * 2
    with pytest.raises(ValueError, match=r"whole GPUs .* gpus_per_worker 0\.5"):
        WorkerTemplate(engine, None, gpus_per_worker=0.5, decode_tp=2)
    with pytest.raises(ValueError, match="prefill_tp must be >= 1, got 0"):
        WorkerTemplate(engine, None, prefill_tp=0)


def test_status_lists_a_tp_workers_ranks_with_their_nodes_and_devices() -> None:
    ranks = (
        RankPlace(0, "10.0.0.7", "n1", 101, "cuda:0 (GPU 2)"),
        RankPlace(1, "10.0.0.7", "n1", 102, "cuda:0 (GPU 3)"),
    )
    ready = (Transition(WorkerState.READY, 1.0, "taking traffic"),)
    worker = WorkerStatus("d0", "decode", WorkerState.READY, ready, "10.0.0.7", ranks=ranks)
    status = ClusterStatus("m", (PoolStatus("decode", 1, (worker,)),), (), RedisStatus("", False))
    text = format_status(status)
    assert "rank 0 10.0.0.7 pid 101 cuda:0 (GPU 2)" in text
    assert "rank 1 10.0.0.7 pid 102 cuda:0 (GPU 3)" in text
    assert status.to_json_dict()["pools"][0]["workers"][0]["ranks"][1]["device"] == (
        "cuda:0 (GPU 3)"
    )
