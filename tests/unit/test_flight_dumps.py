"""Dumps that exist when they matter: ``record_collectives(dump_dir=...)`` writes the
rank's dump on its own when it stalls, on SIGUSR1 and before a PG timeout
(workers/fr_watch.py), on real 2-rank gloo groups; plus the watcher's pure decisions."""

from __future__ import annotations

import os
import pickle
import signal
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest

from fleet.workers.fr_watch import (THREAD_NAME, AutoDump, DumpPolicy, Pending, enqueued, keep_auto_dump,
                                    pending_entries, read_delay_s, timeout_lead_s)
from tests.unit.test_workers_support import Ranks

pytestmark = pytest.mark.timeout(90)

WAIT_S = 20.0  # bound on every wait for a file or a condition


def _wait_file(path: Path, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear within {timeout_s}s"
        time.sleep(0.01)


def _init(rank: int, world_size: int, port: int, pg_timeout_s: float) -> None:
    import torch
    import torch.distributed as dist

    from fleet.workers.rendezvous import loopback_store

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=loopback_store(rank, world_size, port), rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=pg_timeout_s))


def _clean_env(rank: int, world_size: int) -> None:
    for name in ("TORCH_FR_BUFFER_SIZE", "FLEET_AGENT_ADDRESS", "TORCH_NCCL_DUMP_ON_TIMEOUT",
                 "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"):
        os.environ.pop(name, None)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size))


def _last_entry(path: Path) -> dict:
    return pickle.loads(path.read_bytes())["entries"][-1]


def _watchers() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name == THREAD_NAME]


# ---- one real 2-rank run, in phases -------------------------------------------------------
# One run (two torch imports) for all real-gloo checks keeps this file cheap. Each phase
# opens its own handle (and dump folder) and closes it, which also checks that a closed
# handle puts SIGUSR1's handler and the wakeup fd back for the next one.

PG_TIMEOUT_S = 3.0   # the timeout phase's group; the world group has 30 s
BLOCKED = {
    # phase: record_collectives arguments of rank 0 (rank 1 does not record)
    "stall": dict(stall_dump_s=1.0, dump_on_signal=False),
    "signal": dict(stall_dump_s=None, dump_on_signal=True),
    "timeout": dict(stall_dump_s=None, dump_on_signal=False, dump_before_timeout_s=1.0),
}


def _phases(rank: int, world_size: int, port: int, folder: str) -> dict:
    import torch
    import torch.distributed as dist

    _clean_env(rank, world_size)
    folder = Path(folder)
    user_signals: list[int] = []
    user_handler = lambda signum, frame: user_signals.append(signum)  # noqa: E731
    signal.signal(signal.SIGUSR1, user_handler)
    os.environ["TORCH_FR_BUFFER_SIZE"] = "2000"  # so the handles may come after the group
    _init(rank, world_size, port, pg_timeout_s=30.0)
    short = dist.new_group([0, 1], timeout=timedelta(seconds=PG_TIMEOUT_S))
    results = {"healthy": _healthy(folder / "healthy", short, user_handler)}
    for phase in BLOCKED:
        group = short if phase == "timeout" else None
        results[phase] = _blocked(rank, folder / phase, phase, group, user_handler)
    results["user_signals"] = user_signals
    if rank == 1:
        (folder / "done1").touch()
    else:
        _wait_file(folder / "done1")  # rank 0 serves the store: it leaves last
    dist.destroy_process_group()
    if rank == 1:  # a handle never closed: its dump is written at interpreter exit
        from fleet.workers.flight import record_collectives

        record_collectives(dump_dir=folder / "exit")
    return results


def _healthy(dump_dir: Path, group, user_handler) -> dict:
    """Both ranks record and keep making progress: collectives, then steps alone."""
    import torch
    import torch.distributed as dist

    from fleet.workers.flight import record_collectives

    rec = record_collectives(dump_dir=dump_dir, stall_dump_s=0.5, watch_interval_s=0.05,
                             dump_before_timeout_s=5.0)
    env = {k: os.environ.get(k) for k in ("TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")}
    assert rec.watch is not None and rec.watch.alive and rec.watch.signals
    # on the 3 s group, a collective is due for a timeout dump 1.5 s after it starts:
    # the watcher must find each one retired when it looks again
    t = torch.ones(64)
    step = 0
    for _ in range(25):  # collectives in every step
        step += 1
        rec.step(step)
        dist.all_reduce(t, group=group)
        t.div_(2.0)
        time.sleep(0.02)
    for _ in range(15):  # 0.75 s of steps without collectives (longer than stall_dump_s)
        step += 1
        rec.step(step)
        time.sleep(0.05)
    dumps_before_close, reads = list(rec.dumps), rec.watch.reads
    rec.close()
    return {"dumps": dumps_before_close, "after": [r for r, _ in rec.dumps], "reads": reads,
            "env": env, **_leftovers(user_handler)}


