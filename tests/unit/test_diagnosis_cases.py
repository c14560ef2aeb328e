"""Every case of bench/fr_dumps.py, diagnosed from its files as a user would.

For each case at 8 and 64 ranks (300 entries per rank) the generator writes its dumps
into a temporary folder and ``analyze_dumps`` must give the planted verdict and exactly
the planted culprits (and, where a rank died, the planted missing ranks).

The generator checks itself too, from the files alone: the healthy Megatron job's sends
and receives pair up one to one, every rank is blocked in at most one op, no collective
is pending with every member in it unless someone completed it (a stuck kernel), and
the ranks that everyone waits on transitively are exactly the planted culprits; the
onlyActive, empty-dump and gloo variants are the same fault as their full NCCL twins.
"""

from __future__ import annotations

import ast
import pickle
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from bench import fr_dumps
from fleet.controlplane.diagnosis import analyze_dumps

SIZES = (8, 64)
ENTRIES = 300
MEGATRON = fr_dumps.fr_megatron.CASES


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """``get(case, ranks) -> (folder, plant)``, each generated once for the module."""
    cache: dict[tuple[str, int], tuple[Path, fr_dumps.Plant]] = {}

    def get(case: str, ranks: int) -> tuple[Path, fr_dumps.Plant]:
        if (case, ranks) not in cache:
            folder = tmp_path_factory.mktemp(f"{case}-{ranks}")
            cache[(case, ranks)] = folder, fr_dumps.generate(folder, ranks, ENTRIES, case)
        return cache[(case, ranks)]

    return get


@pytest.mark.parametrize("ranks", SIZES)
@pytest.mark.parametrize("case", fr_dumps.CASES)
def test_case_is_diagnosed_as_planted(folders, case, ranks):
    folder, plant = folders(case, ranks)
    d = analyze_dumps(folder)
    assert (d.verdict, sorted(d.culprit_ranks)) == (plant.verdict, sorted(plant.culprit_ranks)), \
        f"{case} at {ranks} ranks: planted {plant.detail!r}; diagnosed: {d.summary}"
    if plant.missing_ranks:
        assert d.missing_ranks == plant.missing_ranks


# --- the generator's self-test ---------------------------------------------------------------

def _docs(folder: Path, plant: fr_dumps.Plant) -> dict[int, dict[str, Any]]:
    docs = {}
    for r in range(plant.ranks):
        path = folder / f"{plant.prefix}{r}"
        if path.exists():
            docs[r] = pickle.loads(path.read_bytes())
    return docs


