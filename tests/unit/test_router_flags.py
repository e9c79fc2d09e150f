"""The router flags of `kvrelay serve` and `kvrelay router` (request bound, API keys, TLS, drain):
their defaults, and bad values refused with a clear error before anything starts."""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path

import pytest

from deploy.cli import build_parser, main
from deploy.router_flags import RouterOptions, router_options
from engine.models.loader import resolve_model
from engine.sampling.sampling_params import SamplingParams
from router.admission import DEFAULT_MAX_QUEUED_REQUESTS
from router.frontend import Frontend, RequestSpec
from router.tls import ServerTLS
from router.tokenizer import RouterTokenizer
from tests.tls_certs import TLSToolsMissing, make_server_certs
from tests.unit.test_tracing import ScriptedBackend

KEY = "sk-0123456789abcdef0123"


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    try:
        return make_server_certs(tmp_path_factory.mktemp("tls"))
    except TLSToolsMissing as e:
        pytest.skip(str(e))


def options(command: str, *argv: str) -> RouterOptions:
    return router_options(build_parser().parse_args([command, *argv]))


@pytest.mark.parametrize("command", ["serve", "router"])
def test_defaults_bound_requests_and_ask_for_no_key_nor_tls(command: str) -> None:
    assert options(command) == RouterOptions(DEFAULT_MAX_QUEUED_REQUESTS, None, None)
    assert DEFAULT_MAX_QUEUED_REQUESTS == 1024


@pytest.mark.parametrize("command", ["serve", "router"])
def test_flags_become_options(command: str, tmp_path: Path, certs) -> None:
    keys = tmp_path / "keys"
    keys.write_text(f"{KEY} team-a\n")
    got = options(
        command, "--max-queued-requests", "8", "--api-keys", str(keys),
        "--tls-cert", certs.cert_file, "--tls-key", certs.key_file,
    )  # fmt: skip
    assert got.max_queued_requests == 8
    assert got.api_keys is not None and got.api_keys.tenant(KEY) == "team-a"
    assert got.tls is not None and got.tls.cert_file == certs.cert_file
    assert any("TLS" in line for line in got.describe())


def test_server_tls_builds_both_servers_credentials(certs) -> None:
    tls = ServerTLS.load(certs.cert_file, certs.key_file)
    assert tls is not None
    assert isinstance(tls.ssl_context(), ssl.SSLContext)
    assert tls.grpc_credentials() is not None
    assert b"PRIVATE KEY" not in repr(tls).encode()


def test_tls_needs_both_files_that_match(tmp_path: Path, certs) -> None:
    with pytest.raises(ValueError, match="both --tls-cert and --tls-key, or neither"):
        ServerTLS.load(certs.cert_file, None)
    with pytest.raises(ValueError, match="both --tls-cert and --tls-key, or neither"):
        ServerTLS.load(None, certs.key_file)
    with pytest.raises(ValueError, match=r"--tls-key .*nope: cannot read it"):
        ServerTLS.load(certs.cert_file, str(tmp_path / "nope"))
    other = make_server_certs(tmp_path)  # another key pair: it does not match the certificate
    with pytest.raises(ValueError, match="not a PEM certificate chain and its private key"):
        ServerTLS.load(certs.cert_file, other.key_file)
    with pytest.raises(ValueError, match="not a PEM certificate"):
        ServerTLS.load(certs.key_file, certs.key_file)


def test_a_bound_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="--max-queued-requests must be >= 1, got 0"):
        options("serve", "--max-queued-requests", "0")


@pytest.mark.parametrize("command", ["serve", "router"])
def test_both_drain_for_drain_seconds(command: str) -> None:
    assert options(command).drain_s == 5.0
    assert options(command, "--drain-seconds", "0.5").drain_s == 0.5
    for bad in ("-1", "nan", "inf"):  # refused while parsing, one line naming the flag
        with pytest.raises(SystemExit) as done:
            options(command, "--drain-seconds", bad)
        assert done.value.code == 2


