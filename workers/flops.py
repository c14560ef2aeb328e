"""Parameter counts and training FLOPs of a ``ModelArgs`` shape, without allocating it.

``param_counts`` builds ``Transformer`` on the meta device (shapes only, no memory, no
init; Scout and Maverick take well under a second) and counts:

* total: every parameter (all routed experts of every MoE layer);
* active: the parameters one token uses: everything except routed experts, plus
  ``top_k`` routed experts per MoE layer (the shared expert is always active).

``flops_per_token`` is the usual training estimate (PaLM appendix B / torchtitan):
``6 * N + 12 * L * H * Q * T`` where N is the active parameters that take part in
matmuls (active minus the token embedding, a lookup), L layers, H query heads, Q head
dim and T the attended context: ``seq_len`` on NoPE/global layers and
``min(seq_len, attention_chunk_size)`` on chunked RoPE layers. Causal masking is not
discounted (the usual convention), so this is an upper bound for attention.
"""

from __future__ import annotations

import torch

from fleet.workers.model import Transformer
from fleet.workers.moe import GroupedExperts
from fleet.workers.spec import ModelArgs


def meta_model(args: ModelArgs) -> Transformer:
    """The model on the meta device: parameter shapes only, no storage, no init."""
    with torch.device("meta"):
        return Transformer(args)


def param_counts(args: ModelArgs) -> tuple[int, int]:
    """``(total, active)`` parameter counts of the model ``args`` describes."""
    model = meta_model(args)
    total = sum(p.numel() for p in model.parameters())
    inactive = 0
    for m in model.modules():
        if isinstance(m, GroupedExperts):
            per_expert = sum(p.numel() for p in m.parameters()) // m.n_local
            inactive += per_expert * (m.n_global - args.top_k)
    return total, total - inactive


def embedding_params(args: ModelArgs) -> int:
    return args.vocab_size * args.dim


def flops_per_token(args: ModelArgs, seq_len: int) -> int:
    """Training FLOPs (forward + backward) per token at context ``seq_len``; see the module doc."""
    _, active = param_counts(args)
    attention = 0
    for i in range(args.n_layers):
        context = seq_len
        if args.attention_chunk_size > 0 and not args.is_nope_layer(i):
            context = min(seq_len, args.attention_chunk_size)
        attention += 12 * args.n_heads * args.head_size * context
    return 6 * (active - embedding_params(args)) + attention


def describe(args: ModelArgs, seq_len: int | None = None) -> dict[str, int | list[int]]:
    """Shape summary for humans and tools: counts, layer kinds, FLOPs at ``seq_len``
    (default ``args.max_seq_len``)."""
    seq_len = seq_len or args.max_seq_len
    total, active = param_counts(args)
    return {
        "total_params": total,
        "active_params": active,
        "n_layers": args.n_layers,
        "moe_layers": [i for i in range(args.n_layers) if args.is_moe_layer(i)],
        "nope_layers": [i for i in range(args.n_layers) if args.is_nope_layer(i)],
        "n_experts": args.n_experts,
        "top_k": args.top_k,
        "seq_len": seq_len,
        "flops_per_token": flops_per_token(args, seq_len),
    }
