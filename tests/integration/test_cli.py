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
    result = run_cli("generate", "hi", "--presence-penalty", "3")
    assert result.returncode == 2
    assert "presence_penalty must be a number in [-2, 2]" in result.stderr


def test_generate_takes_penalties():
    args = ("generate", "Count from one to ten in words.", "--max-tokens", "12")
    plain = run_cli(*args)
    penalised = run_cli(*args, "--repetition-penalty", "2.0", "--frequency-penalty", "1")
    assert plain.returncode == penalised.returncode == 0, penalised.stderr
    assert penalised.stdout != plain.stdout
