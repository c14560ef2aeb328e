"""workers/model.py: shapes, deterministic init, masks (causal, documents, chunks), iRoPE
layout, temperature tuning, and learnability on the synthetic data."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from fleet.workers import data
from fleet.workers.model import AttentionContext, Transformer, positions_in_document
from fleet.workers.moe import MoE
from fleet.workers.spec import ModelArgs, TrainArgs

pytestmark = pytest.mark.timeout(60)


def _tokens(shape, seed=0):
    return torch.randint(256, shape, generator=torch.Generator().manual_seed(seed))


def test_forward_shape_and_dtype():
    args = ModelArgs()
    model = Transformer(args, seed=0)
    logits = model(_tokens((3, 17)))
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
    assert any(".experts." in n for n, _ in a.named_parameters())


def test_layer_layout_follows_args():
    args = ModelArgs(n_layers=8, nope_every=4, moe_every=2)
    model = Transformer(args)
    for i, block in enumerate(model.layers):
        assert block.attention.use_rope == (not args.is_nope_layer(i)), i
        assert isinstance(block.feed_forward, MoE) == args.is_moe_layer(i), i
    assert [i for i, b in enumerate(model.layers) if not b.attention.use_rope] == [3, 7]
    assert all(b.attention.use_rope for b in Transformer(ModelArgs(nope_every=0)).layers)


def test_attention_is_causal():
    model = Transformer(ModelArgs(), seed=0).eval()
    tokens = _tokens((1, 12))
    changed = tokens.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % 256
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    assert torch.allclose(a[0, :8], b[0, :8], atol=1e-6)
    assert not torch.allclose(a[0, 8:], b[0, 8:])


def test_document_masking_blocks_cross_document_attention():
    model = Transformer(ModelArgs(), seed=0).eval()
    tokens = _tokens((2, 20))
    doc_ids = torch.tensor([[0] * 7 + [1] * 13, [0] * 20])
    changed = tokens.clone()
    changed[0, :7] = (changed[0, :7] + 1) % 256  # edit only document 0 of row 0
    with torch.no_grad():
        a, b = model(tokens, doc_ids), model(changed, doc_ids)
        alone = model(tokens[:1, 7:])  # document 1 on its own, positions from 0
        plain = model(tokens[1:])
    assert torch.allclose(a[0, 7:], b[0, 7:], atol=1e-6)
    assert not torch.allclose(a[0, :7], b[0, :7])
    # positions restart at the document start: packed == alone
    torch.testing.assert_close(a[0, 7:], alone[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a[1], plain[0], atol=1e-5, rtol=1e-5)  # one document == no doc_ids
    # without doc_ids the second document does see the first
    with torch.no_grad():
        assert not torch.allclose(model(tokens)[0, 7:], model(changed)[0, 7:])


def test_positions_restart_at_each_document():
    doc_ids = torch.tensor([[0, 0, 0, 1, 1, 2], [5, 5, 5, 5, 5, 5]])
    assert positions_in_document(doc_ids).tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]]


def test_chunked_attention_blocks_cross_chunk_attention():
    tokens = _tokens((1, 16))
    changed = tokens.clone()
    changed[0, :8] = (changed[0, :8] + 1) % 256  # edit chunk 0 only
    local = Transformer(ModelArgs(attention_chunk_size=8, nope_every=0), seed=0).eval()
    with torch.no_grad():
        a, b = local(tokens), local(changed)
    assert torch.allclose(a[0, 8:], b[0, 8:], atol=1e-6)
    assert not torch.allclose(a[0, :8], b[0, :8])
    # a NoPE (global) layer lets information cross chunks again
    irope = Transformer(ModelArgs(attention_chunk_size=8, nope_every=2), seed=0).eval()
    with torch.no_grad():
        assert not torch.allclose(irope(tokens)[0, 8:], irope(changed)[0, 8:])


def test_nope_layers_ignore_positions_rope_layers_do_not():
    args = ModelArgs()
    model = Transformer(args, seed=0)
    x = torch.randn(1, 10, args.dim)
    ctx = AttentionContext(args, 10, model.rope_cos, model.rope_sin, None)
    shifted = AttentionContext(args, 10, model.rope_cos[5:], model.rope_sin[5:], None)  # positions +5
    nope, rope = model.layers[3].attention, model.layers[0].attention
    with torch.no_grad():
        torch.testing.assert_close(nope(x, ctx), nope(x, shifted))
        # RoPE is relative: a constant shift changes nothing either, but a different
        # spacing of positions does
        spread = AttentionContext(args, 10, model.rope_cos[::2], model.rope_sin[::2], None)
        torch.testing.assert_close(nope(x, ctx), nope(x, spread))
        assert not torch.allclose(rope(x, ctx), rope(x, spread))


def test_temperature_tuning_follows_llama4_formula():
    args = ModelArgs(attn_floor_scale=4.0, attn_scale=0.1)
    ctx = AttentionContext(args, 12, torch.zeros(64, 8), torch.zeros(64, 8), None)
    expected = [math.log(math.floor((p + 1) / 4.0) + 1.0) * 0.1 + 1.0 for p in range(12)]
    torch.testing.assert_close(ctx.q_scale.flatten(), torch.tensor(expected))
    tokens = _tokens((1, 12))
    tuned = Transformer(args, seed=0).eval()
    untuned = Transformer(dataclasses.replace(args, attn_temperature_tuning=False), seed=0).eval()
    default = Transformer(ModelArgs(), seed=0).eval()  # floor 8192: scale is 1 on short sequences
    with torch.no_grad():
        assert not torch.allclose(tuned(tokens), untuned(tokens))
        torch.testing.assert_close(default(tokens), untuned(tokens))
        # training mode applies it too (as Hugging Face does)
        assert not torch.allclose(tuned.train()(tokens), untuned.train()(tokens))


def test_gqa_and_mha_shapes():
    for kv in (1, 2, 4):
        args = dataclasses.replace(ModelArgs(), n_kv_heads=kv)
        model = Transformer(args)
        assert model.layers[0].attention.wk.weight.shape == (kv * 16, 64)
        assert model(torch.zeros(2, 5, dtype=torch.long)).shape == (2, 5, 256)
    wide = Transformer(ModelArgs(head_dim=32))
    assert wide.layers[0].attention.wq.weight.shape == (4 * 32, 64)
    assert wide(torch.zeros(1, 5, dtype=torch.long)).shape == (1, 5, 256)


def test_bad_inputs_are_rejected():
    model = Transformer(ModelArgs())
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, 65, dtype=torch.long))
    with pytest.raises(ValueError, match="doc_ids"):
        model(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 7, dtype=torch.long))


def test_loss_decreases_on_synthetic_data():
    torch.set_num_threads(1)
    args, train = ModelArgs(), TrainArgs()
    model = Transformer(args, seed=train.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=train.lr)
    losses = []
    for step in range(1, 31):
        inputs, targets = data.batch(train, args.vocab_size, step, rank=0)[:2]
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        opt.zero_grad()
        (loss + model.aux_loss()).backward()
        opt.step()
        losses.append(loss.item())
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert first > 5.0  # about ln(256) at init
    assert last < first - 1.0, losses
