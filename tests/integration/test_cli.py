"""`kvrelay generate` prints a chat reply from the default model; bad flags give a clear error."""

from __future__ import annotations

import subprocess
import sys


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "deploy.cli", *args], capture_output=True, text=True, timeout=300
    )


def test_generate_prints_reply():
    result = run_cli("generate", "What is the capital of France?", "--max-tokens", "20")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


def test_generate_rejects_bad_sampling():
    result = run_cli("generate", "hi", "--temperature", "-1")
    assert result.returncode == 2
    assert "temperature must be >= 0" in result.stderr
