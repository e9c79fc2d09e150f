"""`kvrelay up CLUSTER.yaml` / `kvrelay down CLUSTER.yaml`: a `ray up` cluster brought up and
served on (`kvrelay serve` on the head, in tmux; a --models-file copied there first), or torn
down, through the ray CLI. Owns no state: pure functions build each command (`--dry-run` prints
them), up() runs them in order."""

from __future__ import annotations

import argparse
import math
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, NoReturn

import yaml

from common.cluster_state import MAX_POOL_SIZE

RAY = "ray"
WAIT_TIMEOUT_S = 1800.0  # GPU nodes boot, install, load the model and warm up: many minutes
POLL_INTERVAL_S = 15.0  # one probe is one SSH round trip to the head
# Where `ray rsync-up` puts --models-file on the head: /tmp exists on the host and in a Ray
# docker container alike (rsync makes no parent folder); copied again by each `kvrelay up`.
REMOTE_MODELS_FILE = "/tmp/kvrelay-models-file.yaml"


@dataclass(frozen=True)
class UpOptions:
    cluster_yaml: str
    num_prefill: int = 1
    num_decode: int = 1
    models: tuple[str, ...] = ()  # serve's --model, repeated; (): serve's default model
    http_port: int = 8000
    grpc_port: int = 50051
    device: str = "cuda"  # not serve's auto: GPU nodes join after serve starts
    serve_args: tuple[str, ...] = field(default=())  # more `kvrelay serve` flags, verbatim
    models_file: str | None = None  # a local file, copied to REMOTE_MODELS_FILE on the head


class Endpoints(NamedTuple):
    http: str
    grpc: str


class Ran(NamedTuple):
    returncode: int
    output: str  # captured stdout + stderr; "" when the command wrote to the terminal


Runner = Callable[[list[str], bool], Ran]  # (command, capture) -> Ran


def ray_up_command(cluster_yaml: str) -> list[str]:
    return [RAY, "up", "-y", cluster_yaml]


def ray_down_command(cluster_yaml: str) -> list[str]:
    return [RAY, "down", "-y", cluster_yaml]


def serve_command(opts: UpOptions, models_file: str = REMOTE_MODELS_FILE) -> list[str]:
    """`kvrelay serve` as the head runs it: against the cluster's Ray, listening on all hosts
    (`models_file`: where serve reads opts.models_file from)."""
    command = [
        "kvrelay", "serve", "--ray-address", "auto", "--host", "0.0.0.0",
        "--prefill", str(opts.num_prefill), "--decode", str(opts.num_decode),
        "--http-port", str(opts.http_port), "--grpc-port", str(opts.grpc_port),
        "--device", opts.device,
    ]  # fmt: skip
    for model in opts.models:
        command += ["--model", model]
    if opts.models_file is not None:
        command += ["--models-file", models_file]
    return command + list(opts.serve_args)


def models_file_upload_command(opts: UpOptions) -> list[str] | None:
    """`ray rsync-up` of the local --models-file to where the head's serve reads it; None
    without one."""
    if opts.models_file is None:
        return None
    return [RAY, "rsync-up", opts.cluster_yaml, opts.models_file, REMOTE_MODELS_FILE]


def check_serve_flags(opts: UpOptions) -> None:
    """The head's `kvrelay serve` command line (--serve-args included) checked here as serve
    checks its flags before Ray starts, a --models-file read from its local copy (a bad file:
    ValueError naming it, the entry and the field), before any ray command runs. The models
    themselves are the head's: not looked for here. A size given twice (--prefill N and again
    in --serve-args) is refused: serve would take the last one silently."""
    from deploy.serve_flags import add_serve_parser, spec_from_args

    own = {"--port": "--http-port"}  # vLLM's name for it, which serve takes too
    for flag in ("--prefill", "--decode", "--http-port", "--port", "--grpc-port", "--device"):
        if any(a == flag or a.startswith(f"{flag}=") for a in opts.serve_args):
            name = own.get(flag, flag)
            raise ValueError(f"--serve-args: give {name} as kvrelay up's own flag, not in it")
    for flag in ("--host", "--ray-address"):
        if any(a == flag or a.startswith(f"{flag}=") for a in opts.serve_args):
            raise ValueError(f"--serve-args: {flag} is kvrelay up's to set, not yours")
    parser = _RaisingParser(prog="kvrelay")
    add_serve_parser(parser.add_subparsers(), lambda args: 0)
    argv = serve_command(opts, models_file=opts.models_file or REMOTE_MODELS_FILE)[1:]
    try:
        spec_from_args(parser.parse_args(argv))
    except ValueError as e:
        raise ValueError(f"kvrelay serve on the head would refuse it: {e}") from None


