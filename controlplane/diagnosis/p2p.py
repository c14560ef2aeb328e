"""Point-to-point ops: which send meets which recv, and who waits on whom.

A send and a recv meet by (source, destination, n-th op between that pair): the
``p2p_seq_id`` of an entry is its own rank's counter over every peer on the group, so it
is no key across ranks. Each side's ring may have lost its oldest ops, so the n-th op is
counted from where both sides agree: a pair's ops complete in order, so the newest
completed send of a pair meets its newest completed recv, and the open ones follow in
order after them (when neither ring wrapped, from the first op).

  * A pending send waits on its receiver, a pending recv on its sender, for the ops the
    partner has not posted (``p2p_unmatched``; ``no trace`` when the partner left none).
  * A recv from a peer whose trace holds no send to that rank anywhere — while the peer
    does point-to-point traffic on the group and its ring reaches back past the recv —
    names the receiver (``p2p_mismatch``): it asks the wrong peer. The same holds for a
    send to a peer that never receives from the sender.
  * Sizes of the ops that meet must agree (``size_mismatch``, both named).

gloo (torch 2.13) records no point-to-point ops at all; NCCL does.
"""

from __future__ import annotations

from collections import defaultdict

from fleet.controlplane.diagnosis.checks import Analysis, Finding
from fleet.controlplane.diagnosis.traces import P2POp


def check_p2p(a: Analysis) -> None:
    posted: dict[tuple[str, int, int, str], list[P2POp]] = defaultdict(list)  # (group, src, dst, kind)
    peers: dict[int, set[tuple[str, int]]] = defaultdict(set)                 # rank -> (kind, peer), any group
    for rank, t in a.traces.ranks.items():
        for group, ops in t.p2p.items():
            for op in ops:
                src, dst = (rank, op.peer) if op.kind == "send" else (op.peer, rank)
                posted[(group, src, dst, op.kind)].append(op)
                peers[rank].add((op.kind, op.peer))
    for group, src, dst in sorted({(g, s, d) for g, s, d, _ in posted}):
        sends = posted.get((group, src, dst, "send"), [])
        recvs = posted.get((group, src, dst, "recv"), [])
        if _wrong_peer(a, group, src, dst, sends, recvs, peers):
            continue
        _check_sizes(a, group, src, dst, sends, recvs, wrapped=_wrapped(a, src) or _wrapped(a, dst))
        open_sends = [op for op in sends if not op.done]
        open_recvs = [op for op in recvs if not op.done]
        if len(open_sends) > len(open_recvs):
            extra, kind, waiter, partner = open_sends[len(open_recvs):], "send", src, dst
        elif len(open_recvs) > len(open_sends):
            extra, kind, waiter, partner = open_recvs[len(open_sends):], "recv", dst, src
        else:
            continue
        if a.now_ns is not None and a.now_ns - extra[0].enter_ns < a.config.settle_s * 1e9:
            continue
        if partner in a.missing:
            why = "has no trace"
        elif a.traces.ranks.get(partner) is None:
            why = "is not in the dumps"
        else:
            why = "never posted the matching recv" if kind == "send" else "never sent it"
        arrow = f"to rank {partner}" if kind == "send" else f"from rank {partner}"
        a.add(Finding(
            "p2p_unmatched", group, extra[0].seq, [partner],
            f"rank {waiter} waits in {kind} {arrow} ({len(extra)} open, p2p #{extra[0].seq} on group "
            f"{group}), which rank {partner} {why}", [waiter]))


def _wrapped(a: Analysis, rank: int) -> bool:
    t = a.traces.ranks.get(rank)
    return t is None or t.first_record != 0


def _wrong_peer(a: Analysis, group: str, src: int, dst: int, sends: list[P2POp], recvs: list[P2POp],
                peers: dict[int, set[tuple[str, int]]]) -> bool:
    """An open recv (send) whose partner never sends to (receives from) this rank on any
    group, though the partner's trace reaches back past it and keeps completed entries
    (an ``onlyActive`` dump does not): the poster asked the wrong peer. Adds a
    ``p2p_mismatch`` finding naming it."""
    for posted, kind, poster, partner, want in ((recvs, "recv", dst, src, "send"), (sends, "send", src, dst, "recv")):
        ops = [op for op in posted if not op.done]  # a completed one met its partner
        if not ops or (want, poster) in peers.get(partner, set()):
            continue
        trace = a.traces.ranks.get(partner)
        if trace is None or not _reaches_back(trace, ops[0].enter_ns):
            continue
        other = sorted({p for k, p in peers.get(poster, set()) if k == kind and p != partner})
        hint = f"; it {'receives from' if kind == 'recv' else 'sends to'} {_list(other)} elsewhere" if other else ""
        a.add(Finding(
            "p2p_mismatch", group, ops[0].seq, [poster],
            f"rank {poster} posted a {kind} {'from' if kind == 'recv' else 'to'} rank {partner} "
            f"(p2p #{ops[0].seq} on group {group}), but rank {partner} never "
            f"{'sends to' if kind == 'recv' else 'receives from'} rank {poster} anywhere in its trace{hint}"))
        return True
    return False


def _reaches_back(trace, when_ns: int) -> bool:  # noqa: ANN001 (RankTrace)
    """The trace holds completed entries, the oldest entered no later than ``when_ns``."""
    oldest, done = None, False
    for ops in trace.groups.values():
        if ops.seqs:
            oldest = ops.enter_ns[0] if oldest is None else min(oldest, ops.enter_ns[0])
            done = done or any(ops.done)
    for ops in trace.p2p.values():
        if ops:
            oldest = ops[0].enter_ns if oldest is None else min(oldest, ops[0].enter_ns)
            done = done or any(op.done for op in ops)
    return done and oldest is not None and oldest <= when_ns


def _check_sizes(a: Analysis, group: str, src: int, dst: int, sends: list[P2POp], recvs: list[P2POp],
                 wrapped: bool) -> None:
    done_s = [op for op in sends if op.done]
    done_r = [op for op in recvs if op.done]
    if wrapped:  # align on the newest completed op of each side
        n = min(len(done_s), len(done_r))
        pairs = list(zip(done_s[len(done_s) - n:], done_r[len(done_r) - n:]))
    else:
        pairs = list(zip(done_s, done_r))
    pairs += list(zip([op for op in sends if not op.done], [op for op in recvs if not op.done]))
    for snd, rcv in pairs:
        x, y = a.sigs[snd.sig], a.sigs[rcv.sig]
        if x.input_sizes and y.output_sizes and x.input_sizes != y.output_sizes:
            a.add(Finding("size_mismatch", group, snd.seq, [src, dst],
                          f"rank {src} sends {list(map(list, x.input_sizes))} to rank {dst}, "
                          f"which receives {list(map(list, y.output_sizes))}"))
            return


def _list(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks[:6])) + (
        ", ..." if len(ranks) > 6 else "")
