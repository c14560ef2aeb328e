"""fleet.proto.vocab and fleet.proto.flight_record: the one table of op and dtype names and
the one rule for reading a native flight-recorder entry (pure functions)."""

from __future__ import annotations

import pytest

from fleet.proto import flight_record, vocab


@pytest.mark.parametrize(("native", "canonical"), [
    ("gloo:allreduce", "all_reduce"), ("nccl:_allgather_base", "all_gather"),
    ("_reduce_scatter_base", "reduce_scatter"), ("all_gather_into_tensor", "all_gather"),
    ("reduce_scatter_tensor", "reduce_scatter"), ("alltoall_base", "all_to_all"),
    ("nccl:send 0->1", "send 0->1"), ("recv 1<-0", "recv 1<-0"), ("broadcast", "broadcast"),
    ("all_reduce", "all_reduce"), ("gloo:custom_op", "custom_op"),
])
def test_canonical_op_folds_backend_names_and_is_idempotent(native: str, canonical: str) -> None:
    assert vocab.canonical_op(native) == canonical
    assert vocab.canonical_op(canonical) == canonical
    assert set(vocab.OP_ALIASES.values()).isdisjoint(vocab.OP_ALIASES)  # targets are fixed points


def test_split_op_takes_the_peer_off_a_point_to_point_op() -> None:
    assert vocab.split_op("send 0->1") == ("send", "0->1")
    assert vocab.split_op("all_reduce") == ("all_reduce", "")
    assert {vocab.split_op(vocab.canonical_op(n))[0] for n in ("nccl:send 0->1", "nccl:recv 1<-0")} == vocab.P2P_OPS


def test_dtype_names_are_torch_python_names() -> None:
    assert [vocab.dtype_name(d) for d in ("Float", "BFloat16", "Float8_e4m3fn", "Long", "ComplexFloat")] == [
        "float32", "bfloat16", "float8_e4m3fn", "int64", "complex64"]
    assert vocab.dtype_name("float32") == "float32"     # already canonical: unchanged
    assert vocab.dtype_name("SomethingNew") == "SomethingNew"  # unknown: kept as written
    assert flight_record.dtype_names(None) == [] and flight_record.dtype_names(["Half"]) == ["float16"]


@pytest.mark.parametrize(("state", "retired", "done"), [
    ("scheduled", True, True),      # gloo: retired is the completion signal
    ("completed", False, True),     # NCCL: state moves
    ("started", False, False), ("scheduled", False, False),
])
def test_an_entry_is_done_when_retired_or_completed(state: str, retired: bool, done: bool) -> None:
    assert flight_record.entry_done({"state": state, "retired": retired}) is done


def test_entry_numbering_and_names() -> None:
    coll = {"is_p2p": False, "collective_seq_id": 7, "p2p_seq_id": 0, "profiling_name": "gloo:allreduce"}
    p2p = {"is_p2p": True, "collective_seq_id": 0, "p2p_seq_id": 3, "profiling_name": "nccl:send 0->1"}
    assert (flight_record.entry_seq(coll), flight_record.entry_op(coll)) == (7, "all_reduce")
    assert (flight_record.entry_seq(p2p), flight_record.entry_op(p2p)) == (3, "send 0->1")
    assert flight_record.entry_seq({"is_p2p": False, "collective_seq_id": None}) == 0
    assert flight_record.p2p_group("0") == "0" + flight_record.P2P_SUFFIX == "0:p2p"


def test_vocab_is_pure_python() -> None:
    import ast
    import inspect

    for module in (vocab, flight_record):
        tree = ast.parse(inspect.getsource(module))
        imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert imported <= {"__future__", "collections", "typing", "fleet"}, (module.__name__, imported)
