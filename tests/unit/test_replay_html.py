"""The HTML incident report without a browser: the pure renderer on literal data (the
page parses, holds its one JSON blob, one track per rank and the culprit's element, refers
to nothing outside itself, and no string can break out of its script or attributes,
fuzzed), the timeline built from traces and fronts (where culprits are placed), and
`fleet replay --html` from dumps, from a job in a real SQLite store and from a large job
(fronts), with its bad paths."""

from __future__ import annotations

import json
import math
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleet.controlplane.cli.main import main as cli
from fleet.controlplane.diagnosis import diagnose
from fleet.controlplane.diagnosis.traces import SignatureTable, TraceBuilder, TraceSet
from fleet.controlplane.errors import ConfigError
from fleet.controlplane.replay_html import NOT_A_JOB, json_blob, render_html
from fleet.controlplane.replay_html_data import CELL, DONE, FRONT, MEASURED, WAITING, job_section, timeline
from fleet.controlplane.replay_html_doc import check_path, write
from fleet.controlplane.store import Store
from fleet.proto.fronts import FrontRow
from tests.replay_html_job import build as build_job
from tests.unit.test_replay_cli import write_mesh

pytestmark = pytest.mark.timeout(60)

MS = 1_000_000


class Page(HTMLParser):
    """Every start tag with its attributes, the text of each script, and the page's text."""

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict[str, str]]] = []
        self.scripts: list[tuple[dict[str, str], str]] = []
        self.text: list[str] = []
        self._script: dict[str, str] | None = None
        self.feed(text)
        self.close()

    def handle_starttag(self, tag, attrs):
        a = {k: v or "" for k, v in attrs}
        self.tags.append((tag, a))
        if tag == "script":
            self._script = a
            self.scripts.append((a, ""))

    def handle_startendtag(self, tag, attrs):
        self.tags.append((tag, {k: v or "" for k, v in attrs}))

    def handle_endtag(self, tag):
        if tag == "script":
            self._script = None

    def handle_data(self, data):
        if self._script is not None:
            a, text = self.scripts[-1]
            self.scripts[-1] = (a, text + data)
        else:
            self.text.append(data)

    def find(self, tag: str | None = None, cls: str | None = None, **attrs: str) -> list[dict[str, str]]:
        return [a for t, a in self.tags if (tag is None or t == tag)
                and (cls is None or cls in a.get("class", "").split())
                and all(a.get(k.replace("_", "-")) == v for k, v in attrs.items())]

    def blob(self) -> dict:
        (text,) = [t for a, t in self.scripts if a.get("id") == "fleet-data"]
        return json.loads(text)


EXTERNAL = re.compile(r"""(?:\b(?:src|href|action|poster|data)\s*=\s*["']?\s*(?:[a-z][a-z0-9+.-]*:)?//)"""
                      r"""|url\(\s*["']?\s*(?!#)|@import""", re.I)


def no_external_reference(html: str, page: Page) -> None:
    assert not EXTERNAL.search(html), EXTERNAL.search(html)
    for _, a in page.tags:
        for k in ("src", "href", "xlink:href", "action"):
            assert k not in a, (k, a)
    assert "http://" not in html and "https://" not in html  # not even an SVG namespace string


# -- the renderer on literal data -----------------------------------------------------------


