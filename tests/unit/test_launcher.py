"""`kvrelay up` / `kvrelay down`: the ray CLI commands they build (several models, a models
file copied to the head), the order up() runs them in (against a scripted runner, no cluster),
--dry-run, a bad models file refused before any ray command, and the router probe's exit
status."""

from __future__ import annotations

import http.server
import re
import shlex
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy.cli import build_parser, main
from deploy.launcher import (
    REMOTE_MODELS_FILE,
    Ran,
    UpOptions,
    bring_up,
    describe_up,
    endpoints,
    models_file_upload_command,
    options_from_args,
    parse_head_ip,
    ray_down_command,
    ray_up_command,
    router_check_command,
    router_probe,
    serve_command,
    start_serve_command,
)

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
AWS = str(DEPLOY / "cluster.yaml")


def up_options(*argv: str) -> UpOptions:
    return options_from_args(build_parser().parse_args(["up", AWS, *argv]))


def test_flags_map_onto_options() -> None:
    opts = up_options(
        "--prefill", "2", "--decode", "3", "--model", "/opt/m", "--http-port", "9000",
        "--grpc-port", "9001", "--device", "cpu",
        "--serve-args=--kv-cache-gib 40 --policy round_robin",
    )  # fmt: skip
    assert opts == UpOptions(
        AWS,
        2,
        3,
        ("/opt/m",),
        9000,
        9001,
        "cpu",
        ("--kv-cache-gib", "40", "--policy", "round_robin"),
    )
    assert up_options() == UpOptions(AWS)
    assert up_options("--prefill", "0").num_prefill == 0  # aggregated decode workers


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--decode", "0"], r"--decode in \[1, 1024\]"),
        (["--prefill", "-1"], r"--prefill must be in \[0, 1024\]"),
        (["--decode", "100000"], r"--decode in \[1, 1024\]"),
        (["--http-port", "70000"], "--http-port"),
        (["--model", "/a", "--models-file", "m.yaml"], "either as --model or in --models-file"),
        (["--model", "/a", "--model", "/a"], "given more than once"),
    ],
)
def test_bad_values_are_refused(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        up_options(*argv)


@pytest.mark.parametrize(
    ("serve_args", "message"),
    [
        ("--bogus-flag 3", "serve on the head would refuse it: unrecognized arguments: --bogus"),
        ("--autoscale-decode 9:1", "would refuse it: --autoscale-decode wants MIN:MAX"),
        ("--prefill 3", "--serve-args: give --prefill as kvrelay up's own flag, not in it"),
        ("--port=9000", "--serve-args: give --http-port as kvrelay up's own flag, not in it"),
        ("--host=127.0.0.1", "--serve-args: --host is kvrelay up's to set, not yours"),
    ],
)
def test_serve_args_are_checked_before_any_ray_command_models_file_or_not(
    serve_args: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["up", AWS, "--model", "/on/the/head", "--dry-run", f"--serve-args={serve_args}"]
    assert main(argv) == 2
    assert message in capsys.readouterr().err
    assert main(["up", AWS, "--dry-run", "--wait-timeout", "-1"]) == 2
    assert "--wait-timeout must be a positive number of seconds, got -1" in capsys.readouterr().err


def test_serve_command_runs_against_the_clusters_ray_on_all_hosts() -> None:
    opts = UpOptions("c.yaml", 2, 3, ("/opt/m",), 9000, 9001, serve_args=("--policy", "random"))
    assert serve_command(opts) == [
        "kvrelay", "serve", "--ray-address", "auto", "--host", "0.0.0.0", "--prefill", "2",
        "--decode", "3", "--http-port", "9000", "--grpc-port", "9001", "--device", "cuda",
        "--model", "/opt/m", "--policy", "random",
    ]  # fmt: skip
    assert "--model" not in serve_command(UpOptions("c.yaml"))  # serve's default model


def test_several_models_each_reach_serve_as_a_model_flag() -> None:
    opts = up_options("--model", "/opt/a", "--model", "/opt/b")
    assert opts.models == ("/opt/a", "/opt/b")
    command = serve_command(opts)
    assert command[-4:] == ["--model", "/opt/a", "--model", "/opt/b"]
    assert "--models-file" not in command and models_file_upload_command(opts) is None


GOOD_MODELS = """models:
  - model: /opt/models/a
    decode: 2
    flags: {kv-cache-gib: 40}
  - model: /opt/models/b
"""


def test_a_models_file_is_copied_to_the_head_and_served_from_there(tmp_path: Path) -> None:
    local = tmp_path / "models.yaml"
    local.write_text(GOOD_MODELS)
    opts = up_options("--models-file", str(local))
    assert models_file_upload_command(opts) == [
        "ray", "rsync-up", AWS, str(local), REMOTE_MODELS_FILE,
    ]  # fmt: skip
    command = serve_command(opts)
    assert command[command.index("--models-file") + 1] == REMOTE_MODELS_FILE
    assert str(local) not in command and "--model" not in command
    runner, clock = ScriptedRunner([1, 0]), FakeClock()
    assert bring_up(opts, run=runner, sleep=clock.sleep, clock=clock) == 0
    upload = runner.commands.index(models_file_upload_command(opts))
    assert runner.commands[upload + 1] == start_serve_command(opts)  # copied, then served
    assert shlex.split(runner.commands[upload + 1][4]) == command
    lines = describe_up(opts, 60.0)
    assert lines[2:4] == [
        shlex.join(models_file_upload_command(opts)),
        shlex.join(runner.commands[upload + 1]),
    ]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("models:\n  - model: /a\n    decode: 0\n", r"models\[0\]\.decode: wants a whole number"),
        (
            "models:\n  - model: /a\n  - model: /b\n    flags: {kv-cache-gb: 1}\n",
            r"models\[1\]\.flags: '--kv-cache-gb' is not an engine flag",
        ),
        ("models:\n  - modle: /a\n", r"models\[0\]: wants a mapping with `model"),
        ("models: [\n", "while parsing"),
    ],
)
def test_a_bad_models_file_is_refused_before_any_ray_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys, text: str, message: str
) -> None:
    local = tmp_path / "models.yaml"
    local.write_text(text)
    ran: list[list[str]] = []
    monkeypatch.setattr("deploy.launcher.run_command", lambda c, capture: ran.append(c))
    monkeypatch.setattr("deploy.launcher._require_ray_cli", lambda: None)
    for extra in ([], ["--dry-run"]):
        assert main(["up", AWS, "--models-file", str(local), *extra]) == 2
        err = capsys.readouterr().err
        assert f"--models-file {local}" in err  # names the local file, not the head's copy
        assert re.search(message, err), err
    assert ran == []


