"""The self-contained HTML incident report of `fleet replay --html FILE`: one file that opens
offline, in any browser.

``render_html(doc)`` takes plain data (``controlplane.replay_html_data`` builds it) and
returns the page:
  * written here, readable without JavaScript: the verdict and its summary, the findings
    (causes first) with the culprits' Python stacks where dumps had them, the job's
    incidents and attempts, the loss curve (inline SVG, one line per attempt, restarts
    dashed) and the lost-time breakdown (a stacked bar, with the numbers in a table);
  * drawn by the inline script (``controlplane.replay_html_page``) from the one JSON blob
    ``<script type="application/json" id="fleet-data">``: the per-rank timeline, the
    culprits' highlights, the incidents and attempt boundaries on its time axis.

Invariants: no external reference at all (no URL in any ``src``, ``href`` or ``url()``);
every text is HTML-escaped; the JSON blob escapes ``<``, ``>`` and ``&`` so that no
string in it (a group name, an incident's evidence) can end the script element. Pure:
no I/O, no clock (``doc["generated_at"]`` is the caller's).
"""

from __future__ import annotations

import datetime as dt
import json
import math
from collections.abc import Mapping, Sequence
from html import escape
from typing import Any

from fleet.controlplane.replay_html_page import CSS, PALETTE, SCRIPT

#: What a report from dumps says in the job's slots.
NOT_A_JOB = "not from a fleet job: no incidents or loss"
#: Findings the page lists (causes first; the verdict's JSON has them all).
MAX_FINDINGS = 60
#: Points per attempt on the loss curve (more are thinned evenly; the last one is kept).
MAX_LOSS_POINTS = 1500
#: The lost-time categories in bar order, with their colours and names.
LOST_PARTS = (("productive_s", "#2e7d32", "productive"), ("startup_s", "#90a4ae", "start-up"),
              ("detection_s", "#e53935", "detection"), ("restart_s", "#fb8c00", "restart"),
              ("recomputed_s", "#8e24aa", "recomputed steps"), ("checkpointing_s", "#1e88e5", "checkpointing"),
              ("other_s", "#bdbdbd", "other"))
ATTEMPT_COLORS = ("#1565c0", "#ef6c00", "#6a1b9a", "#00838f", "#ad1457", "#558b2f")


def e(value: Any) -> str:
    """``value`` as HTML text (quotes included, so it is safe inside an attribute too)."""
    return escape("" if value is None else str(value), quote=True)


def json_blob(data: Any) -> str:
    """``data`` as JSON that can sit inside a ``<script>`` element: ``<``, ``>`` and ``&``
    become ``\\u003c`` and so on, which ``JSON.parse`` reads back unchanged."""
    text = json.dumps(data, separators=(",", ":"), allow_nan=False, ensure_ascii=True)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def op_colors(sigs: Sequence[str]) -> dict[str, str]:
    """Op name (a signature's first word) -> its colour, in sorted op order."""
    ops = sorted({s.split(" ")[0] for s in sigs})
    return {op: PALETTE[i % len(PALETTE)] for i, op in enumerate(ops)}


