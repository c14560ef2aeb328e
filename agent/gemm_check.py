"""The known-answer GEMM test: does this node's matrix multiply compute what it must?

Fixed inputs (seeded, uniform in [-1, 1), rounded once to the tested dtype) are
multiplied on the device under test, C = A @ B, and compared element by element with a
float64 product of the same rounded inputs. The tolerance is derived, not chosen: the
standard forward error bound of an inner product of length K (Higham, Accuracy and
Stability of Numerical Algorithms, 3.5) holds for every summation order, blocked,
split-K or FMA, so a correct unit never exceeds it:

    |C - C_ref| <= (1 + u_out) * gamma_K(u_acc) * (|A| @ |B|) + u_out * |C_ref| + eta

where gamma_K(u) = K*u / (1 - K*u), u_acc is the unit roundoff of the accumulation
(float32: 2^-24), u_out that of rounding the result to the output dtype (0 when the
output is the accumulator: float32; 2^-8 for bfloat16, 2^-11 for float16), and eta
covers underflow (K times half the accumulator's smallest subnormal spacing, plus the
output's). The float64 reference's own error, gamma_K(2^-53) * (|A| @ |B|), is added too.
At size 256 in float32 the bound is about 1e-3 against elements of typical size 5: a
single element off by 1e-3 of the product's scale exceeds it wherever it is.

Half-precision inputs are exact in the float32 accumulator (their products too), so only
the accumulation and the output rounding count; that needs float32 accumulation, so the
test turns off, while it runs, what would lower it (TF32 for float32 products, reduced
precision split-K reductions for bf16/fp16, a float32 matmul precision below "highest")
and restores them after. On the CPU only float32 is tested; on each visible GPU also
bfloat16 and float16. The reference is computed on the same device in float64 (a
different unit from the low-precision one under test; on the CPU, the same cores).

``Defect`` is the simulated fault (chaos ``sdc-gemm``): a defective multiply unit whose
product comes out with one element's lowest exponent bit flipped (the value doubled or
halved), which the test must catch.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import torch

#: Seed of the fixed inputs: every node multiplies the same matrices.
SEED = 20240614

#: Unit roundoff (half an ulp of 1) of each dtype the test runs in.
UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
#: Half the spacing of each dtype's subnormals: the most one rounding can lose to underflow.
_UNDERFLOW = {torch.float32: 2.0 ** -150, torch.bfloat16: 2.0 ** -134, torch.float16: 2.0 ** -25}
#: The lowest exponent bit of each dtype (= its stored mantissa bits), and its integer view.
_EXPONENT_BIT = {torch.float32: (23, torch.int32), torch.bfloat16: (7, torch.int16),
                 torch.float16: (10, torch.int16)}
_F64_ROUNDOFF = 2.0 ** -53


@dataclass(frozen=True)
class Defect:
    """A defective multiply unit: element (``row``, ``col``) of every product it computes
    has its lowest exponent bit flipped (doubled or halved). Positions beyond the
    matrix wrap around."""

    row: int = 5
    col: int = 3


@dataclass(frozen=True)
class GemmResult:
    """One known-answer GEMM test on one device in one dtype.

    ``row``, ``col``: the element nearest to (or furthest past) its bound; ``error``:
    its |C - C_ref|; ``bound``: its allowed error; ``duration_s``: wall time of the test."""

    ok: bool
    dtype: str
    size: int
    device: str
    row: int
    col: int
    error: float
    bound: float
    duration_s: float

    def summary(self) -> str:
        """One line: what was tested and how the worst element fared."""
        what = f"{self.dtype} {self.size}x{self.size} GEMM on {self.device}"
        if self.ok:
            return (f"{what} ok: worst element ({self.row}, {self.col}) off by {self.error:.3g}, "
                    f"bound {self.bound:.3g}")
        return f"{what} wrong: element ({self.row}, {self.col}) off by {self.error:.3g}, bound {self.bound:.3g}"

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def gamma(k: int, u: float) -> float:
    """Higham's gamma_k = k*u / (1 - k*u): the relative error bound of k roundings of unit roundoff u."""
    if k * u >= 1:
        raise ValueError(f"gamma_{k} is unbounded at unit roundoff {u:g} (k*u >= 1)")
    return k * u / (1 - k * u)


def inputs(size: int, dtype: torch.dtype, device: str, seed: int = SEED) -> tuple[torch.Tensor, torch.Tensor]:
    """The test's fixed A and B: uniform in [-1, 1), drawn in float64 on the CPU from
    ``seed``, rounded once to ``dtype``, placed on ``device``."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    a = torch.rand(size, size, generator=g, dtype=torch.float64) * 2 - 1
    b = torch.rand(size, size, generator=g, dtype=torch.float64) * 2 - 1
    return a.to(dtype).to(device), b.to(dtype).to(device)


def error_bound(a: torch.Tensor, b: torch.Tensor, c_ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The elementwise bound on |A @ B - C_ref| for a product of ``a`` and ``b`` (float64
    copies of the rounded inputs) accumulated in float32 and returned in ``dtype``."""
    k = a.shape[1]
    u_acc = UNIT_ROUNDOFF[torch.float32]
    u_out = 0.0 if dtype == torch.float32 else UNIT_ROUNDOFF[dtype]
    abs_product = a.abs() @ b.abs()
    # |A| @ |B| itself is computed in float64: inflate it by its own (tiny) error
    abs_product = abs_product * (1 + gamma(k, _F64_ROUNDOFF))
    eta = k * _UNDERFLOW[torch.float32] + (_UNDERFLOW[dtype] if u_out else 0.0)
    return ((1 + u_out) * gamma(k, u_acc) + gamma(k, _F64_ROUNDOFF)) * abs_product \
        + u_out * c_ref.abs() + eta


