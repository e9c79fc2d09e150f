"""The cluster YAMLs in deploy/: each passes Ray's own config preparation and schema (no cloud
call), and each keeps kvrelay's rules: the head carries no pool resource, every worker node
type carries exactly one pool, and the setup installs kvrelay with its GPU extra."""

from __future__ import annotations

import copy
import os
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest
import ray
import yaml
from ray.autoscaler._private import providers
from ray.autoscaler._private.util import prepare_config, validate_config

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
POOLS = ("prefill_pool", "decode_pool")
YAMLS = ["cluster.yaml", "cluster-70b-tp.yaml", "cluster-onprem.yaml", "fake-cluster.yaml"]


def load(name: str) -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / name).read_text())


@pytest.fixture
def fake_defaults(monkeypatch, tmp_path) -> None:
    """Ray 2.60's wheel lacks fake_multi_node/example.yaml, the defaults prepare_config merges
    for fake_multinode; give it empty ones, so fake-cluster.yaml must be complete by itself
    (`ray start --autoscaling-config` reads it raw, with no defaults)."""
    shipped = providers._DEFAULT_CONFIGS["fake_multinode"]()
    if not os.path.exists(shipped):
        (tmp_path / "empty.yaml").write_text("{}\n")
        monkeypatch.setitem(
            providers._DEFAULT_CONFIGS, "fake_multinode", lambda: str(tmp_path / "empty.yaml")
        )


@pytest.mark.parametrize("name", YAMLS)
def test_ray_prepares_and_validates_it(name: str, fake_defaults) -> None:
    raw = load(name)
    prepared = prepare_config(copy.deepcopy(raw))
    validate_config(prepared)
    if raw["provider"]["type"] == "fake_multinode":
        validate_config(raw)  # the autoscaler validates the file as it is
        assert set(prepared) <= set(raw)  # no field came from (missing) defaults


def pool_of(node_type: dict[str, Any]) -> list[str]:
    return [pool for pool in POOLS if node_type["resources"].get(pool)]


@pytest.mark.parametrize("name", ["cluster.yaml", "fake-cluster.yaml"])
def test_node_types_split_into_head_and_pools(name: str) -> None:
    config = load(name)
    types = config["available_node_types"]
    assert pool_of(types[config["head_node_type"]]) == []
    assert "--resources" not in " ".join(config["head_start_ray_commands"])
    assert pool_of(types["prefill"]) == ["prefill_pool"]
    assert pool_of(types["decode"]) == ["decode_pool"]
    for pool_type in ("prefill", "decode"):
        node_type = types[pool_type]
        assert 1 <= node_type["min_workers"] <= node_type["max_workers"]
        gpus = node_type["resources"].get("GPU")
        if gpus is not None:  # one worker per GPU
            assert node_type["resources"][pool_of(node_type)[0]] == gpus


def test_the_70b_layout_gives_each_tp_worker_its_gpus() -> None:
    """A TP-N worker takes N one-GPU bundles and one pool unit: a node's pool is GPUs / N, for
    the TP its header's `kvrelay up` line asks of that pool."""
    text = (DEPLOY / "cluster-70b-tp.yaml").read_text()
    tp = {pool: int(n) for pool, n in re.findall(r"--(prefill|decode)-tp (\d+)", text)}
    assert tp == {"prefill": 4, "decode": 2}
    config = load("cluster-70b-tp.yaml")
    types = config["available_node_types"]
    assert pool_of(types[config["head_node_type"]]) == []
    for pool, n in tp.items():
        resources = types[pool]["resources"]
        assert pool_of(types[pool]) == [f"{pool}_pool"]
        assert resources[f"{pool}_pool"] * n == resources["GPU"]
    assert config["setup_commands"] == load("cluster.yaml")["setup_commands"]


def test_fake_cluster_decode_pool_can_grow_to_two() -> None:
    config = load("fake-cluster.yaml")
    types = config["available_node_types"]
    decode = types["decode"]
    assert (decode["min_workers"], decode["max_workers"]) == (1, 2)
    assert decode["resources"]["decode_pool"] == 1
    assert sum(t.get("max_workers", 0) for t in types.values()) <= config["max_workers"]


@pytest.mark.parametrize("name", ["cluster.yaml", "cluster-onprem.yaml"])
def test_setup_installs_kvrelay_redis_and_this_ray(name: str) -> None:
    config = load(name)
    setup = "\n".join(config["setup_commands"])
    assert re.search(r"pip install .*kvrelay\[gpu\]", setup)
    assert f'"ray[default]=={ray.__version__}"' in setup  # the cluster's Ray is `ray up`'s
    assert "redis-server" in "\n".join(config["head_setup_commands"])
    assert "tmux" in "\n".join(config["head_setup_commands"])  # `ray exec --tmux`
    assert config["file_mounts"] == {"~/kvrelay": "."}


def onprem_prefill_ips(config: dict[str, Any]) -> list[str]:
    command = config["worker_start_ray_commands"][-1]
    return re.search(r'PREFILL_IPS="([^"]*)"', command).group(1).split()


def test_onprem_prefill_ips_are_worker_ips_and_leave_some_for_decode() -> None:
    config = load("cluster-onprem.yaml")
    workers = config["provider"]["worker_ips"]
    prefill = onprem_prefill_ips(config)
    assert prefill and set(prefill) < set(workers)


@pytest.mark.parametrize(
    ("ip", "pool"), [("10.0.0.12", "prefill_pool"), ("10.0.0.13", "decode_pool")]
)
def test_onprem_worker_start_picks_its_pool_by_ip(ip: str, pool: str, tmp_path: Path) -> None:
    """Run the worker start command in bash with hostname, nvidia-smi and ray stubbed."""
    stubs = {
        "hostname": f"echo '192.168.1.5 {ip} fe80::1'",
        "nvidia-smi": "for i in 0 1 2 3; do echo GPU $i; done",
        "ray": f'printf "%s\\n" "$@" > {shlex.quote(str(tmp_path / "ray-args"))}',
    }
    for name, body in stubs.items():
        (tmp_path / name).write_text(f"#!/bin/sh\n{body}\n")
        (tmp_path / name).chmod(0o755)
    command = load("cluster-onprem.yaml")["worker_start_ray_commands"][-1]
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "RAY_HEAD_IP": "10.0.0.10"}
    subprocess.run(["bash", "-c", command], env=env, check=True, timeout=10)
    args = (tmp_path / "ray-args").read_text().splitlines()
    assert args == ["start", "--address=10.0.0.10:6379", f'--resources={{"{pool}": 4}}']
