"""ServerTLS: the router's certificate chain and private key for HTTPS and gRPC over TLS, read
and checked once at start (it owns their PEM bytes)."""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from pathlib import Path

import grpc


@dataclass(frozen=True)
class ServerTLS:
    cert_file: str
    key_file: str
    cert_pem: bytes = field(repr=False)
    key_pem: bytes = field(repr=False)

    @classmethod
    def load(cls, cert_file: str | None, key_file: str | None) -> ServerTLS | None:
        """None when neither file is given; ValueError naming the flag when one is missing, a
        file cannot be read, or the key does not belong to the certificate."""
        if (cert_file is None) != (key_file is None):
            raise ValueError("give both --tls-cert and --tls-key, or neither")
        if cert_file is None or key_file is None:
            return None
        tls = cls(cert_file, key_file, _read("--tls-cert", cert_file), _read("--tls-key", key_file))
        tls.ssl_context()  # a mismatched pair or a non-PEM file is refused here, not per connection
        return tls

    def ssl_context(self) -> ssl.SSLContext:
        """A server-side context for aiohttp (TLS 1.2 or newer)."""
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            context.load_cert_chain(self.cert_file, self.key_file)
        except ssl.SSLError as e:
            raise ValueError(
                f"--tls-cert {self.cert_file} / --tls-key {self.key_file}: not a PEM certificate "
                f"chain and its private key ({e.reason or e})"
            ) from None
        return context

    def grpc_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key_pem, self.cert_pem)])


def _read(flag: str, path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot read it ({e.strerror or e})") from None
