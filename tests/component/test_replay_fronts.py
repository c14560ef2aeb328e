"""`fleet replay` of a large job (its agents sent collective fronts, the controller pulled
the suspect groups' raw entries): a 64-rank job built by bench/replay_scale.py's fixture
in a real SQLite file and a real PostgreSQL database. The replay names the culprit (from
the diagnosis of the groups pulled whole) and its node, shows the wavefront around the
incident, pages through the fronts and the groups, and refuses a page past the last."""

from __future__ import annotations

import json

import pytest

from bench.replay_scale import FrontsJob, build
from fleet.controlplane.cli.main import main
from fleet.controlplane.fronts_view import standing, standing_line
from fleet.controlplane.store import Store
from fleet.controlplane.store.ingest import prepare
from fleet.proto import events_pb2
from fleet.proto.fronts import FrontRow

pytestmark = pytest.mark.timeout(60)

RANKS = 64


@pytest.fixture
def job(store: Store) -> FrontsJob:
    return build(store, RANKS, steps=4, culprit=37)


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_replay_names_the_culprit_and_shows_the_wavefront(job: FrontsJob, store_url: str,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "replay", job.job, "--store", store_url, "--json")
    assert code == 0
    doc = json.loads(out)
    assert (doc["verdict"], doc["culprit_ranks"]) == ("hang", [37])
    assert doc["missing_ranks"] == []  # the members of groups never pulled are not called missing
    a = doc["attempts"][0]
    assert a["mode"] == "fronts" and a["diagnosed_groups"] == sorted(job.groups)
    assert a["fronts"]["count"] == RANKS * 3 and a["ranks_placed"] == RANKS
    around = {s["group"]: s for s in a["fronts"]["around_incident"]}
    assert set(around) == set(job.groups)
    dp = around["dp0.5"]  # the culprit's DP group: its peer waits one seq ahead
    assert [(k["count"], k["open"]) for k in dp["clusters"]] == [(1, True), (1, False)]
    assert dp["clusters"][1]["ranks"] == [37] and dp["clusters"][1]["entered_seq"] == dp["top_seq"] - 1
    summary = a["fronts"]["summary"]
    assert summary["ranks"] == RANKS and summary["waiting"] == RANKS - 1
    assert {k["desc"]: k["behind"] for k in summary["kinds"]} == {"dp": 1, "pp": 0, "tp": 0}
    assert doc["incidents"][0]["rank"] == 37 and a["nodes"]["37"] == job.node

    code, text, _ = _run(capsys, "replay", job.job, "--store", store_url)
    assert code == 0
    assert f"culprit: rank 37 (node {job.node})" in text
    assert f"rank 37 (node {job.node}) is at seq {dp['top_seq'] - 1} (1 behind)" in text
    assert "63 of 64 ranks wait in a collective" in text and "dp: 32 groups, 63 of 64 fronts open" in text
    assert "page 1 of 4" in text


