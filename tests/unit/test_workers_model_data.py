"""workers/model.py and workers/data.py: shapes, deterministic init and data, learnability."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from workers import data
from workers.model import Transformer
from workers.spec import ModelArgs, TrainArgs

pytestmark = pytest.mark.timeout(60)


def test_forward_shape_and_dtype():
    args = ModelArgs()
    model = Transformer(args, seed=0)
    tokens = torch.randint(args.vocab_size, (3, 17))
    logits = model(tokens)
    assert logits.shape == (3, 17, args.vocab_size)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_init_is_deterministic_per_seed_and_leaves_global_rng_alone():
    before = torch.get_rng_state()
    a, b, c = Transformer(ModelArgs(), seed=7), Transformer(ModelArgs(), seed=7), Transformer(ModelArgs(), seed=8)
    assert torch.equal(torch.get_rng_state(), before)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if not name.endswith("norm.weight"):
            assert not torch.equal(pa, pc), name


def test_attention_is_causal():
    model = Transformer(ModelArgs(), seed=0).eval()
    tokens = torch.randint(256, (1, 12))
    changed = tokens.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % 256
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    assert torch.allclose(a[0, :8], b[0, :8], atol=1e-6)
    assert not torch.allclose(a[0, 8:], b[0, 8:])


def test_gqa_and_mha_shapes():
    for kv in (1, 2, 4):
        args = dataclasses.replace(ModelArgs(), n_kv_heads=kv)
        model = Transformer(args)
        assert model.layers[0].attention.wk.weight.shape == (kv * 16, 64)
        assert model(torch.zeros(2, 5, dtype=torch.long)).shape == (2, 5, 256)


def test_too_long_sequence_is_rejected():
    with pytest.raises(ValueError, match="max_seq_len"):
        Transformer(ModelArgs())(torch.zeros(1, 65, dtype=torch.long))


def test_loss_decreases_on_synthetic_data():
    torch.set_num_threads(1)
    args, train = ModelArgs(), TrainArgs()
    model = Transformer(args, seed=train.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=train.lr)
    losses = []
    for step in range(1, 31):
        inputs, targets = data.batch(train, args.vocab_size, step, rank=0)
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert first > 5.0  # about ln(256) at init
    assert last < first - 1.0, losses


def test_batch_is_deterministic_and_shaped():
    train = TrainArgs(batch_size=3, seq_len=10, seed=5)
    x1, y1 = data.batch(train, 256, step=4, rank=1)
    x2, y2 = data.batch(train, 256, step=4, rank=1)
    assert x1.shape == y1.shape == (3, 10)
    assert x1.dtype == y1.dtype == torch.int64
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert torch.equal(x1[:, 1:], y1[:, :-1])  # targets are inputs shifted by one
    assert int(x1.min()) >= 0 and int(x1.max()) < 256


def test_batch_differs_across_step_rank_and_seed():
    train = TrainArgs()
    base = data.batch(train, 256, 1, 0)[0]
    for other in (data.batch(train, 256, 2, 0)[0], data.batch(train, 256, 1, 1)[0],
                  data.batch(dataclasses.replace(train, seed=1), 256, 1, 0)[0]):
        assert not torch.equal(base, other)


def test_batch_follows_an_affine_rule_per_sequence():
    x, y = data.batch(TrainArgs(batch_size=16, seq_len=20), 256, 3, 0)
    for row_x, row_y in zip(x.tolist(), y.tolist()):
        assert any(all((a * u + b) % 256 == v for u, v in zip(row_x, row_y)) for a, b in data.RULES)


def test_batch_does_not_touch_global_rng():
    before = torch.get_rng_state()
    data.batch(TrainArgs(), 256, 1, 0)
    assert torch.equal(torch.get_rng_state(), before)