def literal_doc(text: str = "x") -> dict:
    """Four ranks; rank 2 never entered world collective 7; two attempts, two incidents."""
    tracks = {str(r): [0, 1000, 0, 6, 0, DONE, 2000, 5000, 0, 7, 0, WAITING] for r in (0, 1, 3)}  # µs
    tracks["2"] = [0, 1500, 0, 6, 0, DONE]
    return {
        "source": f"dumps:/tmp/{text}",
        "diagnosis": {"verdict": "hang", "summary": f"hang: culprit rank 2. {text}", "culprit_ranks": [2],
                      "missing_ranks": [], "findings": [
                          {"kind": "missing", "group": "0", "seq": 7, "ranks": [2], "waiting_ranks": [0, 1, 3],
                           "detail": f"rank 2 never entered collective 7 {text}", "role": "cause",
                           "stacks": [{"rank": 2, "group": "0", "seq": 6, "op": "all_reduce", "state": "completed",
                                       "frames": [{"name": text, "filename": "/job/train.py", "line": 3}]}]}]},
        "timeline": {"t0_ns": 1_700_000_000 * 10**9, "last_ms": 2.0, "end_ms": 7.0, "ranks": [0, 1, 2, 3],
                     "absent": [], "nodes": {"2": f"node-{text}"}, "groups": [["0", text]],
                     "sigs": ["all_reduce [[8]] float32"], "cell": list(CELL), "tracks": tracks, "cells": 7,
                     "note": "", "highlights": [{"rank": 2, "group": "0", "seq": 7, "kind": "missing",
                                                 "start_ms": 2.0, "end_ms": 7.0, "finding": "missing",
                                                 "detail": text}]},
        "job": {"id": "j-1", "name": text, "state": "FAILED", "final_step": 20, "total_steps": 40, "wall_s": 100.0,
                "productive_s": 60.0, "ettr": 0.6, "restarts": 1, "attempt_shown": 2,
                "lost_s": {"startup_s": 5.0, "detection_s": 10.0, "restart_s": 15.0, "recomputed_s": 4.0,
                           "checkpointing_s": 1.0, "other_s": 5.0},
                "attempts": [{"number": 1, "state": "FAILED", "start_ms": -50.0, "end_ms": -10.0, "wall_s": 40.0,
                              "reason": text, "restored_step": None},
                             {"number": 2, "state": "FAILED", "start_ms": -5.0, "end_ms": 9.0, "wall_s": 60.0,
                              "reason": text, "restored_step": 10}],
                "incidents": [{"attempt": 1, "kind": "crash", "rank": 1, "node": text, "detector": "exit",
                               "evidence": text, "at_ms": -11.0, "detected_at": 1_700_000_000.0, "observed": False,
                               "ended_attempt": True},
                              {"attempt": 2, "kind": "hang", "rank": 2, "node": text, "detector": "hang",
                               "evidence": text, "at_ms": 8.0, "detected_at": 1_700_000_001.0, "observed": False,
                               "ended_attempt": True}],
                "loss": [{"attempt": 1, "points": [[s, 4.0 / s] for s in range(1, 13)]},
                         {"attempt": 2, "points": [[s, 4.0 / s] for s in range(11, 21)] + [[21, None]]}],
                "note": ""},
    }


def test_page_holds_the_blob_one_track_per_rank_and_the_culprit():
    html = render_html(literal_doc())
    page = Page(html)
    assert html.startswith("<!DOCTYPE html>")
    blob = page.blob()
    assert blob["timeline"]["tracks"]["2"] == [0, 1500, 0, 6, 0, DONE]
    assert blob["verdict"]["culprit_ranks"] == [2] and blob["job"] == {"attempt_shown": 2}
    assert [a["data-rank"] for a in page.find("div", "track")] == ["0", "1", "2", "3"]
    (culprit,) = page.find(cls="culprit")
    assert (culprit["data-rank"], culprit["data-seq"], culprit["fill"]) == ("2", "7", "url(#fleet-hatch)")
    assert page.find("div", "track", data_rank="2")[0]["class"] == "track is-culprit"
    # the verdict, without any script
    (header,) = page.find("header", data_verdict="hang")
    text = "".join(page.text)
    assert "HANG" in text and "hang: culprit rank 2. x" in text and "rank 2 never entered collective 7 x" in text
    # the job: two incidents and the attempts on the axis, two loss lines, one restart, the lost-time parts
    assert len(page.find("g", "incident")) == 2 and len(page.find("g", "restart")) == 1
    assert len(page.find("g", "attempt")) == 2 and len(page.find("g", "attempt-end")) == 2
    assert [a["data-attempt"] for a in page.find("polyline", "loss")] == ["1", "2"]
    assert len(page.find("line", "restart-line")) == 1
    assert "1 non-finite loss value(s)" in text
    assert {a["data-part"] for a in page.find("rect", "part")} == {
        "productive_s", "startup_s", "detection_s", "restart_s", "recomputed_s", "checkpointing_s", "other_s"}
    assert "ETTR 60.0%" in text
    no_external_reference(html, page)


