"""The one vocabulary of collectives: canonical op names and dtype names.

Collectives reach fleet in two vocabularies: PyTorch's native flight recorder names ops
as the backend does (``gloo:allreduce``, ``nccl:_allgather_base``, ``nccl:send 0->1``)
and dtypes as c10 ScalarTypes (``Float``, ``BFloat16``); fleet's Python wrappers
(workers/recorder.py) name them as ``torch.distributed`` does (``all_reduce``,
``all_gather_into_tensor``) with torch's dtype names (``float32``). This module is the
only table between the two, imported by the workers and by the diagnosis engine alike.

Where each is applied, once (STYLE rule 13):
  * op names: at the store's ingest (every producer's collectives pass through it) and
    in the dump reader (``fleet replay --dumps``); stored rows are canonical.
  * dtype names: where a native entry is read (the worker's ``NativeFlightTail``, the
    dump reader); the wrappers already speak torch's names.

Rows stored before the ingest made op names canonical keep the names they were stored
with (no migration rewrites them, and nothing folds them on read): all ranks of an
attempt used the same recorder, so their verdicts still compare like with like; only the
names shown by ``fleet replay`` for such old attempts are the backend's.

Canonical forms:
  * op: ``"<op>"`` or, for point-to-point ops, ``"<op> <meta>"`` where ``meta`` is the
    native ``"src->dst"`` (send) / ``"dst<-src"`` (recv) in group ranks. The backend
    prefix is dropped and the op word folded through ``OP_ALIASES``; canonical names
    map to themselves, so ``canonical_op`` is idempotent.
  * dtype: torch's Python name without ``torch.`` (``float32``); a name neither table
    knows is kept as written.

Pure Python: no torch, Ray or gRPC.
"""

from __future__ import annotations

#: Backend-specific op names, folded to one name per collective.
OP_ALIASES: dict[str, str] = {
    "allreduce": "all_reduce",
    "allreduce_coalesced": "all_reduce_coalesced",
    "_allgather_base": "all_gather",
    "allgather": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "allgather_into_tensor_coalesced": "all_gather_coalesced",
    "_reduce_scatter_base": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "reducescatter": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter_coalesced",
    "alltoall": "all_to_all",
    "alltoall_base": "all_to_all",
    "all_to_all_single": "all_to_all",
}

#: Point-to-point ops: their canonical name carries the peer as ``meta``.
P2P_OPS = frozenset({"send", "recv"})

#: Native dtype names (c10 ScalarType names, as flight-recorder entries write them) as
#: torch's Python names.
DTYPE_NAMES: dict[str, str] = {
    "Float": "float32", "Double": "float64", "Half": "float16", "BFloat16": "bfloat16",
    "ComplexHalf": "complex32", "ComplexFloat": "complex64", "ComplexDouble": "complex128",
    "Long": "int64", "Int": "int32", "Short": "int16", "Char": "int8", "Byte": "uint8",
    "UInt16": "uint16", "UInt32": "uint32", "UInt64": "uint64", "Bool": "bool",
    "Float8_e4m3fn": "float8_e4m3fn", "Float8_e5m2": "float8_e5m2",
    "Float8_e4m3fnuz": "float8_e4m3fnuz", "Float8_e5m2fnuz": "float8_e5m2fnuz",
    "Float8_e8m0fnu": "float8_e8m0fnu", "Float4_e2m1fn_x2": "float4_e2m1fn_x2",
    "QInt8": "qint8", "QUInt8": "quint8", "QInt32": "qint32",
}


def canonical_op(name: str) -> str:
    """``"gloo:allreduce"`` -> ``"all_reduce"``; ``"nccl:send 0->1"`` -> ``"send 0->1"``."""
    name = name.split(":", 1)[-1]
    op, sep, meta = name.partition(" ")
    op = OP_ALIASES.get(op, op)
    return f"{op} {meta}" if sep else op


def split_op(op: str) -> tuple[str, str]:
    """A canonical op as ``(op, meta)``: ``"send 0->1"`` -> ``("send", "0->1")``."""
    name, _, meta = op.partition(" ")
    return name, meta


def dtype_name(name: object) -> str:
    """A native or Python dtype name as torch's Python name (``"Float"`` -> ``"float32"``)."""
    if isinstance(name, str):
        return DTYPE_NAMES.get(name, name)
    return str(name)
