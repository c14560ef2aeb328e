"""FP8 linear layers: matmuls through ``torch._scaled_mm`` with dynamic scaling.

Owns the FP8 numerics of training: ``float8_linear(x, weight, scaling)`` (an autograd
Function), ``Float8Linear`` (a drop-in ``nn.Linear``) and ``convert_to_float8`` which
swaps a model's eligible linear layers.

Recipe (the torchao "dynamic" recipe, done by hand):

* forward ``y = x @ W^T``: ``x`` and ``W`` are cast to ``float8_e4m3fn`` with a scale
  from their current absolute maximum (``"tensorwise"``: one scale per tensor;
  ``"rowwise"``: one per row of ``x`` and per output channel of ``W``), the product is
  accumulated in high precision and returned in ``x``'s dtype;
* backward: ``grad_y`` is cast to ``float8_e5m2`` (wider range, fewer mantissa bits),
  ``grad_x = grad_y @ W`` and ``grad_W = grad_y^T @ x`` also run through ``_scaled_mm``,
  each operand re-quantized along the axis that matmul keeps (rowwise) or per tensor.

Invariants: master weights stay the fp32 ``nn.Parameter``; FP8 copies live only for
one matmul. Values are clamped to the format's finite range before every cast (casts
saturate in torch 2.13 but overflowed to inf/NaN in older versions). ``_scaled_mm``
wants its first operand row-major and its second column-major, and (on CUDA) the
contraction and output-column dimensions to be multiples of 16. A token dimension that
is contracted (``grad_W``) is zero-padded, which is exact; a weight dimension that is
not a multiple of 16 makes that one matmul fall back to high precision, counted in the
layer's ``fallbacks``.

Measured error against fp32 (tests/unit/test_fp8.py, Gaussian data, 256x128 @ 128x96,
relative Frobenius error): forward 3.7% (tensorwise) / 3.6% (rowwise), grad_x and grad_W
5.7-6.0%. The tests bound them at 6% forward and 12% backward. The tiny preset trained
200 steps in FP8 differs from the fp32 loss curve by 0.061 (tensorwise) / 0.047 (rowwise)
mean absolute over the last 50 steps (losses ~0.28 there, from 5.55 at step 1); the test
bounds it at 0.15. On CPU the FP8 product is computed from the FP8 values in fp32 (the
same numbers ``_scaled_mm`` gives; its CPU kernel is a slow reference one): the casts
make FP8 slower than fp32 there; the speed-up is a GPU's.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
SCALINGS = ("tensorwise", "rowwise")
#: Layers that stay in high precision whatever the recipe: routing decisions are
#: discrete and sensitive, and the output head feeds the softmax directly.
HIGH_PRECISION_NAMES = frozenset({"router", "output"})

_ALIGN = 16
_EPS = 1e-12


def _quantize(t: torch.Tensor, dtype: torch.dtype, dim: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Cast ``t`` to ``dtype``; returns the FP8 tensor and its fp32 dequantization scale.

    ``dim=None`` gives one scale for the tensor; otherwise the amax is taken over ``dim``
    (kept as a size-1 dimension), i.e. one scale per slice along the other axis.
    """
    fmax = torch.finfo(dtype).max
    t32 = t.float()
    amax = t32.abs().amax() if dim is None else t32.abs().amax(dim=dim, keepdim=True)
    scale = amax.clamp(min=_EPS) / fmax
    return (t32 / scale).clamp(-fmax, fmax).to(dtype), scale


def _aligned(*dims: int) -> bool:
    return all(d % _ALIGN == 0 for d in dims)


def _scaled_matmul(a: torch.Tensor, b: torch.Tensor, a_dtype: torch.dtype, b_dtype: torch.dtype,
                   rowwise: bool, out_dtype: torch.dtype) -> torch.Tensor:
    """``a [m, k] @ b [k, n]`` in FP8; rowwise scales are per row of ``a`` and per column of ``b``."""
    a8, sa = _quantize(a, a_dtype, 1 if rowwise else None)
    b8, sb = _quantize(b, b_dtype, 0 if rowwise else None)
    if a8.device.type == "cpu":
        # the same product (FP8 values, high-precision accumulation, then the scales): CPU
        # builds of torch run _scaled_mm through oneDNN, whose FP8 matmul is a reference
        # kernel on CPUs without native FP8 (~1,000x slower than this)
        return ((a8.float() @ b8.float()) * (sa * sb)).to(out_dtype)
    # _scaled_mm layout contract: first operand row-major, second column-major.
    return torch._scaled_mm(a8.contiguous(), b8.t().contiguous().t(), scale_a=sa, scale_b=sb,
                            out_dtype=out_dtype)