class _RaisingParser(argparse.ArgumentParser):
    """argparse that raises ValueError instead of printing usage and exiting."""

    def error(self, message: str) -> NoReturn:
        raise ValueError(message)


def start_serve_command(opts: UpOptions) -> list[str]:
    return [RAY, "exec", opts.cluster_yaml, "--tmux", shlex.join(serve_command(opts))]


def router_probe(http_port: int) -> str:
    """A shell command on the head that exits 0 once the router's /health says 200: it is up
    and has at least one ready worker in each pool (503 before)."""
    fetch = "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=10)"
    return shlex.join(["python", "-c", fetch, f"http://127.0.0.1:{http_port}/health"])


def router_check_command(opts: UpOptions) -> list[str]:
    return [RAY, "exec", opts.cluster_yaml, router_probe(opts.http_port)]


def head_ip_command(cluster_yaml: str) -> list[str]:
    return [RAY, "get-head-ip", cluster_yaml]


def parse_head_ip(output: str) -> str:
    """The address `ray get-head-ip` prints: its last non-empty line (logs may come before)."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    if not lines or " " in lines[-1]:
        raise ValueError(f"`ray get-head-ip` printed no address: {output!r}")
    return lines[-1]


def endpoints(head_ip: str, http_port: int, grpc_port: int) -> Endpoints:
    return Endpoints(f"http://{head_ip}:{http_port}/v1", f"{head_ip}:{grpc_port}")


def check_cluster_yaml(path: str) -> None:
    """Refuse what `ray up` cannot bring up, before any cloud call."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"no cluster config at {path}")
    provider = (yaml.safe_load(Path(path).read_text()) or {}).get("provider", {})
    if provider.get("type") == "fake_multinode":
        raise ValueError(
            f"{path} is a fake cluster: start it with `RAY_FAKE_CLUSTER=1 ray start --head "
            f"--autoscaling-config={path}` (ray up cannot run it), then `kvrelay serve "
            "--ray-address auto`"
        )


def describe_up(opts: UpOptions, wait_s: float) -> list[str]:
    """What up() runs, one shell line each (what --dry-run prints)."""
    probe = shlex.join(router_check_command(opts))
    upload = models_file_upload_command(opts)
    return [
        shlex.join(ray_up_command(opts.cluster_yaml)),
        f"{probe}  # once: a router that already answers is kept",
        *([] if upload is None else [shlex.join(upload)]),
        shlex.join(start_serve_command(opts)),
        f"{probe}  # every {POLL_INTERVAL_S:g} s until it exits 0, at most {wait_s:g} s",
        shlex.join(head_ip_command(opts.cluster_yaml)),
    ]


def run_command(command: list[str], capture: bool) -> Ran:
    if not capture:
        return Ran(subprocess.run(command).returncode, "")
    done = subprocess.run(command, capture_output=True, text=True)
    return Ran(done.returncode, done.stdout + done.stderr)


