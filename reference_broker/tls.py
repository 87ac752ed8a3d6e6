"""TLS for the bundled pair: the files a node serves with, and throw-away certificates.

``make_certificates`` writes a new certificate authority, a server certificate for the
given host names and addresses, and a client certificate (for mutual TLS), with Debian's
``openssl`` command: for tests and ``hafailover pair up --tls``, never for production. The
keys are written beside the certificates, readable by their owner only, and never kept.
"""

from __future__ import annotations

import ipaddress
import shutil
import ssl
import subprocess
from collections.abc import Sequence
from pathlib import Path

import attrs

__all__ = ["TlsFiles", "make_certificates", "server_context"]


@attrs.frozen
class TlsFiles:
    """PEM files: the CA that signed everything, the server's pair, the client's pair."""

    ca: Path
    cert: Path
    key: Path
    client_cert: Path
    client_key: Path


def _openssl(*args: str | Path) -> None:
    openssl = shutil.which("openssl")
    if openssl is None:
        raise RuntimeError("the openssl command is needed to make certificates (Debian: openssl)")
    result = subprocess.run(
        [openssl, *map(str, args)], capture_output=True, text=True, timeout=60, check=False
    )
    if result.returncode != 0:
        raise RuntimeError(f"openssl {args[0]} failed: {result.stderr.strip()}")


def _sign(
    directory: Path, name: str, subject: str, extensions: str, ca: Path, ca_key: Path
) -> None:
    key, request, cert = (directory / f"{name}.{ext}" for ext in ("key", "csr", "pem"))
    config = directory / f"{name}.ext"
    config.write_text(extensions)
    _openssl("req", "-new", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", request,
             "-subj", subject)  # fmt: skip
    _openssl("x509", "-req", "-in", request, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial",
             "-out", cert, "-days", "2", "-sha256", "-extfile", config)  # fmt: skip
    key.chmod(0o600)
    request.unlink()
    config.unlink()


def make_certificates(
    directory: Path, hosts: Sequence[str] = ("localhost", "127.0.0.1"), *, name: str = "pair"
) -> TlsFiles:
    """A fresh CA, a server certificate valid for ``hosts`` and a client certificate."""
    directory.mkdir(parents=True, exist_ok=True)
    ca, ca_key = directory / f"{name}-ca.pem", directory / f"{name}-ca.key"
    _openssl("req", "-x509", "-new", "-newkey", "rsa:2048", "-nodes", "-keyout", ca_key,
             "-out", ca, "-days", "2", "-sha256", "-subj", f"/CN={name} test CA",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign")  # fmt: skip
    ca_key.chmod(0o600)
    names = []
    for host in hosts:
        try:
            ipaddress.ip_address(host)
        except ValueError:
            names.append(f"DNS:{host}")
        else:
            names.append(f"IP:{host}")
    _sign(
        directory,
        f"{name}-server",
        f"/CN={hosts[0]}",
        f"subjectAltName={','.join(names)}\nextendedKeyUsage=serverAuth\n",
        ca,
        ca_key,
    )
    _sign(directory, f"{name}-client", "/CN=app", "extendedKeyUsage=clientAuth\n", ca, ca_key)
    return TlsFiles(
        ca=ca,
        cert=directory / f"{name}-server.pem",
        key=directory / f"{name}-server.key",
        client_cert=directory / f"{name}-client.pem",
        client_key=directory / f"{name}-client.key",
    )


def server_context(cert: Path, key: Path, client_ca: Path | None) -> ssl.SSLContext:
    """The listeners' TLS: this node's certificate; with ``client_ca``, clients must show a
    certificate that CA signed (mutual TLS)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    if client_ca is not None:
        context.load_verify_locations(client_ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context
