"""lrmoe::swiglu_backward, lrmoe::swiglu_backward_scaled, lrmoe::swiglu_dot and lrmoe::swiglu_sqnorm:
torch.library.opcheck, values against the definitions (autograd of the SwiGLU itself for the backward), the outputs'
non-differentiability, and argument errors."""

from __future__ import annotations

import pytest
import torch

from lrmoe.ops import swiglu, swiglu_backward, swiglu_backward_scaled, swiglu_dot, swiglu_sqnorm

# (N rows of h, F, rows or None): repeated and unordered rows, one row, rows in place, no rows.
CASES = [(6, 5, [4, 0, 4, 2]), (1, 1, [0, 0]), (7, 8, None), (3, 4, [])]


def _case(N, F, rows, dtype=torch.float64, index_dtype=torch.int64, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = (2 * torch.randn(N, 2 * F, generator=g)).to(dtype)
    rows_R = None if rows is None else torch.tensor(rows, dtype=index_dtype)
    R = N if rows is None else len(rows)
    return h, rows_R, torch.randn(R, F, generator=g).to(dtype)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("requires_grad", [False, True])
def test_opcheck(case, index_dtype, requires_grad):
    h, rows, dphi = _case(*case, index_dtype=index_dtype)
    torch.library.opcheck(swiglu_backward, (h.requires_grad_(requires_grad), rows, dphi))


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_values_are_the_swiglu_and_its_autograd_gradient(case, dtype):
    h, rows, dphi = _case(*case, dtype=dtype)
    dh, phi = swiglu_backward(h, rows, dphi)
    # The definition: phi = silu(gate) * up of the taken rows, dh = d<phi, dphi>/dh by autograd, in fp64.
    h_rows = (h if rows is None else h[rows.long()]).double().requires_grad_(True)
    gate, up = h_rows.chunk(2, dim=-1)
    want_phi = torch.nn.functional.silu(gate) * up
    (want_dh,) = torch.autograd.grad(want_phi, h_rows, dphi.double())
    tol = {torch.bfloat16: dict(rtol=2e-2, atol=2e-2), torch.float32: dict(rtol=1e-5, atol=1e-6),
           torch.float64: dict(rtol=1e-12, atol=1e-14)}[dtype]  # fp64 computes in fp64 (not fp32 as it once did)
    assert dh.dtype == phi.dtype == dtype and dh.shape == h_rows.shape and phi.shape == dphi.shape
    torch.testing.assert_close(dh.double(), want_dh, **tol)
    torch.testing.assert_close(phi.double(), want_phi.detach(), **tol)
    # phi is what the forward's swiglu gives for the same rows, bit for bit
    assert torch.equal(phi, swiglu(h if rows is None else h[rows.long()]))


def test_outputs_do_not_require_grad():
    h, rows, dphi = _case(6, 5, [1, 2])
    dh, phi = swiglu_backward(h.requires_grad_(True), rows, dphi.requires_grad_(True))
    assert not dh.requires_grad and not phi.requires_grad


@pytest.mark.parametrize("args,match", [
    (((4, 5), None, (4, 2)), "h_N2F must be a 2-D float tensor with an even number of columns"),
    (((4, 6), None, (4, 2)), r"dphi_RF must be a float tensor of shape \(4, 3\)"),
    (((4, 6), [[0, 1]], (2, 3)), "rows_R must be a 1-D int32 or int64 tensor"),
    (((4, 6), [0, 1], (3, 3)), r"dphi_RF must be a float tensor of shape \(2, 3\)"),
])
def test_argument_errors_name_the_argument(args, match):
    h_shape, rows, dphi_shape = args
    rows_R = None if rows is None else torch.tensor(rows)
    with pytest.raises(ValueError, match=match):
        swiglu_backward(torch.randn(*h_shape), rows_R, torch.randn(*dphi_shape))


def test_integer_h_is_refused():
    with pytest.raises(ValueError, match="h_N2F must be a 2-D float tensor"):
        swiglu_backward(torch.ones(3, 4, dtype=torch.int64), None, torch.randn(3, 2))


# ------------------------------------------------------------------------------------------- lrmoe::swiglu_sqnorm


@pytest.mark.parametrize("shape", [(6, 10), (1, 2), (0, 8), (5, 0)])
@pytest.mark.parametrize("requires_grad", [False, True])
def test_sqnorm_opcheck(shape, requires_grad):
    h = torch.randn(*shape, dtype=torch.float64).requires_grad_(requires_grad)
    torch.library.opcheck(swiglu_sqnorm, (h,))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_sqnorm_values_are_the_swiglu_and_the_sum_of_its_squares(dtype):
    g = torch.Generator().manual_seed(2)
    h = (2 * torch.randn(9, 14, generator=g)).to(dtype)
    phi, sq = swiglu_sqnorm(h)
    assert phi.dtype == dtype and sq.dtype == torch.float32 and sq.shape == (9,)
    assert torch.equal(phi, swiglu(h))  # what the forward's swiglu gives, bit for bit
    # ||phi||^2 of the rounded phi, summed in higher precision for the comparison
    torch.testing.assert_close(sq.double(), phi.double().square().sum(-1), rtol=1e-6, atol=0)


def test_sqnorm_outputs_do_not_require_grad():
    phi, sq = swiglu_sqnorm(torch.randn(4, 6, requires_grad=True))
    assert not phi.requires_grad and not sq.requires_grad


@pytest.mark.parametrize("h", [torch.randn(4, 5), torch.randn(4), torch.ones(3, 4, dtype=torch.int64)])
def test_sqnorm_refuses_what_is_not_an_even_float_matrix(h):
    with pytest.raises(ValueError, match="lrmoe::swiglu_sqnorm: h_N2F must be a 2-D float tensor"):
        swiglu_sqnorm(h)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the ops are inlined on CUDA only)")
