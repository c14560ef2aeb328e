"""The diagnosis engine on real native dumps: four (or eight) gloo ranks per case, each
planting one kind of desync (``tests.desync_scenarios``: skipped, mismatched and stalled
collectives, ranks killed without a dump, a blocked majority, two culprits at once),
diagnosed in-process and by ``fleet replay --dumps``; plus a dump folder with a rank
missing and one with a truncated file."""

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


#: Per planted collective (by group): which ranks have an entry for it, and which of
#: those are still waiting in it (unretired) when they dump: what the engine is given.
PLANTED_ENTRIES = {
    "skip": {"0": ({0, 1, 3}, {0, 1, 3})},
    "size": {"0": ({0, 1, 2, 3}, {0, 2, 3})},    # the late culprit's entry failed at once
    "dtype": {"0": ({0, 1, 2, 3}, {1, 2, 3})},
    "op": {"0": ({0, 1, 2, 3}, {0, 1, 2, 3})},
    "subgroup-hang": {"1": ({0}, {0})},
    # The survivors dump after their collective failed: retired, as if it completed.
    "dead_rank": {"0": ({0, 1, 2}, set())},
    "dead_rank_subgroup": {"1": ({0}, set())},
    "blocked_majority": {"3": ({1, 2}, {1, 2})},
    "two_culprits": {"1": ({0}, {0}), "2": ({2}, {2})},
    "dead_rank_tp_dp": {"3": ({4}, set()), "6": ({1, 3, 7}, set())},
}


@pytest.mark.parametrize("case", list(CASES))
def test_dumps_hold_the_planted_fault(case, scenario):
    """The dumps themselves, read without the engine: if this fails, the scenario (or
    gloo's recorder) changed, not the diagnosis."""
    sc = scenario(case)
    layout = CASES[case].layout
    assert sorted(int(p.name[len(DUMP_PREFIX):]) for p in sc.outdir.glob(f"{DUMP_PREFIX}*")) == sc.ranks
    assert list(sc.dead) == list(CASES[case].missing_ranks)
    dumps = {r: read_dump(sc.outdir / f"{DUMP_PREFIX}{r}") for r in sc.ranks}
    if not layout.all_gather:  # nothing in the entries gives the world size away
        assert not any(e["profiling_name"] == "gloo:all_gather" for d in dumps.values() for e in d["entries"])
    for r, d in dumps.items():
        # pg_status is keyed by the rank's local pg_id, not the group's name (see the
        # scenario module): rank 2's "1" is its group "2".
        own = [name for name, ranks in layout.group_names().items() if r in ranks]
        pg_names = {str(e["pg_id"]): str(e["process_group"][0]) for e in d["entries"]}
        assert pg_names == {"0": "0", **{str(i): name for i, name in enumerate(own, 1)}}, r
        assert set(d["pg_status"]) == set(pg_names), r
    if not sc.planted:
        assert all(e["retired"] for d in dumps.values() for e in d["entries"])
        return
    assert sc.planted.keys() == PLANTED_ENTRIES[case].keys() == {b.group for b in CASES[case].findings}
    for group, seq in sc.planted.items():
        at = {r: [e for e in d["entries"] if (str(e["process_group"][0]), e["collective_seq_id"]) == (group, seq)]
              for r, d in dumps.items()}
        entered, waiting = PLANTED_ENTRIES[case][group]
        assert {r for r, es in at.items() if es} == entered, group
        assert {r for r, es in at.items() if es and not es[0]["retired"]} == waiting, group


def assert_planted_findings(findings: list[dict], sc: Scenario, expected, why: str) -> None:
    """Each planted fault has its finding, naming exactly the expected ranks."""
    for blame in expected.findings:
        key = (blame.kind, blame.group, sc.planted[blame.group])
        at_fault = [f for f in findings if (f["kind"], f["group"], f["seq"]) == key]
        assert at_fault, f"no {blame.kind} finding at {blame.group}#{key[2]}:\n{why}"
        assert sorted(at_fault[0]["ranks"]) == list(blame.ranks), why


@pytest.mark.parametrize("case", list(CASES))
def test_diagnosis_names_the_planted_fault(case, scenario):
    sc = scenario(case)
    expected = CASES[case]
    d = analyze_dumps(sc.outdir)

    assert d.verdict == expected.verdict, explain(d)
    assert d.culprit_ranks == list(expected.culprit_ranks), explain(d)
    assert d.to_json().keys() >= JSON_KEYS
    assert d.to_json()["missing_ranks"] == list(expected.missing_ranks), explain(d)
    out = json.loads(json.dumps(d.to_json()))  # plain data throughout
    assert_planted_findings(out["findings"], sc, expected, explain(d))


@pytest.mark.parametrize("case", ["skip", "dtype", "dead_rank"])
def test_replay_cli_gives_the_same_verdict(case, scenario):
    sc = scenario(case)
    expected = CASES[case]
    proc = replay_json(sc.outdir)

    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out.keys() >= JSON_KEYS
    assert (out["verdict"], out["culprit_ranks"]) == (expected.verdict, list(expected.culprit_ranks)), proc.stdout
    assert out["missing_ranks"] == list(expected.missing_ranks)
    assert_planted_findings(out["findings"], sc, expected, proc.stdout[:4000])
    in_process = json.loads(json.dumps(analyze_dumps(sc.outdir).to_json(), default=str))
    assert all(isinstance(f["stacks"], list) for f in out["findings"])  # the CLI adds the stacks
    cli_findings = [{k: v for k, v in f.items() if k != "stacks"} for f in out["findings"]]
    assert cli_findings == in_process["findings"]
    for key in ("verdict", "culprit_ranks", "missing_ranks", "wavefront"):
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
    lines = proc.stderr.strip().splitlines()  # the error, and its hint
    assert len(lines) == 2 and lines[1].startswith("hint: "), proc.stderr
    assert "Traceback" not in proc.stderr
    assert str(broken) in lines[0] or broken.name in lines[0], lines[0]
    assert proc.stdout == ""