def _members(docs: dict[int, dict[str, Any]]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for doc in docs.values():
        for name, cfg in doc["pg_config"].items():
            out[name] = ast.literal_eval(cfg["ranks"])
    return out


def _pending(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """A rank's ops not completed: its entries, or for an empty dump its pg_status."""
    if doc["entries"]:
        return [e for e in doc["entries"] if e["state"] != "completed"]
    return [{"process_group": (g, ""), "collective_seq_id": st["last_started_collective"], "is_p2p": False,
             "profiling_name": "nccl:?", "state": "started"}
            for g, st in doc["pg_status"].items()
            if st["last_started_collective"] > st["last_completed_collective"]]


def _peer(e: dict[str, Any], members: dict[str, list[int]]) -> tuple[str, int]:
    """``("send" | "recv", global peer)`` of a p2p entry ("nccl:send 0->1", own rank first)."""
    kind, arrow = e["profiling_name"].split(":")[1].split(" ")
    local = int(arrow.split("->" if kind == "send" else "<-")[1])
    return kind, members[e["process_group"][0]][local]


def _wait_for(docs, members):
    """``(waits, blocked, stuck, problems)``: whom each rank's pending ops wait on (all of
    them, and the blocking ones: a pending send does not block its rank), the ranks in a
    collective that a peer completed, and inconsistencies of the generator."""
    def status(r: int, g: str, key: str) -> int:
        return docs[r]["pg_status"].get(g, {}).get(key, -1) if r in docs else -1

    waits: dict[int, set[int]] = defaultdict(set)
    blocked: dict[int, set[int]] = defaultdict(set)
    stuck: set[int] = set()
    problems = []
    for r, doc in docs.items():
        pend = _pending(doc)
        if sum(1 for e in pend if not e["profiling_name"].split(":")[1].startswith("send")) > 1:
            problems.append(f"rank {r} is blocked in more than one op")
        for e in pend:
            g = e["process_group"][0]
            if e["is_p2p"]:
                kind, peer = _peer(e, members)
                waits[r].add(peer)
                if kind == "recv":
                    blocked[r].add(peer)
                    if peer in docs and any(
                            x["is_p2p"] and x["state"] != "completed" and _peer(x, members) == ("send", r)
                            for x in docs[peer]["entries"]):
                        problems.append(f"rank {r}'s recv from {peer} and {peer}'s send are both pending")
                continue
            seq = e["collective_seq_id"]
            absent = {m for m in members[g] if m != r and status(m, g, "last_enqueued_collective") < seq}
            if absent:
                waits[r] |= absent
                blocked[r] |= absent
            elif any(status(m, g, "last_completed_collective") >= seq for m in members[g] if m != r):
                stuck.add(r)
            else:
                problems.append(f"rank {r}: collective {seq} of group {g} pending with every member in it")
    return waits, blocked, stuck, problems


def _roots(docs, members) -> tuple[set[int], list[str]]:
    waits, blocked, stuck, problems = _wait_for(docs, members)
    awaited = {q for w in waits.values() for q in w} | stuck
    return {r for r in awaited if not blocked.get(r)}, problems


_NCCL_HANGS = [c for c in MEGATRON if c not in ("dead_rank_gloo", "p2p_wrong_peer")]


@pytest.mark.parametrize("ranks", SIZES)
@pytest.mark.parametrize("case", _NCCL_HANGS + ["healthy", "hang", "subgroup_hang"])
def test_generator_blocks_exactly_behind_the_planted_culprits(folders, case, ranks):
    folder, plant = folders(case, ranks)
    docs = _docs(folder, plant)
    assert sorted(set(range(ranks)) - set(docs)) == plant.missing_ranks
    members = _members(docs)
    roots, problems = _roots(docs, members)
    assert problems == []
    for doc in docs.values():
        es = doc["entries"]
        assert all(a["time_created_ns"] < b["time_created_ns"] and a["record_id"] < b["record_id"]
                   for a, b in zip(es, es[1:]))
        assert all(e["time_created_ns"] < e["time_discovered_started_ns"] < e["time_discovered_completed_ns"]
                   for e in es if e["state"] == "completed")
    assert roots == set(plant.culprit_ranks), plant.detail
    if plant.verdict == "ok":
        assert not any(_pending(d) for d in docs.values())


@pytest.mark.parametrize("ranks", SIZES)
def test_generator_healthy_megatron_sends_and_recvs_pair_up(folders, ranks):
    folder, plant = folders("megatron_healthy", ranks)
    docs = _docs(folder, plant)
    members = _members(docs)
    sends: dict[tuple[str, int, int], list] = defaultdict(list)
    recvs: dict[tuple[str, int, int], list] = defaultdict(list)
    for r, doc in docs.items():
        for e in doc["entries"]:
            if e["is_p2p"]:
                kind, peer = _peer(e, members)
                (sends if kind == "send" else recvs)[(e["process_group"][0], *((r, peer) if kind == "send"
                                                                               else (peer, r)))].append(e)
    assert sends and set(sends) == set(recvs)
    own_counters = False
    for pair, ss in sends.items():
        rs = recvs[pair]
        n = min(len(ss), len(rs))  # both rings end at the step's end; their starts differ
        assert n > 0
        for s, r in zip(ss[-n:], rs[-n:]):
            assert s["input_sizes"] == r["output_sizes"] and s["input_dtypes"] == r["output_dtypes"]
            # the n-th send and the n-th recv of the pair are the same transfer: in flight together
            assert s["time_created_ns"] <= r["time_discovered_completed_ns"]
            assert r["time_created_ns"] <= s["time_discovered_completed_ns"]
            assert s["state"] == r["state"] == "completed"
            own_counters |= s["p2p_seq_id"] != r["p2p_seq_id"]
    assert own_counters  # p2p_seq_id is each rank's own counter, not a key the pair shares


@pytest.mark.parametrize("ranks", SIZES)
def test_generator_wrong_peer_recv_names_a_rank_that_never_sends_to_it(folders, ranks):
    folder, plant = folders("p2p_wrong_peer", ranks)
    docs = _docs(folder, plant)
    members = _members(docs)
    (culprit,) = plant.culprit_ranks
    (recv,) = [e for e in _pending(docs[culprit]) if e["is_p2p"]]
    kind, peer = _peer(recv, members)
    assert kind == "recv" and recv["process_group"][0] == plant.group
    assert not any(e["is_p2p"] and _peer(e, members) == ("send", culprit) and
                   e["process_group"][0] == recv["process_group"][0] for e in docs[peer]["entries"])
    # the true sender's send to the culprit is left pending
    assert any(e["is_p2p"] and e["state"] == "started" and _peer(e, members) == ("send", culprit)
               for d in docs.values() for e in d["entries"])


def _signature(e: dict[str, Any]) -> tuple:
    return e["process_group"][0], e["collective_seq_id"], e["is_p2p"], e["profiling_name"], e["state"]


@pytest.mark.parametrize("ranks", SIZES)
def test_generator_only_active_and_empty_dumps_are_the_stuck_kernel_twin(folders, ranks):
    full = _docs(*folders("stuck_kernel", ranks))
    active = _docs(*folders("stuck_kernel_active", ranks))
    empty_folder, plant = folders("stuck_kernel_empty", ranks)
    empty = _docs(empty_folder, plant)
    (culprit,) = plant.culprit_ranks
    for r in range(ranks):
        assert [_signature(e) for e in active[r]["entries"]] == [_signature(e) for e in _pending(full[r])]
        assert active[r]["pg_status"] == full[r]["pg_status"] == empty[r]["pg_status"]
        assert empty[r]["entries"] == ([] if r == culprit else full[r]["entries"])
    assert all(e["state"] != "completed" for d in active.values() for e in d["entries"])


@pytest.mark.parametrize("ranks", SIZES)
def test_generator_gloo_dead_rank_is_the_nccl_twin_as_gloo_records_it(folders, ranks):
    nccl = _docs(*folders("dead_rank", ranks))
    folder, plant = folders("dead_rank_gloo", ranks)
    gloo = _docs(folder, plant)
    assert set(gloo) == set(nccl) == set(range(ranks)) - set(plant.missing_ranks)
    for r, doc in gloo.items():
        assert doc["pg_config"] == {"": {"name": "", "desc": "", "ranks": "[]"}}
        es = doc["entries"]
        assert len(es) == ENTRIES
        assert all(not e["is_p2p"] and e["retired"] and e["state"] == "scheduled" and
                   e["time_discovered_started_ns"] is None and e["profiling_name"].startswith("gloo:") for e in es)
        assert {str(e["pg_id"]) for e in es} <= set(doc["pg_status"])  # keyed by the local pg_id
        colls = [(e["process_group"][0], e["collective_seq_id"]) for e in nccl[r]["entries"] if not e["is_p2p"]]
        assert [(e["process_group"][0], e["collective_seq_id"]) for e in es][-len(colls):] == colls
        # the survivor's pending collective timed out: retired in gloo, but not counted completed
        pend = [e for e in _pending(nccl[r]) if not e["is_p2p"]]
        for e in pend:
            st = doc["pg_status"][str(e["pg_id"])]
            assert st["last_completed_collective"] < st["last_enqueued_collective"]