def test_compiled_layer_makes_phi_and_its_sqnorm_in_one_forward_kernel_on_cuda():
    """The compiled layer's phi and ||phi||^2 come from swiglu_sqnorm's kernel in the forward graph, reading h once:
    no SwiGLU of Inductor's own anywhere. (||phi||^2 in its PyTorch form was moved into the backward by the
    partitioner once, which recomputed the SwiGLU from the saved h there: seen in the generated code on the H200.)"""
    import re

    from torch._inductor.utils import run_and_get_code

    from lrmoe.nn import LRMoE

    torch.manual_seed(0)
    T, D, F, E, K = 64, 64, 48, 4, 2
    layer = LRMoE(dim=D, hidden_dim=F, num_experts=E, top_k=K, retain=0.5, selection="top").cuda().bfloat16()
    x_TD = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    torch._dynamo.reset()
    _, codes = run_and_get_code(lambda: torch.compile(layer, fullgraph=True)(x_TD).sum().backward())
    assert len(codes) == 2  # forward, backward
    assert "_swiglu_sqnorm_kernel" in codes[0]
    assert not any(re.search(r"def triton_\w*silu", code) for code in codes)  # no SwiGLU kernel of Inductor's


# ------------------------------------------------------------------------------- lrmoe::swiglu_backward_scaled


def _scaled_case(N, F, rows, dtype=torch.float64, seed=0):
    h, rows_R, dphi = _case(N, F, rows, dtype=dtype, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    coef = torch.rand(dphi.shape[0], generator=g).to(torch.promote_types(dtype, torch.float32))
    return h, rows_R, dphi, coef


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("requires_grad", [False, True])
def test_scaled_opcheck(case, requires_grad):
    h, rows, dphi, coef = _scaled_case(*case)
    torch.library.opcheck(swiglu_backward_scaled, (h.requires_grad_(requires_grad), rows, dphi, coef))


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_scaled_values_are_the_gradient_of_the_scaled_rows_and_the_router_dot(case, dtype):
    h, rows, dphi, coef = _scaled_case(*case, dtype=dtype, seed=3)
    dh, cphi, dot = swiglu_backward_scaled(h, rows, dphi, coef)
    # The definitions, in fp64 by autograd: the rows' output gradient is coef * dphi; cphi = coef * phi;
    # dot = <dphi, phi> per row with phi as the forward rounds it.
    h_rows = (h if rows is None else h[rows.long()]).double().requires_grad_(True)
    gate, up = h_rows.chunk(2, dim=-1)
    want_phi = torch.nn.functional.silu(gate) * up
    (want_dh,) = torch.autograd.grad(want_phi, h_rows, dphi.double() * coef.double().unsqueeze(1))
    rounded_phi = swiglu(h if rows is None else h[rows.long()]).double()
    tol = {torch.bfloat16: dict(rtol=2e-2, atol=2e-2), torch.float32: dict(rtol=1e-5, atol=1e-6),
           torch.float64: dict(rtol=1e-12, atol=1e-14)}[dtype]
    assert dh.dtype == cphi.dtype == dtype and dot.dtype == torch.promote_types(dtype, torch.float32)
    assert dh.shape == h_rows.shape and cphi.shape == dphi.shape and dot.shape == (dphi.shape[0],)
    torch.testing.assert_close(dh.double(), want_dh, **tol)
    torch.testing.assert_close(cphi.double(), rounded_phi * coef.double().unsqueeze(1), **tol)
    dot_tol = dict(rtol=1e-5, atol=1e-5) if dtype != torch.float64 else dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dot.double(), (dphi.double() * rounded_phi).sum(-1), **dot_tol)