def test_dumps_say_they_are_no_job():
    doc = literal_doc()
    doc["job"] = None
    page = Page(render_html(doc))
    assert "".join(page.text).count(NOT_A_JOB) == 3
    assert not page.find("g", "marker") and not page.find("polyline") and page.blob()["job"] is None


def test_json_blob_escapes_what_could_end_the_script():
    data = {"s": "</script><script>alert(1)</script><!-- & -->", "n": [1.5, None]}
    text = json_blob(data)
    assert "<" not in text and ">" not in text and "&" not in text
    assert json.loads(text) == data
    with pytest.raises(ValueError):
        json_blob({"loss": math.nan})  # JSON has no NaN: builders send None


TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40) | st.sampled_from(
    ["</script>", "</SCRIPT >", "<!--", "<script>", "\"'><img src=x onerror=alert(1)>", "&amp;", "]]>", "\u2028"])


BASELINE_TAGS = [t for t, _ in Page(render_html(literal_doc("x"))).tags]


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=TEXT)
def test_no_string_breaks_out_of_the_script_or_an_attribute(text):
    html = render_html(literal_doc(text))
    page = Page(html)
    # the same elements as with a harmless string: nothing was opened or closed by the text
    assert [t for t, _ in page.tags] == BASELINE_TAGS
    assert [a.get("id") for a, _ in page.scripts] == ["fleet-data", None]
    blob = page.blob()
    assert blob["timeline"]["groups"] == [["0", text]] and blob["timeline"]["nodes"] == {"2": f"node-{text}"}
    assert blob["timeline"]["highlights"][0]["detail"] == text
    (label,) = [a["title"] for a in page.find("span", "tl-label") if a["title"].startswith("rank 2")]
    assert label == f"rank 2 \u00b7 node-{text}"
    (culprit,) = page.find(cls="culprit")
    assert culprit["data-rank"] == "2"
    no_external_reference(html, page)


# -- the timeline from traces and fronts ----------------------------------------------------


def world(n: int, seqs: int, skip: int | None = None, wrong: int | None = None,
          present: range | None = None) -> TraceSet:
    """``n`` ranks of one world group, ``seqs`` all_reduces each 1 ms apart; ``skip`` never
    enters the last, ``wrong`` enters it as a broadcast; the last is open everywhere."""
    table = SignatureTable()
    ranks = {}
    for r in present if present is not None else range(n):
        b = TraceBuilder(r, table)
        b.declare_group("0", "default_pg", range(n))
        for seq in range(1, seqs + 1):
            if r == skip and seq == seqs:
                continue
            op = "broadcast" if (r == wrong and seq == seqs) else "all_reduce"
            sig = table.intern(op, [[8]], [[8]], ["float32"], ["float32"])
            last = seq == seqs
            b.add_collective("0", seq, sig, seq * MS + r * 1000, 0 if last else seq * MS + 500_000, not last)
        ranks[r] = b.finish()
    return TraceSet("test", ranks, table)


