"""How to read one entry of PyTorch's native flight recorder: the rules fleet applies
in both places that read entries, the worker's ``NativeFlightTail``
(workers/native_fr.py) and the dump reader of ``fleet replay --dumps``
(controlplane/diagnosis/dumps.py).

An entry (dump format 2.x) carries ``record_id, pg_id, process_group, collective_seq_id,
p2p_seq_id, op_id, profiling_name, time_created_ns, input_sizes, input_dtypes,
output_sizes, output_dtypes, state, retired, timeout_ms, is_p2p, frames``.

Rules:
  * Completion: NCCL moves ``state`` to ``completed``; gloo leaves it ``scheduled``
    and ``retired`` becomes True, also for an op that ended by timing out. An entry is
    done when either says so (``entry_done``).
  * Sequence: collectives count in ``collective_seq_id``, point-to-point ops in
    ``p2p_seq_id``; 0 means the entry has no number (e.g. a coalescing marker).
  * Point-to-point ops live in their own numbering, so fleet files them under the
    group name suffixed ``P2P_SUFFIX``.
  * Names: the op through ``vocab.canonical_op``, dtypes through ``vocab.dtype_name``.

Pure Python: no torch, Ray or gRPC.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from fleet.proto.vocab import canonical_op, dtype_name

#: Suffix of the group name under which a group's point-to-point ops are numbered.
P2P_SUFFIX = ":p2p"


def entry_done(entry: Mapping[str, Any]) -> bool:
    """True once the backend finished the entry (``retired``, or ``state == "completed"``)."""
    return is_done(entry.get("retired"), entry.get("state"))


def is_done(retired: object, state: object) -> bool:
    """``entry_done`` from the two fields, for readers that fetched them already."""
    return retired is True or state == "completed"


def entry_seq(entry: Mapping[str, Any]) -> int:
    """The entry's sequence number in its numbering (collective or point-to-point); 0 if none."""
    seq = entry.get("p2p_seq_id") if entry.get("is_p2p") else entry.get("collective_seq_id")
    return int(seq or 0)


def entry_op(entry: Mapping[str, Any]) -> str:
    """The entry's canonical op (``vocab.canonical_op`` of its ``profiling_name``)."""
    return canonical_op(str(entry["profiling_name"]))


def dtype_names(names: Iterable[object] | None) -> list[str]:
    """An entry's ``input_dtypes``/``output_dtypes`` as torch's Python names."""
    return [dtype_name(d) for d in names or ()]


def p2p_group(group: str) -> str:
    """The name point-to-point ops of ``group`` are filed under."""
    return group + P2P_SUFFIX
