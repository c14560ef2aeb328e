"""Collective bandwidth: how many bytes one collective moves, and the bus-bandwidth factor.

The definitions are nccl-tests' (its PERFORMANCE.md), so a figure here compares with an
``all_reduce_perf`` run on the same links:

  * ``S``, the message size of one rank's collective (``message_bytes``): all_reduce,
    broadcast and reduce: the buffer; all_gather: the whole gathered output (n x one rank's
    input); reduce_scatter: the whole input (n x one rank's output); all_to_all: what one
    rank sends in total; send/recv: the tensor.
  * ``algbw = S / t`` with ``t`` the collective's duration, in bytes/s.
  * ``busbw = algbw x bus_factor(op, n)``: 2(n-1)/n for all_reduce, (n-1)/n for all_gather,
    reduce_scatter and all_to_all, 1 for broadcast, reduce and send/recv. It is the rate
    each rank's link carries, comparable across ops and group sizes, and so against the
    link's own rate.

Not rated (``None``): barrier (no payload), gather/scatter and any op not named above, a
coalesced group mixing different collectives (their factors differ), a size with an
unknown dimension (the dump reader keeps an all_to_all's first dimension as -1: its split
changes every step), a dtype without a known width, and an empty payload.

Canonical op names come from ``fleet.proto.vocab``: ``all_gather`` covers both
all_gather_into_tensor (input ``[k]``, output ``[n*k]``) and the list form (n outputs of
``[k]``); ``*_coalesced`` and ``coalesced(a+a)`` rate as their base op over all their tensors.

Pure Python: no torch, Ray or gRPC.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType

from fleet.proto.vocab import split_op

#: Bytes per element of each dtype, by torch's Python name (``fleet.proto.vocab.dtype_name``).
#: ``float4_e2m1fn_x2`` packs two values in one element, so its element is one byte.
DTYPE_BYTES: Mapping[str, int] = MappingProxyType({
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1, "float4_e2m1fn_x2": 1,
    "complex32": 4, "complex64": 8, "complex128": 16,
    "int8": 1, "uint8": 1, "int16": 2, "uint16": 2, "int32": 4, "uint32": 4, "int64": 8, "uint64": 8,
    "bool": 1, "qint8": 1, "quint8": 1, "qint32": 4,
})

#: Ops whose S is the input buffer; all_gather's is its output, handled on its own.
_INPUT_SIZED = frozenset({"all_reduce", "reduce_scatter", "all_to_all", "broadcast", "reduce", "send", "recv"})
_RATED = _INPUT_SIZED | {"all_gather"}

Shape = Sequence[int]


def base_op(op: str) -> str | None:
    """The collective an op rates as: ``all_reduce_coalesced`` and
    ``coalesced(all_reduce+all_reduce)`` -> ``all_reduce``, ``send 0->1`` -> ``send``;
    None for a coalesced group of different collectives."""
    if op.startswith("coalesced(") and op.endswith(")"):
        parts = {_fold(p) for p in op[len("coalesced("):-1].split("+")}
        return parts.pop() if len(parts) == 1 else None
    return _fold(op)


def _fold(op: str) -> str:
    return split_op(op)[0].removesuffix("_coalesced")


def bus_factor(op: str, n: int) -> float | None:
    """busbw / algbw for ``op`` on a group of ``n`` ranks; None for an op that is not rated
    or a group too small to communicate (``n`` < 2, except send/recv: always two ends)."""
    base = base_op(op)
    if base in ("send", "recv"):
        return 1.0
    if base not in _RATED or n < 2:
        return None
    if base == "all_reduce":
        return 2.0 * (n - 1) / n
    if base in ("broadcast", "reduce"):
        return 1.0
    return (n - 1) / n  # all_gather, reduce_scatter, all_to_all


def tensors_bytes(sizes: Iterable[Shape], dtypes: Sequence[str]) -> int | None:
    """Bytes of a list of tensors (shapes, with one dtype each or one for all); None when a
    dimension or a dtype's width is unknown, or the dtypes do not pair with the shapes."""
    shapes = list(sizes)
    if len(dtypes) == len(shapes):
        pairs: Iterable[tuple[Shape, str]] = zip(shapes, dtypes)
    elif len(dtypes) == 1:
        pairs = ((s, dtypes[0]) for s in shapes)
    else:
        return None
    total = 0
    for shape, dtype in pairs:
        width = DTYPE_BYTES.get(dtype)
        if width is None or any(d < 0 for d in shape):
            return None
        total += math.prod(shape) * width
    return total


def message_bytes(op: str, input_sizes: Iterable[Shape], input_dtypes: Sequence[str],
                  output_sizes: Iterable[Shape], output_dtypes: Sequence[str], group_size: int) -> int | None:
    """nccl-tests' ``S`` of one rank's collective, in bytes (see the module docstring);
    None when it has no payload or is not rated. ``group_size`` (ranks) is used only when
    the side that defines S was not recorded (all_gather without outputs: n x input;
    reduce_scatter without inputs: n x output)."""
    base = base_op(op)
    if base not in _RATED:
        return None
    ins, outs = list(input_sizes), list(output_sizes)
    if base == "all_gather":
        size = tensors_bytes(outs, output_dtypes) if outs else _times(tensors_bytes(ins, input_dtypes), group_size)
    elif ins:
        size = tensors_bytes(ins, input_dtypes)
    elif base == "reduce_scatter":
        size = _times(tensors_bytes(outs, output_dtypes), group_size)
    else:  # a recorder that kept only the output of an in-place buffer
        size = tensors_bytes(outs, output_dtypes)
    return size if size else None


def _times(size: int | None, n: int) -> int | None:
    return None if size is None or n < 1 else size * n
