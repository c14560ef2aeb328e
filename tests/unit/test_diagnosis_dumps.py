"""Reading native flight-recorder dumps: formats, naming, bad files, and fuzzing."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleet.controlplane.cli.main import main as cli
from fleet.controlplane.diagnosis import analyze_dumps, load_traces
from fleet.controlplane.errors import DumpError


def entry(rid, seq, name="all_reduce", size=8, dtype="Float", group=("0", "default_pg"), done=True, t=None):
    return {"record_id": rid, "pg_id": 0, "process_group": group, "thread_name": "python",
            "thread_id": "1", "collective_seq_id": seq, "p2p_seq_id": 0, "op_id": seq,
            "profiling_name": f"gloo:{name}", "time_created_ns": t or 1_000_000 * (rid + 1),
            "input_sizes": [[size]], "input_dtypes": [dtype], "output_sizes": [[size]],
            "output_dtypes": [dtype], "state": "scheduled", "time_discovered_started_ns": None,
            "time_discovered_completed_ns": None, "retired": done, "timeout_ms": 3000,
            "is_p2p": False, "frames": [{"name": "f", "filename": "x.py", "line": 1}]}


def doc(entries, version="2.10", pg_config=None):
    return {"version": version, "pg_config": pg_config or {"": {"name": "", "desc": "", "ranks": "[]"}},
            "pg_status": {"0": {"last_enqueued_collective": len(entries), "last_started_collective": -1,
                                "last_completed_collective": len(entries)}},
            "comm_lib_version": "", "entries": entries}


def gather(rid, seq, n):
    e = entry(rid, seq, name="all_gather")
    e["output_sizes"] = [[n, 8]]
    return e


def write_world(folder: Path, n=4, steps=10, culprit=None, fmt="pickle", prefix="fr_dump_"):
    folder.mkdir(parents=True, exist_ok=True)
    for r in range(n):
        last = steps - 1 if r == culprit else steps
        d = doc([gather(0, 1, n)] + [entry(i, i + 1) for i in range(1, last)])
        path = folder / f"{prefix}{r}"
        if fmt == "json":
            path.write_text(json.dumps(d))
        else:
            path.write_bytes(pickle.dumps(d))
    return folder


def test_pickle_and_json_dumps_give_the_same_verdict(tmp_path):
    a = analyze_dumps(write_world(tmp_path / "p", culprit=2))
    b = analyze_dumps(write_world(tmp_path / "j", culprit=2, fmt="json"))
    assert a.verdict == b.verdict == "hang"
    assert a.culprit_ranks == b.culprit_ranks == [2]


def test_prefix_is_inferred_or_given(tmp_path):
    folder = write_world(tmp_path / "d", prefix="rank-")
    assert sorted(load_traces(folder).ranks) == [0, 1, 2, 3]
    assert sorted(load_traces(folder, prefix="rank-").ranks) == [0, 1, 2, 3]
    with pytest.raises(DumpError, match="no dump files named nope<rank>"):
        load_traces(folder, prefix="nope")


def test_several_prefixes_need_a_choice(tmp_path):
    folder = write_world(tmp_path / "d")
    (folder / "other_7").write_bytes(pickle.dumps(doc([])))
    with pytest.raises(DumpError, match="several prefixes.*--prefix"):
        load_traces(folder)
    assert sorted(load_traces(folder, prefix="fr_dump_").ranks) == [0, 1, 2, 3]


def test_missing_rank_is_reported_and_the_rest_analysed(tmp_path):
    folder = write_world(tmp_path / "d", culprit=1)
    (folder / "fr_dump_3").unlink()
    d = analyze_dumps(folder)
    assert d.missing_ranks == [3] and d.culprit_ranks == [1]


@pytest.mark.parametrize("content, message", [
    (b"", "empty file"),
    (b"hello", "not a flight-recorder dump"),
    (pickle.dumps([1, 2]), "top level is list"),
    (pickle.dumps({"entries": []}), "no format version"),
    (pickle.dumps(doc([], version="3.0")), "unsupported format version 3.0"),
    (pickle.dumps(doc([entry(0, 1)]))[:-40], "truncated or corrupt pickle"),
    (b'{"version": "2.10", "entries": [', "truncated or corrupt JSON"),
    (pickle.dumps(doc([{"record_id": 0}])), "malformed entry 0 .KeyError"),
    (pickle.dumps(doc(["x"])), "entry 0 is str"),
    (pickle.dumps({"version": "2.10", "entries": {}}), "'entries' is not a list"),
])
def test_bad_file_is_one_error_naming_it(tmp_path, content, message):
    folder = write_world(tmp_path / "d")
    bad = folder / "fr_dump_2"
    bad.write_bytes(content)
    with pytest.raises(DumpError, match=message) as err:
        load_traces(folder)
    assert str(bad) in str(err.value)


class _Boom:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_pickles_cannot_run_code(tmp_path):
    folder = write_world(tmp_path / "d")
    (folder / "fr_dump_1").write_bytes(pickle.dumps(doc([entry(0, 1, group=_Boom())])))
    with pytest.raises(DumpError, match="posix.system|os.system|only plain data"):
        load_traces(folder)


def test_cli_bad_file_prints_one_line(tmp_path, capsys):
    folder = write_world(tmp_path / "d")
    (folder / "fr_dump_0").write_bytes(b"\x80\x04garbage")
    assert cli(["replay", "--dumps", str(folder), "--json"]) == 2
    err = capsys.readouterr().err.strip()
    lines = err.splitlines()  # the error, and its hint
    assert len(lines) == 2 and "fr_dump_0" in lines[0] and lines[1].startswith("hint: ") and "Traceback" not in err


def test_cli_json_and_perfetto(tmp_path, capsys):
    folder = write_world(tmp_path / "d", culprit=0)
    trace_file = tmp_path / "t.json"
    assert cli(["replay", "--dumps", str(folder), "--json", "--perfetto", str(trace_file)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["verdict"] == "hang" and out["culprit_ranks"] == [0]
    assert {"source", "attempt", "verdict", "culprit_ranks", "findings"} <= set(out)
    assert out["findings"][0]["kind"] == "missing" and out["findings"][0]["seq"] == 10
    perf = json.loads(trace_file.read_text())
    slices = [e for e in perf["traceEvents"] if e["ph"] == "X"]
    flows = [e for e in perf["traceEvents"] if e["ph"] in "stf"]
    assert len(slices) == 4 * 10 - 1
    assert {e['name'] for e in slices} == {'all_gather', 'all_reduce'}
    assert {e["tid"] for e in slices} == {0, 1, 2, 3}
    assert len({e["id"] for e in flows}) == 10  # one flow per matched collective


def test_cli_filters(tmp_path, capsys):
    folder = write_world(tmp_path / "d", culprit=2)
    assert cli(["replay", "--dumps", str(folder), "--json", "--rank", "1", "--around-seq", "3", "--window", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["culprit_ranks"] == [2]  # the analysis still saw every rank
    assert out["findings"] == []        # the finding is at seq 10, outside 2..4
    assert {w["rank"] for w in out["wavefront"]} <= {1}


def test_pool_and_serial_reading_agree(tmp_path):
    folder = tmp_path / "d"
    folder.mkdir()
    for r in range(40):
        ents = [entry(i, i + 1, size=16 if (r == 33 and i == 7) else 8) for i in range(20)]
        (folder / f"fr_dump_{r}").write_bytes(pickle.dumps(doc(ents)))
    serial = analyze_dumps(folder, workers=1)
    pooled = analyze_dumps(folder, workers=2)
    assert serial.to_json() == pooled.to_json()
    assert serial.verdict == "mismatch" and serial.culprit_ranks == [33]


# -- fuzzing: any bytes, any structure -> a verdict or one DumpError, nothing else ---------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=20)

FIELDS = ["record_id", "process_group", "collective_seq_id", "profiling_name", "input_sizes",
          "output_sizes", "input_dtypes", "output_dtypes", "retired", "state", "is_p2p", "time_created_ns"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=300))
def test_fuzz_random_bytes(tmp_path, data):
    _assert_verdict_or_dump_error(tmp_path, data)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(FIELDS), value=json_values, index=st.integers(0, 4), as_json=st.booleans())
def test_fuzz_mutated_entries(tmp_path, field, value, index, as_json):
    d = doc([entry(i, i + 1) for i in range(5)])
    d["entries"][index][field] = value
    data = json.dumps(d).encode() if as_json else pickle.dumps(d)
    _assert_verdict_or_dump_error(tmp_path, data)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(0, 2000), flip=st.integers(0, 2000), byte=st.integers(0, 255))
def test_fuzz_corrupted_pickle(tmp_path, cut, flip, byte):
    data = bytearray(pickle.dumps(doc([entry(i, i + 1) for i in range(5)])))
    if flip < len(data):
        data[flip] = byte
    _assert_verdict_or_dump_error(tmp_path, bytes(data[: max(cut, 1)]))


def _assert_verdict_or_dump_error(tmp_path: Path, data: bytes) -> None:
    folder = tmp_path / "fuzz"
    folder.mkdir(exist_ok=True)
    good = doc([entry(i, i + 1) for i in range(5)])
    (folder / "fr_dump_0").write_bytes(pickle.dumps(good))
    (folder / "fr_dump_1").write_bytes(data)
    try:
        d = analyze_dumps(folder)
    except DumpError as exc:
        assert "fr_dump_1" in str(exc)
    else:
        assert d.verdict in {"ok", "hang", "mismatch", "straggler", "empty"}


def test_native_names_become_canonical_as_dumps_are_read_and_either_completion_signal_counts(tmp_path):
    """The dump reader is an edge: ``allreduce``/``Float`` become ``all_reduce``/``float32``
    there, once; gloo's ``retired`` and NCCL's ``state == completed`` both end an entry."""
    from fleet.controlplane.diagnosis import load_traces

    nccl = entry(2, 2, name="allreduce", dtype="BFloat16", done=False)
    nccl["profiling_name"], nccl["state"] = "nccl:allreduce", "completed"   # NCCL: state, not retired
    open_op = entry(3, 3, name="_allgather_base", done=False)               # neither: still open
    (tmp_path / "fr_0").write_bytes(pickle.dumps(doc([entry(1, 1, name="allreduce"), nccl, open_op])))
    (tmp_path / "fr_1").write_bytes(pickle.dumps(doc([entry(1, 1), entry(2, 2, dtype="BFloat16", done=False),
                                                      entry(3, 3, name="all_gather", done=False)])))
    ts = load_traces(tmp_path)
    for rank, done in ((0, [True, True, False]), (1, [True, False, False])):
        ops = ts.ranks[rank].groups["0"]
        sigs = [ts.table.sigs[s] for s in ops.sigs]
        assert [(s.op, s.input_dtypes) for s in sigs] == [
            ("all_reduce", ("float32",)), ("all_reduce", ("bfloat16",)), ("all_gather", ("float32",))]
        assert list(ops.done) == done
    assert ts.ranks[0].groups["0"].sigs == ts.ranks[1].groups["0"].sigs  # one vocabulary: equal ids


def test_nccl_device_timing_in_dumps_rates_bandwidth_and_gloo_dumps_stay_not_measured(tmp_path, capsys):
    """NCCL dumps taken with TORCH_NCCL_ENABLE_TIMING=1 carry each op's device time
    (``duration_ms``): `fleet replay --dumps` rates them; gloo's dumps have none."""
    nccl, gloo = tmp_path / "nccl", tmp_path / "gloo"
    for folder, timed in ((nccl, True), (gloo, False)):
        folder.mkdir()
        for r in range(4):
            entries = []
            for i in range(3):
                e = entry(i, i + 1, size=1 << 20, t=10_000_000 * (i + 1) + 1000 * r)
                e["profiling_name"] = "nccl:all_reduce" if timed else "gloo:all_reduce"
                if timed:
                    e.update(state="completed", retired=True, duration_ms=2.0 + r * 0.5,
                             time_discovered_completed_ns=10_000_000 * (i + 1) + 5_000_000)
                entries.append(e)
            (folder / f"fr_dump_{r}").write_bytes(pickle.dumps(doc(entries)))
    assert cli(["replay", str(nccl), "--json"]) == 0
    [row] = json.loads(capsys.readouterr().out)["bandwidth"]["rows"]
    # S = 1 Mi float32 = 4 MiB; t = the smallest member's 2.0 ms; busbw = algbw x 2(n-1)/n
    assert (row["op"], row["bytes"], row["measured"], row["timing"]) == ("all_reduce", 4 << 20, 3, ["nccl"])
    assert row["busbw_bps"] == pytest.approx((4 << 20) / 2e-3 * 1.5)
    assert row["skew_s"] == pytest.approx(3e-6) and row["last_rank"] == 3
    assert cli(["replay", str(gloo), "--json"]) == 0
    bw = json.loads(capsys.readouterr().out)["bandwidth"]
    assert not bw["measured"] and bw["rows"][0]["busbw_bps"] is None and bw["rows"][0]["measured"] == 0
    assert bw["timing_note"].startswith("none")
