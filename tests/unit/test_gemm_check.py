"""The known-answer GEMM test: its bound is the derived one, never fires on a correct
product (many seeds, sizes, dtypes), and is tight enough that one element off by 1e-3
of the product's scale, or a flipped bit of a defective unit, fails it."""

from __future__ import annotations

import math
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fleet.agent import gemm_check
from fleet.agent.gemm_check import Defect, compare, error_bound, gamma, inputs, known_answer_gemm

pytestmark = pytest.mark.timeout(120)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def test_gamma_is_highams_and_refuses_an_unbounded_length() -> None:
    u = 2.0 ** -24
    assert gamma(256, u) == pytest.approx(256 * u / (1 - 256 * u), rel=1e-15)
    assert gamma(1, u) > u
    with pytest.raises(ValueError, match="unbounded"):
        gamma(256, 2.0 ** -8)   # bf16 accumulation of 256 terms has no such bound


def test_the_bound_is_derived_from_dtype_and_size() -> None:
    a, b = inputs(64, torch.float32, "cpu")
    a64, b64 = a.double(), b.double()
    c_ref = a64 @ b64
    abs_product = a64.abs() @ b64.abs()
    got = error_bound(a64, b64, c_ref, torch.float32)
    # float32 output is the accumulator: gamma_K(2^-24) of |A| @ |B|, plus the float64
    # reference's own error and underflow, both negligible
    assert torch.allclose(got, gamma(64, 2.0 ** -24) * abs_product, rtol=1e-6, atol=0)
    # a bf16 output adds its rounding, u = 2^-8 of the value
    bf = error_bound(a64, b64, c_ref, torch.bfloat16)
    assert torch.allclose(bf - 2.0 ** -8 * c_ref.abs(), (1 + 2.0 ** -8) * got, rtol=1e-6, atol=1e-30)
    # longer inner products are allowed proportionally more
    big = inputs(256, torch.float32, "cpu")
    ratio = error_bound(big[0].double(), big[1].double(), big[0].double() @ big[1].double(),
                        torch.float32).mean() / got.mean()
    assert 14 < float(ratio) < 18   # ~ (256/64)^2: gamma_K grows with K, and so does |A| @ |B|


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), size=st.sampled_from([16, 33, 128, 256]), dtype=st.sampled_from(DTYPES))
def test_a_correct_product_never_fails(seed: int, size: int, dtype: torch.dtype) -> None:
    r = known_answer_gemm(size, dtype, seed=seed)
    assert r.ok, r.summary()
    assert 0 <= r.error <= r.bound and (r.dtype, r.size, r.device) == (str(dtype)[6:], size, "cpu")


def test_the_bound_catches_one_element_off_by_1e_3_of_the_products_scale() -> None:
    a, b = inputs(256, torch.float32, "cpu")
    a64, b64 = a.double(), b.double()
    c_ref = a64 @ b64
    bound = error_bound(a64, b64, c_ref, torch.float32)
    scale = float(c_ref.pow(2).mean().sqrt())
    # anywhere: every element's bound is far below 1e-3 of the product's scale
    assert float(bound.max()) < 0.25e-3 * scale
    # and 1e-3 of the element's own value exceeds its bound except near zero (~15% of
    # elements, |C| below a fifth of the scale)
    assert float((bound < 1e-3 * c_ref.abs()).double().mean()) > 0.8
    gen = torch.Generator().manual_seed(7)
    for _ in range(20):
        i, j = (int(x) for x in torch.randint(0, 256, (2,), generator=gen))
        c = a @ b
        c[i, j] += 1e-3 * scale * (1 if c[i, j] >= 0 else -1)
        row, col, err, lim = compare(c, a, b)
        assert (row, col) == (i, j) and err > lim


def test_a_non_finite_element_fails() -> None:
    a, b = inputs(32, torch.float32, "cpu")
    c = a @ b
    c[3, 4] = float("nan")
    row, col, err, lim = compare(c, a, b)
    assert (row, col) == (3, 4) and math.isinf(err) and err > lim


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", [16, 256])
def test_a_defective_unit_is_caught(dtype: torch.dtype, size: int) -> None:
    r = known_answer_gemm(size, dtype, defect=Defect())
    assert not r.ok and (r.row, r.col) == (5, 3)
    assert r.error > 100 * r.bound   # a flipped exponent bit halves or doubles the value
    assert "wrong: element (5, 3)" in r.summary()


def test_a_defect_beyond_the_matrix_wraps_around() -> None:
    r = known_answer_gemm(16, defect=Defect(row=21, col=16))
    assert not r.ok and (r.row, r.col) == (5, 0)


def test_the_node_check_on_a_cpu_and_its_worst_result() -> None:
    results = gemm_check.run_node_check(64)
    assert [(r.device, r.dtype) for r in results] == [("cpu", "float32")] and results[0].ok
    bad = known_answer_gemm(64, defect=Defect())
    assert gemm_check.worst([results[0], bad]) is bad
    with pytest.raises(ValueError):
        gemm_check.worst([])


def test_the_matmul_settings_are_restored() -> None:
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")
    try:
        assert known_answer_gemm(64).ok
        assert torch.get_float32_matmul_precision() == "medium"
    finally:
        torch.set_float32_matmul_precision(before)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="size"):
        known_answer_gemm(0)
    with pytest.raises(ValueError, match="dtype"):
        known_answer_gemm(16, torch.float64)


def test_size_256_is_fast() -> None:
    # CPU time, best of 5: other tests share this machine's two cores
    known_answer_gemm(256)   # warm-up: first-call allocations
    times = []
    for _ in range(5):
        t = time.process_time()
        known_answer_gemm(256)
        times.append(time.process_time() - t)
    assert min(times) < 0.2, f"known-answer GEMM at 256 took {min(times):.3f} s of CPU"