def _leftovers(user_handler) -> dict:
    return {"watchers": _watchers(), "handler_restored": signal.getsignal(signal.SIGUSR1) is user_handler,
            "wakeup_fd": signal.set_wakeup_fd(-1)}


def _blocked(rank: int, folder: Path, phase: str, group, user_handler) -> dict:
    """Rank 0 blocks in an all_reduce on ``group``; rank 1 enters it only once rank 0's
    dump exists ("release"), except in the timeout phase, where rank 0 times out in it."""
    import torch
    import torch.distributed as dist

    from fleet.workers.flight import record_collectives

    coord = folder / "coord"
    coord.mkdir(parents=True, exist_ok=True)
    if rank == 1:
        _wait_file(coord / "release")
        if phase != "timeout":
            dist.all_reduce(torch.ones(4), group=group)
        return {}

    rec = record_collectives(dump_dir=folder / "dumps", watch_interval_s=0.1, **BLOCKED[phase])
    name = dist._get_process_group_name(group or dist.group.WORLD)
    seq = 1 + max((e["collective_seq_id"] for e in _ring() if e["process_group"][0] == name), default=0)
    rec.step(1)
    path = folder / "dumps" / "fr_dump_0"
    returned = threading.Event()
    seen: dict = {}

    def check() -> None:  # what a user looking at dump_dir sees while rank 0 hangs
        try:
            deadline = time.monotonic() + WAIT_S
            while not any((e["process_group"][0], e["collective_seq_id"]) == (name, seq) for e in _ring()):
                assert time.monotonic() < deadline, f"rank 0 never entered collective {seq} of group {name}"
                time.sleep(0.01)
            (coord / "blocked0").touch()
            _wait_file(path)
            seen["still_blocked"] = not returned.is_set()
            seen["mtime_ns"] = path.stat().st_mtime_ns
            seen["entry"] = _last_entry(path)
        finally:
            (coord / "release").touch()

    checker = threading.Thread(target=check, name="test-checker", daemon=True)
    checker.start()
    error = None
    try:
        dist.all_reduce(torch.ones(4), group=group)
    except RuntimeError as exc:  # the timeout phase's PG timeout
        error = str(exc).splitlines()[0]
    returned.set()
    checker.join(WAIT_S)
    dumps_before_close = list(rec.dumps)
    rec.close()
    return {"seen": seen, "error": error, "dumps": dumps_before_close, "dumps_after": rec.dumps,
            "final": _last_entry(path), "group": name, "seq": seq, **_leftovers(user_handler)}


def _ring() -> list[dict]:
    from fleet.workers import native_fr

    return native_fr.read_ring()["entries"]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, dict[int, dict]]:
    folder = tmp_path_factory.mktemp("flight-dumps")
    ranks = Ranks(_phases, 2, (str(folder),))
    try:
        _wait_file(folder / "signal" / "coord" / "blocked0", 60)
        time.sleep(0.2)  # the main thread is in the collective (in the ring): let it block in C++
        assert not (folder / "signal" / "dumps" / "fr_dump_0").exists(), "dumped before the signal"
        os.kill(ranks.procs[0].pid, signal.SIGUSR1)  # kill -USR1 <pid>
    finally:
        results = ranks.wait(90)
    return folder, results


def _assert_pending_in_dump(result: dict) -> dict:
    seen = result["seen"]
    assert seen["still_blocked"], "the dump appeared only after the collective returned"
    entry = seen["entry"]
    assert (entry["process_group"][0], entry["collective_seq_id"], entry["profiling_name"]) == (
        result["group"], result["seq"], "gloo:all_reduce")
    assert entry["retired"] is False
    assert result["watchers"] == [] and result["handler_restored"] and result["wakeup_fd"] == -1
    return entry


