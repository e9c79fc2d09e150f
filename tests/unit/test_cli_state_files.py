"""Each local `kvrelay serve` has its own state file: commands find the only one running, refuse
to guess among several, follow --name, skip and clean the files of dead serves, and a serve
never removes or takes over another's file. The other serves here are real processes that
record themselves through the same code `kvrelay serve` runs."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy import cluster_address
from deploy.cli import main

RECORD = """
import sys
from deploy import cluster_address
name, ray_address, http = sys.argv[1:]
cluster_address.record_local(name, ray_address, http, "127.0.0.1:1")
print("recorded", flush=True)
sys.stdin.read()  # until the test closes it
cluster_address.forget_local(name)
"""


@pytest.fixture
def state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KVRELAY_STATE_DIR", str(tmp_path))
    return tmp_path


class OtherServe:
    """A process that records itself as a serve named `name` and stays until stop()."""

    def __init__(self, name: str, ray_address: str, http: str):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", RECORD, name, ray_address, http],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=dict(os.environ),
        )  # fmt: skip
        assert self.proc.stdout is not None and self.proc.stdout.readline() == "recorded\n"

    def stop(self) -> None:
        """Exit as a serve does: it removes its own file."""
        self.proc.communicate("", timeout=60)

    def kill(self) -> None:
        """Die without cleaning up (SIGKILL): its file stays behind."""
        self.proc.kill()
        self.proc.wait(timeout=60)


@pytest.fixture
def others(state_dir: Path) -> Iterator[list[OtherServe]]:
    started: list[OtherServe] = []
    yield started
    for other in started:
        if other.proc.poll() is None:
            other.kill()


def test_none_one_or_several_serves(state_dir: Path, others: list[OtherServe], capsys) -> None:
    with pytest.raises(ValueError, match="no local `kvrelay serve` is running"):
        cluster_address.resolve(None)
    assert cluster_address.resolve("10.0.0.1:6379") == "10.0.0.1:6379"
    others.append(OtherServe("alpha", "127.0.0.1:7001", "http://127.0.0.1:8001/v1"))
    assert (state_dir / "serve-alpha.json").exists()
    assert cluster_address.resolve(None) == "127.0.0.1:7001"  # the only one: no flag needed
    others.append(OtherServe("8002", "127.0.0.1:7002", "http://127.0.0.1:8002/v1"))
    with pytest.raises(ValueError, match="2 `kvrelay serve` run on this machine") as refused:
        cluster_address.resolve(None)
    text = str(refused.value)
    assert "--name NAME or --address" in text
    assert "alpha" in text and "http://127.0.0.1:8001/v1" in text
    assert "8002" in text and "http://127.0.0.1:8002/v1" in text
    assert cluster_address.resolve(None, "alpha") == "127.0.0.1:7001"
    assert cluster_address.resolve(None, "8002") == "127.0.0.1:7002"
    with pytest.raises(ValueError, match="no local `kvrelay serve` named 'beta'; running here"):
        cluster_address.resolve(None, "beta")
    # The command refuses (exit 2) with the same listing, before connecting to anything.
    assert main(["status"]) == 2
    err = capsys.readouterr().err
    assert "alpha" in err and "8002" in err and "--name" in err
    # One stops: the other is the only one again, and its file is untouched.
    others[1].stop()
    assert not (state_dir / "serve-8002.json").exists()
    assert cluster_address.resolve(None) == "127.0.0.1:7001"


def test_a_serve_never_removes_or_takes_over_anothers_file(
    state_dir: Path, others: list[OtherServe]
) -> None:
    others.append(OtherServe("alpha", "127.0.0.1:7001", "http://127.0.0.1:8001/v1"))
    cluster_address.forget_local("alpha")  # this process is not that serve
    assert (state_dir / "serve-alpha.json").exists()
    with pytest.raises(ValueError, match=r"named 'alpha' already runs.*another --name"):
        cluster_address.check_free("alpha")
    with pytest.raises(ValueError, match="named 'alpha' already runs"):
        cluster_address.record_local("alpha", "127.0.0.1:9999", "http://h:1/v1", "h:2")
    assert cluster_address.resolve(None, "alpha") == "127.0.0.1:7001"
    # A name of our own beside it, removed by us on exit; theirs stays.
    cluster_address.record_local("beta", "127.0.0.1:7003", "http://h:3/v1", "h:4")
    assert {s.name for s in cluster_address.running()} == {"alpha", "beta"}
    cluster_address.forget_local("beta")
    assert [s.name for s in cluster_address.running()] == ["alpha"]


def test_the_files_of_dead_serves_are_skipped_cleaned_and_reusable(
    state_dir: Path, others: list[OtherServe]
) -> None:
    dead = OtherServe("gone", "127.0.0.1:7004", "http://127.0.0.1:8004/v1")
    others.append(dead)
    dead.kill()
    assert (state_dir / "serve-gone.json").exists()  # SIGKILL: no clean-up
    # A file whose pid is alive but is another process (a reused pid): dead too.
    reused = json.loads((state_dir / "serve-gone.json").read_text())
    reused.update(name="reused", pid=os.getpid())
    (state_dir / "serve-reused.json").write_text(json.dumps(reused))
    with pytest.raises(ValueError, match="no local `kvrelay serve` is running"):
        cluster_address.resolve(None)
    assert not list(state_dir.glob("serve-*.json")), "dead serves' files are cleaned"
    dead = OtherServe("gone", "127.0.0.1:7005", "http://127.0.0.1:8005/v1")
    others.append(dead)
    assert cluster_address.resolve(None, "gone") == "127.0.0.1:7005"
    dead.kill()
    cluster_address.check_free("gone")  # a dead serve's name is free again
    cluster_address.record_local("gone", "127.0.0.1:7006", "http://h:5/v1", "h:6")
    assert cluster_address.resolve(None) == "127.0.0.1:7006"
    cluster_address.forget_local("gone")


def test_names_must_fit_a_file_name(state_dir: Path) -> None:
    for bad in ("", "../x", "-a", "a b", "x" * 65):
        with pytest.raises(ValueError, match="--name"):
            cluster_address.check_name(bad)
    assert cluster_address.check_name("prod-1.a_b") == "prod-1.a_b"


def test_an_address_where_nothing_listens_is_refused_at_once(capsys) -> None:
    """`kvrelay status --address 127.0.0.1:1` retried Ray's connect for minutes (a new user's
    probe: still running after 329 s); now exit 2 naming the address, before Ray is joined."""
    with socket.socket() as listening:  # a port that accepts: passes
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        cluster_address.check_reachable(f"127.0.0.1:{listening.getsockname()[1]}")
    with socket.socket() as bound:  # bound, never listening: refuses connections
        bound.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{bound.getsockname()[1]}"
        with pytest.raises(ValueError, match=f"nothing answers at {closed}"):
            cluster_address.check_reachable(closed)
        assert main(["status", "--address", closed]) == 2
    assert "nothing answers at" in capsys.readouterr().err
    cluster_address.check_reachable("auto")  # left to Ray


def test_a_router_for_a_serve_not_running_says_so_before_its_ports(
    state_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`kvrelay router --name nope` on a taken port said the port was in use: the missing serve
    is the error to see first."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["router", "--name", "nope", "--http-port", str(port)]) == 2
    err = capsys.readouterr().err
    assert "no local `kvrelay serve` named 'nope'" in err and "in use" not in err