def utc(ts: float | None) -> str:
    if ts is None or not math.isfinite(ts):
        return "-"
    return dt.datetime.fromtimestamp(ts, tz=dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")[:-5] + " UTC"


def render_html(doc: Mapping[str, Any]) -> str:
    """The page (module docstring). ``doc``: ``source``, ``diagnosis`` (the engine's JSON
    form, findings with ``role`` and optionally ``stacks``), ``timeline``
    (``replay_html_data.timeline``), ``job`` (``replay_html_data.job_section``, or None
    for dumps), optionally ``notes`` (lines shown above the timeline) and ``generated_at``
    (Unix seconds)."""
    diag, tl, job = doc["diagnosis"], doc["timeline"], doc.get("job")
    colors = op_colors(tl["sigs"])
    verdict = str(diag.get("verdict", "empty"))
    title = f"fleet replay {doc['source']}: {verdict.upper()}"
    data = {"verdict": {k: diag.get(k) for k in ("verdict", "summary", "culprit_ranks", "missing_ranks")},
            "timeline": tl, "colors": colors,
            "job": None if job is None else {"attempt_shown": job["attempt_shown"]}}
    parts = [
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n",
        "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n",
        f"<title>{e(title)}</title>\n<style>{CSS}</style>\n</head>\n<body>\n",
        _header(doc, diag, job),
        _findings(diag),
        _timeline(tl, job, doc.get("notes", []), colors),
        _job_parts(job),
        "<svg width=\"0\" height=\"0\" style=\"position:absolute\" aria-hidden=\"true\"><defs>"
        "<pattern id=\"fleet-hatch\" width=\"6\" height=\"6\" patternUnits=\"userSpaceOnUse\" "
        "patternTransform=\"rotate(45)\"><rect width=\"6\" height=\"6\" fill=\"rgba(198,40,40,0.08)\"/>"
        "<line x1=\"0\" y1=\"0\" x2=\"0\" y2=\"6\" stroke=\"#c62828\" stroke-width=\"3\"/></pattern></defs></svg>\n",
        f"<script type=\"application/json\" id=\"fleet-data\">{json_blob(data)}</script>\n",
        f"<script>{SCRIPT}</script>\n</body>\n</html>\n",
    ]
    return "".join(parts)


def _header(doc: Mapping[str, Any], diag: Mapping[str, Any], job: Mapping[str, Any] | None) -> str:
    verdict = str(diag.get("verdict", "empty"))
    out = [f"<header id=\"verdict\" data-verdict=\"{e(verdict)}\">",
           f"<h1>fleet replay <span class=\"mono\">{e(doc['source'])}</span></h1>"]
    if job is not None:
        steps = f"step {job['final_step']}" + (f" of {job['total_steps']}" if job["total_steps"] else "")
        out.append(f"<div class=\"muted\">job {e(job['id'])} {e(job['name'])}: {e(job['state'])}, {e(steps)}, "
                   f"{len(job['attempts'])} attempt(s), {e(job['restarts'])} restart(s)</div>")
    out.append(f"<p class=\"summary\"><span class=\"verdict v-{e(verdict)}\">{e(verdict.upper())}</span>"
               f"{e(diag.get('summary', ''))}</p>")
    culprits = diag.get("culprit_ranks") or []
    if culprits:
        shown = ", ".join(str(r) for r in culprits[:32]) + (f" and {len(culprits) - 32} more" if len(culprits) > 32
                                                             else "")
        out.append(f"<p id=\"culprits\">culprit rank{'s' if len(culprits) > 1 else ''}: <b>{e(shown)}</b></p>")
    if diag.get("missing_ranks"):
        out.append(f"<p class=\"note\">no trace from ranks {e(_ranks(diag['missing_ranks']))}</p>")
    if doc.get("generated_at") is not None:
        out.append(f"<div class=\"muted\">written {e(utc(doc['generated_at']))} by fleet replay</div>")
    out.append("</header>\n")
    return "\n".join(out)


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(map(str, ranks)) if len(ranks) <= 16 else f"{len(ranks)} ranks ({ranks[0]}..{ranks[-1]})"


def _findings(diag: Mapping[str, Any]) -> str:
    findings = diag.get("findings") or []
    out = ["<section id=\"evidence\"><h2>Evidence</h2>"]
    if not findings:
        out.append("<p class=\"empty-slot\">no findings: every group's members agree</p></section>\n")
        return "".join(out)
    out.append("<table id=\"findings\"><tr><th>#</th><th>kind</th><th>group</th><th class=\"num\">seq</th>"
               "<th>ranks</th><th>waiting</th><th>detail</th></tr>")
    for n, f in enumerate(findings[:MAX_FINDINGS], 1):
        cls = " class=\"cause\"" if f.get("role") == "cause" else ""
        out.append(f"<tr{cls}><td>{n}</td><td>{e(f['kind'])}</td><td>{e(f['group'])}</td>"
                   f"<td class=\"num\">{e(f['seq'])}</td><td>{e(_ranks(f['ranks']))}</td>"
                   f"<td>{e(_ranks(f.get('waiting_ranks', [])))}</td><td>{e(f['detail'])}</td></tr>")
    out.append("</table>")
    if len(findings) > MAX_FINDINGS:
        out.append(f"<p class=\"muted\">... {len(findings) - MAX_FINDINGS} more findings, the waits the ones above "
                   "explain (fleet replay --json has them all)</p>")
    for n, f in enumerate(findings[:MAX_FINDINGS], 1):
        for st in f.get("stacks", [])[:8]:
            frames = "\n".join(f"{fr['name']} ({fr['filename']}:{fr['line']})" for fr in st["frames"][:24])
            out.append(f"<details class=\"stack\"><summary>#{n} {e(f['kind'])}: rank {e(st['rank'])} stands at "
                       f"{e(st['op'])} #{e(st['seq'])} of group {e(st['group'])} ({e(st['state'])})</summary>"
                       f"<pre class=\"mono\">{e(frames) or '(no frames in the dump)'}</pre></details>")
    out.append("</section>\n")
    return "".join(out)


def _track_h(ranks: int) -> int:
    """Pixels per track: 512 ranks must fit a few screens."""
    return 9 if ranks > 256 else 13 if ranks > 64 else 20


def _timeline(tl: Mapping[str, Any], job: Mapping[str, Any] | None, notes: Sequence[str],
              colors: Mapping[str, str]) -> str:
    out = ["<section id=\"timeline\"><h2>Timeline: collectives per rank</h2>"]
    for line in [*notes, tl.get("note", "")]:
        if line:
            out.append(f"<p class=\"note\">{e(line)}</p>")
    marks = _marks(job)
    flags = "".join(f"<span class=\"axis-flag {'incident' if 'incident' in cls else 'attempt'}\" id=\"flag-mark-{k}\" "
                    f"style=\"display:none\" title=\"{e(text)}\">{e(flag)}</span>"
                    for k, (_, cls, flag, _, text) in enumerate(marks) if flag)
    h = _track_h(len(tl["ranks"]))
    out.append("<div id=\"tl-controls\"><button id=\"tl-fit\">Fit collectives</button>"
               "<button id=\"tl-culprit\">Culprit</button>"
               + ("<button id=\"tl-whole\">Whole job</button>" if job is not None else "") +
               "<button id=\"tl-in\">Zoom in</button><button id=\"tl-out\">Zoom out</button></div>"
               "<div id=\"tl-info\" class=\"muted\"></div>"
               "<div id=\"tl-axis\"><div class=\"pad\"></div><div class=\"scale\">"
               f"<canvas id=\"tl-axis-canvas\"></canvas>{flags}</div></div>"
               f"<div id=\"tl-tracks\" data-track-h=\"{h}\" style=\"--track-h:{h}px\">")
    out.append(_tracks(tl))
    out.append("<svg id=\"tl-markers\" width=\"0\" height=\"0\">")
    for k, (t, cls, _, attempt, text) in enumerate(marks):
        out.append(f"<g class=\"marker {cls}\" id=\"mark-{k}\" data-t=\"{t}\" data-attempt=\"{attempt}\">"
                   f"<line class=\"vis\"/><line class=\"hit\"/><title>{e(text)}</title></g>")
    out.append("</svg></div>"
               f"<noscript><p class=\"note\">The timeline needs JavaScript: {len(tl['ranks'])} ranks, "
               f"{tl['cells']} collectives.</p></noscript>")
    legend = [f"<span><span class=\"sw\" style=\"background:{e(c)}\"></span>{e(op)}</span>"
              for op, c in colors.items()]
    legend += ["<span><span class=\"sw waiting\" style=\"background:#4e79a7\"></span>still waiting in it</span>",
               "<span><span class=\"sw front\"></span>a front (where a rank stands; a large job)</span>",
               "<span><span class=\"sw missing\"></span>culprit: never entered it, its peers wait</span>",
               "<span><span class=\"sw entered\"></span>culprit: entered it wrongly (or stuck in it)</span>",
               "<span><span class=\"sw incident\"></span>incident</span>",
               "<span><span class=\"sw attempt\"></span>attempt start / restart</span>"]
    out.append(f"<div class=\"legend\" id=\"legend\">{''.join(legend)}</div></section>\n")
    return "".join(out)


def _tracks(tl: Mapping[str, Any]) -> str:
    """One ``.track[data-rank]`` per rank: its label, a canvas lane the script draws, and
    the SVG rects of its highlights (placed by the script)."""
    groups = dict((g, d) for g, d in tl["groups"])
    by_rank: dict[int, list[tuple[int, Mapping[str, Any]]]] = {}
    for k, hl in enumerate(tl["highlights"]):
        by_rank.setdefault(hl["rank"], []).append((k, hl))
    absent, nodes = set(tl["absent"]), tl["nodes"]
    out = []
    for i, r in enumerate(tl["ranks"]):
        cls = "track" + (" is-culprit" if r in by_rank else "") + (" absent" if r in absent else "")
        label = f"rank {r}" + (f" \u00b7 {nodes[str(r)]}" if str(r) in nodes else "") + \
            (" (no trace)" if r in absent else "")
        rects = []
        for k, hl in by_rank.get(r, ()):
            group = hl["group"] + (f" ({groups[hl['group']]})" if groups.get(hl["group"]) not in (None, "", hl["group"])
                                   else "")
            did = "never entered" if hl["kind"] == "missing" else "entered"
            fill = " fill=\"url(#fleet-hatch)\"" if hl["kind"] == "missing" else ""
            rects.append(f"<rect class=\"culprit {e(hl['kind'])}\" data-h=\"{k}\" data-rank=\"{r}\" "
                         f"data-seq=\"{e(hl['seq'])}\" data-group=\"{e(hl['group'])}\"{fill}><title>rank {r} {did} "
                         f"seq {e(hl['seq'])} of group {e(group)} ({e(hl['finding'])}): {e(hl['detail'])}"
                         "</title></rect>")
        overlay = f"<svg class=\"ov\">{''.join(rects)}</svg>" if rects else ""
        out.append(f"<div class=\"{cls}\" data-rank=\"{r}\"><span class=\"tl-label\" title=\"{e(label)}\">{e(label)}"
                   f"</span><div class=\"lane\" data-i=\"{i}\"><canvas></canvas>{overlay}</div></div>")
    return "".join(out)


def _marks(job: Mapping[str, Any] | None) -> list[tuple[float, str, str, int, str]]:
    """(ms, classes, axis flag, attempt, hover text) of each attempt boundary and incident."""
    if job is None:
        return []
    out = []
    for a in job["attempts"]:
        n = a["number"]
        if a["start_ms"] is not None:
            restored = f", restored from step {a['restored_step']}" if a["restored_step"] else ""
            out.append((a["start_ms"], "attempt restart" if n > 1 else "attempt", f"attempt {n}", n,
                        f"attempt {n} started{restored}" + (" (a restart)" if n > 1 else "")))
        if a["end_ms"] is not None:
            out.append((a["end_ms"], "attempt-end", "", n,
                        f"attempt {n} ended {a['state']}" + (f": {a['reason']}" if a["reason"] else "")))
    for i in job["incidents"]:
        if i["at_ms"] is not None:
            who = (f" rank {i['rank']}" if i["rank"] is not None and i["rank"] >= 0 else "") + \
                (f" on {i['node']}" if i["node"] else "")
            out.append((i["at_ms"], "incident", i["kind"], i["attempt"],
                        f"incident (attempt {i['attempt']}): {i['kind']}{who} by {i['detector']}: {i['evidence']}"))
    return out


def _job_parts(job: Mapping[str, Any] | None) -> str:
    if job is None:
        slot = f"<p class=\"empty-slot\">{e(NOT_A_JOB)}</p>"
        return "".join(f"<section id=\"{sid}\"><h2>{name}</h2>{slot}</section>\n" for sid, name in
                       (("incidents", "Incidents and restarts"), ("loss", "Loss"), ("lost-time", "Lost time")))
    return _incidents(job) + _loss(job) + _lost_time(job)


def _incidents(job: Mapping[str, Any]) -> str:
    out = ["<section id=\"incidents\"><h2>Incidents and restarts</h2>"]
    if job["incidents"]:
        out.append("<table id=\"incident-table\"><tr><th>attempt</th><th>detected</th><th>kind</th><th>rank</th>"
                   "<th>node</th><th>detector</th><th>evidence</th></tr>")
        for i in job["incidents"]:
            how = " (observed only)" if i["observed"] else ""
            rank = "" if i["rank"] is None or i["rank"] < 0 else i["rank"]
            out.append(f"<tr class=\"incident\"><td>{e(i['attempt'])}</td><td>{e(utc(i['detected_at']))}</td>"
                       f"<td>{e(i['kind'])}{e(how)}</td><td>{e(rank)}</td><td>{e(i['node'])}</td>"
                       f"<td>{e(i['detector'])}</td><td>{e(i['evidence'])}</td></tr>")
        out.append("</table>")
    else:
        out.append("<p class=\"empty-slot\">no incidents recorded</p>")
    out.append("<table id=\"attempt-table\"><tr><th>attempt</th><th>state</th><th>restored from</th>"
               "<th class=\"num\">wall s</th><th>reason</th></tr>")
    for a in job["attempts"]:
        restored = f"step {a['restored_step']}" if a["restored_step"] else "scratch"
        out.append(f"<tr class=\"attempt\"><td>{e(a['number'])}</td><td>{e(a['state'])}</td><td>{e(restored)}</td>"
                   f"<td class=\"num\">{_num(a['wall_s'])}</td><td>{e(a['reason'])}</td></tr>")
    out.append("</table></section>\n")
    return "".join(out)


def _num(x: float | None) -> str:
    """Seconds to a precision that shows a short test job's milliseconds and a long job's tenths."""
    if x is None:
        return "-"
    return f"{x:,.{3 if abs(x) < 10 else 2 if abs(x) < 100 else 1}f}"


def _loss(job: Mapping[str, Any]) -> str:
    series = [(s["attempt"], [(p[0], p[1]) for p in s["points"] if p[1] is not None]) for s in job["loss"]]
    series = [(n, pts) for n, pts in series if pts]
    skipped = sum(1 for s in job["loss"] for p in s["points"] if p[1] is None)
    out = ["<section id=\"loss\"><h2>Loss</h2>"]
    if not series:
        out.append("<p class=\"empty-slot\">no step losses recorded</p></section>\n")
        return "".join(out)
    w, h, left, right, top, bottom = 760, 220, 58, 12, 10, 26
    steps = [p[0] for _, pts in series for p in pts]
    vals = [p[1] for _, pts in series for p in pts]
    s0, s1 = min(steps), max(steps)
    v0, v1 = min(vals), max(vals)
    if s1 == s0:
        s1 = s0 + 1
    if v1 == v0:
        v0, v1 = v0 - 0.5, v1 + 0.5

    def x(s: float) -> float:
        return left + (s - s0) / (s1 - s0) * (w - left - right)

    def y(v: float) -> float:
        return top + (v1 - v) / (v1 - v0) * (h - top - bottom)

    svg = [f"<svg class=\"chart loss-curve\" id=\"loss-curve\" viewBox=\"0 0 {w} {h}\" width=\"{w}\" height=\"{h}\" "
           "role=\"img\" aria-label=\"loss per step\">"]
    for k in range(5):
        v = v0 + (v1 - v0) * k / 4
        svg.append(f"<line class=\"grid\" x1=\"{left}\" x2=\"{w - right}\" y1=\"{y(v):.1f}\" y2=\"{y(v):.1f}\"/>"
                   f"<text x=\"{left - 6}\" y=\"{y(v) + 4:.1f}\" text-anchor=\"end\">{v:.4g}</text>")
    for s in sorted({round(s0 + (s1 - s0) * k / 5) for k in range(6)}):  # steps are whole numbers
        svg.append(f"<text x=\"{x(s):.1f}\" y=\"{h - 8}\" text-anchor=\"middle\">{s}</text>")
    restored = {a["number"]: a["restored_step"] for a in job["attempts"]}
    for i, (n, pts) in enumerate(series):
        color = ATTEMPT_COLORS[i % len(ATTEMPT_COLORS)]
        if i:
            rs = restored.get(n)
            svg.append(f"<line class=\"restart-line\" data-attempt=\"{n}\" x1=\"{x(pts[0][0]):.1f}\" "
                       f"x2=\"{x(pts[0][0]):.1f}\" y1=\"{top}\" y2=\"{h - bottom}\"><title>attempt {n} starts at "
                       f"step {pts[0][0]}{f' (restored from step {rs})' if rs else ''}</title></line>")
        thin = pts if len(pts) <= MAX_LOSS_POINTS else pts[::math.ceil(len(pts) / MAX_LOSS_POINTS)] + [pts[-1]]
        coords = " ".join(f"{x(s):.1f},{y(v):.1f}" for s, v in thin)
        svg.append(f"<polyline class=\"loss\" data-attempt=\"{n}\" stroke=\"{color}\" points=\"{coords}\">"
                   f"<title>attempt {n}: steps {pts[0][0]}..{pts[-1][0]}, loss {pts[0][1]:.4g} to "
                   f"{pts[-1][1]:.4g}</title></polyline>")
    svg.append("</svg>")
    out.append("".join(svg))
    key = " ".join(f"<span><span class=\"sw\" style=\"background:{ATTEMPT_COLORS[i % len(ATTEMPT_COLORS)]}\"></span>"
                   f"attempt {n}</span>" for i, (n, _) in enumerate(series))
    out.append(f"<div class=\"legend\">{key}<span><span class=\"sw attempt\"></span>restart</span></div>")
    if skipped:
        out.append(f"<p class=\"note\">{skipped} non-finite loss value(s) (NaN or inf) are not drawn</p>")
    out.append("</section>\n")
    return "".join(out)


def _lost_time(job: Mapping[str, Any]) -> str:
    wall = job["wall_s"] or 0.0
    values = {"productive_s": job["productive_s"] or 0.0, **job["lost_s"]}
    out = ["<section id=\"lost-time\"><h2>Lost time</h2>"]
    ettr = f"ETTR {job['ettr']:.1%}" if job["ettr"] is not None else "ETTR - (no step records)"
    out.append(f"<p>wall {_num(wall)} s, productive {_num(job['productive_s'])} s: {e(ettr)}</p>")
    w, h = 760, 30
    total = sum(max(values.get(k, 0.0), 0.0) for k, _, _ in LOST_PARTS) or 1.0
    svg = [f"<svg class=\"chart lost-bar\" id=\"lost-bar\" viewBox=\"0 0 {w} {h}\" width=\"{w}\" height=\"{h}\" "
           "role=\"img\" aria-label=\"where the wall time went\">"]
    x = 0.0
    for key, color, name in LOST_PARTS:
        v = max(values.get(key, 0.0), 0.0)
        width = v / total * w
        if width > 0:
            svg.append(f"<rect class=\"part\" data-part=\"{key}\" x=\"{x:.2f}\" y=\"0\" width=\"{width:.2f}\" "
                       f"height=\"{h}\" fill=\"{color}\"><title>{name}: {_num(v)} s ({v / total:.1%})</title></rect>")
        x += width
    svg.append("</svg>")
    out.append("".join(svg))
    rows = "".join(f"<tr><td><span class=\"sw\" style=\"background:{c}\"></span>{n}</td>"
                   f"<td class=\"num\">{_num(values.get(k, 0.0))}</td>"
                   f"<td class=\"num\">{max(values.get(k, 0.0), 0.0) / total:.1%}</td></tr>" for k, c, n in LOST_PARTS)
    out.append(f"<table id=\"lost-table\" class=\"legend-table\"><tr><th>where</th><th class=\"num\">s</th>"
               f"<th class=\"num\">share</th></tr>{rows}</table></section>\n")
    return "".join(out)
