"""The router's Redis-side modules import no torch (checked in a clean interpreter)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODULES = (
    "common.kv_index_schema",
    "common.messages",
    "common.worker_actors",
    "common.kv_publisher",
    "common.redis_url",
    "router.prefix_index",
    "router.policy",
    "router.backend",
    "router.frontend",
    "router.cluster_backend",
    "router.leg",
    "deploy.redis_local",
)


def test_router_redis_modules_do_not_import_torch() -> None:
    code = "; ".join(f"import {m}" for m in MODULES)
    code += "; import sys; assert 'torch' not in sys.modules, 'router imported torch'"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr + result.stdout
