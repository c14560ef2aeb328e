"""`fleet replay` as a dump tool: a folder as the argument, per-host file names, --group
by name or description, the blamed ranks' Python stacks, --exit-code, and a start-up
that imports no store, gRPC, Ray or torch."""

from __future__ import annotations

import json
import pickle
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fleet.controlplane.cli.main import main as cli
from fleet.controlplane.cli.replay import VERDICT_EXIT_CODES
from fleet.controlplane.diagnosis import analyze_dumps, diagnose, load_traces
from fleet.controlplane.diagnosis.stacks import finding_stacks
from fleet.controlplane.errors import DumpError, FleetError
from tests.unit.test_diagnosis_dumps import doc, entry, gather, write_world

pytestmark = pytest.mark.timeout(60)

WORLD = ("0", "default_pg")
DP = ("1", "mesh_dp")
TP = ("2", "mesh_tp")
TORCH_FRAME = {"name": "all_reduce", "filename": "/venv/site-packages/torch/distributed/distributed_c10d.py",
               "line": 3245}


def frames(rank: int, group: str, seq: int) -> list[dict]:
    """A stack that says which entry it belongs to: innermost first, torch's own frame on top."""
    return [TORCH_FRAME, {"name": f"step_g{group}_s{seq}", "filename": f"/job/train_{rank}.py", "line": 100 + seq},
            {"name": "main", "filename": "/job/train.py", "line": 7}]


def write_mesh(folder: Path, n: int = 4, steps: int = 6, stuck: int | None = None, wrong_op: int | None = None,
               names=lambda r: f"fr_dump_{r}", with_frames: bool = True) -> Path:
    """``n`` ranks: an all_gather, then per step one world all_reduce and one on the pair
    groups (mesh_dp = {0, 1}, mesh_tp = {2, 3}). ``stuck`` never enters the last world
    collective; ``wrong_op`` enters world collective 3 as a broadcast."""
    folder.mkdir(parents=True, exist_ok=True)
    for r in range(n):
        pair = DP if r < 2 else TP
        es, rid = [gather(0, 1, n)], 1
        for k in range(steps):
            seq = 2 + k
            if not (r == stuck and k == steps - 1):
                es.append(entry(rid, seq, name="broadcast" if (r == wrong_op and seq == 3) else "all_reduce",
                                done=k < steps - 1))
                rid += 1
            es.append(entry(rid, k + 1, group=pair))
            rid += 1
        for e in es:
            e["frames"] = frames(r, e["process_group"][0], e["collective_seq_id"]) if with_frames else []
        (folder / names(r)).write_bytes(pickle.dumps(doc(es)))
    return folder