def test_a_missing_collective_is_the_gap_where_the_peers_wait():
    traces = world(4, 10, skip=2)
    diag = diagnose(traces).to_json()
    tl = timeline(traces, diag)
    assert tl["ranks"] == [0, 1, 2, 3] and tl["cell"] == list(CELL)
    (h,) = tl["highlights"]
    assert (h["rank"], h["group"], h["seq"], h["kind"], h["finding"]) == (2, "0", 10, "missing", "missing")
    assert h["start_ms"] == pytest.approx(9.0)  # rank 0 entered seq 10 first, 9 ms after t0
    assert h["end_ms"] == tl["end_ms"] > tl["last_ms"]
    cells = tl["tracks"]["0"]
    last = cells[-len(CELL):]
    assert last[3] == 10 and last[5] == WAITING and (last[0] + last[1]) / 1000 == pytest.approx(tl["end_ms"], abs=0.002)
    assert len(tl["tracks"]["2"]) == 9 * len(CELL)
    assert cells[5] == DONE | MEASURED and cells[1] == 500  # measured: entered at 1 ms, exited 0.5 ms later


def test_a_mismatch_is_the_collective_the_culprit_entered():
    traces = world(5, 6, wrong=4)
    diag = diagnose(traces).to_json()
    assert diag["culprit_ranks"] == [4]
    (h,) = timeline(traces, diag)["highlights"]
    assert (h["rank"], h["seq"], h["kind"]) == (4, 6, "entered")
    assert h["start_ms"] == pytest.approx(5.004)


def test_a_rank_without_a_trace_has_its_track_and_selection_narrows():
    traces = world(4, 5, present=range(3))  # rank 3 left no dump; the group says it exists
    diag = diagnose(traces).to_json()
    tl = timeline(traces, diag, end_ns=30 * MS)
    assert tl["ranks"] == [0, 1, 2, 3] and tl["absent"] == [3] and tl["tracks"]["3"] == []
    assert tl["end_ms"] == pytest.approx(29.0)  # waits end at the incident
    (h,) = [h for h in tl["highlights"] if h["rank"] == 3]
    assert h["kind"] == "missing"
    some = timeline(traces, diag, ranks=[1], seq_range=(2, 3))
    assert some["ranks"] == [1] and [some["tracks"]["1"][i + 3] for i in range(0, 12, 6)] == [2, 3]


def test_a_long_trace_keeps_each_ranks_newest_collectives():
    traces = world(8, 200, skip=5)
    tl = timeline(traces, diagnose(traces).to_json(), max_cells=400)
    assert all(len(c) == 50 * len(CELL) for r, c in tl["tracks"].items() if r != "5")
    assert tl["tracks"]["0"][3] == 151 and "newest 50 collectives" in tl["note"]
    assert tl["highlights"][0]["seq"] == 200


def front(rank: int, entered: int, completed: int, at_ms: int, group: str = "dp0") -> FrontRow:
    return FrontRow("j", 1, rank, group, 4, entered, completed, at_ms * MS, (at_ms - 1) * MS, "all_reduce", 7, 3, 0)


def test_fronts_are_cells_and_a_culprit_behind_its_group_is_placed():
    fronts = [front(r, 12, 11, 100 + r) for r in (0, 1, 3)] + [front(2, 11, 11, 90)]
    diag = {"verdict": "hang", "culprit_ranks": [2], "findings": [], "summary": "rank 2 is behind",
            "front_groups": ["dp0"]}
    tl = timeline(None, diag, fronts=fronts, world=range(6), end_ns=200 * MS)
    assert tl["ranks"] == list(range(6)) and tl["absent"] == [4, 5]
    assert tl["tracks"]["0"][5] == WAITING | FRONT and tl["tracks"]["2"][5] == DONE | FRONT | MEASURED
    (h,) = tl["highlights"]
    assert (h["rank"], h["group"], h["seq"], h["kind"]) == (2, "dp0", 12, "missing")
    assert h["start_ms"] == pytest.approx(10.0) and h["end_ms"] == pytest.approx(110.0)  # t0 = rank 2's 90 ms