def test_a_healthy_run_writes_no_automatic_dump(run):
    folder, results = run
    for rank, result in results.items():
        healthy = result["healthy"]
        assert healthy["dumps"] == [] and healthy["after"] == ["close()"]
        assert healthy["watchers"] == [] and healthy["handler_restored"] and healthy["wakeup_fd"] == -1
        # the ring is read now and then, not at every one of the ~40 ticks
        assert 1 <= healthy["reads"] <= 15, healthy["reads"]
        assert healthy["env"] == {"TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                                  "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(folder / "healthy" / "fr_dump_")}
        assert (folder / "healthy" / f"fr_dump_{rank}").is_file()


def test_a_handle_never_closed_dumps_at_exit(run):
    folder, _ = run
    doc = pickle.loads((folder / "exit" / "fr_dump_1").read_bytes())
    assert doc["entries"] and doc["entries"][-1]["profiling_name"] == "gloo:all_reduce"


def test_a_stalled_rank_dumps_while_blocked(run):
    result = run[1][0]["stall"]
    entry = _assert_pending_in_dump(result)
    waited_s = (result["seen"]["mtime_ns"] - entry["time_created_ns"]) / 1e9
    assert 0.9 <= waited_s <= 1.0 + 2.0, f"stall dump after {waited_s:.2f}s (stall_dump_s=1)"
    [(reason, path)] = result["dumps"]
    assert reason.startswith("no progress for 1") and path.name == "fr_dump_0"
    assert result["error"] is None
    # progress resumed, so close() wrote the final dump: the collective completed
    assert [r for r, _ in result["dumps_after"]] == [reason, "close()"]
    assert result["final"]["retired"] is True


def test_sigusr1_dumps_a_rank_blocked_in_a_collective(run):
    result = run[1][0]["signal"]
    _assert_pending_in_dump(result)
    assert [r for r, _ in result["dumps"]] == ["SIGUSR1"]
    assert run[1][0]["user_signals"] == [signal.SIGUSR1]  # the previous handler still ran


def test_dump_lands_before_the_pg_timeout_and_close_keeps_it(run):
    result = run[1][0]["timeout"]
    entry = _assert_pending_in_dump(result)
    assert entry["timeout_ms"] == PG_TIMEOUT_S * 1000
    before_s = (entry["time_created_ns"] + PG_TIMEOUT_S * 1e9 - result["seen"]["mtime_ns"]) / 1e9
    assert 0 < before_s <= 1.0 + 0.5, f"dumped {before_s:.2f}s before the 3s timeout (asked: 1s)"
    [(reason, _)] = result["dumps"]
    assert reason.startswith(f"collective {result['seq']} of group {result['group']} (all_reduce) "
                             "reaches its 3 s timeout in "), reason
    assert result["error"] is not None  # gloo raised in the training thread
    # close() did not overwrite it with a dump where gloo marks the timed-out op retired
    assert result["dumps_after"] == result["dumps"]
    assert result["final"]["collective_seq_id"] == result["seq"] and result["final"]["retired"] is False


# ---- bad arguments -------------------------------------------------------------------------

@pytest.mark.parametrize(("kwargs", "named"), [
    (dict(stall_dump_s=0), "stall_dump_s"),
    (dict(stall_dump_s=-3.0), "stall_dump_s"),
    (dict(stall_dump_s="60"), "stall_dump_s"),
    (dict(dump_on_signal="yes"), "dump_on_signal"),
    (dict(dump_before_timeout_s=-1), "dump_before_timeout_s"),
    (dict(dump_before_timeout_s=float("nan")), "dump_before_timeout_s"),
    (dict(watch_interval_s=0), "watch_interval_s"),
    (dict(watch_interval_s=200.0), "watch_interval_s"),  # not shorter than stall_dump_s
])
def test_bad_arguments_are_refused_by_name(tmp_path, monkeypatch, kwargs, named):
    from fleet.workers.flight import record_collectives

    monkeypatch.delenv("TORCH_FR_BUFFER_SIZE", raising=False)
    monkeypatch.delenv("TORCH_NCCL_DUMP_ON_TIMEOUT", raising=False)
    with pytest.raises(ValueError, match=named) as err:
        record_collectives(dump_dir=tmp_path, agent_address="", **kwargs)
    assert "\n" not in str(err.value)
    # refused before touching anything
    assert "TORCH_FR_BUFFER_SIZE" not in os.environ and "TORCH_NCCL_DUMP_ON_TIMEOUT" not in os.environ
    assert _watchers() == []


