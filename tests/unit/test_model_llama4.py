"""workers/moe.py: routing, load balancing, and expert parallelism over real gloo ranks."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from fleet.workers.model import Transformer
from fleet.workers.moe import MoE
from fleet.workers.spec import ModelArgs

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]
# top_k=2 and packed documents exercise the multi-slot dispatch and the masks on EP ranks.
EP_ARGS = dataclasses.replace(ModelArgs(), top_k=2, max_seq_len=16)
EP_SEED = 3
TOL = dict(atol=1e-5, rtol=1e-5)


def _moe(**overrides) -> MoE:
    model = Transformer(dataclasses.replace(ModelArgs(), **overrides), seed=0)
    return model.moe_layers()[0]


def test_moe_layers_follow_is_moe_layer():
    args = ModelArgs(n_layers=6, moe_every=3)
    model = Transformer(args)
    assert [isinstance(b.feed_forward, MoE) for b in model.layers] == [args.is_moe_layer(i) for i in range(6)]
    assert len(model.moe_layers()) == 2
    assert model.moe_layers()[0].experts.w1.shape == (args.n_experts, args.moe_hidden, args.dim)
    dense = Transformer(ModelArgs(n_experts=0))
    assert dense.moe_layers() == [] and float(dense.aux_loss()) == 0.0


def test_router_score_scales_the_expert_input():
    moe = _moe(top_k=1)
    x = torch.randn(10, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = moe(x)
        scores = torch.sigmoid(moe.router(x))
        pick = scores.argmax(-1)
        ex = moe.experts
        expected = []
        for t in range(10):
            e, xin = pick[t], scores[t, pick[t]] * x[t]
            h = torch.nn.functional.silu(ex.w1[e] @ xin) * (ex.w3[e] @ xin)
            expected.append(moe.shared_experts(x[t]) + ex.w2[e] @ h)
    torch.testing.assert_close(out, torch.stack(expected), atol=1e-6, rtol=1e-5)


def test_tokens_per_expert_and_aux_loss_in_graph():
    moe = _moe(top_k=2)
    x = torch.randn(3, 7, 64)
    moe(x)
    counts = moe.last_tokens_per_expert
    assert counts.dtype == torch.long and counts.shape == (4,) and int(counts.sum()) == 3 * 7 * 2
    assert not counts.requires_grad
    aux = moe.last_aux_loss
    assert aux.requires_grad and float(aux.detach()) > 0
    aux.backward()
    assert moe.router.weight.grad is not None and moe.router.weight.grad.abs().sum() > 0


def test_model_aux_loss_sums_layers_times_coef():
    model = Transformer(ModelArgs(n_layers=4, moe_every=1, aux_loss_coef=0.5))
    model(torch.randint(256, (2, 8)))
    expected = sum(0.5 * m.last_aux_loss for m in model.moe_layers())
    torch.testing.assert_close(model.aux_loss(), expected)


def test_bias_balancing_changes_selection_not_gates():
    moe = _moe(load_balance="bias", top_k=1)
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        base = moe(x)
        assert float(moe.last_aux_loss) == 0.0
        loads = moe.last_tokens_per_expert.clone()
        busiest = int(loads.argmax())
        moe.update_bias(0.1)
        assert moe.expert_bias[busiest] < 0
        assert (moe.expert_bias[loads < loads.float().mean()] > 0).all()
        # A huge bias on one expert routes everything to it; the gate stays its sigmoid score.
        moe.expert_bias.zero_()
        moe.expert_bias[busiest] = 100.0
        out = moe(x)
        assert moe.last_tokens_per_expert[busiest] == 64
        scores = torch.sigmoid(moe.router(x))[:, busiest:busiest + 1]
        ex = moe.experts
        xin = scores * x
        h = torch.nn.functional.silu(xin @ ex.w1[busiest].t()) * (xin @ ex.w3[busiest].t())
        torch.testing.assert_close(out, moe.shared_experts(x) + h @ ex.w2[busiest].t(), atol=1e-6, rtol=1e-5)
        assert not torch.allclose(out, base)
    assert "expert_bias" in moe.state_dict()



@pytest.mark.parametrize("fp8", ["off", "tensorwise"])
def test_idle_expert_gets_a_zero_gradient_not_none(fp8):
    moe = _moe(load_balance="bias", fp8=fp8)
    moe.expert_bias[0] = 100.0  # every token goes to expert 0
    moe(torch.randn(8, 64)).sum().backward()
    assert moe.last_tokens_per_expert.tolist() == [8, 0, 0, 0]
    for w in moe.experts.parameters():
        assert w.grad is not None and w.grad[0].abs().sum() > 0 and not w.grad[1:].any()

# --- expert parallelism over two gloo ranks ---------------------------------------------


def _inputs(rank: int) -> dict[str, torch.Tensor]:
    """Each rank's own tokens, documents, MoE-layer input and loss weights."""
    gen = torch.Generator().manual_seed(100 + rank)
    tokens = torch.randint(EP_ARGS.vocab_size, (2, 16), generator=gen)
    doc_ids = torch.tensor([[0] * 5 + [1] * 11, [0] * 16])
    return {
        "tokens": tokens, "doc_ids": doc_ids,
        "logit_w": torch.randn(2, 16, EP_ARGS.vocab_size, generator=gen),
        "x": torch.randn(24, EP_ARGS.dim, generator=gen),
        "out_w": torch.randn(24, EP_ARGS.dim, generator=gen),
    }