@pytest.mark.parametrize("command", ["serve", "router"])
def test_the_cli_refuses_bad_router_flags_before_starting_anything(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], certs
) -> None:
    keys = tmp_path / "keys"
    keys.write_text(f"{KEY} team-a\n{KEY}-2 team-b extra\n")
    assert main([command, "--api-keys", str(keys)]) == 2
    err = capsys.readouterr().err
    assert f"error: {keys}:2: 'extra' is not NAME=VALUE" in err
    assert KEY not in err
    keys.write_text(f"{KEY} team-a rps=0\n")
    assert main([command, "--api-keys", str(keys)]) == 2
    assert f"error: {keys}:1: rps must be a positive number, got 0" in capsys.readouterr().err
    assert main([command, "--rate-limit-tpm", "100"]) == 2
    assert "--rate-limit-* needs --api-keys" in capsys.readouterr().err
    assert main([command, "--tls-cert", certs.cert_file]) == 2
    assert "give both --tls-cert and --tls-key" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["serve", "router"])
def test_default_max_tokens_is_what_a_request_without_one_gets(command: str) -> None:
    assert options(command).default_max_tokens is None
    assert options(command, "--default-max-tokens", "16").default_max_tokens == 16
    with pytest.raises(ValueError, match="--default-max-tokens must be >= 1, got 0"):
        options(command, "--default-max-tokens", "0")


def test_a_request_without_max_tokens_gets_the_default_not_the_whole_context() -> None:
    tokenizer = RouterTokenizer(resolve_model("default"))
    unset = RequestSpec(prompt_token_ids=(1, 2, 3), sampling=SamplingParams())
    assert unset.max_tokens is None

    def max_tokens(frontend: Frontend) -> int:
        return asyncio.run(frontend.prepare(unset)).request.sampling.max_tokens

    backend = ScriptedBackend()  # a context of 128
    assert max_tokens(Frontend(backend, tokenizer)) == 128 - 3
    assert max_tokens(Frontend(backend, tokenizer, max_tokens_cap=16)) == 16


def test_a_router_joining_a_keyed_cluster_must_bring_its_keys_and_limits(tmp_path: Path) -> None:
    """RouterOptions.check_access against the serve's digest (RouterConfig.access_digest)."""
    keys, other = tmp_path / "keys", tmp_path / "other"
    keys.write_text(f"{KEY} team-a\n")
    other.write_text(f"{KEY} team-b\n")
    serve = options("serve", "--api-keys", str(keys), "--rate-limit-rps", "2")
    cluster = serve.access_digest()
    assert cluster is not None and options("serve").access_digest() is None
    same = options("router", "--api-keys", str(keys), "--rate-limit-rps", "2")
    same.check_access(cluster)  # the same file and limits: joins
    with pytest.raises(ValueError, match=r"admits API keys only .* with the same keys"):
        options("router").check_access(cluster)  # would admit every caller
    for differs in (
        options("router", "--api-keys", str(keys)),  # the serve's limit left out
        options("router", "--api-keys", str(other), "--rate-limit-rps", "2"),
    ):
        with pytest.raises(ValueError, match="differ from its cluster's"):
            differs.check_access(cluster)
    same.check_access(None)  # keys on an open cluster: only stricter
    options("router").check_access(None)


def test_one_key_for_every_client_as_vllms_api_key(tmp_path: Path) -> None:
    """--api-key KEY (vLLM's flag): one tenant; the same key file's router joins, another not."""
    single = options("serve", "--api-key", KEY, "--port", "0")
    assert single.api_keys is not None and single.api_keys.tenant(KEY) == "default"
    assert single.api_keys.tenant(KEY + "x") is None
    keys = tmp_path / "keys"
    keys.write_text(f"{KEY} default\n")
    options("router", "--api-keys", str(keys)).check_access(single.access_digest())  # same
    with pytest.raises(ValueError, match="differ from its cluster's"):
        options("router", "--api-key", KEY + "x").check_access(single.access_digest())
    with pytest.raises(ValueError, match="--api-keys FILE or --api-key KEY, not both"):
        options("serve", "--api-key", KEY, "--api-keys", str(keys))
    with pytest.raises(ValueError, match="--api-key: the key is 5 characters"):
        options("serve", "--api-key", "short")
    limited = options("serve", "--api-key", KEY, "--rate-limit-rps", "2")
    assert limited.default_limits.any
    args = build_parser().parse_args(["serve", "--port", "9001", "--tensor-parallel-size", "2"])
    assert (args.http_port, args.tp) == (9001, 2)  # vLLM's names