def test_a_missing_models_file_is_refused(capsys) -> None:
    assert main(["up", AWS, "--models-file", "no-such-models.yaml", "--dry-run"]) == 2
    assert "--models-file no-such-models.yaml" in capsys.readouterr().err


def test_ray_commands() -> None:
    opts = UpOptions("c.yaml", models=("/models/a b",))  # a path with a space survives quoting
    assert ray_up_command("c.yaml") == ["ray", "up", "-y", "c.yaml"]
    assert ray_down_command("c.yaml") == ["ray", "down", "-y", "c.yaml"]
    exec_serve = start_serve_command(opts)
    assert exec_serve[:4] == ["ray", "exec", "c.yaml", "--tmux"]
    assert shlex.split(exec_serve[4]) == serve_command(opts)
    assert router_check_command(opts) == ["ray", "exec", "c.yaml", router_probe(8000)]


def test_head_ip_and_endpoints() -> None:
    assert parse_head_ip("Fetched IP: 1.2.3.4\n54.1.2.3\n") == "54.1.2.3"
    with pytest.raises(ValueError, match="no address"):
        parse_head_ip("\n")
    assert endpoints("54.1.2.3", 8000, 50051) == ("http://54.1.2.3:8000/v1", "54.1.2.3:50051")


class ScriptedRunner:
    """Stands in for the ray CLI: records each command, answers the router probe from a script."""

    def __init__(self, probe_answers: list[int], head_ip: str = "54.1.2.3") -> None:
        self.commands: list[list[str]] = []
        self.probe_answers = probe_answers
        self.head_ip = head_ip

    def __call__(self, command: list[str], capture: bool) -> Ran:
        self.commands.append(command)
        if command[-1].startswith("python -c"):
            return Ran(self.probe_answers.pop(0), "probe output")
        return Ran(0, f"{self.head_ip}\n" if command[1] == "get-head-ip" else "")


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_up_runs_ray_up_serve_waits_then_prints_endpoints(capsys) -> None:
    opts = UpOptions("c.yaml", 1, 2)
    runner, clock = ScriptedRunner([1, 1, 1, 0]), FakeClock()  # no router yet, 2 waits
    assert bring_up(opts, run=runner, sleep=clock.sleep, clock=clock) == 0
    probe = router_check_command(opts)
    assert runner.commands == [
        ray_up_command("c.yaml"), probe, start_serve_command(opts), probe, probe, probe,
        ["ray", "get-head-ip", "c.yaml"],
    ]  # fmt: skip
    out = capsys.readouterr()
    assert "HTTP (OpenAI)  http://54.1.2.3:8000/v1" in out.out
    assert "gRPC           54.1.2.3:50051" in out.out
    assert "waiting for the router" in out.err


