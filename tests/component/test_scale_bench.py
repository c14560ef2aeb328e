"""bench/scale.py --quick: 128 simulated ranks (16 agent streams over 2 processes) against
the real controller on a SQLite file; one planted hang, a reconnect storm, a replay.

The smoke run of the scale benchmark: the JSON line carries every key the issue asks for,
the hang's culprit is named (rank and node), no stream was refused, every event was
stored exactly once across a SIGKILL of the controller, and ``fleet replay`` answered.
Before it, without a network: the synthetic agents' fronts and the raw entries they hand
over on a TracePull agree, and the controller's real ``Wavefronts`` names a planted
fault's culprit from those fronts.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bench.scale_agents import Agents
from bench.scale_schedule import KINDS, Layout, Schedule, fault_at
from fleet.controlplane.wavefront import Wavefronts
from fleet.proto import agent_pb2, events_pb2
from fleet.proto.columns import dtypes_json, shapes_json
from fleet.proto.columns import unpack as unpack_columns
from fleet.proto.fronts import signature

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(120)

KEYS = ("ranks", "detect_s", "ingest_lag_s", "controller_cpu_s_per_rank_s", "controller_rss_mib",
        "replay_s_16384", "reconnect_s_2048", "desync_ok", "refused", "store", "trials")


def test_quick_run_names_the_hang_and_stores_everything_once() -> None:
    proc = subprocess.run([sys.executable, "bench/scale.py", "--quick", "--seed", "3"], cwd=REPO,
                          capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(KEYS) <= out.keys()
    assert out["ranks"] == [128] and out["store"] == "sqlite"
    assert out["named"] == [1], proc.stdout          # the hang trial named the right rank and node
    assert out["detect_s"][0] is not None and 0 < out["detect_s"][0] < 20
    assert out["refused"] == [0] and out["rejected"] == [0]
    assert out["ingest_lag_s"][0] is not None and out["ingest_lag_s"][0] < 5
    assert out["controller_cpu_s_per_rank_s"][0] > 0 and out["controller_rss_mib"][0] > 0
    storm = out["reconnect"]
    assert storm["streams"] == 16 and storm["reconnect_s"] is not None
    assert storm["exactly_once"], storm
    assert storm["steps_rows"] == storm["steps_keys"] == storm["steps_sent"] > 0
    assert storm["batches_stored"] == storm["batches_sent"] > 0
    assert out["replay_ok"] and out["replay_names_culprit"], proc.stdout


def test_bad_ranks_is_one_clear_line() -> None:
    proc = subprocess.run([sys.executable, "bench/scale.py", "--ranks", "100"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: --ranks: must be a positive multiple of 32, got 100"


def _events(agents: Agents) -> list[events_pb2.Event]:
    out = []
    for n in agents.nodes:
        for _seq, data in n.unacked:
            out.extend(agent_pb2.AgentMessage.FromString(data).batch.events)
    return out


def test_schedule_counts_are_consistent() -> None:
    s = Schedule(100, 1.0)
    assert int(s.per_kind.sum()) == 100 and list(s.per_kind) == [60, 10, 30]
    assert s.entered(0, -1) == 0 and s.entered(0, 0) == 1 and s.completed(0, s.dt_ns // 2) == 1
    assert s.entered(0, s.step_ns) == 101  # step 2's first op
    for k in range(len(KINDS)):
        counts = np.arange(0, 350)
        seqs = s.seqs(counts, k)
        index, _ = s.seq_op(seqs, k)
        # the newest op of kind k among the first c ops is the one seq names
        for c, i in zip(counts.tolist(), index.tolist()):
            assert i < c and (i == -1 or s.kind_of[i % 100] == k)


@pytest.mark.parametrize("kind", ["hang", "desync"])
def test_fronts_and_pulled_entries_agree_and_name_the_culprit(kind: str) -> None:
    layout, schedule = Layout(128), Schedule(100, 1.0)
    agents = Agents("127.0.0.1:1", "t", layout, schedule, 0, layout.nodes, 0.5)
    agents.start_attempt("j-scale-test", 1, 0)
    for now in (1_200_000_000, 2_500_000_000):
        views, template = agents.prepare(now)
        for n in agents.nodes:
            n.emit(now, views, template)
    culprit = 37
    agents.fault = fault_at(schedule, 0, 2_600_000_000, kind, culprit)
    for now in (3_000_000_000, 4_000_000_000, 5_000_000_000):
        views, template = agents.prepare(now)
        for n in agents.nodes:
            n.emit(now, views, template)
    events = _events(agents)
    fronts = Wavefronts("j-scale-test", 1)
    for ev in events:
        if ev.WhichOneof("kind") == "group":
            fronts.declare(ev.group.group, list(ev.group.ranks))
    fronts.apply([ev.fronts for ev in events if ev.WhichOneof("kind") == "fronts"])
    assert len(fronts) == 128 * 3
    verdict = fronts.verdict(9_000_000_000, 3.0)
    assert verdict is not None and verdict.verdict == ("hang" if kind == "hang" else "mismatch")
    assert verdict.culprits == [culprit], verdict.summary
    steps = {(ev.step.rank, ev.step.step) for ev in events if ev.WhichOneof("kind") == "step"}
    assert steps == {(r, k) for r in range(128) for k in (1, 2)}  # step 3 never ends: the fault

    node = agents.nodes[culprit // 8]
    node.unacked.clear()
    node.pull(events_pb2.Command(pull=events_pb2.TracePull(job_id="j-scale-test", attempt=1,
                                                           ranks=node.ranks, last=5)))
    pulled = [e for ev in _events(agents) for e in unpack_columns(ev.collectives)]
    by_key: dict = {}
    for e in pulled:
        by_key.setdefault((e.rank, e.group), []).append(e)
    front_of = {(r.rank, r.group): r for r in fronts.rows(node.ranks)}
    assert by_key.keys() == front_of.keys()
    for key, entries in by_key.items():
        f = front_of[key]
        assert [e.seq for e in entries] == list(range(f.entered_seq - 4, f.entered_seq + 1))
        for e in entries:
            assert (e.state == "completed") == (e.seq <= f.completed_seq)
        newest = entries[-1]
        sizes = shapes_json(d.dims for d in newest.input_sizes)
        assert signature(newest.op, sizes, dtypes_json(newest.input_dtypes), sizes,
                         dtypes_json(newest.output_dtypes)) == f.signature
        assert newest.enter_ns == f.entered_ns
