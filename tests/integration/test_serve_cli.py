"""`kvrelay serve` as a user runs it: prints its addresses, answers, `kvrelay status` in another
shell finds it with no flags, and Ctrl-C (SIGINT) stops everything it started: router,
controller, workers, Ray and redis-server, leaving no process behind. A checkpoint its worker
refuses ends it after one try, in one line."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import torch
from safetensors.torch import load_file, save_file

from deploy.redis_local import free_port
from tests.factories import make_tiny_checkpoint
from tests.integration.serve_process import serve_env


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def test_serve_answers_and_sigint_leaves_no_process_behind(tmp_path):
    http_port, grpc_port = free_port(), free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
    env["KVRELAY_STATE_DIR"] = str(tmp_path)  # where serve says where its cluster is
    proc = subprocess.Popen(
        [sys.executable, "-m", "deploy.cli", "serve", "--http-port", str(http_port),
         "--grpc-port", str(grpc_port), "--kv-cache-gib", "0.2", "--threads-per-worker", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        start_new_session=True,
    )  # fmt: skip
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 240
        assert proc.stdout is not None
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line, "serve exited early:\n" + "".join(lines)
            lines.append(line)
            if "Ctrl-C to stop" in line:
                break
        output = "".join(lines)
        assert f"http://127.0.0.1:{http_port}/v1" in output and f"127.0.0.1:{grpc_port}" in output
        assert re.search(r"local redis-server at redis://127\.0\.0\.1:\d+", output)
        assert "kvrelay: device cpu (no GPU visible to Ray" in output  # --device auto
        spawned = descendants(proc.pid)
        assert any("redis-server" in p.name() for p in spawned)
        body = {
            "model": "SmolLM2-135M-Instruct",
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 12,
            "temperature": 0,
        }
        request = urllib.request.Request(
            f"http://127.0.0.1:{http_port}/v1/chat/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            reply = json.loads(response.read())
        assert "Paris" in reply["choices"][0]["message"]["content"]
        status = subprocess.run(
            [sys.executable, "-m", "deploy.cli", "status", "--json"],
            capture_output=True, text=True, env=env, timeout=120,
        )  # fmt: skip
        assert status.returncode == 0, status.stderr
        pools = {pool["role"]: pool for pool in json.loads(status.stdout)["pools"]}
        assert pools["prefill"]["num_ready"] == 1 and pools["decode"]["num_ready"] == 1
        [decode] = pools["decode"]["workers"]
        assert decode["stats"]["num_requests"] == 1  # the chat request above
        routers = json.loads(status.stdout)["routers"]
        assert [r["http_url"] for r in routers] == [f"http://127.0.0.1:{http_port}/v1"]
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            rest, _ = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    assert proc.returncode == 0, rest
    assert "kvrelay: stopped" in rest
    assert not list(tmp_path.glob("serve-*.json")), "serve removes its state file on exit"
    survivors = [p for p in spawned if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not survivors, [p.name() for p in survivors]


def test_a_checkpoint_its_worker_refuses_ends_serve_after_one_try(
    tmp_path: Path, smollm_dir: Path
) -> None:
    """A tensor no module takes passes the checks before start (only loading finds it): the
    worker's refusal ends the pool's starts at once (the next would fail the same way, each with
    a traceback), and serve exits 1 with one line naming the tensor, leaving nothing behind."""
    folder = make_tiny_checkpoint(tmp_path / "extra", architecture="qwen3", vocab_size=49152)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm_dir / name, folder / name)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.mlp.gate.weight"] = torch.zeros(4, 64)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    env = serve_env(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "deploy.cli", "serve", "--model", str(folder), "--prefill", "0",
         "--http-port", "0", "--grpc-port", "0", "--kv-cache-gib", "0.05",
         "--threads-per-worker", "1"],
        capture_output=True, text=True, env=env, timeout=400,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 1, output
    [error] = [line for line in output.splitlines() if line.startswith("error:")]
    assert "the workers did not start: decode pool: its worker refused to start" in error
    assert "'layers.0.mlp.gate.weight'" in error
    assert output.count("kvrelay-decode-0 ") and "kvrelay-decode-1 " not in output  # one try
    assert not list(tmp_path.glob("serve-*.json"))