def _run(model: Transformer, inp: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Model forward/backward, then a bare MoE layer's; returns outputs and gradients."""
    model.zero_grad()
    logits = model(inp["tokens"], inp["doc_ids"])
    ((logits * inp["logit_w"]).sum() + model.aux_loss()).backward()
    res = {"logits": logits.detach()}
    res.update({f"model.{n}": p.grad.clone() for n, p in model.named_parameters()})
    model.zero_grad()
    moe = model.moe_layers()[0]
    x = inp["x"].clone().requires_grad_()
    out = moe(x)
    ((out * inp["out_w"]).sum() + moe.last_aux_loss).backward()
    res.update({"moe.out": out.detach(), "moe.x_grad": x.grad.clone(), "moe.counts": moe.last_tokens_per_expert})
    res.update({f"moe.{n}": p.grad.clone() for n, p in moe.named_parameters()})
    return res


def ep_worker(rank: int, world: int, store_file: str, out_file: str) -> None:
    """One expert-parallel rank (run in a child process by the test below)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=30))
    try:
        model = Transformer(EP_ARGS, seed=EP_SEED, ep_group=dist.group.WORLD)
        torch.save(_run(model, _inputs(rank)), out_file)
    finally:
        dist.destroy_process_group()


def test_expert_parallel_matches_single_process(tmp_path):
    world = 2
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", "import sys; from tests.unit.test_model_llama4 import ep_worker; "
             "ep_worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])",
             str(r), str(world), str(tmp_path / "store"), str(tmp_path / f"rank{r}.pt")],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for r in range(world)
    ]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=45)[0].decode())
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert all(p.returncode == 0 for p in procs), "\n".join(outputs)

    reference = Transformer(EP_ARGS, seed=EP_SEED)
    ref = [_run(reference, _inputs(r)) for r in range(world)]
    ep = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    n_local = EP_ARGS.n_experts // world
    for r in range(world):
        for key in ("logits", "moe.out", "moe.x_grad", "moe.counts"):
            torch.testing.assert_close(ep[r][key], ref[r][key], **TOL, msg=key)
        for key, grad in ep[r].items():
            if key.startswith(("logits", "moe.out", "moe.x_grad", "moe.counts")):
                continue
            # Each EP rank's expert grads cover every rank's tokens routed to its slice;
            # all other grads cover its own tokens, so they sum to the reference's.
            if ".experts." in key:
                expected = (ref[0][key] + ref[1][key])[r * n_local:(r + 1) * n_local]
                torch.testing.assert_close(grad, expected, **TOL, msg=key)
            else:
                torch.testing.assert_close(grad + ep[1 - r][key], ref[0][key] + ref[1][key], **TOL, msg=key)
