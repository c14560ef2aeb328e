"""`fleet replay --html` opened in a real headless Chromium (Debian's /usr/bin/chromium,
driven by playwright): the page loads from a file:// URL with no console error, no page
error and no request beyond the file itself; its DOM holds one track per rank and the
culprit's highlight for the right rank and collective; a screenshot of each is kept in
the test-artifacts folder (``$FLEET_TEST_ARTIFACTS``, default ``.pytest_artifacts/``).

Sources: (a) dumps of a hang through the ``fleet`` command: in torch's format from
``bench.fr_dumps`` (16 ranks), and from a real gloo run (``tests.desync_scenarios``:
rank 2 never enters world collective N); (b) a job in a real SQLite store
(``tests.replay_html_job``): its incidents and restart on the time axis, its loss curve;
(c) 512 ranks of synthetic dumps (``bench.fr_dumps``): the page opens in under 5 s;
(d) a large job (collective fronts, ``bench.replay_scale``).

One browser for the module, one page reused (a page per test would leave Chromium's
spare renderer behind as a new process); at the end every process it started is gone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from fleet.controlplane.cli.main import main as cli
from fleet.controlplane.store import Store
from tests.replay_html_job import build as build_job

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = Path("/usr/bin/chromium")
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run", "--disable-quic"]
ARTIFACTS = Path(os.environ.get("FLEET_TEST_ARTIFACTS") or REPO / ".pytest_artifacts")
#: The issue's bound on opening a 512-rank report.
OPEN_512_S = 5.0
GONE_WAIT_S = 15.0


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@dataclass
class Opened:
    """A report loaded in the page, with what the page said while it loaded."""

    page: object
    seconds: float             # page.goto to window.fleetReady, seen from here
    ready_ms: float            # navigation start to fleetReady, seen by the page
    messages: list[str] = field(default_factory=list)

    def problems(self) -> list[str]:
        return [m for m in self.messages if not m.startswith(("console.log", "console.debug", "console.info"))]

    def count(self, selector: str) -> int:
        return self.page.evaluate("s => document.querySelectorAll(s).length", selector)

    def screenshot(self, name: str, selector: str | None = None) -> Path:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        path = ARTIFACTS / f"replay_html_{name}.png"
        if selector:
            self.page.locator(selector).screenshot(path=str(path))
        else:
            self.page.screenshot(path=str(path), full_page=True)
        print(f"screenshot: {path}")
        assert path.stat().st_size > 1000
        return path


class Chromium:
    def __init__(self, page: object, blank: Path) -> None:
        self.page, self.blank = page, blank
        self._handlers: list[tuple[str, object]] = []

    def reset(self) -> None:
        """Back to the blank page (its renderer stays the same), the listeners gone."""
        for event, fn in self._handlers:
            self.page.remove_listener(event, fn)
        self._handlers.clear()
        self.page.goto(self.blank.as_uri())

    def open(self, report: Path, timeout_s: float = 30.0) -> Opened:
        page = self.page
        messages: list[str] = []

        def on_console(m) -> None:
            messages.append(f"console.{m.type}: {m.text}")

        def on_error(exc) -> None:
            messages.append(f"pageerror: {exc}")

        def on_request(r) -> None:
            if not r.url.startswith(("file:", "data:", "about:")):
                messages.append(f"request: {r.url}")

        for event, fn in (("console", on_console), ("pageerror", on_error), ("request", on_request)):
            page.on(event, fn)
            self._handlers.append((event, fn))
        t = time.monotonic()
        page.goto(report.as_uri())
        page.wait_for_function("window.fleetReady === true", timeout=timeout_s * 1000)
        seconds = time.monotonic() - t
        return Opened(page, seconds, page.evaluate("window.fleetReadyMs"), messages)


@pytest.fixture(scope="module")
def chromium(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Chromium]:
    if not CHROMIUM.exists():
        pytest.fail(f"no {CHROMIUM}: bash scripts/test.sh installs Debian's chromium", pytrace=False)
    from playwright.sync_api import sync_playwright

    before = _children()
    pw = sync_playwright().start()
    started: set[int] = set()
    try:
        ctx = pw.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")), executable_path=str(CHROMIUM), headless=True,
            args=ARGS, viewport={"width": 1400, "height": 900})
        started = _children() - before
        assert started, "Chromium started no process"
        blank = tmp_path_factory.mktemp("blank") / "blank.html"
        blank.write_text("<!DOCTYPE html><title>blank</title>")
        page = ctx.pages[0] if ctx.pages else ctx.new_page()
        page.goto(blank.as_uri())  # the renderer for file:// pages, before any test counts processes
        yield Chromium(page, blank)
        started |= _children() - before
        ctx.close()
    finally:
        pw.stop()
        deadline = time.monotonic() + GONE_WAIT_S
        while time.monotonic() < deadline and any(_alive(p) for p in started):
            time.sleep(0.1)
        left = sorted(p for p in started if _alive(p))
        for pid in left:
            try:
                psutil.Process(pid).kill()
            except psutil.Error:
                pass
        assert not left, f"Chromium processes left running: {left}"


@pytest.fixture
def loaded(chromium: Chromium) -> Iterator[Chromium]:
    """The module's page, back on a blank page after the test (its renderer stays the same)."""
    yield chromium
    chromium.reset()


