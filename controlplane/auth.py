"""Per-run secrets and the controller address file.

``fleet up`` generates a random token, writes it to ``<state_dir>/token`` with mode
0600, and hands it to its agents; every gRPC call carries it as metadata under
``fleet.proto.contract.TOKEN_METADATA_KEY``. ``<state_dir>/controller.json`` (also
0600) tells other CLI commands where the running controller listens and which job it
runs, its Prometheus metrics port (``metrics_port``, 0 when metrics are off), and, when
the controller uses mutual TLS, which CA and client certificate/key files the CLI
connects with.
"""

from __future__ import annotations

import getpass
import hmac
import json
import os
import secrets
import socket
from dataclasses import asdict, dataclass
from pathlib import Path

from fleet.controlplane.errors import UnavailableError
from fleet.proto.tls import TlsFiles


def new_token() -> str:
    return secrets.token_urlsafe(32)


def operator() -> str:
    """Who runs this process, as a job's reasons name an operator (a stop, a resume): user@host."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (a bare container)
        user = ""
    host = socket.gethostname()
    return f"{user}@{host}" if user else host


def tokens_equal(given: str | None, expected: str) -> bool:
    """Constant-time comparison."""
    return given is not None and hmac.compare_digest(given.encode(), expected.encode())


def _write_private(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


@dataclass(frozen=True)
class ControllerInfo:
    """Where a running controller listens, for the other CLI commands."""

    address: str
    token: str
    job_id: str
    pid: int
    ca_cert: str = ""       # mutual TLS files for clients; all "" when plaintext
    client_cert: str = ""
    client_key: str = ""
    #: the controller's Prometheus /metrics port on its host; 0 = metrics off (and in files
    #: written before the field existed)
    metrics_port: int = 0

    def tls_files(self) -> TlsFiles | None:
        """The client side's TLS files, or None when the controller talks plaintext."""
        if not self.ca_cert:
            return None
        return TlsFiles(ca_cert=Path(self.ca_cert), cert=Path(self.client_cert), key=Path(self.client_key))


def write_controller_info(state_dir: Path, info: ControllerInfo) -> Path:
    path = state_dir / "controller.json"
    _write_private(state_dir / "token", info.token + "\n")
    _write_private(path, json.dumps(asdict(info)))
    return path


def read_controller_info(state_dir: Path) -> ControllerInfo:
    """The running controller's info; UnavailableError when none is running here."""
    path = state_dir / "controller.json"
    try:
        data = json.loads(path.read_text())
        return ControllerInfo(**data)
    except FileNotFoundError:
        raise UnavailableError(
            f"no running controller found ({path} does not exist)",
            hint="is `fleet up` running? --state-dir (or FLEET_STATE_DIR) names the folder it runs in, "
                 "its cluster file's state_dir",
        ) from None
    except (ValueError, TypeError) as exc:
        raise UnavailableError(f"{path}: unreadable controller info ({exc})") from None


def remove_controller_info(state_dir: Path, pid: int) -> None:
    """Remove the info file if it still belongs to controller ``pid``."""
    path = state_dir / "controller.json"
    try:
        if json.loads(path.read_text()).get("pid") == pid:
            path.unlink()
    except (OSError, ValueError):
        pass
