"""What `kvrelay serve` / `kvrelay router` check before anything starts, one line naming the flag:
--host, --http-port and --grpc-port (a taken port, a host that cannot be bound; a port taken later
fails the servers' start with the same one line; two gRPC servers never share a port) and, on
an embedded cluster, that the model is there."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy.cli import main
from deploy.progress import ScaleFailed
from deploy.serve_ports import check_ports, start_servers
from engine.models.loader import resolve_model
from router.frontend import Frontend
from router.grpc_server import GrpcServer
from router.serve import RouterServers
from router.tokenizer import RouterTokenizer
from tests.unit.test_tracing import ScriptedBackend


@pytest.fixture
def taken() -> Iterator[int]:
    """A port a server listens on (SO_REUSEADDR, as aiohttp binds)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.fixture
def nothing_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    async def started(*args, **kwargs) -> int:
        raise AssertionError("the cluster would have started")

    monkeypatch.setattr("deploy.serve._serve", started)


def one_line(capsys: pytest.CaptureFixture[str]) -> str:
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("flag", ["--http-port", "--grpc-port"])
def test_a_taken_port_is_refused_before_anything_starts(
    flag: str, taken: int, nothing_starts: None, capsys: pytest.CaptureFixture[str]
) -> None:
    other = "--grpc-port" if flag == "--http-port" else "--http-port"
    assert main(["serve", flag, str(taken), other, "0"]) == 2
    assert one_line(capsys) == (
        f"error: {flag} {taken}: cannot listen on 127.0.0.1:{taken} (in use)"
    )


@pytest.mark.parametrize(
    ("host", "says"),
    [
        ("999.1.1.1", "--host 999.1.1.1: does not resolve"),
        ("203.0.113.7", "--host 203.0.113.7: not an address of this machine"),
    ],
)
def test_a_host_that_cannot_be_bound_is_refused_before_anything_starts(
    host: str, says: str, nothing_starts: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", "--host", host, "--http-port", "0", "--grpc-port", "0"]) == 2
    assert one_line(capsys).startswith(f"error: {says}")


def test_one_port_for_both_servers_is_refused() -> None:
    with pytest.raises(ValueError, match="--http-port and --grpc-port are both 8123"):
        check_ports("127.0.0.1", 8123, 8123)
    check_ports("127.0.0.1", 0, 0)  # 0: free ones, whatever the host's


@pytest.fixture(scope="module")
def tokenizer() -> RouterTokenizer:
    return RouterTokenizer(resolve_model("default"))


def test_two_grpc_servers_do_not_share_a_port(tokenizer: RouterTokenizer) -> None:
    async def run() -> None:
        first = GrpcServer(Frontend(ScriptedBackend(), tokenizer))
        port = await first.start("127.0.0.1", 0)
        try:
            second = GrpcServer(Frontend(ScriptedBackend(), tokenizer))
            with pytest.raises(RuntimeError, match="Failed to bind"):
                await second.start("127.0.0.1", port)  # grpc's SO_REUSEPORT would share it
        finally:
            await first.stop(None)

    asyncio.run(run())


@pytest.mark.parametrize("server", ["HTTP", "gRPC"])
def test_a_port_taken_after_the_check_is_one_line_naming_the_flag(
    server: str, taken: int, tokenizer: RouterTokenizer
) -> None:
    async def run() -> None:
        servers = RouterServers(Frontend(ScriptedBackend(), tokenizer))
        http, grpc = (taken, 0) if server == "HTTP" else (0, taken)
        flag = "--http-port" if server == "HTTP" else "--grpc-port"
        with pytest.raises(ValueError, match=f"^{flag} {taken}: cannot listen on 127.0.0.1:"):
            await start_servers(servers, "127.0.0.1", http, grpc)
        if server == "gRPC":  # the HTTP server that had started is closed: its port is free
            check_ports("127.0.0.1", servers.http.port, 0)

    asyncio.run(run())


PORTS = ("--http-port", "0", "--grpc-port", "0")


@pytest.mark.parametrize(
    "argv",
    [["/nonexistent/model.gguf"], ["--model", "foo"], ["--models-file", "MODELS"]],
)
def test_a_model_this_machine_lacks_is_refused_before_anything_starts(
    argv: list[str],
    tmp_path: Path,
    nothing_starts: None,
    capsys: pytest.CaptureFixture[str],
) -> None:
    models = tmp_path / "models.yaml"
    models.write_text("models:\n  - model: default\n  - model: /nonexistent/folder\n")
    argv = [str(models) if a == "MODELS" else a for a in argv]
    assert main(["serve", *argv, *PORTS]) == 2
    line = one_line(capsys)
    where = f"--models-file {models}: " if "--models-file" in argv else ""  # the file named
    assert line.startswith(f"error: {where}model ") and "no such file or folder" in line
    assert "foo" in line or "/nonexistent/" in line


def test_a_missing_draft_model_is_named(
    nothing_starts: None, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["serve", "--speculative", "draft", "--draft-model", "/nonexistent/d.gguf", *PORTS]
    assert main(argv) == 2
    assert one_line(capsys).startswith("error: --draft-model: model '/nonexistent/d.gguf'")


def test_the_default_model_and_a_remote_clusters_paths_go_on_to_start(
    nothing_starts: None,
) -> None:
    with pytest.raises(AssertionError, match="would have started"):
        main(["serve", "default", *PORTS])
    with pytest.raises(AssertionError, match="would have started"):  # the workers' to find
        main(["serve", "/only/on/the/workers", "--ray-address", "10.0.0.1:6379", *PORTS])


def test_workers_that_cannot_start_end_serve_with_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    async def fails(*args, **kwargs) -> int:
        raise ScaleFailed("decode pool: 3 starts failed in a row; last: no such model")

    monkeypatch.setattr("deploy.serve._serve", fails)
    assert main(["serve", "default", *PORTS]) == 1
    assert one_line(capsys) == (
        "error: the workers did not start: decode pool: 3 starts failed in a row; last: no such "
        "model"
    )


def test_kvrelay_router_checks_its_host_and_ports_before_connecting(
    taken: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def connects(args) -> dict:
        raise AssertionError("the router would have connected to the cluster")

    monkeypatch.setattr("deploy.ops_cli._controllers", connects)
    # a serve to join (its absence is said first: test_cli_state_files)
    monkeypatch.setattr("deploy.cluster_address.resolve", lambda address, name: "127.0.0.1:1")
    assert main(["router", "--host", "999.1.1.1", *PORTS]) == 2
    assert one_line(capsys).startswith("error: --host 999.1.1.1: does not resolve")
    assert main(["router", "--grpc-port", str(taken), "--http-port", "0"]) == 2
    assert (
        one_line(capsys)
        == f"error: --grpc-port {taken}: cannot listen on 127.0.0.1:{taken} (in use)"
    )