def test_job_section_puts_times_on_the_axis_and_drops_non_finite_values():
    report = {"job": "j-1", "name": "n", "state": "FAILED", "final_step": 3, "total_steps": 10, "wall_s": 10.0,
              "productive_s": 5.0, "ettr": 0.5, "restarts": 1, "lost_s": {"restart_s": math.inf},
              "attempts_detail": [{"number": 1, "state": "FAILED", "started_at": 100.0, "ended_at": 101.5,
                                   "wall_s": 1.5, "reason": ""}],
              "incidents": [{"attempt": 1, "kind": "crash", "rank": 0, "node": "n0", "detector": "exit",
                             "evidence": "", "detected_at": 101.25, "ended_attempt": True}]}
    j = job_section(report, 100 * 10**9, losses={1: [(1, 2.0), (2, math.nan)]}, attempt=1)
    assert j["attempts"][0]["start_ms"] == 0.0 and j["attempts"][0]["end_ms"] == 1500.0
    assert j["incidents"][0]["at_ms"] == 1250.0 and j["lost_s"] == {"restart_s": 0.0}
    assert j["loss"] == [{"attempt": 1, "points": [[1, 2.0], [2, None]]}]
    json_blob(j)  # finite throughout


# -- fleet replay --html ----------------------------------------------------------------------


