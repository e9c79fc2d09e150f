"""Test support: a fake multi-node Ray cluster (deploy/fake-cluster.yaml, Ray's fake_multinode
provider) started with `ray start --head` on free ports in its own temp dir. Owns every process
of that cluster (head, autoscaler, fake nodes, their workers) and kills them all on exit; other
Ray instances on the machine are left alone (no `ray stop`, which kills every Ray process)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import psutil
import yaml

from deploy.redis_local import free_port

FAKE_CLUSTER_YAML = Path(__file__).resolve().parents[1] / "deploy" / "fake-cluster.yaml"
RAY_CLI = str(Path(sys.executable).with_name("ray"))  # this interpreter's Ray, not PATH's
MARKER_ENV = "FAKE_RAY_CLUSTER_ID"  # inherited by every process of one fake cluster
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0


class FakeCluster(NamedTuple):
    address: str  # GCS address, for ray.init(address=...)
    temp_dir: str  # Ray's --temp-dir: logs under session_latest/logs
    config: dict  # the autoscaling config it runs (deploy/fake-cluster.yaml on its port)


def node_ip() -> str:
    """The IP Ray picks for this machine: the fake provider connects its nodes from it."""
    from ray._private.services import get_node_ip_address

    return get_node_ip_address()


def cluster_config(port: int, source: Path = FAKE_CLUSTER_YAML) -> dict:
    """deploy/fake-cluster.yaml with its fake nodes pointed at a head on `port`."""
    config = yaml.safe_load(source.read_text())
    config["provider"]["gcs_address"] = f"{node_ip()}:{port}"
    return config


def head_command(config_path: str, config: dict, port: int, temp_dir: str) -> list[str]:
    """`ray start --head` for this config, every fixed default port moved to a free one."""
    head = config["available_node_types"][config["head_node_type"]]["resources"]
    return [
        RAY_CLI, "start", "--head", f"--port={port}", f"--num-cpus={head.get('CPU', 0)}",
        f"--autoscaling-config={config_path}", f"--temp-dir={temp_dir}",
        f"--ray-client-server-port={free_port()}", f"--dashboard-port={free_port()}",
        f"--dashboard-agent-listen-port={free_port()}",
        "--include-dashboard=false", "--object-store-memory=100000000",
        "--disable-usage-stats",
    ]  # fmt: skip


@contextlib.contextmanager
def fake_cluster(source: Path = FAKE_CLUSTER_YAML) -> Iterator[FakeCluster]:
    """Start the fake cluster; on exit (failure included) kill its every process."""
    temp_dir = tempfile.mkdtemp(prefix="kvr-fake-", dir="/tmp")  # short: socket paths < 108
    try:
        port = free_port()
        config = cluster_config(port, source)
        config_path = os.path.join(temp_dir, "fake-cluster.yaml")
        Path(config_path).write_text(json.dumps(config))
        env = {
            **os.environ,
            "RAY_FAKE_CLUSTER": "1",
            "AUTOSCALER_UPDATE_INTERVAL_S": "1",  # default 5 s between autoscaler rounds
            "RAY_AUTH_MODE": "disabled",
            MARKER_ENV: temp_dir,
        }
        env.pop("RAY_ADDRESS", None)
        started = subprocess.run(
            head_command(config_path, config, port, temp_dir), env=env, capture_output=True,
            text=True, timeout=START_TIMEOUT_S, start_new_session=True,
        )  # fmt: skip
        if started.returncode != 0:
            raise RuntimeError(f"ray start failed:\n{started.stdout}\n{started.stderr}")
        yield FakeCluster(f"{node_ip()}:{port}", temp_dir, config)
    finally:
        kill_cluster_processes(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


def cluster_processes(marker: str) -> list[psutil.Process]:
    """Live processes of the fake cluster `marker` names (its env marker), with descendants."""
    found: dict[int, psutil.Process] = {}
    for proc in psutil.process_iter():
        if proc.pid == os.getpid():
            continue
        try:
            if proc.environ().get(MARKER_ENV) != marker:
                continue
            found[proc.pid] = proc
            found.update((child.pid, child) for child in proc.children(recursive=True))
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return [p for p in found.values() if _alive(p)]


def kill_cluster_processes(marker: str, timeout_s: float = STOP_TIMEOUT_S) -> None:
    """SIGKILL (as `ray stop --force` does) until none is left; raises if some survive."""
    deadline = time.monotonic() + timeout_s
    while procs := cluster_processes(marker):
        if time.monotonic() > deadline:
            raise RuntimeError(f"fake cluster processes survived: {[p.pid for p in procs]}")
        for proc in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        psutil.wait_procs(procs, timeout=5)


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
