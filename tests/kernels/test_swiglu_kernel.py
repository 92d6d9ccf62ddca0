"""lrmoe_kernels.swiglu: the Triton launchers equal the reference ops lrmoe::swiglu_backward, lrmoe::swiglu_sqnorm and
lrmoe::swiglu_backward_scaled and lrmoe::swiglu_dot
(their CPU kernels) on tiny odd shapes: rows through an index (repeated, out of order) or in place, F crossing
several column blocks with a masked edge, a strided h, fp32 and bf16; an index outside h gives zero rows, never a
read.

Without a GPU the kernel runs in Triton's interpreter (tests/conftest.py switches it on) on CPU tensors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from lrmoe_kernels.swiglu import (
    swiglu_backward_scaled_triton,
    swiglu_backward_triton,
    swiglu_dot_triton,
    swiglu_sqnorm_triton,
)

from lrmoe.ops.swiglu import (
    swiglu_backward_reference,
    swiglu_backward_scaled_reference,
    swiglu_dot_reference,
    swiglu_sqnorm_reference,
)
from lrmoe_kernels.launch import interpreting

INTERPRET = interpreting()
DEVICE = "cpu" if INTERPRET else "cuda"
pytestmark = pytest.mark.skipif(
    not INTERPRET and not torch.cuda.is_available(), reason="needs a CUDA device or TRITON_INTERPRET=1"
)


def _case(n, r, f, dtype, seed, indexed=True, strided=False):
    g = torch.Generator().manual_seed(seed)
    h = 3 * torch.randn(n, 4 * f if strided else 2 * f, generator=g)
    h = (h[:, ::2] if strided else h).to(dtype)
    rows = torch.randint(0, n, (r,), generator=g) if indexed else None
    dphi = torch.randn(r if indexed else n, f, generator=g).to(dtype)
    return h.to(DEVICE), None if rows is None else rows.to(DEVICE), dphi.to(DEVICE)


def _check(h, rows, dphi):
    dh, phi = swiglu_backward_triton(h, rows, dphi)
    want_dh, want_phi = swiglu_backward_reference(h.cpu(), None if rows is None else rows.cpu(), dphi.cpu())
    assert dh.dtype == phi.dtype == h.dtype and dh.shape == want_dh.shape and phi.shape == want_phi.shape
    # bf16: phi is rounded twice (silu, then the product) and the interpreter truncates where PyTorch rounds, so
    # up to two bf16 ulps (2^-7 relative each at worst); sigmoid/exp differ in the last fp32 bits. fp32: a few ulps.
    tol = dict(rtol=1.6e-2, atol=1e-3) if h.dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dh.cpu(), want_dh, **tol)
    torch.testing.assert_close(phi.cpu(), want_phi, **tol)


@pytest.mark.parametrize("f", [1, 8, 19])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("indexed", [True, False])
def test_equal_to_reference(f, dtype, indexed):
    _check(*_case(9, 13, f, dtype, seed=f, indexed=indexed))


def test_strided_h():
    _check(*_case(7, 10, 12, torch.float32, seed=3, strided=True))


@pytest.mark.parametrize("layout", ["strided", "expanded"])
def test_strided_and_expanded_rows(layout):
    # A row index with stride 2 (every other element) or 0 (one row repeated) was read as a flat array.
    h, rows, dphi = _case(6, 5, 8, torch.float32, seed=5)
    if layout == "strided":
        view = torch.stack([rows, torch.full_like(rows, 7)], 1)[:, 0]
    else:
        view = rows[2:3].expand(5)
    assert not view.is_contiguous()
    _check(h, view, dphi)


def test_rows_outside_h_give_zeros():
    h, rows, dphi = _case(5, 6, 9, torch.float32, seed=4)
    h[:] = float("nan")  # a read of any row would leak NaN into dh or phi
    rows = torch.tensor([-1, 5, 7, -3, 100, 5], device=h.device)
    dh, phi = swiglu_backward_triton(h, rows, dphi)
    assert torch.equal(dh.cpu(), torch.zeros(6, 18)) and torch.equal(phi.cpu(), torch.zeros(6, 9))


def test_no_rows():
    h, rows, dphi = _case(4, 0, 6, torch.float32, seed=5)
    dh, phi = swiglu_backward_triton(h, rows, dphi)
    assert dh.shape == (0, 12) and phi.shape == (0, 6)


@given(n=st.integers(1, 12), r=st.integers(1, 12), f=st.integers(1, 24), seed=st.integers(0, 2**16),
       indexed=st.booleans())
def test_property_equal_to_reference(n, r, f, seed, indexed):
    _check(*_case(n, r, f, torch.float32, seed, indexed=indexed))


# ------------------------------------------------------------------------------------------- swiglu_sqnorm_triton


def _check_sqnorm(h):
    phi, sq = swiglu_sqnorm_triton(h)
    want_phi, want_sq = swiglu_sqnorm_reference(h.cpu())
    assert phi.dtype == h.dtype and sq.dtype == torch.float32
    assert phi.shape == want_phi.shape and sq.shape == want_sq.shape
    # phi: as in _check (bf16: two roundings, truncated by the interpreter). ||phi||^2 from the kernel's own phi,
    # summed in another order than the reference's: fp32 ulps.
    tol = dict(rtol=1.6e-2, atol=1e-3) if h.dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(phi.cpu(), want_phi, **tol)
    torch.testing.assert_close(sq.cpu(), phi.cpu().float().square().sum(-1), rtol=1e-5, atol=1e-6)
    if h.dtype == torch.float32:
        torch.testing.assert_close(sq.cpu(), want_sq, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("f", [1, 8, 19])  # one column; one step; three steps of 8 with a masked edge
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sqnorm_equal_to_reference(f, dtype):
    h, _, _ = _case(9, 1, f, dtype, seed=10 + f, indexed=False)
    _check_sqnorm(h)


def test_sqnorm_strided_h_and_no_rows():
    h, _, _ = _case(7, 1, 12, torch.float32, seed=11, indexed=False, strided=True)
    _check_sqnorm(h)
    phi, sq = swiglu_sqnorm_triton(h[:0])
    assert phi.shape == (0, 12) and sq.shape == (0,)


@given(n=st.integers(1, 12), f=st.integers(1, 24), seed=st.integers(0, 2**16))
def test_sqnorm_property_equal_to_reference(n, f, seed):
    h, _, _ = _case(n, 1, f, torch.float32, seed, indexed=False)
    _check_sqnorm(h)


# ------------------------------------------------------------------------------ swiglu_backward_scaled_triton


@pytest.mark.parametrize("f", [1, 8, 19])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("indexed", [True, False])
def test_scaled_equal_to_reference(f, dtype, indexed):
    h, rows, dphi = _case(9, 13, f, dtype, seed=10 + f, indexed=indexed)
    coef = torch.rand(dphi.shape[0], generator=torch.Generator().manual_seed(f)).to(DEVICE)
    dh, cphi, dot = swiglu_backward_scaled_triton(h, rows, dphi, coef)
    want = swiglu_backward_scaled_reference(h.cpu(), None if rows is None else rows.cpu(), dphi.cpu(), coef.cpu())
    assert (dh.dtype, cphi.dtype, dot.dtype) == (h.dtype, h.dtype, torch.float32)
    tol = dict(rtol=1.6e-2, atol=1e-3) if h.dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dh.cpu(), want[0], **tol)
    # cphi is rounded three times in bf16 (silu, the product, the coefficient's product), each a truncation in
    # the interpreter: up to 3 * 2^-7 relative.
    torch.testing.assert_close(cphi.cpu(), want[1], **(dict(rtol=3e-2, atol=1e-3) if dtype == torch.bfloat16 else tol))
    # The dot sums F products: each phi may differ by its two roundings (truncations in the interpreter), up to
    # 2 * 2^-7 of |phi| in bf16, so the sum by that much of sum |dphi * phi| (cancellation makes relative error
    # meaningless); fp32 a few ulps of the same sum.
    h_rows = h.cpu() if rows is None else h.cpu()[rows.cpu()]
    scale = (dphi.cpu().float() * torch.nn.functional.silu(h_rows.float()[:, :f]) * h_rows.float()[:, f:]).abs().sum(-1)
    bound = scale * (2.0 ** -6 if dtype == torch.bfloat16 else 1e-6) + 1e-6
    assert ((dot.cpu() - want[2]).abs() <= bound).all()


def test_scaled_rows_outside_h_give_zeros_and_no_rows_give_empty_outputs():
    h, rows, dphi = _case(5, 6, 9, torch.float32, seed=4)
    h[:] = float("nan")  # a read of any row would leak NaN into the outputs
    rows = torch.tensor([-1, 5, 7, -3, 100, 5], device=h.device)
    dh, cphi, dot = swiglu_backward_scaled_triton(h, rows, dphi, torch.ones(6, device=h.device))
    assert not dh.cpu().any() and not cphi.cpu().any() and not dot.cpu().any()
    h, rows, dphi = _case(4, 0, 6, torch.float32, seed=5)
    outs = swiglu_backward_scaled_triton(h, rows, dphi, torch.ones(0, device=h.device))
    assert [t.shape for t in outs] == [(0, 12), (0, 6), (0,)]


@pytest.mark.parametrize("f", [1, 19])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("indexed", [True, False])
def test_dot_equal_to_reference_and_to_the_scaled_kernels_dot(f, dtype, indexed):
    h, rows, dphi = _case(9, 13, f, dtype, seed=20 + f, indexed=indexed)
    dot = swiglu_dot_triton(h, rows, dphi)
    want = swiglu_dot_reference(h.cpu(), None if rows is None else rows.cpu(), dphi.cpu())
    assert dot.dtype == torch.float32
    # Each phi's roundings (truncations in the interpreter) bound the difference, as for the scaled kernel's dot.
    h_rows = h.cpu() if rows is None else h.cpu()[rows.cpu()]
    scale = (dphi.cpu().float() * torch.nn.functional.silu(h_rows.float()[:, :f]) * h_rows.float()[:, f:]).abs().sum(-1)
    assert ((dot.cpu() - want).abs() <= scale * (2.0 ** -6 if dtype == torch.bfloat16 else 1e-6) + 1e-6).all()
    ones = torch.ones(dphi.shape[0], device=h.device)
    assert torch.equal(swiglu_backward_scaled_triton(h, rows, dphi, ones)[2].cpu(), dot.cpu())


@pytest.mark.parametrize("f", [1, 19])
@pytest.mark.parametrize("indexed", [True, False])
def test_dot_from_phi_is_the_dot_of_its_h_bit_for_bit(f, indexed):
    h, rows, dphi = _case(9, 13, f, torch.bfloat16, seed=30 + f, indexed=indexed)
    phi, _ = swiglu_sqnorm_triton(h)  # the forward's phi
    assert torch.equal(swiglu_dot_triton(phi, rows, dphi, True).cpu(), swiglu_dot_triton(h, rows, dphi).cpu())
