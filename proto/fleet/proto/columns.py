"""Collectives on the wire, column by column (``CollectiveColumns``); hand-written, not
generated: the codec of one message of the contract, shared by workers and controller.

A rank reports thousands of collectives a minute and the controller stores them for
thousands of ranks, so they travel as columns: the reporter packs a report's
``CollectiveEvent``s into one block here, the agent forwards blocks untouched, and the
controller turns a block into rows with ``zip`` (no per-row Python code there).

Strings (job ids, group names, ops, states, and the JSON text of sizes and dtype lists)
are stored once per block in ``strings``; string columns hold indexes into it.
``unpack`` is the inverse, for tests and tools that want events back.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence

from fleet.proto import events_pb2

_dumps = json.JSONEncoder(separators=(",", ":")).encode

#: JSON text of shapes and dtype lists by value; a job repeats a few hundred of them.
_JSON: dict[tuple, str] = {}
_JSON_MAX = 8192


def _json(key: tuple, value: object) -> str:
    text = _JSON.get(key)
    if text is None:
        if len(_JSON) >= _JSON_MAX:
            _JSON.clear()
        text = _JSON[key] = _dumps(value)
    return text


def shapes_json(shapes: Iterable[Sequence[int]]) -> str:
    """``[[8,16],[4]]`` for two tensors of shapes (8, 16) and (4,)."""
    key = ("s", *(tuple(s) for s in shapes))
    return _json(key, [list(s) for s in key[1:]])


def dtypes_json(dtypes: Iterable[str]) -> str:
    """``["float32","bfloat16"]``."""
    key = ("d", *dtypes)
    return _json(key, list(key[1:]))


def pack(events: Iterable[events_pb2.CollectiveEvent]) -> events_pb2.CollectiveColumns:
    """One block holding ``events`` in order."""
    strings: dict[str, int] = {}

    def ix(s: str) -> int:
        i = strings.get(s)
        if i is None:
            i = strings[s] = len(strings)
        return i

    job, attempt, rank, group, group_size, seq, op = [], [], [], [], [], [], []
    in_sizes, in_dtypes, out_sizes, out_dtypes = [], [], [], []
    enter, exit_, state, step, estimated, duration, timing = [], [], [], [], [], [], []
    for ev in events:
        job.append(ix(ev.job_id))
        attempt.append(ev.attempt)
        rank.append(ev.rank)
        group.append(ix(ev.group))
        group_size.append(ev.group_size)
        seq.append(ev.seq)
        op.append(ix(ev.op))
        in_sizes.append(ix(shapes_json(s.dims for s in ev.input_sizes)))
        in_dtypes.append(ix(dtypes_json(ev.input_dtypes)))
        out_sizes.append(ix(shapes_json(s.dims for s in ev.output_sizes)))
        out_dtypes.append(ix(dtypes_json(ev.output_dtypes)))
        enter.append(ev.enter_ns)
        exit_.append(ev.exit_ns)
        state.append(ix(ev.state or "started"))
        step.append(ev.step)
        estimated.append(ev.exit_estimated)
        duration.append(ev.duration_ns)
        timing.append(ev.timing)
    return events_pb2.CollectiveColumns(
        strings=list(strings), job_id=job, attempt=attempt, rank=rank, group=group,
        group_size=group_size, seq=seq, op=op, input_sizes=in_sizes, input_dtypes=in_dtypes,
        output_sizes=out_sizes, output_dtypes=out_dtypes, enter_ns=enter, exit_ns=exit_,
        state=state, step=step, exit_estimated=estimated, duration_ns=duration, timing=timing)


def pack_events(events: Sequence[events_pb2.Event]) -> list[events_pb2.Event]:
    """``events`` with its single collectives packed into one block, placed last, so that
    a group's ProcessGroupInfo still comes before its collectives; other events keep
    their order. (The controller stores a report's events in one transaction.)"""
    out: list[events_pb2.Event] = []
    collectives: list[events_pb2.CollectiveEvent] = []
    for event in events:
        if event.WhichOneof("kind") == "collective":
            collectives.append(event.collective)
        else:
            out.append(event)
    if collectives:
        out.append(events_pb2.Event(collectives=pack(collectives)))
    return out


def unpack(block: events_pb2.CollectiveColumns) -> list[events_pb2.CollectiveEvent]:
    """The events of ``block``, in order."""
    s = block.strings
    out = []
    for i in range(len(block.job_id)):
        ev = events_pb2.CollectiveEvent(
            job_id=s[block.job_id[i]], attempt=block.attempt[i], rank=block.rank[i],
            group=s[block.group[i]], group_size=block.group_size[i], seq=block.seq[i],
            op=s[block.op[i]], input_dtypes=json.loads(s[block.input_dtypes[i]]),
            output_dtypes=json.loads(s[block.output_dtypes[i]]), enter_ns=block.enter_ns[i],
            exit_ns=block.exit_ns[i], state=s[block.state[i]], step=block.step[i],
            exit_estimated=block.exit_estimated[i],
            duration_ns=block.duration_ns[i] if block.duration_ns else 0,
            timing=block.timing[i] if block.timing else 0)
        for dims in json.loads(s[block.input_sizes[i]]):
            ev.input_sizes.add().dims.extend(dims)
        for dims in json.loads(s[block.output_sizes[i]]):
            ev.output_sizes.add().dims.extend(dims)
        out.append(ev)
    return out
