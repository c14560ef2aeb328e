"""The inline style sheet and script of the HTML incident report (``controlplane.replay_html``).

The script reads the ``fleet-data`` JSON blob (``controlplane.replay_html_data``'s
sections), builds one ``.track[data-rank]`` element per rank with a canvas lane (a DOM
element per track, a canvas for its collectives: thousands of SVG rects per rank would
not open in seconds), overlays each culprit's highlight as an SVG rect
(``.culprit[data-rank][data-seq]``, hatched where the rank never entered the collective
its peers wait in) and the incidents and attempt boundaries as ``.marker`` lines on the
same time axis, then sets ``window.fleetReady``. Ctrl+wheel (or the wheel over the axis)
zooms, dragging pans, hovering a lane tells what is under the pointer.

No external resource of any kind: the page must open from a file, offline.
"""

from __future__ import annotations

#: Palette for op names, assigned in sorted op order (the legend and the lanes share it).
PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7", "#9c755f",
           "#17becf", "#bcbd22", "#7f7f7f", "#aec7e8")

CSS = """
:root { --fg: #1d232b; --muted: #5d6875; --line: #d8dde3; --bad: #c62828; --warn: #ef6c00; --ok: #2e7d32;
        --attempt: #1565c0; --label-w: 150px; }
* { box-sizing: border-box; }
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, Helvetica, Arial, sans-serif; color: var(--fg);
       margin: 0; padding: 16px 24px 48px; background: #fff; }
h1 { font-size: 20px; margin: 0 0 4px; }
h2 { font-size: 16px; margin: 28px 0 8px; border-bottom: 1px solid var(--line); padding-bottom: 4px; }
code, .mono { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; font-size: 12.5px; }
.muted { color: var(--muted); }
.verdict { display: inline-block; padding: 2px 10px; border-radius: 4px; color: #fff; font-weight: 700;
           letter-spacing: .04em; margin-right: 8px; }
.v-hang, .v-mismatch { background: var(--bad); } .v-straggler { background: var(--warn); }
.v-ok { background: var(--ok); } .v-empty { background: #78909c; }
.summary { font-size: 15px; margin: 8px 0; }
.note { background: #fff8e1; border-left: 3px solid #ffb300; padding: 6px 10px; margin: 8px 0; }
.empty-slot { color: var(--muted); font-style: italic; }
table { border-collapse: collapse; margin: 6px 0; }
th, td { text-align: left; padding: 3px 10px 3px 0; vertical-align: top; border-bottom: 1px solid #eef0f3; }
th { font-weight: 600; color: var(--muted); }
td.num, th.num { text-align: right; }
tr.cause td:first-child { border-left: 3px solid var(--bad); padding-left: 6px; }
details { margin: 4px 0 4px 12px; }
pre { margin: 2px 0; white-space: pre-wrap; }
#tl-controls button { font: inherit; font-size: 13px; margin-right: 4px; padding: 2px 10px; cursor: pointer; }
#tl-info { min-height: 1.5em; margin: 6px 0; font-size: 12.5px; }
#tl-axis { display: flex; height: 34px; position: relative; border-bottom: 1px solid var(--line); }
#tl-axis .pad { width: var(--label-w); flex: none; }
#tl-axis .scale { position: relative; flex: 1; cursor: ew-resize; }
#tl-axis canvas { position: absolute; left: 0; top: 0; width: 100%; height: 100%; }
#tl-tracks { position: relative; max-height: 72vh; overflow-y: auto; overflow-x: hidden;
             border-bottom: 1px solid var(--line); }
.track { display: flex; height: var(--track-h, 18px); }
.track:nth-child(even) { background: #f7f8fa; }
.track .tl-label { width: var(--label-w); flex: none; font-size: min(11px, calc(var(--track-h, 18px) + 1px));
                   line-height: var(--track-h, 18px);
                   overflow: hidden; white-space: nowrap; text-overflow: ellipsis; padding-right: 6px; }
.track.is-culprit .tl-label { color: var(--bad); font-weight: 700; }
.track.absent .tl-label { color: var(--muted); font-style: italic; }
.lane { position: relative; flex: 1; cursor: grab; }
.lane canvas { position: absolute; left: 0; top: 0; width: 100%; height: 100%; }
svg.ov { position: absolute; left: 0; top: 0; width: 100%; height: 100%; overflow: visible; pointer-events: none; }
svg.ov rect { pointer-events: all; }
rect.culprit { stroke: var(--bad); stroke-width: 2; }
rect.culprit.entered { fill: rgba(198, 40, 40, .25); }
#tl-markers { position: absolute; top: 0; left: var(--label-w); pointer-events: none; overflow: visible; }
.marker line { stroke-width: 1.5; }
.marker .hit { stroke: transparent; stroke-width: 8; pointer-events: stroke; }
.marker.incident line.vis { stroke: var(--bad); }
.marker.attempt line.vis { stroke: var(--attempt); stroke-dasharray: 5 3; }
.marker.attempt-end line.vis { stroke: var(--attempt); stroke-dasharray: 2 3; opacity: .6; }
.axis-flag { position: absolute; top: 0; font-size: 10.5px; white-space: nowrap; transform: translateX(-50%);
             padding: 0 3px; border-radius: 2px; color: #fff; pointer-events: auto; }
.axis-flag.incident { background: var(--bad); } .axis-flag.attempt { background: var(--attempt); }
.legend { display: flex; flex-wrap: wrap; gap: 6px 18px; font-size: 12.5px; margin: 8px 0; }
span.sw { display: inline-block; width: 22px; height: 11px; vertical-align: -1px; margin-right: 5px;
                  border: 1px solid rgba(0,0,0,.15); }
.sw.waiting { opacity: .4; } .sw.front { background: #fff; border: 2px solid #555 !important; }
.sw.missing { background: repeating-linear-gradient(45deg, var(--bad) 0 2px, transparent 2px 5px);
              border: 1px solid var(--bad) !important; }
.sw.entered { background: rgba(198,40,40,.25); border: 2px solid var(--bad) !important; }
.sw.incident { background: var(--bad); width: 3px !important; }
.sw.attempt { background: var(--attempt); width: 3px !important; }
svg.chart text { font-size: 11px; fill: var(--muted); }
svg.chart .grid { stroke: #eceff1; }
svg.chart polyline.loss { fill: none; stroke-width: 1.6; }
svg.chart line.restart-line { stroke: var(--attempt); stroke-dasharray: 5 3; }
"""

