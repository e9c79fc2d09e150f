"""Test support: a throw-away CA and a server certificate for 127.0.0.1 / localhost, written as PEM
files into a directory the caller owns (no other state).

Made with the `openssl` command when it is on PATH, else with the `cryptography` package; with
neither, TLSToolsMissing says so (the TLS tests skip on it).
"""

from __future__ import annotations

import datetime
import ipaddress
import shutil
import subprocess
from pathlib import Path

from deploy.redis_local import RedisTLS

HOSTS = ("127.0.0.1", "localhost")  # the server certificate's subjectAltName


class TLSToolsMissing(RuntimeError):
    """Neither the openssl command nor the cryptography package is available."""


def make_server_certs(directory: Path, tool: str = "auto") -> RedisTLS:
    """A CA (ca.pem) and a server certificate it signed (server.pem, server.key) in `directory`.

    `tool`: "openssl", "cryptography" or "auto" (openssl if on PATH, else cryptography)."""
    if tool == "auto":
        tool = "openssl" if shutil.which("openssl") else "cryptography"
    tls = RedisTLS(
        cert_file=str(directory / "server.pem"),
        key_file=str(directory / "server.key"),
        ca_file=str(directory / "ca.pem"),
    )
    if tool == "openssl":
        _with_openssl(directory, tls)
    elif tool == "cryptography":
        _with_cryptography(tls)
    else:
        raise ValueError(f"unknown certificate tool {tool!r}")
    return tls


def _with_openssl(directory: Path, tls: RedisTLS) -> None:
    if shutil.which("openssl") is None:
        raise TLSToolsMissing("no `openssl` command on PATH")
    ca_key, csr, ext = directory / "ca.key", directory / "server.csr", directory / "server.ext"
    new_key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    ca_ext = ["-addext", "basicConstraints=critical,CA:TRUE"]
    ca_ext += ["-addext", "keyUsage=critical,keyCertSign,cRLSign"]
    _openssl(
        *("req", "-x509", *new_key, "-keyout", ca_key, "-out", tls.ca_file),
        *("-days", "2", "-subj", "/CN=kvrelay test CA", *ca_ext),
    )
    ext.write_text(
        f"subjectAltName={','.join(_san_entries())}\n"
        "basicConstraints=critical,CA:FALSE\n"
        "keyUsage=critical,digitalSignature\n"
        "extendedKeyUsage=serverAuth\n"
        "authorityKeyIdentifier=keyid\n"
    )
    _openssl(
        "req", "-new", *new_key, "-keyout", tls.key_file, "-out", csr, "-subj", "/CN=localhost"
    )
    _openssl(
        *("x509", "-req", "-in", csr, "-CA", tls.ca_file, "-CAkey", ca_key, "-CAcreateserial"),
        *("-out", tls.cert_file, "-days", "2", "-extfile", ext),
    )


def _openssl(*args: str | Path) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True, timeout=60)


def _san_entries() -> list[str]:
    return [f"IP:{h}" if h[0].isdigit() else f"DNS:{h}" for h in HOSTS]


def _with_cryptography(tls: RedisTLS) -> None:
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    except ImportError as exc:
        raise TLSToolsMissing(f"no `openssl` command and no cryptography package ({exc})") from exc

    now = datetime.datetime.now(datetime.UTC)

    def certificate(subject: str, key, issuer: str, issuer_key, is_ca: bool) -> x509.Certificate:
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.BasicConstraints(ca=is_ca, path_length=None), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()), False
            )
        )
        if is_ca:
            usage = x509.KeyUsage(False, False, False, False, False, True, True, False, False)
        else:
            usage = x509.KeyUsage(True, False, False, False, False, False, False, False, False)
            names = [x509.IPAddress(ipaddress.ip_address(h)) for h in HOSTS if h[0].isdigit()]
            names += [x509.DNSName(h) for h in HOSTS if not h[0].isdigit()]
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
            eku = x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH])
            builder = builder.add_extension(eku, critical=False)
        return builder.add_extension(usage, critical=True).sign(issuer_key, hashes.SHA256())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    server_key = ec.generate_private_key(ec.SECP256R1())
    ca = certificate("kvrelay test CA", ca_key, "kvrelay test CA", ca_key, is_ca=True)
    server = certificate("localhost", server_key, "kvrelay test CA", ca_key, is_ca=False)
    pem = serialization.Encoding.PEM
    Path(tls.ca_file).write_bytes(ca.public_bytes(pem))
    Path(tls.cert_file).write_bytes(server.public_bytes(pem))
    key_format = serialization.PrivateFormat.PKCS8
    no_password = serialization.NoEncryption()
    Path(tls.key_file).write_bytes(server_key.private_bytes(pem, key_format, no_password))
