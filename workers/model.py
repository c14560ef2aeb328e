"""The Llama-4-style decoder every rank trains (text only).

Owns the architecture (no data, no optimizer): token embedding, ``n_layers`` pre-norm
blocks ``h += attention(norm(h)); h += ffn(norm(h))`` where the FFN is a ``MoE``
(workers/moe.py) on ``args.is_moe_layer(i)`` and a dense SwiGLU otherwise, a final
RMSNorm and an untied output head.

Attention is grouped-query (``n_kv_heads`` key/value heads) through
``F.scaled_dot_product_attention`` with boolean masks (FlexAttention has no CPU
backward), in iRoPE layout:

* RoPE layers rotate q and k; with ``attention_chunk_size > 0`` they attend only inside
  their chunk (positions ``p // chunk_size`` equal), as Llama 4's local layers.
* NoPE layers (``args.is_nope_layer(i)``) use no positional encoding and attend
  causally over the whole (document-masked) sequence. With ``attn_temperature_tuning``
  q is scaled by ``log(floor((p + 1) / attn_floor_scale) + 1) * attn_scale + 1`` exactly
  as Hugging Face's ``Llama4TextAttention`` does: applied in training and inference alike
  (HF does not gate it on ``self.training``), after any rotary embedding. It is 1 for
  positions below ``attn_floor_scale`` (8192), so it only matters for long contexts.
* Llama 4 Scout's parameter-free QK L2-norm is not modelled (it has no parameters, so
  parameter and FLOP counts are unaffected).

Packed documents: ``forward(tokens, doc_ids)`` masks attention at document boundaries
(block-diagonal causal) and restarts positions at each document start (a change of
``doc_ids`` along the sequence), so RoPE, chunk boundaries and temperature tuning all see
each document as if it were alone. (HF uses the row position ``cache_position`` for the
temperature; the two agree without packing.)

Invariant: construction is deterministic. Parameters are drawn from a private
``torch.Generator`` seeded by ``seed`` in a fixed order, so every rank that builds
``Transformer(args, seed)`` holds bit-identical parameters without a broadcast, and the
global RNG is left untouched. Expert weights are drawn for all of a layer's experts and
each expert-parallel rank keeps its slice, so an EP run starts from the non-EP model.
On the meta device nothing is drawn (shape-only builds for counting).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fleet.workers.fp8 import convert_to_float8
from fleet.workers.moe import FeedForward, GroupedExperts, MoE
from fleet.workers.spec import ModelArgs

__all__ = ["Attention", "AttentionContext", "Block", "FeedForward", "MoE", "RMSNorm", "Transformer"]


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned scale (no bias, no mean centring)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosine and sine tables for rotary embeddings, each ``[max_seq_len, head_dim // 2]``."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs of ``x [batch, heads, seq, head_dim]``; ``cos``/``sin`` broadcast
    as ``[seq, head_dim // 2]`` or ``[batch, 1, seq, head_dim // 2]``."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    # Interleave back so channel pairs stay adjacent (the Meta Llama layout).
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


def positions_in_document(doc_ids: torch.Tensor) -> torch.Tensor:
    """Position of each token inside its document, ``[batch, seq]`` (0 at each change of id)."""
    seq = doc_ids.shape[1]
    idx = torch.arange(seq, device=doc_ids.device).expand_as(doc_ids)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    return idx - torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values


class AttentionContext:
    """Per-forward inputs shared by every block: rotary tables, masks, temperature scales.

    Masks are boolean (True = may attend), ``None`` meaning plain causal; built once per
    forward rather than per layer.
    """

    def __init__(self, args: ModelArgs, seq: int, rope_cos: torch.Tensor, rope_sin: torch.Tensor,
                 doc_ids: torch.Tensor | None) -> None:
        device = rope_cos.device
        if doc_ids is None:
            pos = torch.arange(seq, device=device)
            self.cos, self.sin = rope_cos[:seq], rope_sin[:seq]
            same_doc = None
        else:
            pos = positions_in_document(doc_ids)
            self.cos, self.sin = rope_cos[pos].unsqueeze(1), rope_sin[pos].unsqueeze(1)
            same_doc = (doc_ids[:, :, None] == doc_ids[:, None, :]).unsqueeze(1)
        causal = torch.ones(seq, seq, dtype=torch.bool, device=device).tril()
        self.global_mask = None if same_doc is None else same_doc & causal
        self.chunked_mask = self.global_mask
        if args.attention_chunk_size > 0:
            chunk = pos // args.attention_chunk_size
            same_chunk = chunk[..., :, None] == chunk[..., None, :]
            if same_chunk.dim() == 3:
                same_chunk = same_chunk.unsqueeze(1)
            base = causal if self.global_mask is None else self.global_mask
            self.chunked_mask = base & same_chunk
        self.q_scale = None
        if args.attn_temperature_tuning:
            scale = torch.log(torch.floor((pos.float() + 1.0) / args.attn_floor_scale) + 1.0) * args.attn_scale + 1.0
            # [seq, 1] or [batch, 1, seq, 1] against q [batch, heads, seq, head_dim]
            self.q_scale = scale.unsqueeze(-1) if doc_ids is None else scale[:, None, :, None]


class Attention(nn.Module):
    """Causal grouped-query self-attention: ``n_kv_heads`` key/value heads shared by
    ``n_heads // n_kv_heads`` query heads each; RoPE or NoPE per layer."""

    def __init__(self, args: ModelArgs, use_rope: bool) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_size
        self.use_rope = use_rope
        self.temperature_tuning = args.attn_temperature_tuning and not use_rope
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        bsz, seq, _ = x.shape
        q = self.wq(x).view(bsz, seq, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(bsz, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(bsz, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if self.use_rope:
            q, k = apply_rope(q, ctx.cos, ctx.sin), apply_rope(k, ctx.cos, ctx.sin)
            mask = ctx.chunked_mask
        else:
            mask = ctx.global_mask
        if self.temperature_tuning and ctx.q_scale is not None:
            q = q * ctx.q_scale.to(q.dtype)
        gqa = self.n_kv_heads != self.n_heads
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


class Block(nn.Module):
    """One pre-norm decoder block: attention then a dense or MoE feed-forward, each residual."""

    def __init__(self, args: ModelArgs, layer_id: int, ep_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args, use_rope=not args.is_nope_layer(layer_id))
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward: nn.Module = (MoE(args, ep_group) if args.is_moe_layer(layer_id)
                                        else FeedForward(args.dim, args.ffn_hidden))

    def forward(self, x: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), ctx)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """Decoder-only LM: ``forward(tokens [B, S], doc_ids [B, S] | None) -> logits [B, S, V]``."""

    def __init__(self, args: ModelArgs, seed: int = 0, ep_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.args = args
        # The modules' default init draws from the global RNG; fork it so building a
        # model never shifts anyone else's random stream (reset_parameters overwrites all).
        with torch.random.fork_rng(devices=[]):
            self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
            self.layers = nn.ModuleList(Block(args, i, ep_group) for i in range(args.n_layers))
            self.norm = RMSNorm(args.dim, args.norm_eps)
            self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        cos, sin = rope_tables(args.head_size, args.max_seq_len, args.rope_theta)
        # Non-persistent: derived from args, so checkpoints need not carry them.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters(seed)
        if args.fp8 != "off":
            self.apply_fp8(args.fp8)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """Draw every parameter from a generator seeded by ``seed`` (identical on all ranks)."""
        if self.output.weight.is_meta:
            return
        gen = torch.Generator().manual_seed(seed)
        std = 0.02
        # Scale residual-branch outputs down with depth so early training is stable.
        out_std = std / math.sqrt(2 * self.args.n_layers)
        experts = {id(p): m for m in self.modules() if isinstance(m, GroupedExperts)
                   for p in m.parameters(recurse=False)}
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            pstd = out_std if name.endswith(("wo.weight", "w2.weight", "experts.w2")) else std
            owner = experts.get(id(param))
            if owner is None:
                param.normal_(0.0, pstd, generator=gen)
            else:
                full = torch.empty((owner.n_global, *param.shape[1:])).normal_(0.0, pstd, generator=gen)
                param.copy_(full[owner.offset:owner.offset + owner.n_local])

    def apply_fp8(self, scaling: str) -> None:
        """Run attention, dense, shared- and routed-expert matmuls in FP8 (workers/fp8.py);
        the router, embedding, norms and output head stay in high precision."""
        convert_to_float8(self, scaling)

    def moe_layers(self) -> list[MoE]:
        return [layer.feed_forward for layer in self.layers if isinstance(layer.feed_forward, MoE)]

    def aux_loss(self) -> torch.Tensor:
        """Load-balancing loss of the last forward: ``sum(aux_loss_coef * last_aux_loss)``."""
        total = torch.zeros((), device=self.output.weight.device)
        if self.args.load_balance == "aux_loss":
            for moe in self.moe_layers():
                total = total + self.args.aux_loss_coef * moe.last_aux_loss
        return total

    def forward(self, tokens: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        seq = tokens.shape[1]
        if seq > self.args.max_seq_len:
            raise ValueError(f"sequence length {seq} exceeds max_seq_len {self.args.max_seq_len}")
        if doc_ids is not None and doc_ids.shape != tokens.shape:
            raise ValueError(f"doc_ids shape {tuple(doc_ids.shape)} != tokens shape {tuple(tokens.shape)}")
        ctx = AttentionContext(self.args, seq, self.rope_cos, self.rope_sin, doc_ids)
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, ctx)
        return self.output(self.norm(h))
