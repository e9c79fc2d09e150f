"""The router's --host, --http-port and --grpc-port checked before anything starts (`kvrelay serve`
and `kvrelay router`: the host resolves and each port can be bound now), and a bind that fails
later all the same (another process took the port meanwhile) turned into one line naming the
flag. Holds no state."""

from __future__ import annotations

import errno
import socket
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the servers' modules load only when a router starts (the CLI stays light)
    from router.serve import RouterServers

_FLAGS = {"HTTP": "--http-port", "gRPC": "--grpc-port"}


def check_ports(host: str, http_port: int, grpc_port: int) -> None:
    """ValueError naming --host when it does not resolve or is not this machine's, or the port's
    flag when that port is taken: each address of `host` is bound and closed again, with
    SO_REUSEADDR as the servers bind (a port left in TIME_WAIT is free). Port 0 is a free one."""
    if http_port and http_port == grpc_port:
        raise ValueError(f"--http-port and --grpc-port are both {http_port}: give two ports")
    addresses = list(_addresses(host))
    for flag, port in (("--http-port", http_port), ("--grpc-port", grpc_port)):
        for family, address in addresses:
            try:
                with socket.socket(family, socket.SOCK_STREAM) as sock:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    if family == socket.AF_INET6:
                        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                    sock.bind((address, port))
            except OSError as e:
                if e.errno == errno.EADDRNOTAVAIL:
                    raise ValueError(f"--host {host}: not an address of this machine") from None
                why = "in use" if e.errno == errno.EADDRINUSE else e.strerror
                raise ValueError(f"{flag} {port}: cannot listen on {host}:{port} ({why})") from None


def _addresses(host: str) -> Iterator[tuple[int, str]]:
    """Each (family, address) `host` resolves to, as the servers would bind them."""
    try:
        infos = socket.getaddrinfo(
            host, None, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE | socket.AI_ADDRCONFIG
        )
    except (OSError, UnicodeError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise ValueError(f"--host {host}: does not resolve ({why})") from None
    seen = set()
    for family, _, _, _, sockaddr in infos:
        if family in (socket.AF_INET, socket.AF_INET6) and (family, sockaddr[0]) not in seen:
            seen.add((family, sockaddr[0]))
            yield family, str(sockaddr[0])


async def start_servers(servers: RouterServers, host: str, http_port: int, grpc_port: int) -> None:
    """servers.start(); a port taken since check_ports (or a host that cannot be bound): a
    ValueError naming the flag, for the CLI's one-line error."""
    from router.serve import BindFailed

    try:
        await servers.start(host, http_port, grpc_port)
    except BindFailed as e:
        port = http_port if e.server == "HTTP" else grpc_port
        raise ValueError(
            f"{_FLAGS[e.server]} {port}: cannot listen on {host}:{port} ({e.why})"
        ) from None
