"""The HTML incident report of `fleet replay --html` at 64, 512 and 2048 ranks: how long it
takes to render and to open in headless Chromium (Debian's /usr/bin/chromium).

    python bench/replay_html.py [--ranks 64,512,2048] [--entries 300] [--runs 3] [--keep DIR]

Per size: synthetic dumps of a hang (``bench.fr_dumps``, ``--entries`` per rank), read
and diagnosed once (``load_s``, what any `fleet replay` of them costs), then the report
built and rendered (``render_s``: ``replay_html_data.timeline`` and ``render_html``, what
``--html`` adds), its size, and the time from ``page.goto`` to the page's
``window.fleetReady`` (``open_s``, median of ``--runs`` fresh loads; ``ready_ms``: the
page's own navigation start to ready), checking that the page has one track per rank and
the culprit's highlight, and that it logged no console error. The last line is one JSON
object: per size ``render_s_<R>``, ``open_s_<R>``, ``ready_ms_<R>``, ``mb_<R>``,
``load_s_<R>``, and ``ok`` (every page complete and clean).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.fr_dumps import generate  # noqa: E402
from fleet.controlplane.diagnosis import diagnose, load_traces  # noqa: E402
from fleet.controlplane.replay_html import render_html  # noqa: E402
from fleet.controlplane.replay_html_data import timeline  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run", "--disable-quic"]


def render(folder: Path) -> tuple[str, float, float, int]:
    """(the page, load and diagnose seconds, render seconds, the culprit)."""
    t = time.monotonic()
    traces = load_traces(folder)
    diag = diagnose(traces).to_json()
    load_s = time.monotonic() - t
    t = time.monotonic()
    page = render_html({"source": f"dumps:{folder}", "diagnosis": diag, "timeline": timeline(traces, diag),
                        "job": None})
    return page, load_s, time.monotonic() - t, diag["culprit_ranks"][0]


def open_times(page, path: Path, ranks: int, culprit: int, runs: int) -> tuple[float, float, bool]:
    """(median goto-to-ready seconds, the last load's in-page ms, whether every load was clean)."""
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type in ("error", "warning") else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    times, ready_ms, ok = [], 0.0, True
    for _ in range(runs):
        page.goto("about:blank")
        t = time.monotonic()
        page.goto(path.as_uri())
        page.wait_for_function("window.fleetReady === true", timeout=60_000)
        times.append(time.monotonic() - t)
        ready_ms = page.evaluate("window.fleetReadyMs")
        ok &= page.evaluate("document.querySelectorAll('.track[data-rank]').length") == ranks
        ok &= page.evaluate(f"document.querySelectorAll('.culprit[data-rank=\"{culprit}\"]').length") >= 1
    return statistics.median(times), ready_ms, ok and not errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="64,512,2048", help="comma-separated world sizes")
    parser.add_argument("--entries", type=int, default=300, help="flight-recorder entries per rank")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--keep", type=Path, default=None, help="keep the HTML files in this folder")
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    work = Path(tempfile.mkdtemp(prefix="fleet-replay-html-"))
    result: dict[str, object] = {"entries": args.entries}
    ok = True
    try:
        with sync_playwright() as pw:
            ctx = pw.chromium.launch_persistent_context(str(work / "profile"), executable_path=CHROMIUM,
                                                        headless=True, args=ARGS,
                                                        viewport={"width": 1400, "height": 900})
            try:
                page = ctx.pages[0] if ctx.pages else ctx.new_page()
                for ranks in (int(r) for r in args.ranks.split(",")):
                    folder = work / f"dumps{ranks}"
                    generate(folder, ranks, args.entries, "hang", workers=2)
                    html, load_s, render_s, culprit = render(folder)
                    out = (args.keep or work) / f"replay_{ranks}.html"
                    out.parent.mkdir(parents=True, exist_ok=True)
                    out.write_text(html)
                    open_s, ready_ms, clean = open_times(page, out, ranks, culprit, args.runs)
                    ok &= clean
                    mb = out.stat().st_size / 1e6
                    print(f"{ranks} ranks: load+diagnose {load_s:.2f} s, render {render_s:.2f} s, {mb:.1f} MB, "
                          f"open {open_s:.2f} s (in page {ready_ms / 1000:.2f} s), clean: {clean}", flush=True)
                    result.update({f"load_s_{ranks}": round(load_s, 3), f"render_s_{ranks}": round(render_s, 3),
                                   f"mb_{ranks}": round(mb, 2), f"open_s_{ranks}": round(open_s, 3),
                                   f"ready_ms_{ranks}": round(ready_ms)})
                    shutil.rmtree(folder, ignore_errors=True)
            finally:
                ctx.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result["ok"] = ok
    print(json.dumps(result))


if __name__ == "__main__":
    main()
