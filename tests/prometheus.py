"""A throwaway Prometheus server scraping `fleet up`, and the dashboards' queries to run on it.

``PrometheusServer`` runs Debian's ``prometheus`` (``bash scripts/test.sh`` installs it when
missing; a machine without it fails, it never skips) on 127.0.0.1 and a free port, with a
fresh TSDB folder and a config derived from ``dashboards/prometheus.yml``: the shipped
scrape job and alert rules, the scrape and rule-evaluation interval shortened, the
``file_sd`` path pointed at the state dir of the `fleet up` under test. ``stop()`` ends
the process by its PID. Used by tests/integration/test_prometheus.py and bench/dashboards.py.

``panel_queries`` lists every panel query of the generated dashboards and ``substitute``
fills in the template variables the way Grafana would for one job.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
DASHBOARDS = REPO / "dashboards"
INSTALL_HINT = "run `bash scripts/test.sh`, which installs Debian's prometheus package (prometheus, promtool)"
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 20.0


class PrometheusUnavailable(RuntimeError):
    """No Prometheus server can be started here; the message says why and what to do."""


@dataclass(frozen=True)
class PanelQuery:
    dashboard: str
    panel: str
    expr: str


def panels(board: dict) -> list[dict]:
    """Every panel of a dashboard's JSON model, those inside rows included, rows not."""
    out: list[dict] = []
    for panel in board["panels"]:
        if panel["type"] == "row":
            out.extend(panel.get("panels", []))
        else:
            out.append(panel)
    return out


def panel_queries(folder: Path = DASHBOARDS / "grafana") -> list[PanelQuery]:
    """Every query of every panel of every dashboard in ``folder``."""
    out = []
    for path in sorted(folder.glob("*.json")):
        board = json.loads(path.read_text())
        for panel in panels(board):
            out.extend(PanelQuery(path.stem, panel["title"], t["expr"]) for t in panel.get("targets", []))
    return out


def annotation_expr(folder: Path = DASHBOARDS / "grafana") -> str:
    """The incidents annotation's query (the same on every dashboard)."""
    exprs = {a["expr"] for path in folder.glob("*.json")
             for a in json.loads(path.read_text())["annotations"]["list"]}
    (expr,) = exprs
    return expr


def substitute(expr: str, job_id: str, *, rate_interval: str = "30s", interval: str = "5s",
               range_: str = "1h") -> str:
    """``expr`` with Grafana's template variables filled in for one job."""
    for name, value in (("$job_id", job_id), ("$__rate_interval", rate_interval), ("$__interval", interval),
                        ("$__range", range_)):
        expr = expr.replace(name, value)
    if "$" in expr:
        raise ValueError(f"unknown template variable in {expr!r}")
    return expr


def find_binary() -> str:
    path = shutil.which("prometheus")
    if path is None:
        raise PrometheusUnavailable(f"prometheus not found on PATH: {INSTALL_HINT}")
    return path


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def derived_config(targets_file: Path, *, interval_s: float, rules: Path | None = DASHBOARDS / "alerts.yml") -> dict:
    """dashboards/prometheus.yml with the intervals set to ``interval_s``, the file_sd path
    set to ``targets_file`` and the rule file given as an absolute path."""
    config = yaml.safe_load((DASHBOARDS / "prometheus.yml").read_text())
    interval = f"{round(interval_s * 1000)}ms"
    config["global"].update(scrape_interval=interval, evaluation_interval=interval, scrape_timeout=interval)
    config["rule_files"] = [str(rules)] if rules is not None else []
    for job in config["scrape_configs"]:
        for sd in job["file_sd_configs"]:
            sd["files"] = [str(targets_file)]
            sd["refresh_interval"] = interval
    return config


class PrometheusServer:
    """Debian's prometheus on 127.0.0.1 scraping the `fleet up` whose target file is ``targets_file``."""

    def __init__(self, workdir: Path, targets_file: Path, *, interval_s: float = 1.0,
                 rules: Path | None = DASHBOARDS / "alerts.yml") -> None:
        self.workdir = workdir
        self.interval_s = interval_s
        self.config_path = workdir / "prometheus.yml"
        self.config_path.write_text(yaml.safe_dump(derived_config(targets_file, interval_s=interval_s, rules=rules)))
        self.log_path = workdir / "prometheus.log"
        self.proc: subprocess.Popen | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = START_TIMEOUT_S) -> PrometheusServer:
        """Start it and wait (bounded) until it answers ready; a port taken in between is retried."""
        binary = find_binary()
        for _ in range(3):
            self.port = _free_port()
            storage = self.workdir / f"tsdb-{self.port}"
            with self.log_path.open("a") as log:
                self.proc = subprocess.Popen(
                    [binary, f"--config.file={self.config_path}", f"--web.listen-address=127.0.0.1:{self.port}",
                     f"--storage.tsdb.path={storage}", "--storage.tsdb.retention.time=1d"],
                    stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir)
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline and self.proc.poll() is None:
                if self._ready():
                    return self
                time.sleep(0.1)
            if self.proc.poll() is None:
                self.stop()
                raise PrometheusUnavailable(f"prometheus not ready after {timeout_s} s: {self.log_tail()}")
            if "address already in use" not in self.log_tail():
                raise PrometheusUnavailable(f"prometheus exited {self.proc.returncode}: {self.log_tail()}")
        raise PrometheusUnavailable(f"prometheus found no free port: {self.log_tail()}")

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as reply:
                return reply.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text()[-chars:]
        except OSError:
            return ""

    def stop(self) -> None:
        """Terminate the server by its PID (SIGKILL after ``STOP_TIMEOUT_S``). Idempotent."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(STOP_TIMEOUT_S)
        self.proc = None

    def __enter__(self) -> PrometheusServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def api(self, path: str, **params: Any) -> Any:
        """GET ``/api/v1/<path>``; its ``data`` (raises on an error status, with Prometheus's message)."""
        query = urllib.parse.urlencode({k: v for k, v in params.items() if v is not None})
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=30) as reply:
                body = json.loads(reply.read())
        except urllib.error.HTTPError as e:
            body = json.loads(e.read() or b"{}")
            raise AssertionError(f"prometheus {path} {params}: {body.get('error', e)}") from None
        if body.get("status") != "success":
            raise AssertionError(f"prometheus {path} {params}: {body}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        """An instant query's series (``[{"metric": labels, "value": [t, "v"]}, ...]``)."""
        data = self.api("query", query=expr, time=at)
        assert data["resultType"] == "vector", f"{expr}: {data['resultType']}"
        return data["result"]

    def targets_up(self) -> list[dict]:
        """Active targets of the fleet scrape job that were scraped successfully."""
        return [t for t in self.api("targets")["activeTargets"]
                if t["labels"].get("job") == "fleet" and t["health"] == "up"]

    def wait_for(self, cond: Callable[[], Any], what: str, timeout_s: float, poll_s: float = 0.2) -> Any:
        """Poll ``cond`` until it returns something truthy (returned) or ``timeout_s`` passes."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc is None or self.proc.poll() is not None:
                raise AssertionError(f"prometheus exited while waiting for {what}: {self.log_tail()}")
            got = cond()
            if got:
                return got
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
            time.sleep(poll_s)
