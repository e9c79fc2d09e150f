"""The router's front ends import neither torch nor transformers (in a clean interpreter), nor
OpenTelemetry (it loads only when tracing is configured)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_front_ends_do_not_import_torch_or_transformers() -> None:
    code = (
        "import router.http_server, router.grpc_server, router.tokenizer, sys; "
        "loaded = {name.split('.')[0] for name in sys.modules}; "
        "heavy = {'torch', 'transformers', 'opentelemetry'} & loaded; "
        "assert not heavy, f'the router imported {heavy}'"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr + result.stdout