@contextlib.contextmanager
def _full_precision_matmul() -> Iterator[None]:
    """float32 accumulation for every matmul while the test runs (see the module
    docstring); the caller's settings are restored after, through the API they use."""
    cuda = torch.backends.cuda.matmul
    reductions = {name: getattr(cuda, name) for name in (
        "allow_fp16_reduced_precision_reduction", "allow_bf16_reduced_precision_reduction")}
    backends = [b for b in (cuda, getattr(torch.backends.mkldnn, "matmul", None))
                if b is not None and hasattr(b, "fp32_precision")]
    if backends:   # torch >= 2.9: per-backend precision; mixing in the legacy API is refused
        saved = [b.fp32_precision for b in backends]
        for b in backends:
            b.fp32_precision = "ieee"
    else:
        saved = [torch.get_float32_matmul_precision(), cuda.allow_tf32]
        torch.set_float32_matmul_precision("highest")
        cuda.allow_tf32 = False
    for name in reductions:
        setattr(cuda, name, False)
    try:
        yield
    finally:
        if backends:
            for b, value in zip(backends, saved):
                b.fp32_precision = value
        else:
            torch.set_float32_matmul_precision(saved[0])
            cuda.allow_tf32 = saved[1]
        for name, value in reductions.items():
            setattr(cuda, name, value)


def _flip_exponent_bit(c: torch.Tensor, defect: Defect) -> None:
    bit, int_dtype = _EXPONENT_BIT[c.dtype]
    row, col = defect.row % c.shape[0], defect.col % c.shape[1]
    view = c.view(int_dtype)
    mask = torch.tensor(1 << bit, dtype=int_dtype, device=c.device)
    view[row, col] = view[row, col] ^ mask


def known_answer_gemm(size: int, dtype: torch.dtype = torch.float32, device: str = "cpu",
                      defect: Defect | None = None, seed: int = SEED) -> GemmResult:
    """Multiply the fixed inputs on ``device`` in ``dtype`` and check every element
    against its bound. ``defect``: simulate a defective unit (chaos ``sdc-gemm``)."""
    if size < 1:
        raise ValueError(f"size must be >= 1, not {size}")
    if dtype not in UNIT_ROUNDOFF:
        raise ValueError(f"dtype must be one of {sorted(map(str, UNIT_ROUNDOFF))}, not {dtype}")
    t0 = time.perf_counter()
    a, b = inputs(size, dtype, device, seed)
    with _full_precision_matmul():
        c = a @ b
    if defect is not None:
        _flip_exponent_bit(c, defect)
    if c.is_cuda:
        torch.cuda.synchronize(c.device)
    row, col, err, lim = compare(c, a, b)
    return GemmResult(ok=err <= lim, dtype=str(dtype).removeprefix("torch."), size=size, device=str(c.device),
                      row=row, col=col, error=err, bound=lim, duration_s=time.perf_counter() - t0)


def compare(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple[int, int, float, float]:
    """Check the product ``c`` of ``a`` and ``b`` (all in the tested dtype) element by
    element: (row, col, error, bound) of the element furthest past, or nearest to, its
    bound. A non-finite element counts as an infinite error."""
    a64, b64 = a.double(), b.double()
    c_ref = a64 @ b64
    bound = error_bound(a64, b64, c_ref, c.dtype)
    error = (c.double() - c_ref).abs()
    error = torch.where(torch.isfinite(error), error, torch.full_like(error, float("inf")))
    row, col = divmod(int(torch.argmax(error / bound)), c.shape[1])
    return row, col, float(error[row, col]), float(bound[row, col])


def devices() -> list[str]:
    """What the node's test covers: every visible GPU, else the CPU."""
    if torch.cuda.is_available():
        return [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    return ["cpu"]


def dtypes_for(device: str) -> list[torch.dtype]:
    """float32 everywhere; bfloat16 and float16 too on a GPU (the dtypes training uses there)."""
    if device.startswith("cuda"):
        return [torch.float32, torch.bfloat16, torch.float16]
    return [torch.float32]


def run_node_check(size: int, defect: Defect | None = None) -> list[GemmResult]:
    """The node's whole test: every device of ``devices()`` in each of its dtypes."""
    return [known_answer_gemm(size, dtype, device, defect) for device in devices() for dtype in dtypes_for(device)]


def worst(results: list[GemmResult]) -> GemmResult:
    """The result that speaks for the node: a failing one if any (the furthest past its
    bound), else the one nearest its bound."""
    if not results:
        raise ValueError("no results")
    return max(results, key=lambda r: (not r.ok, r.error / r.bound if r.bound > 0 else float("inf")))