def test_paging_through_fronts_and_groups(job: FrontsJob, store_url: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    def page(*flags: str) -> dict:
        code, out, err = _run(capsys, "replay", job.job, "--store", store_url, "--json", *flags)
        assert code == 0, err
        return json.loads(out)["attempts"][0]["fronts"]["page"]

    p1, p2 = page("--page-size", "50"), page("--page", "2", "--page-size", "50")
    assert (p1["pages"], p1["total"], len(p1["rows"]), len(p2["rows"])) == (4, 192, 50, 50)
    keys = lambda p: [(r["rank"], r["group"]) for r in p["rows"]]  # noqa: E731
    assert not set(keys(p1)) & set(keys(p2)) and keys(p1) == sorted(keys(p1))
    last = page("--page", "4", "--page-size", "50")
    assert len(last["rows"]) == 192 - 150
    # --rank and --group (a description names every group of that kind) narrow the pages
    assert [r["group"] for r in page("--rank", "37")["rows"]] == ["dp0.5", "pp1.5", "tp4"]
    dp = page("--group", "dp", "--page-size", "1000")
    assert dp["total"] == RANKS and {r["group"][:2] for r in dp["rows"]} == {"dp"}
    groups = page("--page-by", "group", "--page-size", "10", "--page", "2")
    assert groups["total"] == 8 + 16 + 32 and groups["pages"] == 6 and len(groups["rows"]) == 10
    assert {g["group"]: g["behind"] for g in page("--page-by", "group", "--page-size", "100")["rows"]
            if g["behind"]} == {"dp0.5": 1}

    code, _, err = _run(capsys, "replay", job.job, "--store", store_url, "--page", "5", "--page-size", "50")
    assert code == 2 and "--page 5: past the last page" in err and "192 fronts, 4 page(s) of 50" in err
    assert "Traceback" not in err
    code, _, err = _run(capsys, "replay", job.job, "--store", store_url, "--page-by", "node")
    assert code == 2 and "--page-by" in err


def test_paging_a_job_that_sent_every_collective_is_refused(store: Store, store_url: str,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    plain = store.create_job("small", total_steps=1, config_json="{}")
    store.create_attempt(plain)
    code, _, err = _run(capsys, "replay", plain, "--store", store_url, "--page", "2")
    assert code == 2 and "no pages" in err


def test_standing_line_names_the_outlier_and_its_node() -> None:
    rows = [FrontRow("j", 1, r, "dp0", 512, 812, 811, 1_700_000_000 * 10**9, 0, "all_reduce", 1, 1, 0)
            for r in range(512) if r != 77]
    rows.append(FrontRow("j", 1, 77, "dp0", 512, 811, 811, 0, 0, "all_reduce", 1, 1, 0))
    s = standing("dp0", "dp", range(512), rows)
    line = standing_line(s, {77: "n9"})
    assert line.startswith("group dp0 (dp, 512 members): 511 ranks wait in all_reduce seq 812 since ")
    assert line.endswith("; rank 77 (node n9) is at seq 811 (1 behind) (all_reduce done), not waiting")
    assert s["outliers"] == [77] and s["missing"] == []


def test_an_attempt_that_wrote_no_fronts_is_still_replayed_as_a_large_jobs(
        job: FrontsJob, store: Store, store_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    # a large job's attempt that ended before its first fronts flush (a restart soon after
    # placing): its ranks are above the job's agent.raw_ingest_max_ranks, so it is read as
    # a large job's (around pulled entries), never as every rank's every collective
    from sqlalchemy import text

    with store._engine.begin() as c:  # the job as `fleet up` stores it: its config's agent section
        c.execute(text("UPDATE jobs SET config_json = :c WHERE id = :j"),
                  {"c": json.dumps({"agent": {"raw_ingest_max_ranks": RANKS // 2}}), "j": job.job})
    second = store.create_attempt(job.job)
    store.record_ranks(job.job, second, [(rank, f"node-{rank // 8}", 2000 + rank) for rank in range(RANKS)])
    # a third whose ranks were not placed by this controller (no placement rows), but
    # declared their groups: the declared ranks count
    third = store.create_attempt(job.job)
    store.record_batches([("agent-x", 1, 1, prepare([events_pb2.Event(group=events_pb2.ProcessGroupInfo(
        job_id=job.job, attempt=third, rank=rank, group="dp0", desc="dp", ranks=range(RANKS)))
        for rank in range(RANKS)]))])
    assert store.count_ranks(job.job, third) == 0 and store.count_declared_ranks(job.job, third) == RANKS
    code, out, _ = _run(capsys, "replay", job.job, "--store", store_url, "--json")
    assert code == 0
    attempts = json.loads(out)["attempts"]
    assert [(a["attempt"], a.get("mode")) for a in attempts] == [
        (1, "fronts"), (second, "fronts"), (third, "fronts")]
    assert attempts[1]["fronts"]["count"] == 0 and attempts[1]["ranks_placed"] == RANKS


def test_many_incidents_of_one_kind_are_listed_in_part_and_counted(
        job: FrontsJob, store: Store, store_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    # a reconnect storm raises an agent_loss per node: the text shows a few, counts the
    # rest with their nodes, and --json keeps every one
    for n in range(8):
        store.record_incident(job.job, 1, "agent_loss", "agent", f"the agent of node-{n} was not heard from",
                              rank=n * 8, node=f"node-{n}")
    code, text, _ = _run(capsys, "replay", job.job, "--store", store_url)
    assert code == 0
    assert text.count("agent_loss rank") == 5
    assert "... 3 more agent_loss incidents (8 in all, on 8 node(s): node-0, node-1, node-2, node-3, node-4, " \
           "node-5 ...; --json lists every one)" in " ".join(text.split())
    assert "hang rank 37" in text  # another kind is listed as ever
    code, out, _ = _run(capsys, "replay", job.job, "--store", store_url, "--json")
    assert sum(i["kind"] == "agent_loss" for i in json.loads(out)["incidents"]) == 8
