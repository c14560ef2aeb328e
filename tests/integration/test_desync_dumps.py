"""The diagnosis engine on real native dumps: four gloo ranks per case, each planting one
kind of desync (``tests.desync_scenarios``), diagnosed in-process and by
``fleet replay --dumps``; plus a dump folder with a rank missing and one with a
truncated file."""

from __future__ import annotations

import json
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fleet.controlplane.diagnosis import analyze_dumps
from tests.desync_scenarios import CASES, DUMP_PREFIX, Scenario, generate

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

FLEET = [sys.executable, "-m", "fleet.controlplane.cli.main"]
REPO = Path(__file__).resolve().parents[2]
JSON_KEYS = {"source", "attempt", "verdict", "culprit_ranks", "findings", "missing_ranks", "wavefront"}


@pytest.fixture(scope="module")
def scenario(tmp_path_factory):
    """``scenario(case)``: that case's dumps, generated once per module."""
    made: dict[str, Scenario] = {}

    def get(case: str) -> Scenario:
        if case not in made:
            made[case] = generate(case, tmp_path_factory.mktemp(case))
        return made[case]

    return get


def explain(d) -> str:
    return json.dumps(d.to_json(), indent=1, default=str)[:4000]


def replay_json(folder: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*FLEET, "replay", "--dumps", str(folder), "--json"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)


def read_dump(path: Path) -> dict:
    """One of our own dumps (trusted, so plain ``pickle``), or a JSON one."""
    raw = path.read_bytes()
    return json.loads(raw) if raw[:1] == b"{" else pickle.loads(raw)


#: Which ranks have an entry for the planted collective, and which of those are still
#: waiting in it (unretired) when they dump: what the engine is given to work with.
PLANTED_ENTRIES = {
    "skip": ({0, 1, 3}, {0, 1, 3}),
    "size": ({0, 1, 2, 3}, {0, 2, 3}),    # the late culprit's entry failed at once
    "dtype": ({0, 1, 2, 3}, {1, 2, 3}),
    "op": ({0, 1, 2, 3}, {0, 1, 2, 3}),
    "subgroup-hang": ({0}, {0}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_dumps_hold_the_planted_fault(case, scenario):
    """The dumps themselves, read without the engine: if this fails, the scenario (or
    gloo's recorder) changed, not the diagnosis."""
    sc = scenario(case)
    dumps = {r: read_dump(sc.outdir / f"{DUMP_PREFIX}{r}") for r in range(4)}
    if sc.seq is None:
        assert all(e["retired"] for d in dumps.values() for e in d["entries"])
        return
    at = {r: [e for e in d["entries"] if (str(e["process_group"][0]), e["collective_seq_id"]) == (sc.group, sc.seq)]
          for r, d in dumps.items()}
    entered, waiting = PLANTED_ENTRIES[case]
    assert {r for r, es in at.items() if es} == entered
    assert {r for r, es in at.items() if es and not es[0]["retired"]} == waiting
    # pg_status is keyed by the rank's local pg_id, not the group's name (see the
    # scenario module): rank 2's "1" is its group "2".
    pg_names = {str(e["pg_id"]): str(e["process_group"][0]) for e in dumps[2]["entries"]}
    assert set(dumps[2]["pg_status"]) == {"0", "1"} and pg_names["1"] == "2"


@pytest.mark.parametrize("case", list(CASES))
def test_diagnosis_names_the_planted_fault(case, scenario):
    sc = scenario(case)
    expected = CASES[case]
    d = analyze_dumps(sc.outdir)

    assert d.verdict == expected.verdict, explain(d)
    assert d.culprit_ranks == list(expected.culprit_ranks), explain(d)
    assert d.to_json().keys() >= JSON_KEYS
    assert d.to_json()["missing_ranks"] == []
    json.dumps(d.to_json())  # plain data throughout
    if expected.kind is None:
        return
    assert sc.group == expected.group and sc.seq is not None, sc
    at_fault = [f for f in d.findings if (f.kind, f.group, f.seq) == (expected.kind, sc.group, sc.seq)]
    assert at_fault, f"no {expected.kind} finding at {sc.group}#{sc.seq}:\n{explain(d)}"
    assert sorted(at_fault[0].ranks) == list(expected.culprit_ranks), explain(d)


@pytest.mark.parametrize("case", ["skip", "dtype"])
def test_replay_cli_gives_the_same_verdict(case, scenario):
    sc = scenario(case)
    expected = CASES[case]
    proc = replay_json(sc.outdir)

    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out.keys() >= JSON_KEYS
    assert (out["verdict"], out["culprit_ranks"]) == (expected.verdict, list(expected.culprit_ranks))
    assert any((f["kind"], f["group"], f["seq"]) == (expected.kind, sc.group, sc.seq) for f in out["findings"])
    in_process = json.loads(json.dumps(analyze_dumps(sc.outdir).to_json(), default=str))
    for key in ("verdict", "culprit_ranks", "findings", "missing_ranks", "wavefront"):
        assert out[key] == in_process[key], key


def test_a_rank_without_a_dump_is_reported_and_the_rest_analysed(scenario, tmp_path):
    folder = tmp_path / "dumps"
    shutil.copytree(scenario("skip").outdir, folder)
    (folder / f"{DUMP_PREFIX}1").unlink()  # a gap: ranks 0, 2 and 3 remain

    d = analyze_dumps(folder)

    assert d.to_json()["missing_ranks"] == [1], explain(d)
    assert (d.verdict, d.culprit_ranks) == ("hang", [2]), explain(d)


def test_a_truncated_dump_fails_replay_with_one_line_naming_it(scenario, tmp_path):
    folder = tmp_path / "dumps"
    shutil.copytree(scenario("skip").outdir, folder)
    broken = folder / f"{DUMP_PREFIX}2"
    data = broken.read_bytes()
    broken.write_bytes(data[: len(data) // 2])

    proc = replay_json(folder)

    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert str(broken) in lines[0] or broken.name in lines[0], lines[0]
    assert proc.stdout == ""