def test_up_keeps_a_router_that_already_answers() -> None:
    runner, clock = ScriptedRunner([0, 0]), FakeClock()
    assert bring_up(UpOptions("c.yaml"), run=runner, sleep=clock.sleep, clock=clock) == 0
    assert not any("--tmux" in command for command in runner.commands)


def test_up_gives_up_after_the_timeout(capsys) -> None:
    runner, clock = ScriptedRunner([1] * 100), FakeClock()
    rc = bring_up(UpOptions("c.yaml"), wait_s=60, run=runner, sleep=clock.sleep, clock=clock)
    assert rc == 1
    assert clock.now == 60  # 4 polls of 15 s
    assert "ray attach c.yaml --tmux" in capsys.readouterr().err
    assert runner.commands[-1] == router_check_command(UpOptions("c.yaml"))


def test_up_stops_when_ray_up_fails() -> None:
    def failing(command: list[str], capture: bool) -> Ran:
        calls.append(command)
        return Ran(3, "")

    calls: list[list[str]] = []
    assert bring_up(UpOptions("c.yaml"), run=failing) == 3
    assert calls == [ray_up_command("c.yaml")]


def test_dry_run_prints_and_runs_nothing(capsys) -> None:
    assert main(["up", AWS, "--decode", "2", "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == describe_up(up_options("--decode", "2"), 1800.0)
    assert lines[0] == f"ray up -y {AWS}" and lines[-1] == f"ray get-head-ip {AWS}"
    assert main(["down", AWS, "--dry-run"]) == 0
    assert capsys.readouterr().out.strip() == f"ray down -y {AWS}"


def test_fake_cluster_and_missing_yaml_are_refused(capsys) -> None:
    assert main(["up", str(DEPLOY / "fake-cluster.yaml"), "--dry-run"]) == 2
    assert "RAY_FAKE_CLUSTER=1 ray start --head" in capsys.readouterr().err
    assert main(["down", "no-such.yaml", "--dry-run"]) == 2


class HealthServer:
    """A local /health answering `status` (what the router answers on the head)."""

    def __init__(self) -> None:
        self.status = 503
        owner = self

        class Health(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(owner.status)
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def health_server() -> Iterator[HealthServer]:
    server = HealthServer()
    yield server
    server.close()


def test_router_probe_exits_0_only_on_200(health_server: HealthServer) -> None:
    probe = router_probe(health_server.port).replace("python", shlex.quote(sys.executable), 1)
    assert subprocess.run(probe, shell=True, capture_output=True, timeout=30).returncode != 0
    health_server.status = 200
    assert subprocess.run(probe, shell=True, capture_output=True, timeout=30).returncode == 0
