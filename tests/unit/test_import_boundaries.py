"""The dependency direction of the layout (README "Layout"), read from every module's imports:
engine imports nothing of ours but kvtransfer's disk block files (the disk tier's I/O, in
engine/execution/disk_setup.py alone); common only the engine (and kvtransfer in
worker_runtime.py and rank_actors.py, which only the workers import); the workers neither each
other nor the router; the router no worker."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OURS = ("engine", "common", "kvtransfer", "prefill_worker", "decode_worker", "router", "deploy")
ALLOWED = {
    "engine": {"engine", "kvtransfer"},  # kvtransfer: disk_setup.py only (below)
    "common": {"common", "engine", "kvtransfer"},  # kvtransfer: WORKER_ONLY
    "kvtransfer": {"kvtransfer"},
    "prefill_worker": {"prefill_worker", "common", "engine", "kvtransfer"},
    "decode_worker": {"decode_worker", "common", "engine", "kvtransfer"},
    "router": {"router", "common", "engine"},
}


def imported_packages(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return {name.split(".")[0] for name in names} & set(OURS)


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_only_what_the_layout_allows(package: str) -> None:
    bad = {
        str(path.relative_to(ROOT)): sorted(imported_packages(path) - ALLOWED[package])
        for path in (ROOT / package).rglob("*.py")
    }
    assert not {path: names for path, names in bad.items() if names}


# common's modules that only the workers import (a worker's process: NIXL, its ranks' actors)
WORKER_ONLY = ("worker_runtime", "rank_actors")


def test_only_the_workers_import_the_worker_runtime() -> None:
    users = {
        str(path.relative_to(ROOT))
        for package in ("router", "engine", "kvtransfer")
        for path in (ROOT / package).rglob("*.py")
        if any(f"common.{name}" in path.read_text() for name in WORKER_ONLY)
    }
    assert not users
    kvtransfer_users = {
        path.name for path in (ROOT / "common").glob("*.py") if "kvtransfer" in path.read_text()
    }
    assert kvtransfer_users <= {f"{name}.py" for name in WORKER_ONLY}


def test_only_the_disk_setup_of_the_engine_imports_kvtransfer() -> None:
    """The disk tier's block files go through NIXL (kvtransfer/disk_blocks.py, which imports
    nothing of ours but kvtransfer): that one engine module may import them, no other."""
    users = {
        str(path.relative_to(ROOT))
        for path in (ROOT / "engine").rglob("*.py")
        if "kvtransfer" in imported_packages(path)
    }
    assert users <= {"engine/execution/disk_setup.py"}