def test_scaled_with_unit_coefficients_is_swiglu_backward():
    h, rows, dphi = _case(6, 5, [4, 0, 4, 2], dtype=torch.float32, seed=4)
    dh, cphi, _ = swiglu_backward_scaled(h, rows, dphi, torch.ones(4))
    want_dh, want_phi = swiglu_backward(h, rows, dphi)
    assert torch.equal(cphi, want_phi)
    torch.testing.assert_close(dh, want_dh, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("coef,match", [
    (torch.ones(3), r"coef_R must be a 1-D torch.float32 tensor with one entry per row of dphi_RF \(2\)"),
    (torch.ones(2, dtype=torch.float64), "coef_R must be a 1-D torch.float32 tensor"),
    (torch.ones(2, 1), "coef_R must be a 1-D torch.float32 tensor"),
])
def test_scaled_argument_errors_name_the_argument(coef, match):
    with pytest.raises(ValueError, match=match):
        swiglu_backward_scaled(torch.randn(4, 6), torch.tensor([0, 1]), torch.randn(2, 3), coef)


def test_scaled_outputs_do_not_require_grad():
    h, rows, dphi, coef = _scaled_case(6, 5, [1, 2])
    outs = swiglu_backward_scaled(h.requires_grad_(True), rows, dphi.requires_grad_(True), coef)
    assert not any(t.requires_grad for t in outs)


# ------------------------------------------------------------------------------------------ lrmoe::swiglu_dot


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("requires_grad", [False, True])
def test_dot_opcheck(case, requires_grad):
    h, rows, dphi = _case(*case)
    torch.library.opcheck(swiglu_dot, (h.requires_grad_(requires_grad), rows, dphi))


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_dot_is_the_scaled_ops_dot(case, dtype):
    # The definition: <dphi_i, phi_i> with phi as the forward rounds it, in fp64 here; and the same value as
    # swiglu_backward_scaled's dot (which the retained rows get), whatever their coefficients.
    h, rows, dphi = _case(*case, dtype=dtype, seed=5)
    dot = swiglu_dot(h, rows, dphi)
    phi = swiglu(h if rows is None else h[rows.long()]).double()
    assert dot.dtype == torch.promote_types(dtype, torch.float32) and dot.shape == (dphi.shape[0],)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dot.double(), (dphi.double() * phi).sum(-1), **tol)
    coef = torch.rand(dphi.shape[0]).to(dot.dtype)
    assert torch.equal(swiglu_backward_scaled(h, rows, dphi, coef)[2], dot)


def test_dot_argument_errors_name_the_op_and_argument():
    with pytest.raises(ValueError, match=r"lrmoe::swiglu_dot: dphi_RF must be a float tensor of shape \(2, 3\)"):
        swiglu_dot(torch.randn(4, 6), torch.tensor([0, 1]), torch.randn(3, 3))


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_dot_from_a_saved_phi_is_the_dot_of_its_h_bit_for_bit(case, dtype):
    h, rows, dphi = _case(*case, dtype=dtype, seed=6)
    torch.library.opcheck(swiglu_dot, (swiglu(h), rows, dphi, True))
    assert torch.equal(swiglu_dot(swiglu(h), rows, dphi, True), swiglu_dot(h, rows, dphi))


@pytest.mark.parametrize("phi_shape,rows,dphi_shape,match", [
    ((4, 3), None, (4, 2), r"with src_is_phi, src must be a 2-D float tensor \[N, F\] with dphi_RF's F columns"),
    ((4, 3), [0, 1], (3, 3), r"dphi_RF must be a float tensor of shape \(2, 3\)"),
    ((4, 3), [[0]], (1, 3), "rows_R must be a 1-D int32 or int64 tensor"),
])
def test_dot_from_phi_argument_errors(phi_shape, rows, dphi_shape, match):
    with pytest.raises(ValueError, match=match):
        swiglu_dot(torch.randn(*phi_shape), None if rows is None else torch.tensor(rows), torch.randn(*dphi_shape),
                   True)