def bring_up(
    opts: UpOptions,
    wait_s: float = WAIT_TIMEOUT_S,
    run: Runner = run_command,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> int:
    """ray up, serve on the head unless a router already answers, wait for it, print where."""
    _say(f"kvrelay up: {shlex.join(ray_up_command(opts.cluster_yaml))}")
    if (rc := run(ray_up_command(opts.cluster_yaml), False).returncode) != 0:
        return rc
    if run(router_check_command(opts), True).returncode == 0:
        _say("kvrelay up: a router already answers on the head; not starting another")
        _say("  (resize with `kvrelay scale`; restart with `kvrelay down` first)")
    else:
        if (upload := models_file_upload_command(opts)) is not None:
            _say(f"kvrelay up: {shlex.join(upload)}")
            if (rc := run(upload, False).returncode) != 0:
                return rc
        _say("kvrelay up: starting `kvrelay serve` on the head (ray exec --tmux)")
        if (rc := run(start_serve_command(opts), False).returncode) != 0:
            return rc
    start = clock()
    while (probe := run(router_check_command(opts), True)).returncode != 0:
        waited = clock() - start
        if waited >= wait_s:
            _say(f"kvrelay up: no answer from the router after {waited:.0f} s; last probe:")
            _say(probe.output[-2000:])
            _say(f"  serve's output: ray attach {opts.cluster_yaml} --tmux")
            return 1
        _say(f"kvrelay up: waiting for the router and its workers ({waited:.0f} s)")
        sleep(POLL_INTERVAL_S)
    head = run(head_ip_command(opts.cluster_yaml), True)
    if head.returncode != 0:
        _say(head.output)
        return head.returncode
    where = endpoints(parse_head_ip(head.output), opts.http_port, opts.grpc_port)
    print(f"kvrelay: serving on {opts.cluster_yaml}", flush=True)
    print(f"  HTTP (OpenAI)  {where.http}", flush=True)
    print(f"  gRPC           {where.grpc}", flush=True)
    return 0


def add_up_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="`ray up` a cluster, then `kvrelay serve` on its head")
    p.add_argument("cluster_yaml", help="a `ray up` config, e.g. deploy/cluster.yaml")
    p.add_argument(
        "--prefill", type=int, default=1, help="number of prefill workers (0: aggregated)"
    )
    p.add_argument("--decode", type=int, default=1, help="number of decode workers")
    p.add_argument(
        "--model",
        action="append",
        default=None,
        metavar="MODEL",
        help="model name, .gguf or HF folder on every node; repeated, several models side by "
        "side, each with its own --prefill / --decode pools (serve's --model)",
    )
    p.add_argument(
        "--models-file",
        default=None,
        metavar="PATH",
        help="several models from a YAML or JSON file on this machine (instead of --model; "
        "deploy/models_file.py shows the format): checked here, copied to the head "
        f"(ray rsync-up, to {REMOTE_MODELS_FILE}) and given to serve as --models-file",
    )
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=50051)
    p.add_argument(
        "--device",
        default="cuda",
        choices=["cuda", "cpu", "auto"],
        help="cuda (default; one GPU per worker, or --serve-args='--gpus-per-worker 0.5' for two "
        "on each), cpu, or auto (serve picks from the GPUs Ray has when it starts, before the "
        "GPU nodes have joined: usually cpu)",
    )
    p.add_argument(
        "--wait-timeout",
        type=float,
        default=WAIT_TIMEOUT_S,
        help=f"seconds to wait for the router (default {WAIT_TIMEOUT_S:g})",
    )
    p.add_argument("--dry-run", action="store_true", help="print the commands, run none")
    p.add_argument(
        "--serve-args",
        default="",
        help='more `kvrelay serve` flags, one string: --serve-args="--kv-cache-gib 40"',
    )
    p.set_defaults(func=up)


def add_down_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("down", help="`ray down` a cluster: every node, the head included")
    p.add_argument("cluster_yaml", help="the config it was brought up with")
    p.add_argument("--dry-run", action="store_true", help="print the command, run it not")
    p.set_defaults(func=down)


def options_from_args(args: argparse.Namespace) -> UpOptions:
    if not (0 <= args.prefill <= MAX_POOL_SIZE and 1 <= args.decode <= MAX_POOL_SIZE):
        raise ValueError(
            f"--prefill must be in [0, {MAX_POOL_SIZE}] (0: aggregated workers) and --decode in "
            f"[1, {MAX_POOL_SIZE}]"
        )
    for flag, port in (("--http-port", args.http_port), ("--grpc-port", args.grpc_port)):
        if not 0 < port < 65536:
            raise ValueError(f"{flag} must be a TCP port (1-65535), got {port}")
    models = tuple(args.model or ())
    if models and args.models_file is not None:
        raise ValueError("give the models either as --model or in --models-file")
    repeated = next((m for i, m in enumerate(models) if m in models[:i]), None)
    if repeated is not None:
        raise ValueError(f"--model {repeated!r} is given more than once")
    return UpOptions(
        args.cluster_yaml, args.prefill, args.decode, models, args.http_port,
        args.grpc_port, args.device, tuple(shlex.split(args.serve_args)), args.models_file,
    )  # fmt: skip


def up(args: argparse.Namespace) -> int:
    opts = options_from_args(args)
    if not 0 < args.wait_timeout < math.inf:
        raise ValueError(
            f"--wait-timeout must be a positive number of seconds, got {args.wait_timeout}"
        )
    check_cluster_yaml(opts.cluster_yaml)
    check_serve_flags(opts)
    if args.dry_run:
        print("\n".join(describe_up(opts, args.wait_timeout)))
        return 0
    _require_ray_cli()
    return bring_up(opts, args.wait_timeout)


def down(args: argparse.Namespace) -> int:
    check_cluster_yaml(args.cluster_yaml)
    command = ray_down_command(args.cluster_yaml)
    if args.dry_run:
        print(shlex.join(command))
        return 0
    _require_ray_cli()
    return run_command(command, False).returncode


def _require_ray_cli() -> None:
    if shutil.which(RAY) is None:
        raise FileNotFoundError("the `ray` command is not on PATH (pip install 'ray[default]')")


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
