"""Bandwidth analytics (controlplane/diagnosis/bandwidth.py): nccl-tests' message sizes and
bus factors, and the per-group figures over hand-built traces with known sizes and times."""

from __future__ import annotations

import pytest

from fleet.controlplane.diagnosis.bandwidth import DTYPE_BYTES, base_op, bus_factor, message_bytes, tensors_bytes
from fleet.proto.vocab import DTYPE_NAMES

pytestmark = pytest.mark.timeout(60)

MIB = 1 << 20


# --- formulas -------------------------------------------------------------------------

def test_every_dtype_fleet_names_has_a_width():
    missing = set(DTYPE_NAMES.values()) - set(DTYPE_BYTES)
    assert not missing
    assert DTYPE_BYTES["bfloat16"] == 2 and DTYPE_BYTES["float8_e4m3fn"] == 1 and DTYPE_BYTES["complex128"] == 16


@pytest.mark.parametrize("op,n,factor", [
    ("all_reduce", 4, 1.5), ("all_reduce", 2, 1.0), ("all_reduce_coalesced", 8, 1.75),
    ("all_gather", 4, 0.75), ("all_gather_coalesced", 4, 0.75), ("reduce_scatter", 8, 0.875),
    ("all_to_all", 4, 0.75), ("broadcast", 4, 1.0), ("reduce", 16, 1.0), ("send 0->1", 2, 1.0),
    ("coalesced(all_reduce+all_reduce)", 4, 1.5),
])
def test_bus_factor(op, n, factor):
    assert bus_factor(op, n) == pytest.approx(factor)


@pytest.mark.parametrize("op,n", [("barrier", 4), ("gather", 4), ("scatter", 4), ("all_reduce", 1),
                                  ("coalesced(all_reduce+broadcast)", 4), ("unknown_op", 4)])
def test_bus_factor_not_rated(op, n):
    assert bus_factor(op, n) is None


def test_all_reduce_size_is_the_buffer():
    assert message_bytes("all_reduce", [(MIB,)], ["float32"], [(MIB,)], ["float32"], 4) == 4 * MIB
    # a coalesced all_reduce: the sum of its tensors, each with its own dtype
    assert message_bytes("all_reduce_coalesced", [(10,), (4, 5)], ["float32", "bfloat16"], [], [], 4) == 40 + 40


def test_all_gather_size_is_the_gathered_output_in_both_forms():
    into_tensor = message_bytes("all_gather", [(100,)], ["bfloat16"], [(400,)], ["bfloat16"], 4)
    list_form = message_bytes("all_gather", [(100,)], ["bfloat16"], [(100,)] * 4, ["bfloat16"] * 4, 4)
    no_output = message_bytes("all_gather", [(100,)], ["bfloat16"], [], [], 4)
    assert into_tensor == list_form == no_output == 800


def test_reduce_scatter_size_is_the_whole_input():
    assert message_bytes("reduce_scatter", [(400,)], ["float32"], [(100,)], ["float32"], 4) == 1600
    assert message_bytes("reduce_scatter", [(100,)] * 4, ["float32"] * 4, [(100,)], ["float32"], 4) == 1600
    assert message_bytes("reduce_scatter", [], [], [(100,)], ["float32"], 4) == 1600


def test_all_to_all_size_is_what_one_rank_sends():
    assert message_bytes("all_to_all", [(8, 16)], ["float16"], [(6, 16)], ["float16"], 4) == 8 * 16 * 2
    # the dump reader's all_to_all keeps the first dimension unknown: not rated
    assert message_bytes("all_to_all", [(-1, 16)], ["float16"], [(-1, 16)], ["float16"], 4) is None


def test_broadcast_and_reduce_sizes():
    assert message_bytes("broadcast", [(3, 3)], ["int64"], [(3, 3)], ["int64"], 8) == 72
    assert message_bytes("reduce", [(5,)], ["float64"], [(5,)], ["float64"], 8) == 40


@pytest.mark.parametrize("args", [
    ("barrier", [], [], [], [], 4),
    ("gather", [(4,)], ["float32"], [(4,)] * 4, ["float32"] * 4, 4),
    ("all_reduce", [(4,)], ["mystery"], [(4,)], ["mystery"], 4),
    ("all_reduce", [(0,)], ["float32"], [(0,)], ["float32"], 4),
    ("coalesced(all_reduce+broadcast)", [(4,), (4,)], ["float32"] * 2, [(4,), (4,)], ["float32"] * 2, 4),
])
def test_message_bytes_not_rated(args):
    assert message_bytes(*args) is None


def test_coalesced_same_op_is_the_sum_of_its_parts():
    assert base_op("coalesced(all_gather+all_gather)") == "all_gather"
    assert message_bytes("coalesced(all_gather+all_gather)", [(2,), (3,)], ["float32"] * 2,
                         [(8,), (12,)], ["float32"] * 2, 4) == 80


def test_tensors_bytes_pairs_dtypes_or_fails():
    assert tensors_bytes([(2, 3), (4,)], ["int32"]) == 40
    assert tensors_bytes([(2,), (4,)], ["int32", "int64", "int8"]) is None
