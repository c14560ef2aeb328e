"""`fleet report` and `fleet replay` over a real store (SQLite file and PostgreSQL): a failed
program's exit code and traceback, detection measured from the last progress fleet saw
(a step, or without the step API a collective), and wall time by attempt."""

from __future__ import annotations

import json
import time

import pytest

from fleet.controlplane.cli.main import main
from fleet.controlplane.lifecycle import AttemptState, JobState
from fleet.controlplane.store import Store
from fleet.proto import events_pb2 as pb

pytestmark = pytest.mark.timeout(120)

S = 1_000_000_000
TRACEBACK = "".join(f"  File \"train.py\", line {n}, in frame_{n}\n" for n in range(1, 15)) + \
    "RuntimeError: loss went to the moon\n"


def _step(job_id: str, attempt: int, rank: int, step: int, end_s: float) -> pb.Event:
    ev = pb.Event()
    s = ev.step
    s.job_id, s.attempt, s.rank, s.step = job_id, attempt, rank, step
    s.loss, s.step_time_s, s.tokens_per_s, s.end_ns = 2.5, 0.5, 1000.0, int(end_s * S)
    return ev


def _coll(job_id: str, attempt: int, rank: int, seq: int, enter_s: float, exit_s: float | None) -> pb.Event:
    ev = pb.Event()
    c = ev.collective
    c.job_id, c.attempt, c.rank, c.group, c.group_size = job_id, attempt, rank, "0", 2
    c.seq, c.op, c.state, c.step = seq, "all_reduce", "started" if exit_s is None else "completed", 0
    c.input_sizes.add().dims.extend([4])
    c.input_dtypes.append("float32")
    c.output_sizes.add().dims.extend([4])
    c.output_dtypes.append("float32")
    c.enter_ns = int(enter_s * S)
    if exit_s is not None:
        c.exit_ns = int(exit_s * S)
    return ev


def _two_attempts(store: Store, name: str) -> str:
    """A job whose attempt 1 failed and attempt 2 runs."""
    job = store.create_job(name, total_steps=10, config_json="{}")
    store.set_job_state(job, JobState.PLACING, "placing")
    store.create_attempt(job)
    store.set_attempt_state(job, 1, AttemptState.RUNNING)
    store.set_attempt_state(job, 1, AttemptState.FAILED, "rank 1 exited")
    store.create_attempt(job)
    store.set_attempt_state(job, 2, AttemptState.RUNNING)
    return job