def run(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = cli(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_html_from_dumps_and_json_stays_one_document(tmp_path, capsys):
    folder = write_mesh(tmp_path / "d", n=6, stuck=4)
    out_file = tmp_path / "report.html"
    code, out, err = run(capsys, "replay", "--dumps", str(folder), "--html", str(out_file), "--json")
    assert code == 0 and json.loads(out)["culprit_ranks"] == [4]
    assert f"wrote {out_file}" in err.replace("\n", "")
    page = Page(out_file.read_text())
    assert [a["data-rank"] for a in page.find("div", "track")] == [str(r) for r in range(6)]
    (c,) = page.find(cls="culprit")
    assert (c["data-rank"], c["data-seq"], c["class"]) == ("4", "7", "culprit missing")
    assert "".join(page.text).count(NOT_A_JOB) == 3
    assert not list(tmp_path.glob(".report.html.*"))  # no temporary file left behind
    code, out, _ = run(capsys, "replay", str(folder), "--html", str(out_file))  # stdout without --json
    assert code == 0 and f"wrote {out_file}" in out.replace("\n", "")


@pytest.mark.parametrize("bad, message", [
    ("nope/r.html", "--html nope/r.html: no folder nope"),
    ("d", "--html d: a folder; give the file to write (e.g. d/replay.html)"),
    ("file/r.html", "--html file/r.html: no folder file"),
])
def test_an_unwritable_html_path_is_one_line_naming_the_flag(tmp_path, capsys, monkeypatch, bad, message):
    monkeypatch.chdir(tmp_path)  # short paths: the line is not wrapped
    write_mesh(tmp_path / "d", stuck=1)
    (tmp_path / "file").write_text("")
    code, out, err = run(capsys, "replay", "d", "--html", bad, "--json")
    lines = [ln for ln in (out + err).splitlines() if ln.strip()]
    # one error line (the CLI may add its hint line on where flags are listed)
    assert code == 2 and message in lines[0] and all(ln.startswith("hint:") for ln in lines[1:]), lines
    assert "Traceback" not in out + err and not out


def test_write_is_atomic_and_names_the_flag_when_it_fails(tmp_path):
    target = tmp_path / "r.html"
    target.write_text("old")
    assert write(target, "new page") == len("new page") and target.read_text() == "new page"
    assert [p.name for p in tmp_path.iterdir()] == ["r.html"]
    with pytest.raises(ConfigError, match=r"--html .*: cannot write"):
        write(tmp_path / "gone" / "r.html", "x")
    assert check_path(Path("~") / "r.html") == Path.home() / "r.html"


def test_html_of_a_job_in_the_store(tmp_path, capsys):
    url = f"sqlite:///{tmp_path}/fleet.db"
    with Store(url) as store:
        job = build_job(store)
    out_file = tmp_path / "job.html"
    code, out, _ = run(capsys, "replay", job.job, "--store", url, "--html", str(out_file))
    assert code == 0 and "2 incident(s), 2 attempt(s)" in out.replace("\n", "")
    page = Page(out_file.read_text())
    assert len(page.find("div", "track")) == 4
    (c,) = page.find(cls="culprit")
    assert (c["data-rank"], c["data-seq"]) == (str(job.culprit), str(job.world_seq))
    assert [a["data-attempt"] for a in page.find("g", "incident")] == ["1", "2"]
    assert [a["data-attempt"] for a in page.find("g", "restart")] == ["2"]
    assert [a["data-attempt"] for a in page.find("polyline", "loss")] == ["1", "2"]
    assert len(page.find("tr", "incident")) == 2 and len(page.find("rect", "part")) >= 2
    tl = page.blob()["timeline"]
    assert tl["nodes"] == {"0": "node-0", "1": "node-0", "2": "node-1", "3": "node-1"}
    assert [g for g, _ in tl["groups"]] == ["0", "1", "2"] and dict(tl["groups"])["0"] == "default_pg"
    # the hang incident ends the waits, and the markers sit on the timeline's axis
    hang = float(page.find("g", "incident")[1]["data-t"])
    assert tl["end_ms"] == pytest.approx(hang, abs=0.01) and 0 < tl["last_ms"] < hang
    assert float(page.find("g", "restart")[0]["data-t"]) < 0  # attempt 2 began before its first collective
    # the culprit alone (--rank): its peers are not drawn, the gap starts where it was last seen in the group
    assert run(capsys, "replay", job.job, "--store", url, "--rank", str(job.culprit), "--html", str(out_file))[0] == 0
    page = Page(out_file.read_text())
    (c,) = page.find(cls="culprit")
    assert (c["data-rank"], c["data-group"], c["data-seq"]) == (str(job.culprit), "0", str(job.world_seq))
    assert [a["data-rank"] for a in page.find("div", "track")] == [str(job.culprit)]


def test_html_of_a_large_job_shows_its_fronts_and_the_paging(tmp_path, capsys):
    from bench.replay_scale import build

    url = f"sqlite:///{tmp_path}/fleet.db"
    with Store(url) as store:
        job = build(store, 64, steps=4, culprit=37)
    out_file = tmp_path / "big.html"
    code, _, _ = run(capsys, "replay", job.job, "--store", url, "--html", str(out_file), "--json")
    assert code == 0
    page = Page(out_file.read_text())
    assert len(page.find("div", "track")) == 64
    (c,) = page.find(cls="culprit")
    assert c["data-rank"] == "37" and c["data-group"].startswith("dp")
    text = "".join(page.text)
    assert "A large job" in text and f"fleet replay {job.job} --page N" in text and "all 192 fronts" in text
    tl = page.blob()["timeline"]
    cells = [(r, a[i + 2], a[i + 5]) for r, a in tl["tracks"].items() for i in range(0, len(a), len(CELL))]
    pulled = {(r, g) for r, g, f in cells if not f & FRONT}  # the raw entries drawn instead of fronts
    assert pulled and sum(1 for _, _, f in cells if f & FRONT) == 192 - len(pulled)


def test_html_from_dumps_imports_no_store_grpc_ray_or_torch(tmp_path):
    # numpy is allowed: the bandwidth table of the dumps (diagnosis.bandwidth) is vectorised
    import subprocess
    import sys

    folder = write_mesh(tmp_path / "d", stuck=1)
    probe = (
        "import sys\n"
        "from fleet.controlplane.cli.main import main\n"
        f"code = main(['replay', {str(folder)!r}, '--html', {str(tmp_path / 'r.html')!r}, '--json'])\n"
        "print(code, sorted({m.split('.')[0] for m in sys.modules} & "
        "{'sqlalchemy', 'alembic', 'grpc', 'ray', 'torch'}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "0 []" and (tmp_path / "r.html").stat().st_size > 10_000