SCRIPT = r"""
(function () {
  "use strict";
  var D = JSON.parse(document.getElementById("fleet-data").textContent);
  var T = D.timeline, J = D.job, COLORS = D.colors;
  var WAITING = 2, FRONT = 4, MEASURED = 8, W = T.cell.length;
  var tracksEl = document.getElementById("tl-tracks");
  var axisScale = document.querySelector("#tl-axis .scale");
  var axisCv = document.getElementById("tl-axis-canvas");
  var info = document.getElementById("tl-info");
  var n = T.ranks.length;
  var trackH = +tracksEl.getAttribute("data-track-h");
  var dpr = window.devicePixelRatio || 1;
  var sigColor = T.sigs.map(function (s) { return COLORS[s.split(" ")[0]] || "#888"; });
  T.ranks.forEach(function (r) {  // start and duration come in whole µs: ms from here on
    var a = T.tracks[String(r)];
    for (var k = 0; k < a.length; k += W) { a[k] /= 1000; a[k + 1] /= 1000; }
  });

  // the page holds one .track per rank (a canvas lane, the culprits' SVG rects) and the
  // markers; the script draws the lanes and places the rest on the time axis
  var lanes = Array.prototype.slice.call(tracksEl.querySelectorAll(".track > .lane"));
  var canvases = lanes.map(function (l) { return l.querySelector("canvas"); });
  var overlays = lanes.map(function (l) { return l.querySelector("svg.ov"); });
  var marks = Array.prototype.map.call(document.querySelectorAll("#tl-markers .marker"), function (g) {
    return {t: +g.getAttribute("data-t"), el: g, attempt: +g.getAttribute("data-attempt"),
            incident: g.classList.contains("incident"),
            flagEl: document.getElementById("flag-" + g.getAttribute("id"))};
  });
  var mk = document.getElementById("tl-markers");

  // the view: [a, b] in ms from t0
  var hi = Math.max(T.last_ms, 1e-3), firstCell = Infinity;
  T.ranks.forEach(function (r) { var a = T.tracks[String(r)]; if (a.length && a[0] < firstCell) firstCell = a[0]; });
  if (firstCell === Infinity) firstCell = 0;
  // the shown attempt's incidents join the first view unless they would squash the collectives
  var shown = J ? J.attempt_shown : null, reach = hi + 3 * (hi - firstCell);
  marks.forEach(function (m) {
    if (m.incident && (shown === null || m.attempt === shown) && m.t > hi && m.t <= reach) hi = m.t;
  });
  var fit = {a: firstCell - (hi - firstCell) * 0.02 - 1e-3, b: hi + (hi - firstCell) * 0.04 + 1e-3};
  var whole = {a: fit.a, b: fit.b};
  marks.forEach(function (m) { whole.a = Math.min(whole.a, m.t); whole.b = Math.max(whole.b, m.t); });
  var pad = (whole.b - whole.a) * 0.02;
  whole.a -= pad; whole.b += pad;
  var view = {a: fit.a, b: fit.b};

  var groupIndex = Object.create(null);
  T.groups.forEach(function (g, j) { groupIndex[g[0]] = j; });
  function groupName(g) {
    var desc = T.groups[groupIndex[g]] ? T.groups[groupIndex[g]][1] : "";
    return g + (desc && desc !== g ? " (" + desc + ")" : "");
  }
  function laneWidth() { return lanes.length ? lanes[0].clientWidth : axisScale.clientWidth; }
  function sx(t, w) { return (t - view.a) / (view.b - view.a) * w; }
  function size(cv, w, h) {
    var pw = Math.max(1, Math.round(w * dpr)), ph = Math.max(1, Math.round(h * dpr));
    if (cv.width !== pw || cv.height !== ph) { cv.width = pw; cv.height = ph; }
    var ctx = cv.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, w, h);
    return ctx;
  }
  // a lane has one row per group the rank is in (group order), so groups never overlap
  var laneRows = T.ranks.map(function (r) {
    var a = T.tracks[String(r)], seen = {}, list = [], k;
    for (k = 0; k < a.length; k += W) if (!seen[a[k + 2]]) { seen[a[k + 2]] = true; list.push(a[k + 2]); }
    list.sort(function (x, y) { return x - y; });
    var row = {};
    list.forEach(function (g, j) { row[g] = j; });
    return {row: row, count: Math.max(list.length, 1)};
  });
  function rowBox(i, gi, h) {
    var lr = laneRows[i], rh = (h - 2) / lr.count, j = lr.row[gi];
    if (j === undefined) return [1, h - 2];
    return [1 + j * rh, Math.max(rh - (lr.count > 1 ? 1 : 0), 1)];
  }
  function drawTrack(i, w) {
    var a = T.tracks[String(T.ranks[i])], ctx = size(canvases[i], w, trackH), h = trackH;
    var k, s, x0, x1, flags, box;
    for (k = 0; k < a.length; k += W) {
      s = a[k]; x0 = sx(s, w); x1 = sx(s + a[k + 1], w);
      if (x1 < -1 || x0 > w + 1) continue;
      flags = a[k + 5];
      box = rowBox(i, a[k + 2], h);
      ctx.fillStyle = sigColor[a[k + 4]];
      if (flags & WAITING) {
        ctx.globalAlpha = 0.35;
        ctx.fillRect(x0, box[0], Math.max(x1 - x0, 1), box[1]);
        ctx.globalAlpha = 1;
        ctx.fillRect(x0, box[0], 2, box[1]);
      } else {
        // a pixel apart: back-to-back ops of one group stay distinguishable
        ctx.fillRect(x0, box[0], Math.max(x1 - x0 - 1, 1), box[1]);
      }
      if (flags & FRONT) {
        ctx.strokeStyle = "#333";
        ctx.strokeRect(x0 + 0.5, box[0] + 0.5, Math.max(x1 - x0, 3) - 1, Math.max(box[1] - 1, 1));
      }
    }
    var ov = overlays[i];
    if (ov) {
      ov.querySelectorAll("rect.culprit").forEach(function (rect) {
        var hl = T.highlights[+rect.getAttribute("data-h")];
        var r0 = Math.max(sx(hl.start_ms, w), -2), r1 = Math.min(sx(hl.end_ms, w), w + 2);
        var b = rowBox(i, groupIndex[hl.group], h);
        rect.setAttribute("x", r0);
        rect.setAttribute("y", b[0]);
        rect.setAttribute("width", Math.max(r1 - r0, 4));
        rect.setAttribute("height", Math.max(b[1], 2));
      });
    }
  }
  function niceStep(span) {
    var raw = span / 8, p = Math.pow(10, Math.floor(Math.log10(raw))), m = raw / p;
    return p * (m < 1.5 ? 1 : m < 3.5 ? 2 : m < 7.5 ? 5 : 10);
  }
  function fmt(ms, step) {
    if (step >= 1000) return (ms / 1000).toFixed(step >= 10000 ? 0 : 1) + " s";
    if (step >= 1) return ms.toFixed(0) + " ms";
    return ms.toFixed(Math.min(3, Math.ceil(-Math.log10(step)))) + " ms";
  }
  function drawAxis(w) {
    var ctx = size(axisCv, w, 34), step = niceStep(view.b - view.a), t;
    ctx.fillStyle = "#5d6875"; ctx.strokeStyle = "#c5ccd3"; ctx.font = "10.5px system-ui, sans-serif";
    for (t = Math.ceil(view.a / step) * step; t <= view.b; t += step) {
      var x = Math.round(sx(t, w)) + 0.5;
      ctx.beginPath(); ctx.moveTo(x, 26); ctx.lineTo(x, 34); ctx.stroke();
      ctx.fillText(fmt(t, step), x + 2, 32);
    }
  }
  function drawMarks(w) {
    var h = tracksEl.scrollHeight;
    mk.setAttribute("width", w); mk.setAttribute("height", h);
    marks.forEach(function (m) {
      var x = sx(m.t, w), inside = x >= 0 && x <= w;
      m.el.style.display = inside ? "" : "none";
      m.el.querySelectorAll("line").forEach(function (l) {
        l.setAttribute("x1", x); l.setAttribute("x2", x); l.setAttribute("y1", 0); l.setAttribute("y2", h);
      });
      if (m.flagEl) { m.flagEl.style.display = inside ? "" : "none"; m.flagEl.style.left = x + "px"; }
    });
  }
  function draw() {
    var w = laneWidth();
    for (var i = 0; i < n; i++) drawTrack(i, w);
    drawAxis(axisScale.clientWidth);
    drawMarks(w);
  }
  var pending = false;
  function redraw() {
    if (pending) return;
    pending = true;
    window.requestAnimationFrame(function () { pending = false; draw(); });
  }
  function setView(a, b) {
    var span = Math.max(b - a, 1e-4);
    view.a = a; view.b = a + span;
    redraw();
  }
  function zoomAt(x, w, factor) {
    var t = view.a + x / w * (view.b - view.a);
    setView(t - (t - view.a) * factor, t + (view.b - t) * factor);
  }
  function onWheel(e, always) {
    if (!always && !(e.ctrlKey || e.metaKey || e.altKey)) return;
    e.preventDefault();
    var box = e.currentTarget.getBoundingClientRect();
    zoomAt(e.clientX - box.left, box.width, e.deltaY > 0 ? 1.25 : 0.8);
  }
  axisScale.addEventListener("wheel", function (e) { onWheel(e, true); }, {passive: false});
  lanes.forEach(function (lane) {
    lane.addEventListener("wheel", function (e) { onWheel(e, false); }, {passive: false});
  });
  var drag = null;
  tracksEl.addEventListener("mousedown", function (e) {
    if (e.button === 0 && e.target.closest(".lane")) drag = {x: e.clientX, a: view.a, b: view.b};
  });
  window.addEventListener("mouseup", function () { drag = null; });
  window.addEventListener("mousemove", function (e) {
    if (!drag) return;
    var dt = (e.clientX - drag.x) / laneWidth() * (drag.b - drag.a);
    setView(drag.a - dt, drag.b - dt);
  });
  tracksEl.addEventListener("mousemove", function (e) {
    var lane = e.target.closest ? e.target.closest(".lane") : null;
    if (!lane || drag) return;
    var i = +lane.getAttribute("data-i"), r = T.ranks[i], a = T.tracks[String(r)];
    var box = lane.getBoundingClientRect(), w = box.width, x = e.clientX - box.left;
    var t = view.a + x / w * (view.b - view.a), tol = 3 / w * (view.b - view.a), hit = -1;
    for (var k = 0; k < a.length; k += W) if (a[k] <= t + tol && a[k] + a[k + 1] >= t - tol) hit = k;
    var text = "rank " + r + " at " + fmt(t, (view.b - view.a) / 8);
    if (hit >= 0) {
      var f = a[hit + 5];
      text = "rank " + r + ": " + T.sigs[a[hit + 4]] + " \u00b7 group " + groupName(T.groups[a[hit + 2]][0]) +
        " \u00b7 seq " + a[hit + 3] + " \u00b7 entered at " + fmt(a[hit], 0.001) + " \u00b7 " +
        (f & WAITING ? "still waiting (" + fmt(a[hit + 1], 0.001) + " so far)" :
          (f & MEASURED ? "took " : "done within ") + fmt(a[hit + 1], 0.001)) +
        (f & FRONT ? " \u00b7 a front: where the rank stood, not every collective" : "");
    }
    lane.title = text;
    info.textContent = text;
  });
  tracksEl.addEventListener("dblclick", function () { setView(fit.a, fit.b); });
  function button(id, fn) { var b = document.getElementById(id); if (b) b.addEventListener("click", fn); }
  button("tl-fit", function () { setView(fit.a, fit.b); });
  button("tl-whole", function () { setView(whole.a, whole.b); });
  button("tl-in", function () { zoomAt(laneWidth() / 2, laneWidth(), 0.5); });
  button("tl-out", function () { zoomAt(laneWidth() / 2, laneWidth(), 2); });
  button("tl-culprit", function () {
    if (!T.highlights.length) return;
    var h = T.highlights[0], span = Math.max((h.end_ms - h.start_ms) * 3, (fit.b - fit.a) / 20);
    setView(h.start_ms - span / 3, h.start_ms + span * 2 / 3);
    var el = tracksEl.querySelector('.track[data-rank="' + h.rank + '"]');
    if (el) tracksEl.scrollTop = el.offsetTop - tracksEl.clientHeight / 2;
  });
  window.addEventListener("resize", redraw);
  draw();
  var t0 = new Date(T.t0_ns / 1e6);
  info.textContent = T.ranks.length + " ranks, " + T.cells + " collectives drawn; time 0 = " +
    (T.t0_ns ? t0.toISOString().replace("T", " ").replace("Z", " UTC") : "-") +
    ". Ctrl+wheel or the wheel over the axis zooms, drag pans, double-click fits.";
  document.body.setAttribute("data-ready", "1");
  window.fleetReadyMs = performance.now();  // since the navigation started: the open time
  window.fleetReady = true;
})();
"""
