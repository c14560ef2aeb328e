"""Schema migrations on both backends: from empty, from a store made before migrations,
refusing a newer fleet's store, concurrent first opens, and `fleet db`."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.migration import MigrationContext
from sqlalchemy import Engine, create_engine, event, inspect, text
from sqlalchemy.engine import make_url

from fleet.controlplane.cli.main import main
from fleet.controlplane.errors import ConfigError, FleetError, UnavailableError
from fleet.controlplane.lifecycle import NodeActor
from fleet.controlplane.store import Store, migrate
from fleet.controlplane.store.engine import make_engine
from fleet.controlplane.store.schema import metadata

pytestmark = pytest.mark.timeout(120)

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def engine(store_url: str) -> Iterator[Engine]:
    """A plain engine on the test's store, to build and inspect it behind the Store's back."""
    url = make_url(store_url)
    if url.get_backend_name() == "sqlite":
        Path(url.database).parent.mkdir(parents=True, exist_ok=True)
    eng = create_engine(url)
    try:
        yield eng
    finally:
        eng.dispose()


def _alembic_upgrade(engine: Engine, revision: str) -> None:
    cfg = Config()
    cfg.set_main_option("script_location", str(migrate.MIGRATIONS_DIR))
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)


def _scalar(engine: Engine, sql: str):
    with engine.connect() as conn:
        return conn.execute(text(sql)).scalar()


def test_upgrade_from_empty_reaches_head_and_matches_the_models(store_url: str,
                                                                 engine: Engine) -> None:
    assert migrate.inspect_url(store_url).state == migrate.EMPTY
    assert migrate.upgrade_url(store_url) == (None, migrate.head())
    assert migrate.current(engine) == migrate.head() == "0009"
    with engine.connect() as conn:
        # Alembic misreads SQLite's DEFAULT '' as a difference; its defaults are checked below.
        ctx = MigrationContext.configure(conn, opts={
            "compare_type": True, "compare_server_default": engine.dialect.name != "sqlite"})
        assert compare_metadata(ctx, metadata) == []
        defaults = {c["name"]: c["default"] for c in inspect(conn).get_columns("nodes")}
        assert [defaults["health"].split("::")[0], defaults["health_reason"].split("::")[0]] == [
            "'unknown'", "''"]
    assert migrate.upgrade_url(store_url) == ("0009", "0009")


def test_at_head_opening_costs_one_query(store_url: str) -> None:
    migrate.upgrade_url(store_url)
    eng, write, _ = make_engine(store_url)
    statements: list[str] = []
    event.listen(eng, "before_cursor_execute",
                 lambda _c, _cur, sql, *_a: statements.append(sql.strip().upper()))
    try:
        assert migrate.upgrade(write) == ("0009", "0009")
    finally:
        eng.dispose()
    assert [s for s in statements if s not in ("BEGIN", "ROLLBACK", "COMMIT")] == [
        "SELECT VERSION_NUM FROM ALEMBIC_VERSION"]


def test_store_made_before_migrations_is_stamped_and_upgraded(store_url: str,
                                                              engine: Engine) -> None:
    _alembic_upgrade(engine, "0001")
    with engine.begin() as conn:
        conn.execute(text("DROP TABLE alembic_version"))
        conn.execute(text(
            "INSERT INTO jobs (id, name, state, total_steps, config_json, created_at, "
            "updated_at, ended_at, reason) VALUES ('j-old', 'llama', 'RUNNING', 100, '{}', "
            "1.0, 2.0, NULL, '')"))
        conn.execute(text(
            "INSERT INTO collectives (job_id, attempt, rank, group_name, seq, group_size, op, "
            "input_sizes, input_dtypes, output_sizes, output_dtypes, enter_ns, exit_ns, state, "
            "exit_estimated, step) VALUES ('j-old', 1, :rank, '0', 7, 2, 'all_reduce', '[[4]]', "
            "'[\"float32\"]', '[[4]]', '[\"float32\"]', 10, 20, 'completed', FALSE, 3)"),
            [{"rank": 0}, {"rank": 1}])
        conn.execute(text(
            "INSERT INTO steps (job_id, attempt, rank, step, loss, step_time_s, tokens_per_s, "
            "end_ns, grad_norm, lr, mfu, aux_loss, imbalanced, expert_load) VALUES "
            "('j-old', 1, 0, 3, 2.5, 0.1, 1000.0, 30, 1.0, 0.001, 0.4, 0.0, FALSE, '[]')"))
        conn.execute(text(
            "INSERT INTO nodes (name, ray_node_id, hostname, resources_json, state, "
            "quarantine_reason, quarantined_since, last_seen) VALUES "
            "('n1', 'r1', 'h1', '{}', 'quarantined', 'bad GEMM', 5.0, 6.0)"))
    assert migrate.inspect_url(store_url).state == migrate.UNVERSIONED

    assert migrate.upgrade_url(store_url) == ("0001", "0009")
    with Store(store_url) as store:
        job = store.get_job("j-old")
        assert (job.name, job.state.value, job.steps_completed) == ("llama", "RUNNING", 3)
        assert [(c.rank, c.seq, c.state, c.input_sizes) for c in store.collectives("j-old")] == [
            (0, 7, "completed", ((4,),)), (1, 7, "completed", ((4,),))]
        assert [(s.step, s.lr) for s in store.steps("j-old")] == [(3, 0.001)]
        (node,) = store.list_nodes()
        assert (node.state, node.quarantine_reason, node.health, node.health_reason) == (
            "quarantined", "bad GEMM", "unknown", "")
        # its history starts with the state it was in, by the migration, at its quarantine time
        assert [(t.from_state, t.to_state, t.reason, t.actor, t.job_id, t.at)
                for t in store.node_history("n1")] == [(None, "quarantined", "bad GEMM", "migration", None, 5.0)]
        store.release_node("n1")
        assert [t.actor for t in store.node_history("n1")] == ["migration", "operator"]
    assert migrate.current(engine) == "0009"


def test_store_made_before_migrations_that_lacks_a_table_is_refused(store_url: str,
                                                                    engine: Engine) -> None:
    _alembic_upgrade(engine, "0001")
    with engine.begin() as conn:
        conn.execute(text("DROP TABLE alembic_version"))
        conn.execute(text("DROP TABLE process_groups"))
    with pytest.raises(FleetError, match="missing: process_groups"):
        Store(store_url)
    assert migrate.current(engine) is None
    assert _scalar(engine, "SELECT count(*) FROM jobs") == 0  # still there, untouched


def test_newer_fleets_store_is_refused_and_kept(store_url: str, engine: Engine,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    with Store(store_url) as store:
        job_id = store.create_job("x", 1, "{}")
    with engine.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = '0099'"))
    with pytest.raises(ConfigError, match=r"revision '0099'.*upgrade fleet"):
        Store(store_url)
    assert migrate.inspect_url(store_url).state == migrate.UNKNOWN
    code = main(["db", "upgrade", "--url", store_url])
    out, err = capsys.readouterr()
    assert code == ConfigError.exit_code
    lines = (out + err).strip().splitlines()  # the error, and its hint
    assert "0099" in lines[0] and len(lines) == 2 and lines[1].startswith("hint: ")
    assert _scalar(engine, "SELECT version_num FROM alembic_version") == "0099"
    assert _scalar(engine, "SELECT id FROM jobs") == job_id


def test_concurrent_first_opens_all_succeed(store_url: str) -> None:
    n = 4
    barrier = threading.Barrier(n, timeout=30)
    errors: list[BaseException] = []
    jobs: list[str] = []

    def open_store() -> None:
        try:
            barrier.wait()
            with Store(store_url) as store:
                jobs.append(store.create_job("x", 1, "{}"))
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=open_store, name=f"opener-{i}") for i in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert not any(th.is_alive() for th in threads)
    assert errors == []
    with Store(store_url) as store:
        assert len(store.list_jobs()) == n


def test_concurrent_first_opens_from_processes(store_url: str, tmp_path: Path) -> None:
    n = 3
    go = tmp_path / "go"
    script = (
        "import sys, time, pathlib\n"
        "from fleet.controlplane.store import Store\n"
        "go = pathlib.Path(sys.argv[2]); pathlib.Path(sys.argv[3]).touch()\n"
        "deadline = time.monotonic() + 60\n"
        "while not go.exists() and time.monotonic() < deadline: time.sleep(0.005)\n"
        "with Store(sys.argv[1]) as s: s.create_job('p', 1, '{}')\n"
    )
    procs = [subprocess.Popen([sys.executable, "-c", script, store_url, str(go),
                               str(tmp_path / f"ready-{i}")], cwd=REPO_ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(n)]
    try:
        deadline = time.monotonic() + 60
        while (sum((tmp_path / f"ready-{i}").exists() for i in range(n)) < n
               and time.monotonic() < deadline):
            time.sleep(0.01)
        go.touch()
        results = [p.communicate(timeout=90) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0] * n, [err for _out, err in results]
    with Store(store_url) as store:
        assert len(store.list_jobs()) == n


def test_fleet_db_upgrade_and_current(store_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["db", "current", "--url", store_url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {
        "url": store_url, "current": None, "head": "0009", "state": "empty"}

    assert main(["db", "upgrade", "--url", store_url]) == 0
    out = capsys.readouterr().out
    assert out.strip() == f"store {store_url} upgraded (empty) -> 0009"
    assert main(["db", "upgrade", "--url", store_url]) == 0
    assert capsys.readouterr().out.strip() == f"store {store_url} already at 0009 (head)"

    assert main(["db", "current", "--url", store_url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {
        "url": store_url, "current": "0009", "head": "0009", "state": "head"}
    assert main(["db", "current", "--url", store_url]) == 0
    assert capsys.readouterr().out.strip() == f"store {store_url} at 0009 (head)"


def test_fleet_db_with_a_cluster_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"sqlite:///{tmp_path}/c.db"
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(f"name: demo\nstore:\n  url: {url}\n")
    assert main(["db", "upgrade", "--cluster", str(cluster)]) == 0
    assert capsys.readouterr().out.strip() == f"store {url} upgraded (empty) -> 0009"


@pytest.mark.parametrize("url, code", [
    ("postgresql+psycopg://fleet:s3cret@127.0.0.1:1/fleet", UnavailableError.exit_code),
    ("mysql://fleet:s3cret@127.0.0.1/fleet", ConfigError.exit_code),
    ("not a url", ConfigError.exit_code),
])
@pytest.mark.parametrize("verb", ["upgrade", "current"])
def test_fleet_db_with_a_bad_url(verb: str, url: str, code: int,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["db", verb, "--url", url]) == code != 0
    out, err = capsys.readouterr()
    lines = (out + err).strip().splitlines()  # the error, and its hint
    assert len(lines) == 2 and lines[1].startswith("hint: ") and "FLEET_STORE" in lines[1], lines
    assert url.split("@")[-1] in lines[0] and "s3cret" not in out + err
    assert "Traceback" not in out + err


REVISIONS = ["0001", "0002", "0003", "0004", "0005", "0006", "0007", "0008"]
BEFORE_NODE_HISTORY = [r for r in REVISIONS if r < "0004"]


@pytest.mark.parametrize("start", BEFORE_NODE_HISTORY)
def test_upgrade_from_every_revision_keeps_nodes_and_starts_their_history(
        store_url: str, engine: Engine, start: str) -> None:
    assert REVISIONS + [migrate.head()] == [f"{i:04d}" for i in range(1, len(REVISIONS) + 2)]
    _alembic_upgrade(engine, start)
    with engine.begin() as conn:
        conn.execute(text(
            "INSERT INTO nodes (name, ray_node_id, hostname, resources_json, state, "
            "quarantine_reason, quarantined_since, last_seen) VALUES "
            "('n0', 'r0', 'h0', '{}', 'healthy', '', NULL, 7.0), "
            "('n1', 'r1', 'h1', '{}', 'quarantined', 'bad GEMM', 5.0, 6.0)"))
    assert migrate.upgrade_url(store_url) == (start, migrate.head())
    assert "node_transitions" in inspect(engine).get_table_names()
    with Store(store_url) as store:
        assert [(n.name, n.state, n.quarantine_reason) for n in store.list_nodes()] == [
            ("n0", "healthy", ""), ("n1", "quarantined", "bad GEMM")]
        assert {name: [(t.from_state, t.to_state, t.reason, t.actor, t.at) for t in store.node_history(name)]
                for name in ("n0", "n1")} == {
            "n0": [(None, "healthy", "registered before node history was kept", "migration", 7.0)],
            "n1": [(None, "quarantined", "bad GEMM", "migration", 5.0)]}
        store.upsert_node("n2", "r2", "h2", "{}")
        assert store.quarantine_node("n0", "crashes", actor=NodeActor.POLICY, job_id="j-1")
        assert [(t.node, t.to_state, t.actor, t.job_id) for t in store.last_node_transitions().values()] == [
            ("n0", "quarantined", "policy", "j-1"), ("n1", "quarantined", "migration", None),
            ("n2", "healthy", "controller", None)]


def test_downgrade_from_head_drops_node_history_only(store_url: str, engine: Engine) -> None:
    with Store(store_url) as store:
        store.upsert_node("n0", "r0", "h0", "{}")
    cfg = Config()
    cfg.set_main_option("script_location", str(migrate.MIGRATIONS_DIR))
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, "0003")
    assert "node_transitions" not in inspect(engine).get_table_names()
    assert _scalar(engine, "SELECT count(*) FROM nodes") == 1
    assert migrate.upgrade_url(store_url) == ("0003", migrate.head())


def test_upgrade_from_0004_keeps_incidents_without_traceback_or_exit_code(store_url: str,
                                                                          engine: Engine) -> None:
    _alembic_upgrade(engine, "0004")
    with engine.begin() as conn:
        conn.execute(text(
            "INSERT INTO jobs (id, name, state, total_steps, config_json, created_at, "
            "updated_at, ended_at, reason) VALUES ('j-old', 'llama', 'RUNNING', 100, '{}', "
            "1.0, 2.0, NULL, '')"))
        conn.execute(text(
            "INSERT INTO incidents (job_id, attempt, kind, rank, node, detector, evidence, detected_at) "
            "VALUES ('j-old', 1, 'crash', 0, 'n0', 'crash', 'rank 0 died', 3.0), "
            "('j-old', 1, 'hang', NULL, NULL, 'flight-recorder', 'rank 1 never entered', 4.0)"))
    assert migrate.upgrade_url(store_url) == ("0004", migrate.head())
    indexes = {i["name"] for t in ("steps", "collectives") for i in inspect(engine).get_indexes(t)}
    assert {"ix_steps_job_id_attempt_end_ns", "ix_collectives_job_id_attempt_enter_ns"} <= indexes
    with Store(store_url) as store:
        assert [(i.kind, i.evidence, i.detected_at, i.traceback, i.exit_code)
                for i in store.incidents("j-old")] == [
            ("crash", "rank 0 died", 3.0, "", None), ("hang", "rank 1 never entered", 4.0, "", None)]
        store.record_incident("j-old", 2, "crash", "crash", "rank 1 died", rank=1,
                              traceback="ValueError: boom\n", exit_code=1)
        assert [(i.traceback, i.exit_code) for i in store.incidents("j-old")][-1] == ("ValueError: boom\n", 1)


def test_downgrade_to_0004_drops_traceback_and_exit_code_and_keeps_incidents(store_url: str,
                                                                             engine: Engine) -> None:
    with Store(store_url) as store:
        job = store.create_job("x", 1, "{}")
        store.record_incident(job, 1, "crash", "crash", "rank 0 died", traceback="tb", exit_code=-9)
    cfg = Config()
    cfg.set_main_option("script_location", str(migrate.MIGRATIONS_DIR))
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, "0004")
    assert {c["name"] for c in inspect(engine).get_columns("incidents")}.isdisjoint({"traceback", "exit_code"})
    assert _scalar(engine, "SELECT evidence FROM incidents") == "rank 0 died"
    assert migrate.upgrade_url(store_url) == ("0004", migrate.head())
    with Store(store_url) as store:
        assert [(i.evidence, i.traceback, i.exit_code) for i in store.incidents(job)] == [("rank 0 died", "", None)]


def test_upgrade_from_0006_keeps_incidents_acted_on_and_statuses_without_a_phase(store_url: str,
                                                                                  engine: Engine) -> None:
    _alembic_upgrade(engine, "0006")
    with engine.begin() as conn:
        conn.execute(text(
            "INSERT INTO jobs (id, name, state, total_steps, config_json, created_at, "
            "updated_at, ended_at, reason) VALUES ('j-old', 'llama', 'RUNNING', 100, '{}', "
            "1.0, 2.0, NULL, '')"))
        conn.execute(text(
            "INSERT INTO incidents (job_id, attempt, kind, rank, node, detector, evidence, detected_at) "
            "VALUES ('j-old', 1, 'hang', 1, 'n0', 'hang', 'rank 1 never entered', 4.0)"))
        conn.execute(text(
            "INSERT INTO worker_status (job_id, attempt, rank, state, time_ns, pid, hostname, restored_step, "
            "detail, phase_s) VALUES ('j-old', 1, 0, 'TRAINING', 5, 1, 'h0', 0, '', 0.0)"))
    assert migrate.upgrade_url(store_url) == ("0006", migrate.head())
    with Store(store_url) as store:
        assert [(i.kind, i.observed) for i in store.incidents("j-old")] == [("hang", "")]
        assert [s.phase for s in store.worker_status("j-old")] == [""]
        store.record_incident("j-old", 2, "hang", "hang", "stalled", rank=1, node="n0", detected_at=6.0,
                              observed="would restart the attempt (restart 1 of 3)")
        assert [i.observed for i in store.incidents("j-old")][-1] == "would restart the attempt (restart 1 of 3)"
        # an observed incident never counts towards quarantining its node
        assert [i.detected_at for i in store.incidents_on_node("n0", 0.0)] == [4.0]


def test_upgrade_from_0007_keeps_collectives_as_not_measured(store_url: str, engine: Engine) -> None:
    _alembic_upgrade(engine, "0007")
    with engine.begin() as conn:
        conn.execute(text(
            "INSERT INTO jobs (id, name, state, total_steps, config_json, created_at, "
            "updated_at, ended_at, reason) VALUES ('j-old', 'llama', 'RUNNING', 100, '{}', "
            "1.0, 2.0, NULL, '')"))
        conn.execute(text(
            "INSERT INTO collectives (job_id, attempt, rank, group_name, seq, group_size, op, input_sizes, "
            "input_dtypes, output_sizes, output_dtypes, enter_ns, exit_ns, state, exit_estimated, step) "
            "VALUES ('j-old', 1, 0, '0', 1, 2, 'all_reduce', '[[4]]', '[\"float32\"]', '[[4]]', "
            "'[\"float32\"]', 100, 900, 'completed', true, 1)"))
    assert migrate.upgrade_url(store_url) == ("0007", migrate.head())
    with Store(store_url) as store:
        [row] = store.collectives("j-old")
        assert (row.exit_ns, row.duration_ns, row.timing) == (900, None, 0)
        [summary] = store.collective_summary("j-old")
        # an estimated exit is no duration: the old row reads as not measured
        assert (summary.mean_duration_ms, summary.measured, summary.timings) == (None, 0, ())
