"""dashboards/: the committed Grafana JSON and alert rules are dashboards/generate.py's output,
every panel queries Prometheus, every query is valid PromQL, and the alert rules pass Debian's
promtool (syntax and the unit tests in alerts_test.yml, which must cover each alert both ways)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fleet.controlplane.metrics import TARGETS_FILE
from tests.prometheus import INSTALL_HINT, panels, substitute

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]
DASHBOARDS = REPO / "dashboards"
NAMES = ("fleet-job-overview", "fleet-reliability", "fleet-collectives", "fleet-moe", "fleet-sdc")
ALERTS = ("FleetMoEExpertUnderloaded", "FleetMoEExpertOverloaded", "FleetEttrLow", "FleetIncidentRateHigh",
          "FleetNodeQuarantined", "FleetIngestDrops", "FleetAgentSilent")


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail(f"promtool not found: {INSTALL_HINT}", pytrace=False)
    return path


def generate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(DASHBOARDS / "generate.py"), *args],
                          capture_output=True, text=True, timeout=60, cwd=REPO)


def load_board(name: str) -> dict:
    return json.loads((DASHBOARDS / "grafana" / f"{name}.json").read_text())


def test_committed_files_are_the_generators_output(tmp_path: Path) -> None:
    out = generate("--out", str(tmp_path))
    assert out.returncode == 0, out.stderr
    generated = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    assert generated == ["alerts.yml", *(f"grafana/{n}.json" for n in sorted(NAMES))]
    for rel in generated:
        assert (DASHBOARDS / rel).read_text() == (tmp_path / rel).read_text(), \
            f"dashboards/{rel} is stale: run .venv/bin/python dashboards/generate.py"
    committed = sorted(p.name for p in (DASHBOARDS / "grafana").glob("*.json"))
    assert committed == sorted(f"{n}.json" for n in NAMES), "a dashboard JSON the generator does not write"
    assert generate("--check").returncode == 0


def test_check_reports_a_stale_file(tmp_path: Path) -> None:
    assert generate("--out", str(tmp_path)).returncode == 0
    (tmp_path / "grafana" / "fleet-moe.json").write_text("{}\n")
    out = generate("--out", str(tmp_path), "--check")
    assert out.returncode == 1 and "grafana/fleet-moe.json" in out.stderr


@pytest.mark.parametrize("name", NAMES)
def test_every_panel_queries_prometheus_through_the_variables(name: str) -> None:
    board = load_board(name)
    assert board["uid"] == name
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["job_id"]["query"] == "label_values(fleet_job_step, job_id)"
    assert variables["job_id"]["datasource"]["uid"] == "${datasource}"
    found = panels(board)
    assert len(found) >= 4, f"{name}: only {len(found)} panels"
    ids = [p["id"] for p in board["panels"]] + [p["id"] for p in found if p not in board["panels"]]
    assert len(set(ids)) == len(ids) and 0 not in ids, f"{name}: panel ids not unique"
    for panel in found:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        exprs = [t.get("expr", "") for t in panel.get("targets", [])]
        assert exprs and all(e.strip() for e in exprs), f"{name}: panel {panel['title']!r} has no query"
    # the incidents annotation: the incident's own time (ms) as the event's time
    (annotation,) = board["annotations"]["list"]
    assert annotation["useValueForTime"] is True
    assert annotation["expr"].startswith("fleet_incident_timestamp_seconds{") and "* 1000" in annotation["expr"]


def test_every_query_is_valid_promql(tmp_path: Path) -> None:
    """promtool parses each query (variables substituted) as a recording rule's expression."""
    exprs = set()
    for name in NAMES:
        board = load_board(name)
        exprs.update(t["expr"] for p in panels(board) for t in p["targets"])
        exprs.update(a["expr"] for a in board["annotations"]["list"])
    rules = {"groups": [{"name": "panels", "rules": [
        {"record": f"panel:query_{i}", "expr": substitute(e, "some-job")} for i, e in enumerate(sorted(exprs))]}]}
    path = tmp_path / "panels.yml"
    path.write_text(yaml.safe_dump(rules))
    out = subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(exprs)} rules found" in out.stdout


