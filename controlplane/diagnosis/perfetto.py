"""Chrome / Perfetto trace JSON of collective traces (opens in ui.perfetto.dev).

One process, one track (thread) per rank, one complete slice per collective
(``ph: "X"``, times in microseconds from the earliest entry), and one flow per matched
collective (``s`` on the first rank to enter, ``t`` on the next, ``f`` on the last) so
the UI draws arrows across the ranks that met in it. A slice's end is its measured
exit when the backend gave one; otherwise the rank's next op in the group (the op was
done by then), or the end of the trace for an op that never finished, whose name then
says ``(waiting)``. Findings become instant events on the blamed ranks' tracks.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection
from typing import Any

from fleet.controlplane.diagnosis.engine import Diagnosis
from fleet.controlplane.diagnosis.traces import TraceSet

PID = 1


def perfetto_trace(traces: TraceSet, diagnosis: Diagnosis | None = None, *,
                   ranks: Collection[int] | None = None, group: str | None = None,
                   seq_range: tuple[int, int] | None = None) -> dict[str, Any]:
    """The trace document; ``ranks``/``group``/``seq_range`` keep only what they select."""
    chosen = sorted(r for r in traces.ranks if ranks is None or r in ranks)
    t0 = min((o.enter_ns[0] for r in chosen for g, o in traces.ranks[r].groups.items()
              if o.enter_ns and (group is None or g == group)), default=0)
    t_end = max((max(o.enter_ns) for r in chosen for o in traces.ranks[r].groups.values() if o.enter_ns),
                default=t0)
    events: list[dict[str, Any]] = [
        {"ph": "M", "pid": PID, "name": "process_name", "args": {"name": f"fleet replay {traces.source}"}}]
    meet: dict[tuple[str, int], list[tuple[int, float]]] = defaultdict(list)  # (group, seq) -> (rank, ts)
    sigs = traces.table.sigs
    for rank in chosen:
        events.append({"ph": "M", "pid": PID, "tid": rank, "name": "thread_name",
                       "args": {"name": f"rank {rank}"}})
        events.append({"ph": "M", "pid": PID, "tid": rank, "name": "thread_sort_index",
                       "args": {"sort_index": rank}})
        for gname, ops in traces.ranks[rank].groups.items():
            if group is not None and gname != group:
                continue
            n = len(ops.seqs)
            for i in range(n):
                seq = ops.seqs[i]
                if seq_range and not seq_range[0] <= seq <= seq_range[1]:
                    continue
                enter = ops.enter_ns[i]
                if ops.exit_ns[i]:
                    end = ops.exit_ns[i]
                elif i + 1 < n:
                    end = ops.enter_ns[i + 1]
                else:
                    end = enter if ops.done[i] else t_end
                sig = sigs[ops.sigs[i]]
                ts = (enter - t0) / 1e3
                name = sig.op if ops.done[i] else f"{sig.op} (waiting)"
                events.append({
                    "ph": "X", "pid": PID, "tid": rank, "ts": ts, "dur": max((end - enter) / 1e3, 0.001),
                    "name": name, "cat": f"group {gname}",
                    "args": {"group": gname, "seq": seq, "input_sizes": [list(s) for s in sig.input_sizes],
                             "output_sizes": [list(s) for s in sig.output_sizes],
                             "dtypes": sorted(set(sig.input_dtypes) | set(sig.output_dtypes)),
                             "done": bool(ops.done[i])},
                })
                meet[(gname, seq)].append((rank, ts))
    flow_id = 0
    for (gname, seq), arrivals in meet.items():
        if len(arrivals) < 2:
            continue
        flow_id += 1
        arrivals.sort(key=lambda a: a[1])
        for k, (rank, ts) in enumerate(arrivals):
            ph = "s" if k == 0 else ("f" if k == len(arrivals) - 1 else "t")
            ev = {"ph": ph, "pid": PID, "tid": rank, "ts": ts, "id": flow_id, "name": f"{gname}#{seq}",
                  "cat": "match"}
            if ph != "s":
                ev["bp"] = "e"
            events.append(ev)
    if diagnosis is not None:
        for f in diagnosis.findings:
            for rank in f.ranks:
                if rank in chosen:
                    events.append({"ph": "i", "s": "t", "pid": PID, "tid": rank, "ts": (t_end - t0) / 1e3,
                                   "name": f.kind, "args": {"detail": f.detail, "group": f.group, "seq": f.seq}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"source": traces.source, "verdict": diagnosis.verdict if diagnosis else None}}
