"""Generates fleet's Grafana dashboards and Prometheus alerting rules (dashboards as code).

Owns everything under ``dashboards/`` that is generated: ``grafana/fleet-*.json`` (five
dashboards built with grafana-foundation-sdk) and ``alerts.yml`` (Prometheus alerting
rules). Both read one set of thresholds (``Thresholds``), so an alert and the line a
dashboard draws for it always agree. The committed files are this script's output with
the default thresholds; a test regenerates them and fails when they differ.

    .venv/bin/python dashboards/generate.py                     # rewrite dashboards/ in place
    .venv/bin/python dashboards/generate.py --check             # exit 1 when dashboards/ is stale
    .venv/bin/python dashboards/generate.py --out /etc/fleet --moe-min-share 0.03 --ettr-min 0.95

Queries follow the metric contract of the controller's ``/metrics`` (controlplane/metrics.py,
job_metrics.py, collective_metrics.py): label ``job_id``, seconds, ratios 0-1. Every panel
filters on the ``$job_id`` template variable where the series carries that label; the
controller-wide series (ingest, agents, nodes) are per controller, i.e. per ``fleet up``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import yaml
from grafana_foundation_sdk.builders import bargauge, dashboard, heatmap, prometheus, stat, table, timeseries
from grafana_foundation_sdk.builders import common as common_b
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common, dashboard as model
from grafana_foundation_sdk.models import heatmap as heatmap_model, prometheus as prometheus_model

from fleet.proto.kinds import IncidentKind

HERE = Path(__file__).resolve().parent
DS = model.DataSourceRef(type_val="prometheus", uid="${datasource}")
J = 'job_id=~"$job_id"'
#: The incidents annotation (Grafana's "series value as timestamp" wants milliseconds).
ANNOTATION_EXPR = f"fleet_incident_timestamp_seconds{{{J}}} * 1000"


@dataclasses.dataclass(frozen=True)
class Thresholds:
    """What the alerts fire on, and the lines the dashboards draw for them."""

    moe_min_share: float = 0.05     # an expert under this share of its layer's tokens is starved
    moe_max_share: float = 0.20     # ... over this share, overloaded (Llama 4 fine-tuning guide)
    moe_for: str = "10m"            # sustained this long (a few hundred steps), not one batch
    ettr_min: float = 0.90          # effective training time ratio below this pages
    ettr_for: str = "15m"
    incidents_per_hour: int = 3     # more incidents than this in an hour, per job
    agent_silent_s: float = 30.0    # an agent not heard from for this long
    agent_silent_for: str = "1m"
    ingest_drop_window: str = "5m"  # any event lost in this window

    def check(self) -> None:
        """Raise ``ValueError`` naming the flag when the thresholds make no sense together."""
        if not 0 <= self.moe_min_share < self.moe_max_share <= 1:
            raise ValueError("--moe-min-share and --moe-max-share must satisfy 0 <= min < max <= 1")
        if not 0 < self.ettr_min <= 1:
            raise ValueError("--ettr-min must be in (0, 1]")
        if self.incidents_per_hour < 0:
            raise ValueError("--incidents-per-hour must be >= 0")
        if self.agent_silent_s <= 0:
            raise ValueError("--agent-silent-s must be > 0")


# ---- panel helpers -------------------------------------------------------------------

def q(expr: str, legend: str = "", *, instant: bool = False, table_format: bool = False) -> prometheus.Dataquery:
    query = prometheus.Dataquery().expr(expr).datasource(DS)
    if legend:
        query = query.legend_format(legend)
    if instant:
        query = query.instant()
    if table_format:
        query = query.format(prometheus_model.PromQueryFormat.TABLE)
    return query


def _targets(panel: Any, queries: list[prometheus.Dataquery]) -> Any:
    for ref, query in zip("ABCDEFGH", queries, strict=False):
        panel = panel.with_target(query.ref_id(ref))
    return panel


def _steps(*points: tuple[float | None, str]) -> dashboard.ThresholdsConfig:
    return dashboard.ThresholdsConfig().mode(model.ThresholdsMode.ABSOLUTE).steps(
        [model.Threshold(value=v, color=c) for v, c in points])


def ts(title: str, queries: list[prometheus.Dataquery], *, unit: str = "short", desc: str = "",
       w: int = 12, h: int = 8, stacked: bool = False, lines: tuple[tuple[float | None, str], ...] = (),
       minimum: float | None = None, maximum: float | None = None) -> timeseries.Panel:
    """A time series panel; ``lines`` draws threshold lines (dashed) at those values."""
    panel = (timeseries.Panel().title(title).description(desc).datasource(DS).unit(unit)
             .span(w).height(h).fill_opacity(40 if stacked else 10).line_width(1))
    if stacked:
        panel = panel.stacking(common_b.StackingConfig().mode(common.StackingMode.NORMAL))
    if lines:
        panel = panel.thresholds(_steps(*lines)).thresholds_style(
            common_b.GraphThresholdsStyleConfig().mode(common.GraphTresholdsStyleMode.DASHED))
    if minimum is not None:
        panel = panel.min(minimum)
    if maximum is not None:
        panel = panel.max(maximum)
    return _targets(panel, queries)


def st(title: str, queries: list[prometheus.Dataquery], *, unit: str = "short", desc: str = "",
       w: int = 6, h: int = 4, steps: tuple[tuple[float | None, str], ...] = ((None, "green"),),
       named: bool = False) -> stat.Panel:
    """A stat panel of the newest value; ``named`` shows each series' legend with its value."""
    panel = (stat.Panel().title(title).description(desc).datasource(DS).unit(unit).span(w).height(h)
             .thresholds(_steps(*steps)).color_mode(common.BigValueColorMode.VALUE)
             .graph_mode(common.BigValueGraphMode.AREA)
             .reduce_options(common_b.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
             .text_mode(common.BigValueTextMode.VALUE_AND_NAME if named else common.BigValueTextMode.AUTO))
    return _targets(panel, queries)


def bars(title: str, queries: list[prometheus.Dataquery], *, unit: str = "short", desc: str = "",
         w: int = 12, h: int = 8, steps: tuple[tuple[float | None, str], ...] = ((None, "green"),),
         minimum: float | None = None, maximum: float | None = None) -> bargauge.Panel:
    """Horizontal bars, one per series (instant queries)."""
    panel = (bargauge.Panel().title(title).description(desc).datasource(DS).unit(unit).span(w).height(h)
             .orientation(common.VizOrientation.HORIZONTAL).display_mode(common.BarGaugeDisplayMode.BASIC)
             .thresholds(_steps(*steps))
             .reduce_options(common_b.ReduceDataOptions().calcs(["lastNotNull"]).values(False)))
    if minimum is not None:
        panel = panel.min(minimum)
    if maximum is not None:
        panel = panel.max(maximum)
    return _targets(panel, queries)


def quantiles(metric: str, by: str, selector: str, window: str = "$__rate_interval",
              qs: tuple[float, ...] = (0.5, 0.9, 0.99), legend: str = "") -> list[prometheus.Dataquery]:
    """``histogram_quantile`` of ``metric`` per ``by`` labels, one query per quantile."""
    sel = f"{{{selector}}}" if selector else ""
    group = f"le, {by}" if by else "le"
    return [q(f"histogram_quantile({p}, sum by ({group}) (rate({metric}_bucket{sel}[{window}])))",
              f"{legend}p{round(p * 100)}") for p in qs]


class _PrometheusAnnotation(model.AnnotationQuery):
    """An annotation query with the Prometheus data source's own fields, which the SDK's
    generic model lacks (series value as timestamp, title/text templates, tag labels)."""

    def __init__(self, *, step: str, title: str, text: str, tag_keys: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.extra = {"step": step, "titleFormat": title, "textFormat": text, "tagKeys": tag_keys,
                      "useValueForTime": True}

    def to_json(self) -> dict[str, object]:
        return {**super().to_json(), **self.extra}


class _Built:
    """Hands an already-built model to a builder method that expects a builder."""

    def __init__(self, built: Any) -> None:
        self._built = built

    def build(self) -> Any:
        return self._built


def incidents_annotation() -> _Built:
    return _Built(_PrometheusAnnotation(
        name="Incidents", datasource=DS, enable=True, hide=False, icon_color="red", expr=ANNOTATION_EXPR,
        step="5s", title="{{kind}} on {{node}}", text="rank {{rank}}, action {{action}}, incident {{incident}}",
        tag_keys="kind,node,action"))


def base(uid: str, title: str, desc: str) -> dashboard.Dashboard:
    """A dashboard with the data source and job variables every fleet dashboard has."""
    job = (dashboard.QueryVariable("job_id").label("Job").datasource(DS)
           .query("label_values(fleet_job_step, job_id)")
           .refresh(model.VariableRefresh.ON_TIME_RANGE_CHANGED).sort(model.VariableSort.ALPHABETICAL_DESC)
           .include_all(True).all_value(".+"))
    return (dashboard.Dashboard(title).uid(uid).description(desc).tags(["fleet"]).editable()
            .time("now-1h", "now").refresh("5s").timezone("browser")
            .tooltip(model.DashboardCursorSync.CROSSHAIR)
            .with_variable(dashboard.DatasourceVariable("datasource").label("Data source").type("prometheus"))
            .with_variable(job)
            .link(dashboard.DashboardLink("fleet").type(model.DashboardLinkType.DASHBOARDS).tags(["fleet"])
                  .as_dropdown(True).include_vars(True).keep_time(True))
            .annotation(incidents_annotation()))


def add(board: dashboard.Dashboard, rows: list[tuple[str, list[Any]]]) -> dashboard.Dashboard:
    for title, panels in rows:
        board = board.with_row(dashboard.Row(title))
        for panel in panels:
            board = board.with_panel(panel)
    return board


# ---- the dashboards ------------------------------------------------------------------

def job_overview(t: Thresholds) -> dashboard.Dashboard:
    ettr_steps = ((None, "red"), (t.ettr_min, "green"))
    return add(base("fleet-job-overview", "fleet / job overview",
                    "One training job: state, progress, loss, throughput and where its wall time went."), [
        ("Job", [
            st("Jobs by state", [q("fleet_jobs > 0", "{{state}}")], named=True,
               desc="Jobs in this controller's store per state (states with none hidden)."),
            st("Attempts by state", [q(f"fleet_attempts{{{J}}} > 0", "{{state}}")], named=True,
               desc="The job's attempts per state; a restart ends one attempt and places the next."),
            st("Step", [q(f"fleet_job_step{{{J}}}", "step"), q(f"fleet_job_total_steps{{{J}}}", "of")],
               named=True, desc="Newest step the current attempt completed, and the job's total."),
            st("ETTR", [q(f"fleet_ettr_ratio{{{J}}}", "ETTR")], unit="percentunit", steps=ettr_steps,
               desc=f"Effective training time ratio so far: productive step time / wall time "
                    f"(the FleetEttrLow alert fires under {t.ettr_min:g})."),
        ]),
        ("Training", [
            ts("Loss", [q(f"fleet_loss{{{J}}}", "loss")], w=8, desc="Mean over ranks of the newest step's loss."),
            ts("Tokens / s", [q(f"fleet_tokens_per_second{{{J}}}", "tokens/s")], w=8,
               desc="Sum over ranks of their newest step's tokens per second."),
            ts("Step duration", quantiles("fleet_step_duration_seconds", "", J), unit="s", w=8,
               desc="Quantiles of every rank's step time over the rate window."),
            ts("Restarts", [q(f"fleet_restarts_total{{{J}}}", "restarts")], w=8,
               desc="Attempts restarted after a failure (cumulative)."),
        ]),
        ("Goodput", [
            ts("Productive and lost time (badput)",
               [q(f"fleet_productive_seconds{{{J}}}", "productive"),
                q(f"fleet_lost_seconds{{{J}}}", "{{category}}")], unit="s", stacked=True, w=16,
               desc="Wall time split as fleet report splits it: productive step time stacked with the time "
                    "lost per category (Google goodput BadputType names where one fits)."),
            ts("ETTR", [q(f"fleet_ettr_ratio{{{J}}}", "ETTR")], unit="percentunit", w=8,
               lines=ettr_steps, minimum=0, maximum=1),
        ]),
    ])


def reliability(t: Thresholds) -> dashboard.Dashboard:
    return add(base("fleet-reliability", "fleet / reliability",
                    "Incidents, how fast they were detected and recovered, restarts, quarantines, "
                    "agents and the ingest path. Incidents are annotations on every fleet dashboard."), [
        ("Incidents", [
            ts("Incidents by kind and node", [q(f"sum by (kind, node) (fleet_incidents_total{{{J}}}) > 0",
                                                "{{kind}} on {{node}}")], w=12,
               desc="Incidents recorded (cumulative; kinds and nodes with none hidden)."),
            st("Incidents in the last hour", [q(f"sum(increase(fleet_incidents_total{{{J}}}[1h]))", "incidents")],
               steps=((None, "green"), (t.incidents_per_hour + 1, "red")), w=4,
               desc=f"The FleetIncidentRateHigh alert fires over {t.incidents_per_hour}."),
            st("Restarts", [q(f"fleet_restarts_total{{{J}}}", "restarts")], w=4),
            st("Quarantined nodes", [q("fleet_quarantined_nodes", "quarantined")], w=4,
               steps=((None, "green"), (1, "red"))),
            table.Panel().title("Incidents (newest 200)").datasource(DS).span(24).height(8)
            .unit("dateTimeAsIso").with_target(q(ANNOTATION_EXPR, instant=True, table_format=True).ref_id("A")),
        ]),
        ("Detection and recovery", [
            bars("Detection time by kind (range)",
                 quantiles("fleet_detection_seconds", "kind", "", "$__range", (0.5, 0.9), "{{kind}} ")
                 + [q("sum by (kind) (increase(fleet_detection_seconds_sum[$__range])) / "
                      "sum by (kind) (increase(fleet_detection_seconds_count[$__range]))", "{{kind}} mean")],
                 unit="s", desc="Fault to incident (detected_after_s), over the dashboard's time range."),
            bars("Recovery time by kind (range)",
                 quantiles("fleet_recovery_seconds", "kind", "", "$__range", (0.5, 0.9), "{{kind}} ")
                 + [q("sum by (kind) (increase(fleet_recovery_seconds_sum[$__range])) / "
                      "sum by (kind) (increase(fleet_recovery_seconds_count[$__range]))", "{{kind}} mean")],
                 unit="s", desc="Detection to the first step of the next attempt."),
        ]),
        ("Nodes and agents", [
            ts("Nodes by state", [q("fleet_nodes", "{{state}}")], w=8),
            ts("Quarantined", [q("fleet_node_quarantined", "{{node}}")], w=8, minimum=0, maximum=1,
               desc="1 while the node is quarantined."),
            ts("Agents: last heard", [q("fleet_agent_last_heard_seconds", "{{node}}"),
                                      q("fleet_agents_connected", "connected")], unit="s", w=8,
               lines=((None, "green"), (t.agent_silent_s, "red")),
               desc=f"Seconds since each connected agent was last heard from; FleetAgentSilent fires "
                    f"over {t.agent_silent_s:g} s (the 'connected' series counts streams)."),
        ]),
        ("Ingest", [
            ts("Ingested / s", [q("sum(rate(fleet_ingest_events_total[$__rate_interval]))", "events"),
                                q("sum(rate(fleet_ingest_batches_total[$__rate_interval]))", "batches"),
                                q("sum(rate(fleet_ingest_duplicate_batches_total[$__rate_interval]))",
                                  "duplicate batches")], w=6),
            ts("Errors and drops", [
                q("sum by (reason) (increase(fleet_ingest_errors_total[$__rate_interval]))", "error: {{reason}}"),
                q("sum by (source) (increase(fleet_ingest_dropped_events_total[$__rate_interval]))",
                  "dropped by {{source}}")], w=6, desc="Any drop fires FleetIngestDrops."),
            ts("Commit duration", quantiles("fleet_ingest_commit_seconds", "", "", qs=(0.5, 0.99)), unit="s", w=6),
            ts("Writer queue", [q("fleet_ingest_queued_events", "queued events")], w=6),
        ]),
    ])


def collectives(t: Thresholds) -> dashboard.Dashboard:
    lag = f"fleet_collective_arrival_lag_seconds{{{J}}}"
    by_op = "op, timing"
    return add(base("fleet-collectives", "fleet / collectives",
                    "Who arrives late at collectives, and how long collectives take by op."), [
        ("Arrival lag", [
            heatmap.Panel().title("Arrival lag by rank").datasource(DS).span(24).height(10)
            .description("How late each rank (row) entered its recent collectives behind the first member "
                         "(mean over the last window of matched collectives). A straggler is a hot row.")
            .calculate(False).rows_frame(heatmap.RowsHeatmapOptions().layout(common.HeatmapCellLayout.AUTO))
            .y_axis(heatmap.YAxisConfig().unit("none").axis_label("rank"))
            .color(heatmap.HeatmapColorOptions().mode(heatmap_model.HeatmapColorMode.SCHEME).scheme("Oranges")
                   .scale(heatmap_model.HeatmapColorScale.EXPONENTIAL).exponent(0.5).steps(64))
            .show_tooltip().show_legend()
            .cell_values(heatmap.CellValues().unit("s"))
            .with_target(q(lag, "{{rank}}").ref_id("A")),
            ts("Slowest ranks", [q(f"topk(5, {lag})", "rank {{rank}}")], unit="s", w=12),
            bars("Arrival lag now", [q(lag, "rank {{rank}}", instant=True)], unit="s", w=12),
        ]),
        ("Duration by op", [
            ts("Collective duration p50", quantiles("fleet_collective_duration_seconds", by_op, J, qs=(0.5,),
                                                    legend="{{op}} ({{timing}}) "), unit="s", w=8,
               desc="timing=poll_upper_bound: gloo entries whose exit is the reporter's poll time (an upper "
                    "bound), never mixed with measured ones."),
            ts("Collective duration p99", quantiles("fleet_collective_duration_seconds", by_op, J, qs=(0.99,),
                                                    legend="{{op}} ({{timing}}) "), unit="s", w=8),
            ts("Collectives / s", [q(f"sum by ({by_op}) (rate(fleet_collective_duration_seconds_count{{{J}}}"
                                     "[$__rate_interval]))", "{{op}} ({{timing}})")], w=8),
        ]),
        ("Bandwidth", [
            ts("Bus bandwidth by group and op", [q(f"fleet_collective_busbw_bytes_per_second{{{J}}}",
                                                   "group {{group}} {{op}}")], unit="Bps", w=12,
               desc="Median bus bandwidth (nccl-tests' definition) of each group's recent collectives whose "
                    "duration was measured on every member (blocking calls on gloo, NCCL's timing). With a "
                    "topology, fleet_collective_utilization_ratio is it over the group's slowest link."),
            ts("Arrival skew by group", [q(f"fleet_collective_arrival_skew_seconds{{{J}}}", "group {{group}}")],
               unit="s", w=12,
               desc="Median first-to-last member enter of each group's recent collectives: a late rank makes "
                    "the others wait here (the slow_comm detector names it)."),
        ]),
    ])


def moe(t: Thresholds) -> dashboard.Dashboard:
    band = ((None, "red"), (t.moe_min_share, "green"), (t.moe_max_share, "red"))
    return add(base("fleet-moe", "fleet / MoE experts",
                    "Mixture-of-experts routing balance: each expert's share of its layer's tokens."), [
        ("Expert load", [
            ts("Expert token share", [q(f"fleet_moe_expert_token_share_ratio{{{J}}}",
                                        "layer {{layer}} expert {{expert}}")],
               unit="percentunit", w=12, lines=band, minimum=0,
               desc=f"Share of the layer's tokens routed to each expert in the newest step (summed over ranks). "
                    f"Alerts: under {t.moe_min_share:g} or over {t.moe_max_share:g} for {t.moe_for}."),
            ts("Least and most loaded expert per layer",
               [q(f"fleet_moe_layer_min_share_ratio{{{J}}}", "layer {{layer}} min"),
                q(f"fleet_moe_layer_max_share_ratio{{{J}}}", "layer {{layer}} max")],
               unit="percentunit", w=12, lines=band, minimum=0),
            ts("Imbalance per layer (coefficient of variation)",
               [q(f"stddev by (job_id, layer) (fleet_moe_expert_token_share_ratio{{{J}}}) / "
                  f"avg by (job_id, layer) (fleet_moe_expert_token_share_ratio{{{J}}})", "layer {{layer}}")],
               w=12, minimum=0, desc="Standard deviation of the experts' shares over their mean: 0 is a "
               "perfectly even router."),
            bars("Expert share now", [q(f"fleet_moe_expert_token_share_ratio{{{J}}}",
                                        "layer {{layer}} expert {{expert}}", instant=True)],
                 unit="percentunit", w=12, steps=band, minimum=0, maximum=1),
        ]),
    ])


def sdc(t: Thresholds) -> dashboard.Dashboard:
    checks = f"fleet_sdc_checks_total{{{J}}}"
    return add(base("fleet-sdc", "fleet / silent data corruption",
                    "Fingerprint comparisons across copies that must be identical, and what they found."), [
        ("Checks", [
            st("Checks in range", [q(f"sum by (result) (increase({checks}[$__range]))", "{{result}}")],
               named=True, w=8),
            st("Mismatches in range", [q(f'sum by (kind) (increase(fleet_sdc_checks_total{{{J}, result="mismatch"}}'
                                         "[$__range]))", "{{kind}}")],
               named=True, w=8, steps=((None, "green"), (1, "red"))),
            st("SDC incidents by node", [q(f'sum by (node) (fleet_incidents_total{{{J}, kind="{IncidentKind.SDC}"}})',
                                           "{{node}}")], named=True, w=8, steps=((None, "green"), (1, "red"))),
            ts("Checks by kind and result", [q(f"sum by (kind, result) (increase({checks}[$__rate_interval]))",
                                               "{{kind}} {{result}}")], w=24),
        ]),
    ])


DASHBOARDS = {
    "fleet-job-overview": job_overview,
    "fleet-reliability": reliability,
    "fleet-collectives": collectives,
    "fleet-moe": moe,
    "fleet-sdc": sdc,
}


def dashboard_json(name: str, t: Thresholds) -> dict[str, Any]:
    """One dashboard as Grafana's JSON model, panel ids numbered in order."""
    built = DASHBOARDS[name](t).build()
    for number, panel in enumerate(built.panels or [], start=1):
        panel.id_val = number
    return json.loads(json.dumps(built, cls=JSONEncoder))


# ---- alerting rules -------------------------------------------------------------------

def alert_rules(t: Thresholds) -> dict[str, Any]:
    """Prometheus alerting rules (one group) for the conditions operators page on."""
    def rule(name: str, expr: str, for_: str | None, severity: str, summary: str, description: str) -> dict:
        out: dict[str, Any] = {"alert": name, "expr": expr}
        if for_:
            out["for"] = for_
        out["labels"] = {"severity": severity}
        out["annotations"] = {"summary": summary, "description": description}
        return out

    return {"groups": [{"name": "fleet", "rules": [
        rule("FleetMoEExpertUnderloaded", f"fleet_moe_expert_token_share_ratio < {t.moe_min_share:g}",
             t.moe_for, "warning", "MoE expert {{ $labels.expert }} of layer {{ $labels.layer }} is starved",
             f"Job {{{{ $labels.job_id }}}}: the expert gets {{{{ $value | humanizePercentage }}}} of its layer's "
             f"tokens (under {t.moe_min_share:g} for {t.moe_for}): router collapse or a dead expert."),
        rule("FleetMoEExpertOverloaded", f"fleet_moe_expert_token_share_ratio > {t.moe_max_share:g}",
             t.moe_for, "warning", "MoE expert {{ $labels.expert }} of layer {{ $labels.layer }} is overloaded",
             f"Job {{{{ $labels.job_id }}}}: the expert gets {{{{ $value | humanizePercentage }}}} of its layer's "
             f"tokens (over {t.moe_max_share:g} for {t.moe_for}): its rank is the step's straggler."),
        rule("FleetEttrLow", f"fleet_ettr_ratio < {t.ettr_min:g}", t.ettr_for, "critical",
             "Job {{ $labels.job_id }}: ETTR {{ $value | humanizePercentage }}",
             f"Effective training time ratio under {t.ettr_min:g} for {t.ettr_for}: see fleet report for where "
             "the time went."),
        rule("FleetIncidentRateHigh",
             f"sum by (job_id) (increase(fleet_incidents_total[1h])) > {t.incidents_per_hour}", None, "critical",
             "Job {{ $labels.job_id }}: {{ $value | humanize }} incidents in the last hour",
             f"More than {t.incidents_per_hour} incidents in an hour: something recurs (fleet report, "
             "fleet nodes)."),
        rule("FleetNodeQuarantined", "fleet_quarantined_nodes > 0", None, "warning",
             "{{ $value }} node(s) quarantined",
             "fleet took nodes out of service (fleet nodes shows why); repair them and fleet release NODE."),
        rule("FleetIngestDrops",
             f"sum by (instance, source) (increase(fleet_ingest_dropped_events_total[{t.ingest_drop_window}])) > 0",
             None, "critical", "Telemetry lost ({{ $labels.source }})",
             f"{{{{ $value | humanize }}}} events dropped by the {{{{ $labels.source }}}} in {t.ingest_drop_window} "
             "(the store's ingest_drops table has each)."),
        rule("FleetAgentSilent", f"fleet_agent_last_heard_seconds > {t.agent_silent_s:g}", t.agent_silent_for,
             "critical", "Agent on {{ $labels.node }} silent for {{ $value | humanizeDuration }}",
             f"A connected agent sent nothing for over {t.agent_silent_s:g} s for {t.agent_silent_for}: "
             "a wedged node or a broken stream."),
    ]}]}


ALERTS_HEADER = """\
# Generated by dashboards/generate.py: do not edit. Change a threshold with its flag, e.g.
#   .venv/bin/python dashboards/generate.py --out DIR --moe-min-share 0.03 --ettr-min 0.95
# (--help lists them), and point Prometheus's rule_files at DIR/alerts.yml.
"""


def render(t: Thresholds) -> dict[str, str]:
    """Every generated file, path relative to dashboards/ -> its text."""
    files = {f"grafana/{name}.json": json.dumps(dashboard_json(name, t), indent=2, sort_keys=True) + "\n"
             for name in DASHBOARDS}
    files["alerts.yml"] = ALERTS_HEADER + yaml.safe_dump(alert_rules(t), sort_keys=False, width=120)
    return files


def main(argv: list[str] | None = None) -> int:
    defaults = Thresholds()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=HERE, help="folder to write into (default: dashboards/)")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 when a file differs")
    for field in dataclasses.fields(Thresholds):
        parser.add_argument("--" + field.name.replace("_", "-"), type=type(getattr(defaults, field.name)),
                            default=getattr(defaults, field.name), help=f"default {getattr(defaults, field.name)}")
    args = parser.parse_args(argv)
    t = Thresholds(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Thresholds)})
    try:
        t.check()
    except ValueError as e:
        parser.error(str(e))
    stale = []
    for rel, text in render(t).items():
        path = args.out / rel
        if args.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(rel)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    if stale:
        print(f"stale in {args.out}: {', '.join(stale)} (run dashboards/generate.py)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
