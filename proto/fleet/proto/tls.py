"""Mutual TLS between node agents (and the CLI) and the controller.

One CA signs the controller's server certificate and the clients' certificates. The
server requires a client certificate signed by that CA; a client trusts only that CA
and checks the server certificate against the address it dials (its SAN must name the
controller's IP or host name). Without ``TlsFiles`` both sides talk plaintext, which is
meant for loopback only.

Lives beside the wire contract (it imports nothing but grpc) because both ends of
every connection use it: the agent and the CLI as clients, the controller as server.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc


class TlsFileError(ValueError):
    """A certificate or key file could not be read; the message names the file."""


@dataclass(frozen=True)
class TlsFiles:
    """PEM files: the CA that signs both sides, and this side's certificate and key."""

    ca_cert: Path
    cert: Path
    key: Path


def _read(files: TlsFiles, name: str) -> bytes:
    path = Path(getattr(files, name))
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise TlsFileError(f"TLS {name} {path}: cannot read ({exc.strerror or exc})") from None
    if b"-----BEGIN " not in data:
        raise TlsFileError(f"TLS {name} {path}: not a PEM file")
    return data


def channel_credentials(files: TlsFiles) -> grpc.ChannelCredentials:
    """Client side: trust ``ca_cert`` only, present ``cert``/``key`` to the server."""
    return grpc.ssl_channel_credentials(
        root_certificates=_read(files, "ca_cert"),
        private_key=_read(files, "key"),
        certificate_chain=_read(files, "cert"),
    )


def server_credentials(files: TlsFiles) -> grpc.ServerCredentials:
    """Server side: present ``cert``/``key``; require client certificates signed by ``ca_cert``."""
    return grpc.ssl_server_credentials(
        [(_read(files, "key"), _read(files, "cert"))],
        root_certificates=_read(files, "ca_cert"),
        require_client_auth=True,
    )