def test_a_dump_dir_that_cannot_exist_is_named(tmp_path, monkeypatch):
    from fleet.workers.flight import record_collectives

    monkeypatch.delenv("TORCH_FR_BUFFER_SIZE", raising=False)
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="dump_dir .*file/dumps"):
        record_collectives(dump_dir=tmp_path / "file" / "dumps", agent_address="")
    assert "TORCH_FR_BUFFER_SIZE" not in os.environ


# ---- the watcher's decisions, with literal timestamps ---------------------------------------

S = 1_000_000_000  # ns per second


def _entry(record_id: int, seq: int, created_s: float, timeout_ms: int, retired: bool = False, **kw) -> dict:
    return {"record_id": record_id, "collective_seq_id": seq, "p2p_seq_id": 0, "is_p2p": False,
            "process_group": ("0", "default_pg"), "profiling_name": "nccl:all_reduce",
            "time_created_ns": int(created_s * S), "timeout_ms": timeout_ms, "retired": retired,
            "state": "scheduled", **kw}


def test_pending_entries_and_their_dump_times():
    entries = [_entry(0, 11, 100, 600_000, retired=True),
               _entry(1, 12, 100, 600_000),
               _entry(2, 13, 100, 600_000, state="completed"),  # NCCL's completion
               _entry(3, 0, 100, 0),                            # no timeout: nothing to wait for
               _entry(4, 3, 100, 4_000, is_p2p=True, p2p_seq_id=3, profiling_name="nccl:send 0->1")]
    coll, p2p = pending_entries(entries, dump_before_timeout_s=5.0)
    assert (coll.record_id, coll.seq, coll.op, coll.deadline_ns, coll.dump_at_ns) == (
        1, 12, "all_reduce", 700 * S, 695 * S)
    assert coll.reason(695 * S) == "collective 12 of group 0 (all_reduce) reaches its 600 s timeout in 5 s"
    assert (p2p.seq, p2p.op, p2p.dump_at_ns) == (3, "send 0->1", 102 * S)  # half of a short timeout
    assert p2p.reason(105 * S) == "p2p op 3 of group 0 (send 0->1) reached its 4 s timeout 1 s ago"
    assert timeout_lead_s(600, 5) == 5 and timeout_lead_s(3, 5) == 1.5 and timeout_lead_s(3, 0) == 0


def test_read_delay_stays_well_inside_the_shortest_timeout():
    policy = DumpPolicy(watch_interval_s=1.0)
    assert read_delay_s(policy, None) == 1.0         # nothing known yet: read at once
    assert read_delay_s(policy, 600.0) == 30.0       # capped
    assert read_delay_s(policy, 3.0) == 1.0          # never below one interval
    assert read_delay_s(DumpPolicy(watch_interval_s=0.1), 3.0) == pytest.approx(0.375)


def test_close_keeps_an_automatic_dump_only_for_a_collective_near_its_timeout():
    p = Pending(record_id=7, group="1", seq=4, op="all_reduce", is_p2p=False, timeout_s=3.0,
                deadline_ns=103 * S, dump_at_ns=101 * S)
    last = AutoDump("collective 4 of group 1 ...", Path("fr_dump_0"), (p,), steps=9, enqueued=20)
    assert keep_auto_dump(None, 200 * S, 9, 20) is None
    assert keep_auto_dump(last, 100 * S, 9, 20) is None     # not due (a stall dump): write the final one
    assert keep_auto_dump(last, 200 * S, 10, 20) is None    # a step since: training went on
    assert keep_auto_dump(last, 200 * S, 9, 21) is None     # a collective since
    kept = keep_auto_dump(last, 102 * S, 9, 20)
    assert kept and "collective 4 of group 1 was pending in it near its timeout" in kept
    assert keep_auto_dump(AutoDump("SIGUSR1", Path("x"), (), 9, 20), 200 * S, 9, 20) is None
    assert enqueued({"0": {"last_enqueued_collective": 5}, "1": {"last_enqueued_collective": 2}}) == 7
