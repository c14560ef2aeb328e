"""Store tests on both backends: a real SQLite file and a real PostgreSQL database."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from sqlalchemy import event

from fleet.controlplane.errors import ConfigError, FleetError, NotFoundError, StateError
from fleet.controlplane.lifecycle import AttemptState, JobState, NodeActor, NodeState
from fleet.controlplane.store import RecoveryRecord, Store
from fleet.controlplane.store.incidents import TRACEBACK_MAX_CHARS
from fleet.proto import events_pb2 as pb
from fleet.proto.kinds import IncidentKind

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def store(store_url: str):
    with Store(store_url) as s:
        yield s


@pytest.fixture
def job(store: Store) -> str:
    job_id = store.create_job("llama", total_steps=100, config_json='{"a": 1}')
    store.set_job_state(job_id, JobState.PLACING, "placing")
    assert store.create_attempt(job_id) == 1
    return job_id


def coll(job_id: str, seq: int, state: str = "started", *, rank: int = 0, attempt: int = 1,
         group: str = "0", op: str = "all_reduce", dur_ns: int = 2_000_000, measured: bool = True) -> pb.Event:
    ev = pb.Event()
    c = ev.collective
    c.job_id, c.attempt, c.rank, c.group, c.group_size = job_id, attempt, rank, group, 4
    c.seq, c.op, c.state, c.step = seq, op, state, seq // 10
    c.input_sizes.add().dims.extend([8, 16])
    c.input_dtypes.append("float32")
    c.output_sizes.add().dims.extend([8, 16])
    c.output_dtypes.append("float32")
    c.enter_ns = 1_000_000_000 + seq * 10_000_000
    if state != "started":
        c.exit_ns = c.enter_ns + dur_ns
        if measured:
            c.duration_ns, c.timing = dur_ns, pb.COLLECTIVE_TIMING_WRAPPER
        else:
            c.exit_estimated = True
    return ev


def step_ev(job_id: str, step: int, *, rank: int = 0, attempt: int = 1) -> pb.Event:
    ev = pb.Event()
    s = ev.step
    s.job_id, s.attempt, s.rank, s.step = job_id, attempt, rank, step
    s.loss, s.step_time_s, s.tokens_per_s, s.end_ns = 2.5, 0.1, 1000.0, step * 1000
    return ev


# -- lifecycle ----------------------------------------------------------------------------

def test_job_lifecycle_transitions_are_stored(store: Store, job: str) -> None:
    store.set_job_state(job, JobState.RUNNING, "all ranks up")
    store.set_job_state(job, JobState.SUCCEEDED, "done")
    rec = store.get_job(job)
    assert rec.state is JobState.SUCCEEDED and rec.reason == "done"
    assert rec.ended_at is not None and rec.attempts == 1 and rec.total_steps == 100
    assert job.startswith("j-") and len(job) == len("j-20250101-120000-abcd")
    jobs = [(t.entity, t.from_state, t.to_state) for t in store.transitions(job)]
    assert jobs == [
        ("job", None, "PENDING"),
        ("job", "PENDING", "PLACING"),
        ("attempt", None, "PLACING"),
        ("job", "PLACING", "RUNNING"),
        ("job", "RUNNING", "SUCCEEDED"),
    ]


def test_illegal_transition_raises_and_writes_nothing(store: Store, job: str) -> None:
    before = store.transitions(job)
    with pytest.raises(StateError, match="PLACING -> SUCCEEDED"):
        store.set_job_state(job, JobState.SUCCEEDED)
    with pytest.raises(StateError):
        store.set_attempt_state(job, 1, AttemptState.SUCCEEDED)
    assert store.transitions(job) == before
    assert store.get_job(job).state is JobState.PLACING
    assert store.get_attempts(job)[0].state is AttemptState.PLACING


def test_attempts(store: Store, job: str) -> None:
    store.set_attempt_state(job, 1, AttemptState.RUNNING)
    store.set_attempt_restored(job, 1, 0)
    store.set_attempt_final_step(job, 1, 42)
    store.set_attempt_state(job, 1, AttemptState.FAILED, "rank 3 crashed")
    assert store.create_attempt(job) == 2
    a1, a2 = store.get_attempts(job)
    assert (a1.number, a1.state, a1.restored_step, a1.final_step, a1.reason) == (
        1, AttemptState.FAILED, 0, 42, "rank 3 crashed")
    assert a1.ended_at is not None and a2.ended_at is None and a2.state is AttemptState.PLACING
    assert [t.to_state for t in store.transitions(job) if t.attempt == 1] == [
        "PLACING", "RUNNING", "FAILED"]
    with pytest.raises(NotFoundError):
        store.set_attempt_state(job, 9, AttemptState.RUNNING)


def test_missing_job(store: Store) -> None:
    with pytest.raises(NotFoundError, match="j-nope"):
        store.get_job("j-nope")
    with pytest.raises(NotFoundError):
        store.set_job_state("j-nope", JobState.PLACING)
    with pytest.raises(NotFoundError):
        store.create_attempt("j-nope")


def test_list_jobs_newest_first(store: Store) -> None:
    ids = [store.create_job(f"j{i}", 10, "{}") for i in range(3)]
    listed = [j.id for j in store.list_jobs()]
    assert listed == list(reversed(ids))
    assert len(store.list_jobs(limit=2)) == 2


# -- ingest -------------------------------------------------------------------------------

def test_record_batch_is_idempotent(store: Store, job: str) -> None:
    events = [coll(job, 1), step_ev(job, 1)]
    assert store.record_batch("agent-a", 1, 1, events) is True
    assert store.record_batch("agent-a", 1, 1, [coll(job, 2), step_ev(job, 2)]) is False
    assert len(store.collectives(job)) == 1 and len(store.steps(job)) == 1
    assert store.committed_seq("agent-a", 1) == 1
    assert store.committed_seq("agent-a", 2) == 0
    assert store.record_batch("agent-a", 2, 1, []) is True  # a new epoch restarts seq


def test_collective_started_and_completed_collapse_in_one_batch(store: Store, job: str) -> None:
    store.record_batch("a", 1, 1, [coll(job, 1), coll(job, 1, "completed"), coll(job, 2)])
    rows = store.collectives(job)
    assert [(r.seq, r.state) for r in rows] == [(1, "completed"), (2, "started")]
    assert rows[0].exit_ns == rows[0].enter_ns + 2_000_000 and rows[1].exit_ns is None
    assert rows[0].input_sizes == ((8, 16),) and rows[0].output_dtypes == ("float32",)


def test_collective_completion_across_batches(store: Store, job: str) -> None:
    store.record_batch("a", 1, 1, [coll(job, 1), coll(job, 2)])
    store.record_batch("a", 1, 2, [coll(job, 1, "completed"), coll(job, 2, "failed"),
                                   coll(job, 3, "completed")])  # start of 3 never seen
    store.record_batch("a", 1, 3, [coll(job, 3)])  # a late start never undoes completion
    rows = store.collectives(job)
    assert [(r.seq, r.state, r.exit_ns is not None) for r in rows] == [
        (1, "completed", True), (2, "failed", True), (3, "completed", True)]


def test_collective_queries_and_summary(store: Store, job: str) -> None:
    events = []
    for rank in range(2):
        for seq in (1, 2, 3, 5):  # rank 1 misses nothing but both skip seq 4
            events.append(coll(job, seq, rank=rank, op="broadcast" if seq == 1 else "all_reduce"))
            if not (rank == 1 and seq == 5):
                events.append(coll(job, seq, "completed", rank=rank, dur_ns=4_000_000))
    events.append(coll(job, 1, "completed", group="tp", rank=0))
    events.append(coll(job, 2, group="tp", rank=0))  # completed, but only seen retired by a poll
    events.append(coll(job, 2, "completed", group="tp", rank=0, dur_ns=90_000_000, measured=False))
    store.record_batch("a", 1, 1, events)
    assert len(store.collectives(job, attempt=1, rank=1, group="0")) == 4
    assert [r.group for r in store.collectives(job, rank=0)] == ["0"] * 4 + ["tp"] * 2
    summary = {(s.rank, s.group): s for s in store.collective_summary(job, attempt=1)}
    s0, s1, tp = summary[0, "0"], summary[1, "0"], summary[0, "tp"]
    assert (s0.count, s0.first_seq, s0.last_seq, s0.consecutive) == (4, 1, 5, False)
    assert (s0.completed, s0.last_completed_seq) == (4, 5)
    assert (s1.completed, s1.last_completed_seq) == (3, 3)
    assert dict(s0.ops) == {"broadcast": 1, "all_reduce": 3}
    assert s0.mean_duration_ms == pytest.approx(4.0)
    # the estimated exit is no duration: the mean is of the measured one alone
    assert tp.consecutive and tp.count == 2 and tp.mean_duration_ms == pytest.approx(2.0)
    assert (tp.measured, tp.timings, s1.measured, s1.timings) == (1, ("wrapper",), 3, ("wrapper",))
    assert store.collective_summary(job, attempt=2) == []


def test_steps_status_checkpoints(store: Store, job: str) -> None:
    status = pb.Event()
    w = status.status
    w.job_id, w.attempt, w.rank, w.state, w.restored_step = job, 1, 0, pb.WorkerStatus.RESTORED, 20
    w.pid, w.hostname, w.time_ns, w.phase_s = 123, "h1", 5, 1.5
    ckpt = pb.Event()
    c = ckpt.checkpoint
    c.job_id, c.attempt, c.rank, c.step, c.path = job, 1, 0, 30, "/ckpt/30"
    c.manifest_sha256, c.save_s, c.time_ns = "ab" * 32, 2.0, 1_700_000_000_000_000_000
    events = [step_ev(job, s, rank=r) for s in (21, 22, 23) for r in (1, 0)]
    store.record_batch("a", 1, 1, [status, ckpt, *events])
    assert [(s.step, s.rank) for s in store.steps(job)] == [
        (21, 0), (21, 1), (22, 0), (22, 1), (23, 0), (23, 1)]
    assert [s.step for s in store.steps(job, attempt=1, rank=1)] == [21, 22, 23]
    assert store.last_step(job) == 23 and store.last_step(job, attempt=2) == 0
    assert store.get_job(job).steps_completed == 23
    assert store.get_attempts(job)[0].restored_step == 20
    (ws,) = store.worker_status(job, attempt=1)
    assert (ws.state, ws.pid, ws.hostname, ws.restored_step) == ("RESTORED", 123, "h1", 20)
    latest = store.latest_valid_checkpoint(job)
    assert latest is not None and (latest.step, latest.valid) == (30, True)
    assert latest.created_at == pytest.approx(1_700_000_000.0)
    assert store.latest_valid_checkpoint(job, before_step=30) is None
    store.invalidate_checkpoint(job, 30)
    assert store.latest_valid_checkpoint(job) is None
    assert [k.valid for k in store.checkpoints(job)] == [False]


def test_native_op_names_are_stored_canonical_and_diagnosed_as_one_vocabulary(store: Store, job: str) -> None:
    """Ranks whose recorders named the same collective differently (native ``allreduce``,
    the wrapper's ``all_reduce``) store one name: no per-read folding, no false mismatch."""
    from fleet.controlplane.diagnosis import diagnose_attempt

    native = {0: "allreduce", 1: "gloo:allreduce", 2: "all_reduce", 3: "all_reduce"}
    gathers = {0: "_allgather_base", 1: "all_gather_into_tensor", 2: "allgather", 3: "all_gather"}
    events = []
    for rank in range(4):
        store.record_rank(job, 1, rank, "n1", 100 + rank)
        for seq, op in ((1, native[rank]), (2, gathers[rank]), (3, "nccl:send 0->1")):
            events.append(coll(job, seq, "completed", rank=rank, op=op))
    store.record_batch("a", 1, 1, events)
    assert {r.op for r in store.collectives(job)} == {"all_reduce", "all_gather", "send 0->1"}
    assert {dict(s.ops)["all_reduce"] for s in store.collective_summary(job)} == {1}
    _, diagnosis = diagnose_attempt(store, job, 1)
    assert diagnosis.verdict != "mismatch" and not diagnosis.culprit_ranks, diagnosis.summary


def test_a_checkpoint_reported_invalid_is_invalid_everywhere(store: Store, job: str) -> None:
    from fleet.controlplane.replay import replay_report
    from fleet.controlplane.report import job_report

    def ckpt(step: int, **kw: object) -> pb.Event:
        return pb.Event(checkpoint=pb.CheckpointEvent(job_id=job, attempt=1, rank=0, step=step,
                                                      path=f"/ckpt/{step}", manifest_sha256="ab" * 32,
                                                      save_s=1.0, **kw))

    store.record_batch("a", 1, 1, [ckpt(10), ckpt(20)])
    store.record_batch("a", 1, 2, [ckpt(20, invalid=True, reason="__0_0.distcp does not match its sha256"),
                                   ckpt(40, invalid=True, reason="never committed")])  # no row: ignored
    assert [(c.step, c.valid) for c in store.checkpoints(job)] == [(10, True), (20, False)]
    assert store.latest_valid_checkpoint(job).step == 10
    (action,) = store.actions(job)
    assert (action.kind, action.attempt) == ("ckpt_invalid", 1)
    assert action.cause == "checkpoint of step 20 invalid: __0_0.distcp does not match its sha256"
    assert [(c["step"], c["valid"]) for c in replay_report(store, job)["checkpoints"]] == [(10, True), (20, False)]
    report = job_report(store.get_job(job), store.get_attempts(job), store.steps(job), store.incidents(job),
                        store.actions(job), store.checkpoints(job), store.list_nodes(), time.time())
    assert [(c["step"], c["valid"]) for c in report["checkpoints"]] == [(10, True), (20, False)]
    assert report["invalid_checkpoints"] == [action.cause]
    # a re-save of the step is valid again; a commit and an invalidation in one batch: the later wins
    store.record_batch("a", 1, 3, [ckpt(20)])
    store.record_batch("a", 1, 4, [ckpt(10), ckpt(10, invalid=True, reason="rot")])
    assert [(c.step, c.valid) for c in store.checkpoints(job)] == [(10, False), (20, True)]
    store.invalidate_checkpoint(job, 20, "corrupted by chaos")
    assert store.actions(job)[-1].cause == "checkpoint of step 20 invalid: corrupted by chaos"
    assert store.latest_valid_checkpoint(job) is None
    with pytest.raises(NotFoundError):
        store.invalidate_checkpoint(job, 99, "no such step")


def test_ckpt_corrupt_on_disk_reaches_the_store_through_the_restore(store: Store, job: str, tmp_path: Path) -> None:
    """The real path: a committed checkpoint, the chaos fault's corruption, the restore's
    verification (rank 0's ``latest_valid``) and its report, the ingest: the store's flag,
    which replay and report show, then says what the manifest says."""
    from types import SimpleNamespace

    import torch

    from fleet.controlplane.replay import replay_report
    from fleet.workers import checkpoint
    from fleet.workers.train import _Emitter

    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    sent: list[pb.Event] = []
    emit = _Emitter(SimpleNamespace(job_id=job, attempt=1, rank=0), SimpleNamespace(emit=sent.append))
    for step in (10, 20):
        path, sha, save_s = checkpoint.save(tmp_path, step, model, opt)
        emit.checkpoint(step, path, sha, save_s)
    checkpoint.corrupt_newest(tmp_path)                    # what ckpt-corrupt does (step 20)
    skipped: list[checkpoint.InvalidCheckpoint] = []
    assert checkpoint.latest_valid(tmp_path, skipped=skipped)[0] == 10
    for bad in skipped:
        emit.checkpoint_invalid(bad.step, bad.path, bad.reason)
    store.record_batch("a", 1, 1, sent)
    assert [(c.step, c.valid) for c in store.checkpoints(job)] == [(10, True), (20, False)]
    assert [(c["step"], c["valid"]) for c in replay_report(store, job)["checkpoints"]] == [(10, True), (20, False)]
    assert "sha256" in store.actions(job)[-1].cause


# -- nodes, ranks, incidents, actions ------------------------------------------------------

def test_nodes_ranks_incidents_actions(store: Store, job: str) -> None:
    store.upsert_node("n1", "ray-1", "host1", '{"CPU": 8}')
    store.quarantine_node("n1", "GEMM known-answer mismatch")
    store.upsert_node("n1", "ray-1b", "host1", '{"CPU": 8}')  # re-register keeps quarantine
    store.touch_node("n1")
    (n1,) = store.list_nodes()
    assert (n1.ray_node_id, n1.state, n1.quarantine_reason) == (
        "ray-1b", "quarantined", "GEMM known-answer mismatch")
    store.release_node("n1")
    assert store.list_nodes()[0].state == "healthy"
    with pytest.raises(NotFoundError):
        store.touch_node("n9")

    store.record_rank(job, 1, 0, "n1", 100)
    store.record_rank(job, 1, 1, "n1", 101)
    store.record_rank(job, 1, 1, "n2", 201)  # corrected placement
    assert [(r.rank, r.node, r.pid) for r in store.ranks(job, 1)] == [
        (0, "n1", 100), (1, "n2", 201)]
    # many at once (one transaction), correcting one already placed
    store.record_ranks(job, 2, [(r, f"n{r % 2 + 1}", 300 + r) for r in range(4)])
    store.record_ranks(job, 2, [(3, "n1", 999)])
    assert [(r.rank, r.node, r.pid) for r in store.ranks(job, 2)] == [
        (0, "n1", 300), (1, "n2", 301), (2, "n1", 302), (3, "n1", 999)]
    assert store.count_ranks(job, 2) == 4
    with pytest.raises(NotFoundError):
        store.record_ranks("j-nope", 1, [(0, "n1", 1)])

    iid = store.record_incident(job, 1, "hang", "hang-detector", "rank 1 never entered seq 7",
                                rank=1, node="n2")
    (inc,) = store.incidents(job)
    assert (inc.id, inc.rank, inc.node, inc.kind) == (iid, 1, "n2", "hang")
    aid = store.record_action(job, 1, "restart", f"incident {iid}")
    assert [(a.id, a.kind) for a in store.actions(job)] == [(aid, "restart")]
    with pytest.raises(ValueError):
        store.record_action(job, 1, "reboot", "x")
    with pytest.raises(NotFoundError):
        store.record_incident("j-nope", 1, "hang", "d", "e")

    store.record_health("n1", 10, 50.0, 1.5, 1 << 30, 1 << 34, 4)
    (h,) = store.health_samples("n1")
    assert (h.time_ns, h.workers_alive) == (10, 4)


def test_many_nodes_upserted_at_once_as_each_one_alone(store: Store) -> None:
    # a reconnect storm's Hellos: one transaction for many nodes, the same rows as one by one
    store.upsert_node("n1", "ray-1", "host1", '{"CPU": 8}')
    store.quarantine_node("n1", "GEMM known-answer mismatch")
    store.upsert_nodes([("n1", "ray-1b", "host1b"), ("n2", "ray-2", "host2"), ("n3", "ray-3", "host3"),
                        ("n2", "ray-2b", "host2b")])   # a name twice: its last identity
    nodes = {n.name: n for n in store.list_nodes()}
    assert {name: (n.ray_node_id, n.hostname, n.state) for name, n in nodes.items()} == {
        "n1": ("ray-1b", "host1b", "quarantined"), "n2": ("ray-2b", "host2b", "healthy"),
        "n3": ("ray-3", "host3", "healthy")}
    assert nodes["n1"].resources_json == '{"CPU": 8}' and nodes["n2"].resources_json == "{}"
    store.upsert_nodes([("n2", "ray-2c", "host2c")])
    assert [t.reason for t in store.node_history("n2")] == ["registered"]   # registered once
    assert store.upsert_nodes([]) is None


def test_committed_seqs_of_many_streams(store: Store, job: str) -> None:
    assert store.committed_seqs([("a", 1), ("b", 1)]) == {("a", 1): 0, ("b", 1): 0}
    assert store.committed_seqs([]) == {}


def test_node_health(store: Store) -> None:
    store.upsert_node("n1", "ray-1", "host1", "{}")
    (n1,) = store.list_nodes()
    assert (n1.health, n1.health_reason) == ("unknown", "")
    store.set_node_health("n1", "failed", "GEMM known-answer mismatch on GPU 3")
    store.upsert_node("n1", "ray-1b", "host1", "{}")  # re-register keeps the verdict
    (n1,) = store.list_nodes()
    assert (n1.health, n1.health_reason, n1.state) == (
        "failed", "GEMM known-answer mismatch on GPU 3", "healthy")
    with pytest.raises(NotFoundError, match="n9"):
        store.set_node_health("n9", "ok", "")


def test_sdc_checks(store: Store, job: str) -> None:
    a = store.record_sdc_check(job, 1, 20, "fingerprint", "ab12", "ab12", True, rank=1,
                               node="n1", time_ns=7)
    b = store.record_sdc_check(job, 1, 10, "gemm", "1.5", "1.0", False, "GPU 3 differs",
                               node="n2")
    store.create_attempt(job)
    store.record_sdc_check(job, 2, 5, "replay", "cd", "cd", True, rank=0)
    checks = store.sdc_checks(job, attempt=1)
    assert [(c.id, c.step, c.kind, c.ok) for c in checks] == [
        (b, 10, "gemm", False), (a, 20, "fingerprint", True)]
    gemm, param = checks
    assert (gemm.rank, gemm.node, gemm.detail, gemm.value, gemm.expected) == (
        None, "n2", "GPU 3 differs", "1.5", "1.0")
    assert gemm.time_ns > 1_600_000_000 * 10**9 and param.time_ns == 7
    assert (param.rank, param.node) == (1, "n1")
    assert [c.id for c in store.sdc_checks(job, kind="fingerprint")] == [a]
    assert [c.kind for c in store.sdc_checks(job, kind="replay")] == ["replay"]
    assert [c.attempt for c in store.sdc_checks(job)] == [1, 1, 2]
    assert store.sdc_checks("j-other") == []
    with pytest.raises(ValueError, match="kind"):
        store.record_sdc_check(job, 1, 1, "vibes", "", "", True)
    with pytest.raises(NotFoundError):
        store.record_sdc_check("j-nope", 1, 1, "gemm", "", "", True)


def test_ingest_drops(store: Store) -> None:
    first = store.record_drop("agent-a", "n1", 3, 10, 12, 3000, "spill disk full", "agent")
    store.record_drop("agent-b", "n2", 1, 4, 4, 17, "event 2: unknown dtype", "controller")
    (d,) = store.ingest_drops("n1")
    assert (d.id, d.agent_id, d.epoch, d.first_seq, d.last_seq, d.events, d.reason, d.source) == (
        first, "agent-a", 3, 10, 12, 3000, "spill disk full", "agent")
    assert d.at == pytest.approx(time.time(), abs=60)
    assert [x.node for x in store.ingest_drops()] == ["n1", "n2"]
    assert store.ingest_drops("n9") == []
    # a DropReport sent again after a broken stream is recorded once
    assert store.record_drop("agent-a", "n1", 3, 10, 12, 3000, "spill disk full", "agent") == first
    assert len(store.ingest_drops("n1")) == 1
    with pytest.raises(ValueError, match="source"):
        store.record_drop("a", "n", 1, 1, 1, 1, "x", "gremlins")


# -- construction ---------------------------------------------------------------------------

@pytest.mark.parametrize("url", [
    "not a url",
    "mysql://fleet:s3cret@db.example/fleet",
    "nosuchdb://fleet:s3cret@db.example/fleet",
])
def test_bad_url(url: str) -> None:
    with pytest.raises(FleetError) as err:
        Store(url)
    assert "s3cret" not in str(err.value)
    assert isinstance(err.value, ConfigError)
    assert url.split("@")[-1] in str(err.value)


def test_sqlite_folder_that_cannot_be_created(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="cannot create folder"):
        Store(f"sqlite:///{tmp_path}/file/sub/fleet.db")


def test_closed_store_refuses(store_url: str) -> None:
    s = Store(store_url)
    s.close()
    s.close()
    with pytest.raises(StateError, match="closed"):
        s.list_jobs()


def test_reopen_keeps_data(store_url: str) -> None:
    with Store(store_url) as s:
        job_id = s.create_job("x", 1, "{}")
    with Store(store_url) as s:
        assert s.get_job(job_id).name == "x"


# -- concurrency and throughput ------------------------------------------------------------

def test_concurrent_writers_lose_nothing(store: Store, job: str) -> None:
    n_threads, n_batches, per_batch = 4, 50, 10
    errors: list[BaseException] = []
    stop = threading.Event()

    def writer(t: int) -> None:
        try:
            for b in range(1, n_batches + 1):
                events = [coll(job, b, rank=t, group=f"g{i}") for i in range(per_batch)]
                events += [coll(job, b, "completed", rank=t, group=f"g{i}")
                           for i in range(per_batch)]
                events.append(step_ev(job, b, rank=t))
                assert store.record_batch(f"agent-{t}", 1, b, events)
        except BaseException as e:  # surfaced by the main thread below
            errors.append(e)

    def reader() -> None:
        try:
            while not stop.is_set():
                store.collective_summary(job)
                store.last_step(job)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(t,), name=f"writer-{t}")
               for t in range(n_threads)]
    threads.append(threading.Thread(target=reader, name="reader"))
    for th in threads:
        th.start()
    for th in threads[:-1]:
        th.join(timeout=60)
    stop.set()
    threads[-1].join(timeout=10)
    assert not any(th.is_alive() for th in threads)
    assert errors == []
    rows = store.collectives(job)
    assert len(rows) == n_threads * n_batches * per_batch
    assert all(r.state == "completed" for r in rows)
    assert len(store.steps(job)) == n_threads * n_batches
    assert all(store.committed_seq(f"agent-{t}", 1) == n_batches for t in range(n_threads))