def test_alert_rules_pass_promtool() -> None:
    check = subprocess.run([promtool(), "check", "rules", str(DASHBOARDS / "alerts.yml")],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0 and f"SUCCESS: {len(ALERTS)} rules found" in check.stdout, check.stdout + check.stderr
    test = subprocess.run([promtool(), "test", "rules", str(DASHBOARDS / "alerts_test.yml")],
                          capture_output=True, text=True, timeout=60)
    assert test.returncode == 0 and "SUCCESS" in test.stdout, test.stdout + test.stderr


def test_every_alert_is_tested_firing_and_not_firing() -> None:
    rules = yaml.safe_load((DASHBOARDS / "alerts.yml").read_text())
    alerts = {r["alert"]: r for g in rules["groups"] for r in g["rules"]}
    assert set(alerts) == set(ALERTS)
    for name, rule in alerts.items():
        assert rule["labels"]["severity"] in ("warning", "critical"), name
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], name
    cases = yaml.safe_load((DASHBOARDS / "alerts_test.yml").read_text())
    assert cases["rule_files"] == ["alerts.yml"]
    fires = {a: 0 for a in ALERTS}
    quiet = {a: 0 for a in ALERTS}
    for test in cases["tests"]:
        for check in test["alert_rule_test"]:
            (fires if check.get("exp_alerts") else quiet)[check["alertname"]] += 1
    assert all(fires.values()), f"alerts never expected to fire: {[a for a, n in fires.items() if not n]}"
    assert all(quiet.values()), f"alerts never expected to stay quiet: {[a for a, n in quiet.items() if not n]}"


def test_thresholds_change_alerts_and_dashboard_lines_together(tmp_path: Path) -> None:
    out = generate("--out", str(tmp_path), "--moe-min-share", "0.03", "--moe-max-share", "0.3",
                   "--ettr-min", "0.95", "--incidents-per-hour", "5", "--agent-silent-s", "45")
    assert out.returncode == 0, out.stderr
    rules = {r["alert"]: r for r in yaml.safe_load((tmp_path / "alerts.yml").read_text())["groups"][0]["rules"]}
    assert rules["FleetMoEExpertUnderloaded"]["expr"] == "fleet_moe_expert_token_share_ratio < 0.03"
    assert rules["FleetMoEExpertOverloaded"]["expr"] == "fleet_moe_expert_token_share_ratio > 0.3"
    assert rules["FleetEttrLow"]["expr"] == "fleet_ettr_ratio < 0.95"
    assert rules["FleetIncidentRateHigh"]["expr"].endswith("> 5")
    assert rules["FleetAgentSilent"]["expr"] == "fleet_agent_last_heard_seconds > 45"
    board = json.loads((tmp_path / "grafana" / "fleet-moe.json").read_text())
    lines = [[s["value"] for s in p["fieldConfig"]["defaults"]["thresholds"]["steps"]]
             for p in panels(board) if "thresholds" in p["fieldConfig"]["defaults"]]
    assert [None, 0.03, 0.3] in lines
    check = subprocess.run([promtool(), "check", "rules", str(tmp_path / "alerts.yml")],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr


@pytest.mark.parametrize("args, flag", [
    (("--moe-min-share", "0.3"), "--moe-min-share"),
    (("--ettr-min", "1.5"), "--ettr-min"),
    (("--agent-silent-s", "0"), "--agent-silent-s"),
    (("--incidents-per-hour", "many"), "--incidents-per-hour"),
])
def test_bad_thresholds_get_one_line_naming_the_flag(tmp_path: Path, args: tuple[str, ...], flag: str) -> None:
    out = generate("--out", str(tmp_path), *args)
    assert out.returncode == 2
    assert flag in out.stderr.strip().splitlines()[-1] and "Traceback" not in out.stderr
    assert not any(tmp_path.iterdir()), "a refused run wrote files"


def test_prometheus_config_finds_fleet_up_and_loads_the_alerts() -> None:
    config = yaml.safe_load((DASHBOARDS / "prometheus.yml").read_text())
    assert config["rule_files"] == ["alerts.yml"]
    (job,) = config["scrape_configs"]
    (sd,) = job["file_sd_configs"]
    # Prometheus resolves relative paths against the config file's folder: from dashboards/
    # this is where `fleet up` (state_dir .fleet, run from the repository root) writes its target
    (target,) = sd["files"]
    assert (DASHBOARDS / target).resolve() == (REPO / ".fleet" / TARGETS_FILE).resolve()
    assert config["global"]["scrape_interval"] == "5s"
    out = subprocess.run([promtool(), "check", "config", str(DASHBOARDS / "prometheus.yml")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "SUCCESS: 1 rule files found" in out.stdout, out.stdout + out.stderr


def test_grafana_provisioning_points_at_the_prometheus_and_the_dashboards() -> None:
    (source,) = yaml.safe_load((DASHBOARDS / "provisioning" / "datasources" / "fleet.yml").read_text())["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://127.0.0.1:9090" and source["isDefault"]
    header = (DASHBOARDS / "prometheus.yml").read_text()
    assert "--web.listen-address=127.0.0.1:9090" in header
    (provider,) = yaml.safe_load((DASHBOARDS / "provisioning" / "dashboards" / "fleet.yml").read_text())["providers"]
    assert provider["type"] == "file" and re.fullmatch(r"\$\{?FLEET_DASHBOARDS\}?", provider["options"]["path"])
