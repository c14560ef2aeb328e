"""A small Llama-style decoder: the model every rank trains.

Owns the architecture only (no data, no optimizer): token embedding, ``n_layers`` blocks
of RMSNorm -> grouped-query attention with rotary embeddings (causal) and RMSNorm ->
SwiGLU feed-forward, a final RMSNorm and the output projection.

Invariant: construction is deterministic. Parameters are drawn from a private
``torch.Generator`` seeded by ``seed``, so every rank that builds ``Transformer(args,
seed)`` holds bit-identical parameters without a broadcast, and the global RNG is left
untouched.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from workers.spec import ModelArgs


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
    """Rotate pairs of channels of ``x`` ``[batch, heads, seq, head_dim]`` by position."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    # Interleave back so channel pairs stay adjacent (the Llama layout).
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    """Causal grouped-query self-attention: ``n_kv_heads`` key/value heads shared by
    ``n_heads // n_kv_heads`` query heads each."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        bsz, seq, _ = x.shape
        q = self.wq(x).view(bsz, seq, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(bsz, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(bsz, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        repeats = self.n_heads // self.n_kv_heads
        if repeats > 1:
            k = k.repeat_interleave(repeats, dim=1)
            v = v.repeat_interleave(repeats, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """One pre-norm decoder block: attention then feed-forward, each with a residual."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """Decoder-only language model: ``forward(tokens [batch, seq]) -> logits [batch, seq, vocab]``."""

    def __init__(self, args: ModelArgs, seed: int = 0) -> None:
        super().__init__()
        self.args = args
        # The modules' default init draws from the global RNG; fork it so building a
        # model never shifts anyone else's random stream (reset_parameters overwrites all).
        with torch.random.fork_rng(devices=[]):
            self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
            self.layers = nn.ModuleList(Block(args) for _ in range(args.n_layers))
            self.norm = RMSNorm(args.dim, args.norm_eps)
            self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        cos, sin = rope_tables(args.dim // args.n_heads, args.max_seq_len, args.rope_theta)
        # Non-persistent: derived from args, so checkpoints need not carry them.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """Draw every parameter from a generator seeded by ``seed`` (identical on all ranks)."""
        gen = torch.Generator().manual_seed(seed)
        std = 0.02
        # Scale residual-branch outputs down with depth so early training is stable.
        out_std = std / math.sqrt(2 * self.args.n_layers)
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(("wo.weight", "w2.weight")):
                param.normal_(0.0, out_std, generator=gen)
            else:
                param.normal_(0.0, std, generator=gen)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        if seq > self.args.max_seq_len:
            raise ValueError(f"sequence length {seq} exceeds max_seq_len {self.args.max_seq_len}")
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))