def test_in_memory_store_is_shared_between_threads() -> None:
    with Store("sqlite://") as s:
        job_id = s.create_job("m", 1, "{}")
        errors: list[BaseException] = []

        def work(t: int) -> None:
            try:
                for b in range(1, 21):
                    assert s.record_batch(f"m{t}", 1, b, [step_ev(job_id, b, rank=t)])
                    s.get_job(job_id)
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=work, args=(t,), name=f"mem-{t}") for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=30)
        assert errors == [] and len(s.steps(job_id)) == 80


def test_throughput_report(store: Store, job: str, capsys: pytest.CaptureFixture) -> None:
    """Not asserted: prints collective events/s that record_batch sustains on each backend."""
    n_batches, size = 20, 1000
    ops = size // 2
    # Same-batch pairs: each op's start and completion in one batch of 1000 events.
    batches = [[e for k in range(ops) for e in (
        coll(job, b * ops + k, rank=k % 8), coll(job, b * ops + k, "completed", rank=k % 8))]
        for b in range(n_batches)]
    t0 = time.perf_counter()
    for i, events in enumerate(batches):
        store.record_batch("perf-1", 1, i + 1, events)
    same = n_batches * size / (time.perf_counter() - t0)
    # Split: 1000 starts in one batch, their 1000 completions (updates) in the next.
    base = n_batches * ops + 1
    split = []
    for b in range(n_batches // 2):
        seqs = range(base + b * size, base + (b + 1) * size)
        split.append([coll(job, s, rank=1) for s in seqs])
        split.append([coll(job, s, "completed", rank=1) for s in seqs])
    t0 = time.perf_counter()
    for i, events in enumerate(split):
        store.record_batch("perf-2", 1, i + 1, events)
    cross = n_batches * size / (time.perf_counter() - t0)
    with capsys.disabled():
        print(f"\nrecord_batch on {store.dialect}, batches of {size} collective events: "
              f"{same:,.0f} events/s (start+completion in one batch), "
              f"{cross:,.0f} events/s (completions in a later batch)")
    assert len(store.collectives(job)) == n_batches * ops + n_batches // 2 * size


def test_incidents_on_a_node_span_jobs_and_respect_the_window(store: Store, job: str) -> None:
    other = store.create_job("other", total_steps=10, config_json="{}")
    t0 = time.time()
    store.record_incident(job, 1, "crash", "crash", "rank 0 died", rank=0, node="node-0")
    store.record_incident(other, 1, "hang", "flight-recorder", "rank 2 never entered", rank=2, node="node-0")
    store.record_incident(job, 1, "crash", "crash", "rank 3 died", rank=3, node="node-1")
    got = store.incidents_on_node("node-0", since=t0 - 1)
    assert [(i.job_id, i.kind, i.rank) for i in got] == [(job, "crash", 0), (other, "hang", 2)]
    assert store.incidents_on_node("node-0", since=time.time() + 60) == []


def test_step_aggregates_name_the_slowest_rank_lowest_first_on_ties(store: Store, job: str) -> None:
    times = {1: {0: 0.1, 1: 0.3, 2: 0.3, 3: 0.2},     # a tie at the top: the lower rank
             2: {0: 0.5, 1: 0.1, 2: 0.1, 3: 0.1},
             3: {0: 0.2, 1: 0.2, 2: 0.2, 3: 0.9}}
    events = []
    for step, by_rank in times.items():
        for rank, t in by_rank.items():
            ev = step_ev(job, step, rank=rank)
            ev.step.step_time_s = t
            events.append(ev)
    store.record_batch("a", 1, 1, events)
    recorded, steps = store.step_aggregates(job, 1, last=2)
    assert recorded == 3
    assert [(s["step"], s["ranks"], s["slowest_rank"], s["step_time_s_max"]) for s in steps] == [
        (2, 4, 0, 0.5), (3, 4, 3, 0.9)]
    assert store.step_aggregates(job, 1)[1][0]["slowest_rank"] == 1
    assert store.step_aggregates(job, 2) == (0, [])


def test_step_span_and_recoveries(store: Store, job: str) -> None:
    assert store.step_span(job, 1) is None
    store.record_batch("a", 1, 1, [step_ev(job, 4, rank=0), step_ev(job, 5, rank=1), step_ev(job, 3, rank=1)])
    assert store.step_span(job, 1) == (3000, 5, 5000)
    rec = RecoveryRecord(
        job_id=job, incident_id=7, failed_attempt=1, attempt=2, failed_at=100.0, detect_s=0.4,
        teardown_s=0.1, place_s=0.05, pg_init_s=0.2, restore_s=0.3, first_step_s=0.15, total_s=1.2,
        restored_step=4, steps_lost=1, restored_from="memory", reused_workers=3)
    store.record_recovery(rec)
    assert store.recoveries(job) == [rec]
    assert store.recoveries("j-none") == []
    with pytest.raises(NotFoundError):
        store.record_recovery(RecoveryRecord(**{**rec.__dict__, "job_id": "j-none"}))


# -- node lifecycle and history --------------------------------------------------------------

def test_every_node_state_change_is_stored_with_who_and_why(store: Store, job: str) -> None:
    store.upsert_node("n1", "ray-1", "host1", "{}")
    store.upsert_node("n1", "ray-1b", "host1", "{}")  # re-registering is no state change
    assert store.quarantine_node("n1", "2 crashes in 600 s", actor=NodeActor.POLICY, job_id=job) is True
    # already quarantined: the first reason stays and nothing is written
    assert store.quarantine_node("n1", "operator says bad GPU") is False
    (n1,) = store.list_nodes()
    assert (n1.state, n1.quarantine_reason) == (NodeState.QUARANTINED, "2 crashes in 600 s")
    assert store.release_node("n1", reason="GPU replaced") is True
    assert store.release_node("n1") is False  # healthy already: nothing to release
    history = store.node_history("n1")
    assert [(t.from_state, t.to_state, t.reason, t.actor, t.job_id) for t in history] == [
        (None, "healthy", "registered", "controller", None),
        ("healthy", "quarantined", "2 crashes in 600 s", "policy", job),
        ("quarantined", "healthy", "GPU replaced", "operator", None),
    ]
    assert history[1].at == n1.quarantined_since
    assert history[0].at <= history[1].at <= history[2].at
    assert store.node_history("n9") == []
    assert store.last_node_transitions() == {"n1": history[-1]}
    for verb in (lambda: store.quarantine_node("n9", "x"), lambda: store.release_node("n9")):
        with pytest.raises(NotFoundError, match="n9"):
            verb()
    assert store.node_history("n9") == []


def test_a_node_moved_concurrently_is_moved_once(store: Store) -> None:
    store.upsert_node("n1", "ray-1", "host1", "{}")
    n = 4
    barrier = threading.Barrier(n, timeout=30)
    moved: list[bool] = []

    def quarantine(i: int) -> None:
        barrier.wait()
        moved.append(store.quarantine_node("n1", f"reason {i}", actor=NodeActor.POLICY))

    threads = [threading.Thread(target=quarantine, args=(i,), name=f"quarantine-{i}") for i in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert not any(th.is_alive() for th in threads)
    assert sorted(moved) == [False] * (n - 1) + [True]
    history = store.node_history("n1")
    assert [t.to_state for t in history] == ["healthy", "quarantined"]
    assert store.list_nodes()[0].quarantine_reason == history[1].reason


def test_incident_kinds_are_validated_and_read_back_as_enums(store: Store, job: str) -> None:
    store.record_incident(job, 1, IncidentKind.NODE_LOSS, "node_loss", "gone", rank=0, node="n1")
    store.record_incident(job, 1, "agent_loss", "heartbeat", "silent", rank=-1, node="n1")
    with pytest.raises(ValueError, match=r"unknown incident kind 'gpu_fell_off'; known: crash, error"):
        store.record_incident(job, 1, "gpu_fell_off", "d", "e")
    kinds = [i.kind for i in store.incidents(job)]
    assert kinds == [IncidentKind.NODE_LOSS, IncidentKind.AGENT_LOSS]
    assert all(type(k) is IncidentKind for k in kinds)
    assert [i.kind for i in store.incidents_on_node("n1", 0.0)] == kinds


# -- failed programs: traceback and exit code; the last progress before an incident ---------

def test_an_incident_keeps_the_programs_traceback_and_exit_code(store: Store, job: str) -> None:
    tb = 'Traceback (most recent call last):\n  File "train.py", line 3\nValueError: lösung ✗\n'
    store.record_incident(job, 1, "crash", "crash", "rank 1 exited", rank=1, node="n1", traceback=tb, exit_code=1)
    store.record_incident(job, 1, "crash", "crash", "rank 0 killed", rank=0, node="n1", exit_code=-9)
    store.record_incident(job, 1, "hang", "flight-recorder", "rank 2 never entered seq 7", rank=2, node="n1")
    long = "x" * (TRACEBACK_MAX_CHARS + 10) + "\nRuntimeError: the end\n"
    store.record_incident(job, 1, "crash", "crash", "rank 3 exited", rank=3, node="n1", traceback=long, exit_code=2)
    got = [(i.traceback, i.exit_code) for i in store.incidents(job)]
    assert got[:3] == [(tb, 1), ("", -9), ("", None)]
    assert got[3] == (long[-TRACEBACK_MAX_CHARS:], 2) and got[3][0].endswith("RuntimeError: the end\n")
    assert [(i.traceback, i.exit_code) for i in store.incidents_on_node("n1", 0.0)] == got


def _coll_at(job_id: str, attempt: int, rank: int, seq: int, enter_ns: int, exit_ns: int | None) -> pb.Event:
    ev = coll(job_id, seq, "started" if exit_ns is None else "completed", rank=rank, attempt=attempt)
    ev.collective.enter_ns = enter_ns
    if exit_ns is not None:
        ev.collective.exit_ns = exit_ns
    return ev


def _step_at(job_id: str, attempt: int, rank: int, step: int, end_ns: int) -> pb.Event:
    ev = step_ev(job_id, step, rank=rank, attempt=attempt)
    ev.step.end_ns = end_ns
    return ev


def test_last_progress_is_the_newest_step_else_the_newest_completed_collective_else_entry(
        store: Store, job: str, monkeypatch: pytest.MonkeyPatch) -> None:
    s = 1_000_000_000
    store.create_attempt(job)
    store.create_attempt(job)
    events = [_coll_at(job, 1, 0, q, q * s, q * s + s // 2) for q in range(1, 6)]  # seq 1..5 done
    events += [_coll_at(job, 1, r, 6, 6 * s + r, None) for r in (0, 1)]            # both wait in seq 6
    events += [_coll_at(job, 2, 0, q, q * s, None) for q in (1, 2, 3)]            # gloo: no completion
    events += [_step_at(job, 3, r, 1, 20 * s + r * s // 10) for r in (0, 1)]       # step 1 ends at 20.0/20.1 s
    events += [_coll_at(job, 3, 0, 9, 25 * s, 25 * s + 1)]                         # a later collective
    assert store.record_batch("a", 1, 1, events)

    assert store.last_progress_ns(job, 1, 7 * s) == 5 * s + s // 2  # a completion beats a newer entry
    assert store.last_progress_ns(job, 1, 5 * s + 1) == 4 * s + s // 2  # seq 5 had not completed yet
    assert store.last_progress_ns(job, 1, s - 1) is None
    assert store.last_progress_ns(job, 2, 10 * s) == 3 * s  # without completions, the newest entry
    assert store.last_progress_ns(job, 3, 30 * s) == 20 * s + s // 10  # a step beats a later collective
    assert store.last_progress_ns(job, 3, 20 * s + 1) == 20 * s
    assert store.last_progress_ns(job, 3, 19 * s) is None
    assert store.last_progress_ns(job, 4, 30 * s) is None and store.last_progress_ns("j-none", 1, 30 * s) is None
    # the window is what bounds the lookup: with only the two waiting entries in it, no completion
    monkeypatch.setattr(store, "PROGRESS_WINDOW", 2)
    assert store.last_progress_ns(job, 1, 7 * s) == 6 * s + 1


def test_last_progress_is_one_indexed_lookup_per_table(store: Store, job: str) -> None:
    assert store.record_batch("a", 1, 1, [_coll_at(job, 1, 0, 1, 10, 20)])
    statements: list[tuple[str, object]] = []
    listen = lambda _c, _cur, sql, params, *_a: statements.append((sql, params))  # noqa: E731
    event.listen(store._engine, "before_cursor_execute", listen)
    try:
        assert store.last_progress_ns(job, 1, 100) == 20
    finally:
        event.remove(store._engine, "before_cursor_execute", listen)
    queries = [(q, p) for q, p in statements if q.strip().upper() not in ("BEGIN", "COMMIT", "ROLLBACK")]
    assert [("steps" in q, "collectives" in q) for q, _ in queries] == [(True, False), (False, True)]
    if store.dialect == "sqlite":  # PostgreSQL's planner picks a scan for a table this small
        with store._engine.connect() as conn:
            plans = [" ".join(str(r[-1]) for r in conn.exec_driver_sql("EXPLAIN QUERY PLAN " + q, p))
                     for q, p in queries]
        assert "INDEX ix_steps_job_id_attempt_end_ns" in plans[0]
        assert "INDEX ix_collectives_job_id_attempt_enter_ns" in plans[1]