def check_loaded(opened: Opened, ranks: int) -> None:
    assert opened.problems() == []
    assert opened.count(".track[data-rank]") == ranks
    assert opened.page.evaluate(
        "[...document.querySelectorAll('.track[data-rank]')].map(t => +t.dataset.rank).join()"
    ) == ",".join(str(r) for r in range(ranks))
    assert opened.page.evaluate("document.querySelector('#verdict .verdict').textContent") != ""


def culprit_box(opened: Opened, rank: int, seq: int) -> dict:
    sel = f'.culprit[data-rank="{rank}"][data-seq="{seq}"]'
    assert opened.count(sel) >= 1, opened.page.evaluate(
        "[...document.querySelectorAll('.culprit')].map(e => e.outerHTML.slice(0, 200))")
    box = opened.page.locator(sel).first.bounding_box()
    assert box and box["width"] >= 4 and box["height"] >= 2, box
    return box


def replay_dumps_html(folder: Path, out: Path) -> dict:
    """``fleet replay --dumps FOLDER --html OUT --json`` as a command: its verdict."""
    proc = subprocess.run([sys.executable, "-m", "fleet.controlplane.cli.main", "replay", "--dumps", str(folder),
                           "--html", str(out), "--json"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert f"wrote {out}" in proc.stderr.replace("\n", "")  # stdout stays the one JSON document
    return json.loads(proc.stdout)


def check_hang_page(opened: Opened, ranks: int, culprit: int, seq: int) -> None:
    check_loaded(opened, ranks)
    culprit_box(opened, culprit, seq)
    assert opened.count(".culprit") == 1 and opened.count(".track.is-culprit") == 1
    assert opened.page.evaluate("document.querySelector('.track.is-culprit').dataset.rank") == str(culprit)
    assert opened.page.evaluate("document.querySelector('.culprit title').textContent").startswith(
        f"rank {culprit} never entered seq {seq} of group")
    # hovering a lane says what is under the pointer
    lane = opened.page.locator('.track[data-rank="1"] .lane').bounding_box()
    opened.page.mouse.move(lane["x"] + lane["width"] * 0.3, lane["y"] + lane["height"] / 2)
    assert opened.page.evaluate("document.getElementById('tl-info').textContent").startswith("rank 1")


def test_dumps_of_a_hang(loaded: Chromium, tmp_path: Path) -> None:
    """Dumps in torch's format (bench.fr_dumps: an MoE job on 16 ranks, rings wrapped):
    rank 3 never entered world all_reduce N."""
    from bench.fr_dumps import generate

    plant = generate(tmp_path / "dumps", 16, 400, "hang", culprit=3)
    verdict = replay_dumps_html(tmp_path / "dumps", tmp_path / "hang.html")
    assert (verdict["verdict"], verdict["culprit_ranks"]) == ("hang", [3])
    opened = loaded.open(tmp_path / "hang.html")
    check_hang_page(opened, 16, 3, plant.seq)
    opened.screenshot("dumps_hang")
    assert opened.problems() == []


def test_dumps_of_a_real_gloo_hang(loaded: Chromium, tmp_path: Path) -> None:
    """Four real gloo ranks (tests.desync_scenarios "skip"): rank 2 never enters world
    collective N, the others wait in it and dump."""
    from tests.desync_scenarios import CASES, generate

    scenario = generate("skip", tmp_path / "dumps", timeout_s=150)
    verdict = replay_dumps_html(scenario.outdir, tmp_path / "gloo.html")
    (culprit,) = CASES["skip"].culprit_ranks
    # what the page must show: the engine's verdict on these dumps (tests/integration/test_desync_dumps.py)
    assert (verdict["verdict"], verdict["culprit_ranks"]) == ("hang", [culprit]), json.dumps(verdict)[:3000]
    opened = loaded.open(tmp_path / "gloo.html")
    check_hang_page(opened, scenario.world_size, culprit, scenario.seq)
    opened.screenshot("gloo_hang")
    assert opened.problems() == []


def test_a_job_from_the_store_shows_incidents_restarts_and_loss(loaded: Chromium, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    url = f"sqlite:///{tmp_path}/fleet.db"
    with Store(url) as store:
        job = build_job(store)
    out = tmp_path / "job.html"
    assert cli(["replay", job.job, "--store", url, "--html", str(out), "--json"]) == 0
    opened = loaded.open(out)
    check_loaded(opened, 4)
    culprit_box(opened, job.culprit, job.world_seq)
    assert opened.count(".marker.incident") == job.incidents and opened.count(".marker.restart") == 1
    assert opened.count("#loss-curve polyline.loss") == job.attempts and opened.count("#lost-bar rect.part") >= 2
    # the first view shows the hang's incident; "Whole job" brings every marker onto the axis
    visible = "[...document.querySelectorAll(s)].filter(e => getComputedStyle(e).display !== 'none').length"
    assert opened.page.evaluate(f"s => {visible}", ".marker.incident") >= 1
    opened.page.click("#tl-whole")
    opened.page.wait_for_function(f"() => (s => {visible})('.marker') === document.querySelectorAll('.marker').length")
    width = opened.page.evaluate("document.querySelector('#tl-tracks .lane').clientWidth")
    xs = opened.page.evaluate("[...document.querySelectorAll('.marker line.vis')].map(l => +l.getAttribute('x1'))")
    assert xs and all(0 <= x <= width for x in xs)
    opened.screenshot("store_job")
    assert opened.problems() == []


def test_512_ranks_open_in_under_5_s(loaded: Chromium, tmp_path: Path) -> None:
    from bench.fr_dumps import generate

    plant = generate(tmp_path / "dumps", 512, 300, "hang")
    out = tmp_path / "r512.html"
    assert cli(["replay", "--dumps", str(tmp_path / "dumps"), "--html", str(out), "--json"]) == 0
    opened = loaded.open(out)
    size_mb = out.stat().st_size / 1e6
    print(f"512 ranks: {size_mb:.1f} MB; page.goto to fleetReady {opened.seconds:.2f} s "
          f"(navigation start to ready {opened.ready_ms / 1000:.2f} s in the page)")
    assert opened.seconds < OPEN_512_S
    check_loaded(opened, 512)
    (culprit,) = plant.culprit_ranks
    culprit_box(opened, culprit, plant.seq)
    opened.screenshot("512_ranks", "#timeline")
    assert opened.problems() == []


def test_a_large_job_shows_its_fronts(loaded: Chromium, tmp_path: Path) -> None:
    from bench.replay_scale import build

    url = f"sqlite:///{tmp_path}/fleet.db"
    with Store(url) as store:
        job = build(store, 64, steps=4, culprit=37)
    out = tmp_path / "fronts.html"
    assert cli(["replay", job.job, "--store", url, "--html", str(out), "--json"]) == 0
    opened = loaded.open(out)
    check_loaded(opened, 64)
    assert opened.count('.culprit[data-rank="37"]') == 1
    assert "--page N" in opened.page.evaluate("document.querySelector('#timeline .note').textContent")
    opened.screenshot("large_job")
    assert opened.problems() == []