def _report(store_url: str, job: str, capsys: pytest.CaptureFixture[str]) -> dict:
    capsys.readouterr()
    assert main(["report", job, "--store", store_url, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


INCIDENT_KEYS = {"attempt", "kind", "rank", "node", "detector", "evidence", "ended_attempt", "detected_at",
                 "detected_after_s", "recovery_s", "next_attempt_after_s", "exit_code", "traceback"}
ATTEMPT_KEYS = {"number", "state", "started_at", "ended_at", "wall_s", "reason"}


def test_report_of_a_job_with_steps(store: Store, store_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    job = _two_attempts(store, "steps")
    t0 = time.time()
    store.record_batch("a", 1, 1, [_step(job, 1, r, k, t0 + k + r / 10) for k in (1, 2, 3) for r in (0, 1)]
                       + [_step(job, 2, 0, 1, t0 + 9.0)])
    store.record_incident(job, 1, "crash", "crash", "rank 1 exited", rank=1, node="n1",
                          detected_at=t0 + 3.6, traceback=TRACEBACK, exit_code=1)
    store.record_incident(job, 1, "straggler", "straggler", "rank 0 slow", rank=0, node="n0", detected_at=t0 + 2.5)
    out = _report(store_url, job, capsys)
    assert out["ettr"] is not None and out["ettr"] > 0
    crash, slow = out["incidents"]
    assert set(crash) >= INCIDENT_KEYS and set(slow) >= INCIDENT_KEYS
    # from the newest step end before detection: rank 1's step 3 at +3.1
    assert (crash["kind"], crash["ended_attempt"], crash["exit_code"], crash["traceback"]) == (
        "crash", True, 1, TRACEBACK)
    assert crash["detected_at"] == pytest.approx(t0 + 3.6) and crash["detected_after_s"] == pytest.approx(0.5)
    assert crash["recovery_s"] == pytest.approx(5.4) and crash["next_attempt_after_s"] is not None
    # an incident the attempt ran on has its detection time too: from step 2 of rank 1 at +2.1
    assert (slow["ended_attempt"], slow["exit_code"], slow["traceback"]) == (False, None, "")
    assert slow["detected_after_s"] == pytest.approx(0.4) and slow["recovery_s"] is None
    assert [set(a) for a in out["attempts_detail"]] == [ATTEMPT_KEYS, ATTEMPT_KEYS]
    assert [(a["number"], a["state"], a["reason"]) for a in out["attempts_detail"]] == [
        (1, "FAILED", "rank 1 exited"), (2, "RUNNING", "")]
    assert out["attempts_detail"][0]["ended_at"] is not None and out["attempts_detail"][1]["ended_at"] is None


def test_report_of_a_job_with_only_collectives(store: Store, store_url: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    job = _two_attempts(store, "no-step-api")
    t0 = time.time()
    events = [_coll(job, 1, r, q, t0 + q, t0 + q + 0.25) for q in (1, 2) for r in (0, 1)]
    events += [_coll(job, 1, 0, 3, t0 + 3, None)]  # rank 0 waits in seq 3: rank 1 died
    events += [_coll(job, 2, r, 1, t0 + 8, None) for r in (0, 1)]  # gloo: entries, no completion yet
    store.record_batch("a", 1, 1, events)
    store.record_incident(job, 1, "crash", "crash", "rank 1 was killed", rank=1, node="n1",
                          detected_at=t0 + 4.0, traceback="", exit_code=-9)
    store.record_incident(job, 2, "hang", "flight-recorder", "rank 1 never entered seq 2", rank=1, node="n1",
                          detected_at=t0 + 10.0)
    store.record_incident(job, 2, "agent_loss", "heartbeat", "agent silent", rank=-1, node="n2",
                          detected_at=t0 + 7.0)
    out = _report(store_url, job, capsys)
    assert out["ettr"] is None and out["productive_s"] == 0.0
    killed, hang, lost = out["incidents"]
    assert all(set(i) >= INCIDENT_KEYS for i in out["incidents"])
    # from the last completed collective (seq 2 at +2.25), not rank 0's newer entry into seq 3
    assert (killed["exit_code"], killed["traceback"], killed["detected_after_s"]) == (-9, "", pytest.approx(1.75))
    assert killed["recovery_s"] is None and killed["next_attempt_after_s"] is not None
    assert hang["detected_after_s"] == pytest.approx(2.0)  # the newest entry, without a completion
    assert lost["detected_after_s"] is None  # nothing of attempt 2 had happened by +7
    assert [(a["number"], a["state"]) for a in out["attempts_detail"]] == [(1, "FAILED"), (2, "RUNNING")]
    assert all(a["wall_s"] >= 0 for a in out["attempts_detail"])


def test_report_text_shows_a_signal_death_and_the_traceback_tail(store: Store, store_url: str,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    job = _two_attempts(store, "text")
    t0 = time.time()
    store.record_batch("a", 1, 1, [_coll(job, 1, 0, 1, t0 + 1, t0 + 1.5)])
    store.record_incident(job, 1, "crash", "crash", "rank 1 was killed", rank=1, node="n1",
                          detected_at=t0 + 2.0, traceback=TRACEBACK, exit_code=-9)
    capsys.readouterr()
    assert main(["report", job, "--store", store_url]) == 0
    text = capsys.readouterr().out
    assert "ETTR: not measured" in text and "fleet.step" in text
    assert "killed by signal 9 (SIGKILL)" in text
    lines = text.splitlines()
    shown = [ln for ln in lines if ln.startswith("    ") and ("File" in ln or "Error" in ln)]
    assert shown == ["    " + ln for ln in TRACEBACK.splitlines()[-10:]]  # the last 10, indented
    assert "    ..." in lines and "line 5, in frame_5" not in text


def test_replay_lists_incidents_with_exit_code_and_traceback(store: Store, store_url: str,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    job = _two_attempts(store, "replay")
    t0 = time.time()
    store.record_batch("a", 1, 1, [_coll(job, 1, r, 1, t0 + 1, t0 + 1.5) for r in (0, 1)])
    store.record_incident(job, 1, "crash", "crash", "rank 1 exited", rank=1, node="n1",
                          detected_at=t0 + 2.0, traceback=TRACEBACK, exit_code=3)
    store.record_incident(job, 2, "hang", "flight-recorder", "rank 0 never entered", rank=0, node="n0")
    capsys.readouterr()
    assert main(["replay", job, "--store", store_url, "--json"]) == 0
    incidents = json.loads(capsys.readouterr().out)["incidents"]
    assert [(i["kind"], i["exit_code"], i["traceback"]) for i in incidents] == [
        ("crash", 3, TRACEBACK), ("hang", None, "")]
    assert main(["replay", job, "--store", store_url]) == 0
    text = capsys.readouterr().out
    assert "rank 1 exited; exit code 3" in text
    assert "    RuntimeError: loss went to the moon" in text and "line 4, in frame_4" not in text


def _sdc(job_id: str, attempt: int, rank: int, step: int, kind: str, value: str, ok: bool,
         detail: str = "") -> pb.Event:
    return pb.Event(sdc=pb.SdcCheckEvent(job_id=job_id, attempt=attempt, rank=rank, step=step, kind=kind,
                                         value=value, expected="d0", ok=ok, detail=detail, time_ns=time.time_ns()))


def _sdc_job(store: Store) -> str:
    """Attempt 1 on 4 ranks over 2 nodes: a transient flip at step 31 (rolled back in memory),
    then a persistent one at step 61 that ended it; attempt 2 runs."""
    job = _two_attempts(store, "sdc")
    for attempt in (1, 2):
        for rank, node in enumerate(["node-0", "node-0", "node-1", "node-1"]):
            store.record_rank(job, attempt, rank, node, 100 + rank)
    transient = json.dumps({"first_bad_step": 31, "suspects": [2], "state": "weights", "replays": 1,
                            "rollback_step": 30, "triage": ["step 40: rank 2's weights differ from ranks [0, 1, 3]",
                                                            "replay 1 of steps 31..40: rank 2 agrees now"],
                            "evidence": "the flip did not repeat"})
    persistent = json.dumps({"first_bad_step": 61, "suspects": [3], "state": "weights+optimizer", "replays": 1,
                             "rollback_step": 60, "triage": ["step 70: rank 3 differs", "replay 1: rank 3 "
                                                             "differs again"], "evidence": "it repeats"})
    events = [_sdc(job, 1, r, s, "fingerprint", "d0", ok=not (r, s) in ((2, 40), (3, 70)))
              for s in (10, 20, 30, 40, 50, 60, 70) for r in range(4)]
    events += [_sdc(job, 1, r, 40, "replay", "d0", ok=True) for r in range(4)]
    events += [_sdc(job, 1, 0, 44, "trigger", "53.1", ok=False, detail="grad norm 53.1 > 10 x running median 2.3"),
               _sdc(job, 1, 2, 40, "verdict", "transient", ok=False, detail=transient),
               _sdc(job, 1, 0, 44, "verdict", "clean", ok=True, detail=json.dumps({"replays": 1, "triage": []})),
               _sdc(job, 1, 3, 70, "verdict", "persistent", ok=False, detail=persistent)]
    store.record_batch("a", 1, 1, events)
    store.record_incident(job, 1, "sdc", "sdc_transient", "transient silent data corruption ...", rank=2,
                          node="node-1")
    store.record_incident(job, 1, "sdc", "sdc_persistent", "persistent silent data corruption ...", rank=3,
                          node="node-1")
    return job


def test_report_shows_the_sdc_incidents(store: Store, store_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    job = _sdc_job(store)
    out = _report(store_url, job, capsys)["sdc"]
    assert (out["fingerprint_checks"], out["fingerprints"], out["mismatches"], out["triggers"], out["replays"]) == (
        7, 28, 2, 1, 4)
    transient, persistent = out["incidents"]
    assert {k: transient[k] for k in ("attempt", "verdict", "first_bad_step", "suspect_rank", "suspect_node",
                                      "rollback_step", "replays", "detector")} == {
        "attempt": 1, "verdict": "transient", "first_bad_step": 31, "suspect_rank": 2, "suspect_node": "node-1",
        "rollback_step": 30, "replays": 1, "detector": "sdc_transient"}
    assert (persistent["verdict"], persistent["first_bad_step"], persistent["suspect_rank"],
            persistent["rollback_step"]) == ("persistent", 61, 3, 60)
    assert persistent["triage"] == ["step 70: rank 3 differs", "replay 1: rank 3 differs again"]
    assert [v["verdict"] for v in out["verdicts"]] == ["transient", "clean", "persistent"]

    assert main(["report", job, "--store", store_url]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "silent data corruption: 7 fingerprint check(s) (28 fingerprints), 2 mismatch(es), 1 trigger(s), " \
           "4 replay(s)" in text
    assert "SDC incidents" in text and "weights+optimizer" in text and "replay 1 of steps 31..40" in text
    assert "1 trigger triage(s) found no corruption (clean)" in text


def test_replay_shows_the_sdc_incidents(store: Store, store_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    job = _sdc_job(store)
    capsys.readouterr()
    assert main(["replay", job, "--store", store_url, "--json"]) == 0
    sdc = json.loads(capsys.readouterr().out)["sdc"]
    assert [(i["verdict"], i["first_bad_step"], i["suspect_node"]) for i in sdc["incidents"]] == [
        ("transient", 31, "node-1"), ("persistent", 61, "node-1")]
    assert main(["replay", job, "--store", store_url, "--attempt", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["sdc"]["incidents"] == []
    assert main(["replay", job, "--store", store_url]) == 0
    lines = [" ".join(ln.split()) for ln in capsys.readouterr().out.splitlines()]
    sdc_lines = [ln for ln in lines if ln.startswith("attempt 1: SDC")]
    assert sdc_lines == [
        "attempt 1: SDC TRANSIENT from step 31, rank 2 on node-1 (weights), 1 replay(s), rolled back to step 30; "
        "triage: step 40: rank 2's weights differ from ranks [0, 1, 3]; replay 1 of steps 31..40: rank 2 agrees now",
        "attempt 1: SDC PERSISTENT from step 61, rank 3 on node-1 (weights+optimizer), 1 replay(s), rolled back to "
        "step 60; triage: step 70: rank 3 differs; replay 1: rank 3 differs again"], lines
