"""workers/data.py: packed synthetic documents and the memory-mapped token file."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fleet.workers import data
from fleet.workers.spec import TrainArgs

pytestmark = pytest.mark.timeout(30)

V = 256
TRAIN = TrainArgs(batch_size=4, seq_len=48, seed=3, mean_doc_len=10)


def _same(a: data.Batch, b: data.Batch) -> bool:
    return all(torch.equal(x, y) for x, y in ((a.inputs, b.inputs), (a.targets, b.targets),
                                               (a.doc_ids, b.doc_ids))) and a.position == b.position


def _check_packing(b: data.Batch) -> None:
    """targets are shifted inputs, masked right after EOS; doc_ids step after each EOS."""
    x, y, d = b.inputs, b.targets, b.doc_ids
    assert x.shape == y.shape == d.shape and x.dtype == y.dtype == d.dtype == torch.int64
    eos = x == data.EOS
    assert torch.equal(y == data.IGNORE, eos)
    assert torch.equal(x[:, 1:][~eos[:, :-1]], y[:, :-1][~eos[:, :-1]])
    assert (d[:, 0] == 0).all()
    assert torch.equal(d[:, 1:] - d[:, :-1], eos[:, :-1].long())


# ---- synthetic ------------------------------------------------------------------------------

def test_synthetic_is_deterministic_and_packed():
    a, b = data.batch(TRAIN, V, 7, 1), data.batch(TRAIN, V, 7, 1)
    assert _same(a, b) and a.position is None
    assert a.inputs.shape == (4, 48)
    _check_packing(a)
    assert int(a.inputs.min()) >= 0 and int(a.inputs.max()) < V


def test_synthetic_differs_across_step_rank_and_seed():
    base = data.batch(TRAIN, V, 1, 0).inputs
    for other in (data.batch(TRAIN, V, 2, 0), data.batch(TRAIN, V, 1, 1),
                  data.batch(dataclasses.replace(TRAIN, seed=4), V, 1, 0)):
        assert not torch.equal(base, other.inputs)


def test_synthetic_documents_follow_one_rule_each_and_have_the_mean_length():
    train = dataclasses.replace(TRAIN, batch_size=16, seq_len=64, mean_doc_len=12)
    b = data.batch(train, V, 5, 0)
    lengths = []
    for row, ids in zip(b.inputs.tolist(), b.doc_ids.tolist()):
        docs: dict[int, list[int]] = {}
        for tok, doc in zip(row, ids):
            docs.setdefault(doc, []).append(tok)
        for i, toks in docs.items():
            content = [t for t in toks if t != data.EOS]
            assert data.EOS not in toks[:-1]  # EOS only closes a document
            if toks[-1] == data.EOS and i > 0:
                lengths.append(len(content))   # whole documents (not the row's first or cut one)
            s = [t - 1 for t in content]
            assert any(all((a * u + c) % (V - 1) == w for u, w in zip(s, s[1:])) for a, c in data.RULES)
    assert 6 <= min(lengths) and max(lengths) <= 18
    assert 10 <= sum(lengths) / len(lengths) <= 14


def test_two_value_unpacking_still_works():
    inputs, targets = data.batch(TRAIN, V, 1, 0)
    assert torch.equal(inputs, data.batch(TRAIN, V, 1, 0)[0])
    assert F.cross_entropy(torch.zeros(inputs.numel(), V), targets.flatten()).isfinite()


def test_synthetic_does_not_touch_global_rng():
    before = torch.get_rng_state()
    data.batch(TRAIN, V, 1, 0)
    assert torch.equal(torch.get_rng_state(), before)


# ---- token file ----------------------------------------------------------------------------

def _token_file(tmp_path, n=1000, suffix=".u16", dtype=np.uint16):
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 200, n).astype(dtype)
    tokens[rng.random(n) < 0.1] = data.EOS
    path = tmp_path / f"tokens{suffix}"
    tokens.tofile(path)
    return path, tokens.astype(np.int64)


@pytest.mark.parametrize(("suffix", "dtype"), [(".u16", np.uint16), (".bin", np.uint16), (".u32", np.uint32)])
def test_token_file_reads_exactly_the_expected_windows(tmp_path, suffix, dtype):
    path, tokens = _token_file(tmp_path, suffix=suffix, dtype=dtype)
    train = dataclasses.replace(TRAIN, dataset=str(path), batch_size=2, seq_len=16)
    n_windows = (len(tokens) - 1) // 16
    seen = set()
    for step in (0, 1, 2, 40):
        for rank in (0, 1, 2):
            b = data.batch(train, V, step, rank, dp_size=3)
            assert b.position == (step * 3 + rank) * 2
            for i in range(2):
                w = (b.position + i) % n_windows
                seen.add((step, w))
                window = torch.from_numpy(tokens[w * 16: w * 16 + 17])
                assert torch.equal(b.inputs[i], window[:-1])
                assert torch.equal(b.targets[i][window[:-1] != 0], window[1:][window[:-1] != 0])
            _check_packing(b)
    assert len(seen) == 4 * 3 * 2  # ranks and steps never share a window (before wrapping)


def test_restored_position_reproduces_the_batch(tmp_path):
    path, _ = _token_file(tmp_path)
    train = dataclasses.replace(TRAIN, dataset=str(path))
    b = data.batch(train, V, 9, 1, dp_size=2)
    again = data.TokenFileDataset(path).batch_at(b.position, train.batch_size, train.seq_len, V)
    assert _same(b, again) and _same(b, data.batch(train, V, 9, 1, dp_size=2))


def test_token_file_needs_its_dp_size(tmp_path):
    path, _ = _token_file(tmp_path)
    with pytest.raises(ValueError, match="dp_size"):
        data.batch(dataclasses.replace(TRAIN, dataset=str(path)), V, 1, 1)


@pytest.mark.parametrize("case", ["missing", "suffix", "odd_size", "empty", "short", "vocab"])
def test_bad_token_file_is_a_clear_error(tmp_path, case):
    path = tmp_path / "tokens.u16"
    seq_len, vocab = 16, V
    if case == "suffix":
        path = tmp_path / "tokens.txt"
        path.write_bytes(b"\0\0")
    elif case == "odd_size":
        path.write_bytes(b"\1\0\2")
    elif case == "empty":
        path.write_bytes(b"")
    elif case == "short":
        np.arange(1, 10, dtype=np.uint16).tofile(path)
    elif case == "vocab":
        np.full(100, 300, dtype=np.uint16).tofile(path)
    train = dataclasses.replace(TRAIN, dataset=str(path), seq_len=seq_len)
    with pytest.raises(ValueError, match=str(path)):
        data.batch(train, vocab, 1, 0)