def run(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = cli(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def one_line(text: str) -> str:
    """The error's line: an error prints it and one ``hint:`` line, nothing else."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    assert len(lines) == 2 and lines[1].startswith("hint: "), text
    assert "Traceback" not in text
    return lines[0]


# -- per-host file names -------------------------------------------------------------------


def host_name(r: int) -> str:
    host = ["node-a", "node-b.rack2", "gpu12", "gpu13-x"][r // 2]  # digits, dashes and dots in host names
    return f"nccl_trace_{host}_{r}"


def test_per_host_prefixes_are_one_set_without_an_argument(tmp_path):
    folder = write_mesh(tmp_path / "d", n=8, stuck=5, names=host_name)
    traces = load_traces(folder)
    assert sorted(traces.ranks) == list(range(8))
    assert Path(traces.ranks[5].source).name == "nccl_trace_gpu12_5"
    d = diagnose(traces)
    assert (d.verdict, d.culprit_ranks) == ("hang", [5])


def test_prefix_selects_per_host_files_and_exact_names_win(tmp_path):
    folder = write_mesh(tmp_path / "d", n=8, names=host_name)
    (folder / "notes_9").write_bytes(pickle.dumps(doc([])))  # an unrelated name: no shared prefix
    with pytest.raises(DumpError, match="several prefixes.*--prefix"):
        load_traces(folder)
    assert sorted(load_traces(folder, prefix="nccl_trace_").ranks) == list(range(8))
    assert sorted(load_traces(folder, prefix="nccl_trace_gpu1").ranks) == [4, 5, 6, 7]
    # <prefix><rank> files, when present, are the set: a stray <prefix><x>_<rank> is not read
    plain = write_world(tmp_path / "p")
    (plain / "fr_dump_old_1").write_bytes(b"garbage")
    assert sorted(load_traces(plain, prefix="fr_dump_").ranks) == [0, 1, 2, 3]


@pytest.mark.parametrize("prefix", [None, "nccl_trace_"])
def test_two_files_for_one_rank_is_one_error_naming_both(tmp_path, prefix):
    folder = write_mesh(tmp_path / "d", names=host_name)
    (folder / "nccl_trace_node-z_3").write_bytes((folder / "nccl_trace_node-b.rack2_3").read_bytes())
    with pytest.raises(DumpError) as err:
        load_traces(folder, prefix)
    msg = str(err.value)
    assert "rank 3" in msg and "nccl_trace_node-b.rack2_3" in msg and "nccl_trace_node-z_3" in msg
    assert "--prefix" in msg


def test_cli_reads_per_host_names_with_the_short_prefix_flag(tmp_path, capsys):
    folder = write_mesh(tmp_path / "d", n=8, stuck=2, names=host_name)
    for argv in ([str(folder)], [str(folder), "-p", "nccl_trace_"]):
        code, out, _ = run(capsys, "replay", *argv, "--json")
        assert code == 0
        out = json.loads(out)
        assert out["verdict"] == "hang" and out["culprit_ranks"] == [2] and out["ranks"] == list(range(8))


# -- the positional argument ---------------------------------------------------------------


def test_positional_folder_or_job_id(tmp_path, capsys, monkeypatch):
    folder = write_mesh(tmp_path / "d", stuck=1)
    code, out, _ = run(capsys, "replay", str(folder), "--json")
    assert code == 0 and json.loads(out)["culprit_ranks"] == [1]
    # a relative folder in the working directory is a folder too
    monkeypatch.chdir(tmp_path)
    code, out, _ = run(capsys, "replay", "d", "--json")
    assert code == 0 and json.loads(out)["source"] == "dumps:d"
    # anything else is a job id: read from the store
    code, out, err = run(capsys, "replay", "j-1-nope", "--store", f"sqlite:///{tmp_path}/none.db")
    assert code == 3 and "no store at" in one_line(out + err)
    for argv, message in [
        (["./gone"], "./gone: no such folder of flight-recorder dumps"),
        ([str(folder / "fr_dump_0")], "a file, not a folder of flight-recorder dumps"),
        ([str(folder), "--dumps", str(folder)], "exactly one"),
        (["j-1", "-p", "fr_dump_"], "--prefix: only with a folder of dumps"),
    ]:
        code, out, err = run(capsys, "replay", *argv)
        assert code == 2 and message in one_line(out + err)


def test_a_job_with_no_attempt_yet_replays_as_empty(tmp_path, capsys):
    from fleet.controlplane.store import Store

    url = f"sqlite:///{tmp_path}/fleet.db"
    job = Store(url).create_job("queued", 10, "{}")
    code, out, _ = run(capsys, "replay", job, "--store", url, "--json")
    report = json.loads(out)
    assert code == 0 and (report["source"], report["verdict"], report["attempts"]) == (f"store:{job}", "empty", [])


# -- --group -------------------------------------------------------------------------------


def test_group_by_name_or_description_and_repeated(tmp_path, capsys):
    folder = write_mesh(tmp_path / "d", stuck=3)
    code, out, _ = run(capsys, "replay", str(folder), "--json", "-g", "mesh_dp")
    out = json.loads(out)
    assert code == 0 and {w["group"] for w in out["wavefront"]} == {"1"}
    assert out["findings"] == [] and out["culprit_ranks"] == [3]  # the hang is in the world group
    code, out, _ = run(capsys, "replay", str(folder), "--json", "-g", "mesh_dp", "--group", "2")
    assert {w["group"] for w in json.loads(out)["wavefront"]} == {"1", "2"}
    code, out, _ = run(capsys, "replay", str(folder), "--json", "-g", "default_pg")
    out = json.loads(out)
    assert {w["group"] for w in out["wavefront"]} == {"0"} and [f["ranks"] for f in out["findings"]] == [[3]]
    trace = tmp_path / "t.json"
    assert run(capsys, "replay", str(folder), "-g", "mesh_dp", "-g", "mesh_tp", "--perfetto", str(trace),
               "--json")[0] == 0
    slices = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    assert slices and {e["args"]["group"] for e in slices} == {"1", "2"}


def test_unknown_group_lists_the_groups(tmp_path, capsys):
    folder = write_mesh(tmp_path / "d")
    code, out, err = run(capsys, "replay", str(folder), "-g", "mesh_pp")
    line = one_line(out + err)
    assert code == 2 and "--group mesh_pp" in line
    assert "0 (default_pg), 1 (mesh_dp), 2 (mesh_tp)" in line


# -- stacks --------------------------------------------------------------------------------


def test_stacks_of_a_hang_show_where_the_culprit_stands(tmp_path, capsys):
    folder = write_mesh(tmp_path / "d", stuck=2)
    code, out, _ = run(capsys, "replay", str(folder), "--json")
    out = json.loads(out)
    (f,) = [f for f in out["findings"] if f["kind"] == "missing"]
    assert (f["group"], f["seq"], f["ranks"]) == ("0", 7, [2])
    # rank 2 never entered world collective 7: its stack is its newest entry on the world group
    assert f["stacks"] == [{"rank": 2, "group": "0", "seq": 6, "op": "all_reduce", "state": "completed",
                            "frames": frames(2, "0", 6)}]
    code, text, _ = run(capsys, "replay", str(folder))
    assert code == 0
    lines = text.splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.startswith("#1 missing rank 2"))
    assert "never entered #7; stands at all_reduce #6 of group 0 (completed)" in lines[head]
    assert lines[head + 1:head + 3] == ["    step_g0_s6 (/job/train_2.py:106)", "    main (/job/train.py:7)"]
    assert "1 torch.distributed frame above" in lines[head + 3]


def test_stacks_of_a_mismatch_are_the_culprits_entry(tmp_path, capsys):
    folder = write_mesh(tmp_path / "d", wrong_op=1)
    code, out, _ = run(capsys, "replay", str(folder), "--json")
    out = json.loads(out)
    assert out["verdict"] == "mismatch" and out["culprit_ranks"] == [1]
    (f,) = [f for f in out["findings"] if f["kind"] == "op_mismatch"]
    assert [(s["rank"], s["group"], s["seq"], s["op"], s["frames"][1]["name"]) for s in f["stacks"]] == [
        (1, "0", 3, "broadcast", "step_g0_s3")]
    code, text, _ = run(capsys, "replay", str(folder))
    assert "#1 op_mismatch rank 1 in broadcast #3 (completed):" in text
    assert "    step_g0_s3 (/job/train_1.py:103)" in text


def test_stacks_without_frames_or_file(tmp_path, capsys):
    folder = write_mesh(tmp_path / "d", stuck=0, with_frames=False)
    code, out, _ = run(capsys, "replay", str(folder), "--json")
    (f,) = json.loads(out)["findings"]
    assert [(s["rank"], s["seq"], s["frames"]) for s in f["stacks"]] == [(0, 6, [])]
    code, text, _ = run(capsys, "replay", str(folder))
    assert "no frames in the dump" in text
    # a rank with no file gets no stack; max_ranks bounds the files re-read
    folder = write_mesh(tmp_path / "e", stuck=3)
    (folder / "fr_dump_3").unlink()
    traces = load_traces(folder)
    d = diagnose(traces)
    assert d.culprit_ranks == [3]
    assert all(s == [] for s in finding_stacks(d, traces).values())
    assert finding_stacks(d, traces, max_ranks=0) == {i: [] for i in range(len(d.findings))}


def test_a_job_from_the_store_has_empty_stacks(tmp_path, capsys):
    from fleet.controlplane.lifecycle import AttemptState, JobState
    from fleet.controlplane.store import Store
    from fleet.proto import events_pb2 as pb

    url = f"sqlite:///{tmp_path}/s.db"
    t0 = time.time()
    with Store(url) as store:
        job = store.create_job("hang", total_steps=10, config_json="{}")
        store.set_job_state(job, JobState.PLACING, "placing")
        store.create_attempt(job)
        store.set_attempt_state(job, 1, AttemptState.RUNNING)
        events = []
        for rank, seqs in ((0, (1, 2, 3)), (1, (1, 2))):
            for seq in seqs:
                ev = pb.Event()
                c = ev.collective
                c.job_id, c.attempt, c.rank, c.group, c.group_size = job, 1, rank, "0", 2
                c.seq, c.op = seq, "all_reduce"
                c.state, c.enter_ns = "started" if seq == 3 else "completed", int((t0 - 60 + seq) * 1e9)
                if seq < 3:
                    c.exit_ns = c.enter_ns + 1000
                events.append(ev)
        store.record_batch("a", 1, 1, events)
    code, out, _ = run(capsys, "replay", job, "--store", url, "--json", "--exit-code")
    out = json.loads(out)
    assert code == VERDICT_EXIT_CODES["hang"] and out["verdict"] == "hang"
    assert out["findings"] and all(f["stacks"] == [] for f in out["findings"])
    assert all(f["stacks"] == [] for a in out["attempts"] for f in a["diagnosis"]["findings"])


# -- --exit-code ---------------------------------------------------------------------------


def test_exit_code_follows_the_verdict(tmp_path, capsys):
    ok = write_mesh(tmp_path / "ok")
    hang = write_mesh(tmp_path / "hang", stuck=1)
    mism = write_mesh(tmp_path / "mism", wrong_op=2)
    assert run(capsys, "replay", str(ok), "--exit-code")[0] == 0
    assert run(capsys, "replay", str(hang), "--exit-code", "--json")[0] == VERDICT_EXIT_CODES["hang"] == 11
    assert run(capsys, "replay", str(mism), "--exit-code")[0] == VERDICT_EXIT_CODES["mismatch"] == 10
    assert run(capsys, "replay", str(hang))[0] == 0  # without the flag a verdict is no failure
    # no verdict's code is an error's code
    error_codes = {c.exit_code for c in _subclasses(FleetError)} | {1, 2}
    assert not error_codes & {c for c in VERDICT_EXIT_CODES.values() if c}
    assert len(set(VERDICT_EXIT_CODES.values())) == len(VERDICT_EXIT_CODES)


def _subclasses(cls: type) -> set[type]:
    out = {cls}
    for sub in cls.__subclasses__():
        out |= _subclasses(sub)
    return out


# -- start-up ------------------------------------------------------------------------------


HEAVY = ("sqlalchemy", "alembic", "grpc", "ray", "torch")


def test_replaying_dumps_imports_no_store_grpc_ray_or_torch(tmp_path):
    folder = write_mesh(tmp_path / "d", stuck=1)
    probe = (
        "import sys\n"
        "from fleet.controlplane.cli.main import main\n"
        f"codes = [main(['replay', {str(folder)!r}, '--json']), main(['replay', {str(folder)!r}]),"
        f" main(['replay', '--help'])]\n"
        f"print(codes, sorted({{m.split('.')[0] for m in sys.modules}} & {set(HEAVY)!r}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "[0, 0, 0] []"


def test_a_folder_of_per_host_folders_is_read_through(tmp_path):
    # dumps collected one folder per host, as torchfrtrace walks them
    flat = write_world(tmp_path / "flat", culprit=2)
    for r, host in enumerate(["node-a", "node-a", "node-b", "node-b"]):
        (tmp_path / "nested" / host).mkdir(parents=True, exist_ok=True)
        shutil.copy(flat / f"fr_dump_{r}", tmp_path / "nested" / host / f"fr_dump_{r}")
    d = analyze_dumps(tmp_path / "nested")
    assert sorted(d.ranks) == [0, 1, 2, 3] and (d.verdict, d.culprit_ranks) == ("hang", [2])
