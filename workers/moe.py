"""Llama 4's mixture-of-experts feed-forward, with optional expert parallelism.

Owns ``MoE``: a shared SwiGLU expert every token goes through (``n_shared_experts``
shared experts are one SwiGLU of width ``n_shared_experts * moe_hidden``, the same
function and parameter count), plus ``n_experts`` routed SwiGLU experts of width
``moe_hidden`` of which a sigmoid router picks ``top_k`` per token.

Routing (as Llama 4): ``scores = sigmoid(router(x))``; the top-k experts by score are
chosen and each chosen expert sees its **input** scaled by its sigmoid score
(``expert(score * x)``, as Hugging Face's ``Llama4TextMoe``), not its output. The layer
returns ``shared(x) + sum_k expert_k(score_k * x)``.

Load balancing, ``args.load_balance``:

* ``"aux_loss"``: Switch-style auxiliary loss ``n_experts * sum_i f_i * P_i``, where
  ``f_i`` is the fraction of this rank's routing slots given to expert i and ``P_i`` is
  the mean over tokens of the scores normalized to sum to one per token. It is left in
  ``last_aux_loss`` (in the graph, not yet multiplied by ``aux_loss_coef``; the model's
  ``aux_loss()`` does that).
* ``"bias"``: DeepSeek-V3's loss-free balancing. A per-expert ``expert_bias`` buffer
  (not trained, saved in checkpoints) is added to the scores for *selection only*; the
  gate value stays the unbiased sigmoid. After each optimizer step the trainer calls
  ``update_bias(rate, tokens_per_expert)``: ``bias_i += rate * sign(mean_load - load_i)``,
  so overloaded experts become less likely to be picked. For the bias to stay identical
  on every rank, pass the same counts everywhere (sum ``last_tokens_per_expert`` over the
  micro-batches and all-reduce it over the data-parallel group first).

Expert parallelism: with an ``ep_group`` of size E, this rank holds experts
``[r * n_local, (r + 1) * n_local)`` (r = rank in the group, ``n_local = n_experts / E``)
in ``experts`` (stacked parameters ``[n_local, ...]``). Routed tokens go to their owning
rank with ``all_to_all_single`` (the counts first, then the rows, uneven splits), are
processed there and come back with a second all-to-all; the autograd versions
(``torch.distributed.nn.functional``) run the reverse exchange in backward. Routing,
aux loss and token counts are per rank (over this rank's own tokens).
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn.functional as F
from torch import nn

from fleet.workers.fp8 import float8_linear
from fleet.workers.spec import ModelArgs


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)`` (the dense FFN and the shared expert)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class GroupedExperts(nn.Module):
    """This rank's routed experts as stacked SwiGLU weights (``nn.Linear`` layout).

    ``w1``/``w3``: ``[n_local, hidden, dim]``, ``w2``: ``[n_local, dim, hidden]``.
    ``n_global`` and ``offset`` say which slice of the layer's experts these are, so
    the model can initialise every expert of the layer and keep this slice.
    ``fp8_scaling`` (None or a scaling name) is set by ``convert_to_float8``.
    """

    def __init__(self, n_local: int, dim: int, hidden: int, n_global: int, offset: int) -> None:
        super().__init__()
        self.n_local, self.n_global, self.offset = n_local, n_global, offset
        self.w1 = nn.Parameter(torch.empty(n_local, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n_local, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n_local, hidden, dim))
        self.fp8_scaling: str | None = None
        self.fallbacks: Counter = Counter()

    def _linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if self.fp8_scaling is None:
            return F.linear(x, w)
        return float8_linear(x, w, self.fp8_scaling, fallbacks=self.fallbacks)

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """``x`` holds rows grouped by local expert, ``counts[e]`` rows for expert e."""
        outs = []
        # Experts without tokens still run (on zero rows): every weight then gets a
        # gradient, possibly zero, so sharded-gradient collectives line up on all ranks.
        for e, chunk in enumerate(torch.split(x, counts)):
            h = F.silu(self._linear(chunk, self.w1[e])) * self._linear(chunk, self.w3[e])
            outs.append(self._linear(h, self.w2[e]))
        return torch.cat(outs)


class MoE(nn.Module):
    """Shared expert + sigmoid-routed top-k experts; ``forward(x [..., dim]) -> [..., dim]``."""

    def __init__(self, args: ModelArgs, ep_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.n_experts, self.top_k = args.n_experts, args.top_k
        self.load_balance = args.load_balance
        self.ep_group = ep_group
        self.ep_size = dist.get_world_size(ep_group) if ep_group is not None else 1
        ep_rank = dist.get_rank(ep_group) if ep_group is not None else 0
        if args.n_experts % self.ep_size:
            raise ValueError(f"n_experts ({args.n_experts}) must be divisible by the "
                             f"expert-parallel size ({self.ep_size})")
        n_local = args.n_experts // self.ep_size
        self.router = nn.Linear(args.dim, args.n_experts, bias=False)
        self.experts = GroupedExperts(n_local, args.dim, args.moe_hidden, args.n_experts, ep_rank * n_local)
        self.shared_experts = (FeedForward(args.dim, args.moe_hidden * args.n_shared_experts)
                               if args.n_shared_experts else None)
        # Persistent so a restored run routes exactly as the original would.
        self.register_buffer("expert_bias", torch.zeros(args.n_experts), persistent=True)
        self.last_aux_loss: torch.Tensor = torch.zeros(())
        self.last_tokens_per_expert: torch.Tensor = torch.zeros(args.n_experts, dtype=torch.long)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        n_tokens = x.shape[0]
        scores = torch.sigmoid(self.router(x).float())                      # [T, E]
        select = scores.detach()
        if self.load_balance == "bias":
            select = select + self.expert_bias
        top_idx = select.topk(self.top_k, dim=-1).indices                    # [T, k]
        top_scores = scores.gather(-1, top_idx)

        flat_expert = top_idx.flatten()
        order = flat_expert.argsort(stable=True)
        token_idx = order // self.top_k
        counts = torch.bincount(flat_expert, minlength=self.n_experts)
        self.last_tokens_per_expert = counts.detach()
        if self.load_balance == "aux_loss":
            frac = counts.float() / max(n_tokens * self.top_k, 1)
            prob = (scores / scores.sum(-1, keepdim=True)).mean(0) if n_tokens else scores.sum(0)
            self.last_aux_loss = self.n_experts * (frac * prob).sum()
        else:
            self.last_aux_loss = scores.new_zeros(())

        routed_in = x[token_idx] * top_scores.flatten()[order, None].to(x.dtype)
        if self.ep_size == 1:
            routed_out = self.experts(routed_in, counts.tolist())
        else:
            routed_out = self._expert_parallel(routed_in, counts)
        out = self.shared_experts(x) if self.shared_experts is not None else torch.zeros_like(x)
        out = out.index_add(0, token_idx, routed_out.to(out.dtype))
        return out.reshape(shape)

    def _expert_parallel(self, routed_in: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Send rows (grouped by global expert) to their owners, run them, bring them back."""
        n_local, group = self.experts.n_local, self.ep_group
        # counts.view(E, n_local)[r] goes to rank r; we get [src, n_local] back.
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=group)
        send_splits = counts.view(self.ep_size, n_local).sum(1).tolist()
        recv_matrix = recv_counts.view(self.ep_size, n_local)
        recv_splits = recv_matrix.sum(1).tolist()
        received = dist_fn.all_to_all_single(
            routed_in.new_empty(sum(recv_splits), routed_in.shape[1]), routed_in,
            output_split_sizes=recv_splits, input_split_sizes=send_splits, group=group)
        # Rows arrive ordered [source rank][local expert]; the experts want [expert][source].
        local_expert = (torch.arange(n_local, device=recv_counts.device)
                        .repeat(self.ep_size).repeat_interleave(recv_matrix.flatten()))
        regroup = local_expert.argsort(stable=True)
        processed = self.experts(received[regroup], recv_matrix.sum(0).tolist())
        restored = processed[regroup.argsort()]
        return dist_fn.all_to_all_single(
            routed_in.new_empty(routed_in.shape), restored,
            output_split_sizes=send_splits, input_split_sizes=recv_splits, group=group)

    @torch.no_grad()
    def update_bias(self, rate: float, tokens_per_expert: torch.Tensor | None = None) -> None:
        """Loss-free balancing step: raise the bias of under-loaded experts, lower the others.

        ``tokens_per_expert`` defaults to ``last_tokens_per_expert`` (this rank, last
        forward); pass globally reduced counts to keep every rank's bias identical.
        """
        load = (self.last_tokens_per_expert if tokens_per_expert is None else tokens_per_expert).float()
        self.expert_bias += rate * torch.sign(load.mean() - load).to(self.expert_bias.device)