def _pad_rows(t: torch.Tensor) -> torch.Tensor:
    """Zero-pad dim 0 to a multiple of 16 (exact for a contracted dimension)."""
    extra = -t.shape[0] % _ALIGN
    return F.pad(t, (0, 0, 0, extra)) if extra else t


class _Float8Matmul(torch.autograd.Function):
    """``x [m, k] @ weight[n, k]^T`` with FP8 operands in both passes."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, scaling: str, fallbacks: Counter) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.scaling, ctx.fallbacks = scaling, fallbacks
        n, k = weight.shape
        ctx.empty = x.shape[0] == 0  # an expert that got no tokens: nothing to quantize
        if ctx.empty:
            return x @ weight.t().to(x.dtype)
        if not _aligned(n, k):
            fallbacks["forward"] += 1
            return x @ weight.t().to(x.dtype)
        return _scaled_matmul(x, weight.t(), E4M3, E4M3, scaling == "rowwise", x.dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight = ctx.saved_tensors
        rowwise, fallbacks = ctx.scaling == "rowwise", ctx.fallbacks
        n, k = weight.shape
        if ctx.empty:
            return grad_out @ weight.to(grad_out.dtype), torch.zeros_like(weight), None, None
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            if _aligned(n, k):
                grad_x = _scaled_matmul(grad_out, weight, E5M2, E4M3, rowwise, x.dtype)
            else:
                fallbacks["grad_input"] += 1
                grad_x = (grad_out @ weight.to(grad_out.dtype)).to(x.dtype)
        if ctx.needs_input_grad[1]:
            if _aligned(n, k):
                grad_w = _scaled_matmul(_pad_rows(grad_out).t(), _pad_rows(x), E5M2, E4M3, rowwise,
                                        torch.float32).to(weight.dtype)
            else:
                fallbacks["grad_weight"] += 1
                grad_w = (grad_out.t().float() @ x.float()).to(weight.dtype)
        return grad_x, grad_w, None, None


def float8_linear(x: torch.Tensor, weight: torch.Tensor, scaling: str = "tensorwise",
                  bias: torch.Tensor | None = None, fallbacks: Counter | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with the matmul in FP8; ``x`` is ``[..., in]``.

    The result has ``x``'s dtype; the bias is added in high precision. ``fallbacks``
    (optional) counts matmuls that ran in high precision because of their shape.
    """
    if scaling not in SCALINGS:
        raise ValueError(f"fp8 scaling must be one of {SCALINGS}, not {scaling!r}")
    lead = x.shape[:-1]
    out = _Float8Matmul.apply(x.reshape(-1, x.shape[-1]), weight, scaling,
                              Counter() if fallbacks is None else fallbacks)
    out = out.reshape(*lead, weight.shape[0])
    return out if bias is None else out + bias.to(out.dtype)


class Float8Linear(nn.Linear):
    """``nn.Linear`` whose matmuls run in FP8 (see the module docstring); same parameters."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 scaling: str = "tensorwise", device=None, dtype=None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        if scaling not in SCALINGS:
            raise ValueError(f"fp8 scaling must be one of {SCALINGS}, not {scaling!r}")
        self.scaling = scaling
        self.fallbacks: Counter = Counter()

    @classmethod
    def from_linear(cls, linear: nn.Linear, scaling: str) -> "Float8Linear":
        """Wrap ``linear``'s own Parameter objects (no copy, optimizer state stays valid)."""
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                  scaling=scaling, device="meta")
        new.weight = linear.weight
        new.bias = linear.bias
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return float8_linear(x, self.weight, self.scaling, self.bias, self.fallbacks)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, scaling={self.scaling}"


def convert_to_float8(module: nn.Module, scaling: str = "tensorwise") -> nn.Module:
    """Swap ``module``'s eligible ``nn.Linear`` layers for ``Float8Linear`` in place.

    Every ``nn.Linear`` is eligible except those named in ``HIGH_PRECISION_NAMES``
    (the MoE router and the output head); embeddings and norms are not linear layers and
    stay as they are. Submodules holding stacked expert weights opt in by exposing an
    ``fp8_scaling`` attribute, which is set to ``scaling``. Returns ``module``.
    """
    if scaling not in SCALINGS:
        raise ValueError(f"fp8 scaling must be one of {SCALINGS}, not {scaling!r}")
    for parent in list(module.modules()):
        if hasattr(parent, "fp8_scaling"):
            parent.fp8_scaling = scaling
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and name not in HIGH_PRECISION_NAMES:
                setattr(parent, name, Float8Linear.from_linear(child, scaling))
    return module


def fallback_counts(module: nn.Module) -> Counter:
    """Matmuls that ran in high precision for shape reasons, summed over ``module``."""
    total: Counter = Counter()
    for m in module.modules():
        if isinstance(getattr(m, "fallbacks", None), Counter):
            total.update(m.fallbacks)
    return total
