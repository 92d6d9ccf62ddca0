"""lrmoe_kernels.token_rows: the Triton launchers equal the reference ops lrmoe::gather_sum_rows and
lrmoe::gather_dot_rows (their CPU kernels) on tiny odd shapes: K = 1, 3 (padded to 4) and 8, skipped rows (-1),
repeated rows, column counts that cross several blocks with a masked edge, a strided source, fp32 and bf16, leading
token dims for gather_sum_rows_triton; the router gradient with the pair scores (gather_dot_scores_triton) equals
gather_dot_rows and lrmoe::score_pairs' reference for every deterministic metric, non-finite inputs included.

Without a GPU the kernels run in Triton's interpreter (tests/conftest.py switches it on) on CPU tensors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from lrmoe_kernels.token_rows import gather_dot_rows_triton, gather_dot_scores_triton, gather_sum_rows_triton

from lrmoe.ops.scoring import score_pairs_reference
from lrmoe.ops.token_rows import gather_dot_rows_reference, gather_sum_rows_reference
from lrmoe_kernels.launch import interpreting

INTERPRET = interpreting()
DEVICE = "cpu" if INTERPRET else "cuda"
pytestmark = pytest.mark.skipif(
    not INTERPRET and not torch.cuda.is_available(), reason="needs a CUDA device or TRITON_INTERPRET=1"
)


def _case(n_src, n_tok, top_k, cols, dtype, seed, skip=0.25, strided=False):
    g = torch.Generator().manual_seed(seed)
    src = torch.randn(n_src, 2 * cols if strided else cols, generator=g).to(dtype)
    src = src[:, ::2] if strided else src
    rows = torch.randint(0, n_src, (n_tok, top_k), generator=g)
    rows[torch.rand(n_tok, top_k, generator=g) < skip] = -1
    w = torch.randn(n_tok, top_k, generator=g).to(dtype)
    gt = torch.randn(n_tok, cols, generator=g).to(dtype)
    return src.to(DEVICE), rows.to(DEVICE), w.to(DEVICE), gt.to(DEVICE)


def _tol(dtype):  # accumulation order differs; bf16 output: 1 ulp (the interpreter truncates fp32 -> bf16)
    return dict(rtol=1.6e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("top_k", [1, 3, 8])
@pytest.mark.parametrize("cols", [1, 8, 21])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equal_to_reference(top_k, cols, dtype):
    src, rows, w, gt = _case(7, 5, top_k, cols, dtype, seed=top_k * 100 + cols)
    for weights in (w, None):
        got = gather_sum_rows_triton(src, rows, weights)
        assert got.dtype == dtype and got.shape == (5, cols)
        torch.testing.assert_close(got, gather_sum_rows_reference(src, rows, weights), **_tol(dtype))
    dot = gather_dot_rows_triton(src, rows, gt)
    assert dot.dtype == torch.float32
    torch.testing.assert_close(dot, gather_dot_rows_reference(src, rows, gt), rtol=1e-5, atol=1e-5)


def test_strided_source_and_all_rows_skipped():
    src, rows, w, gt = _case(6, 4, 3, 10, torch.float32, seed=1, strided=True)
    rows[1] = -1  # a token with no row: zeros
    got = gather_sum_rows_triton(src, rows, w)
    torch.testing.assert_close(got, gather_sum_rows_reference(src, rows, w))
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    dot = gather_dot_rows_triton(src, rows, gt)
    torch.testing.assert_close(dot, gather_dot_rows_reference(src, rows, gt))
    assert torch.equal(dot[1], torch.zeros_like(dot[1]))


def test_no_tokens():
    src, rows, w, gt = _case(3, 0, 2, 5, torch.float32, seed=2)
    assert gather_sum_rows_triton(src, rows, w).shape == (0, 5)
    assert gather_dot_rows_triton(src, rows, gt).shape == (0, 2)


@pytest.mark.parametrize("lead", [(2, 3), (3, 1, 2), (6,)])
def test_gather_sum_leading_dims(lead):
    # Rows [..., K] give out [..., C], allocated in that shape by the launcher (not a view of [T, C]).
    src, rows, w, _ = _case(7, 6, 3, 21, torch.float32, seed=3)
    for weights in (w, None):
        got = gather_sum_rows_triton(src, rows.view(*lead, 3), None if weights is None else weights.view(*lead, 3))
        assert got.shape == (*lead, 21) and got._base is None
        torch.testing.assert_close(got.view(6, 21), gather_sum_rows_reference(src, rows, weights))
    one = gather_sum_rows_triton(src, rows[2], w[2])  # one token, rows [K]
    assert one.shape == (21,)
    torch.testing.assert_close(one, gather_sum_rows_reference(src, rows[2:3], w[2:3])[0])
    empty = gather_sum_rows_triton(src, rows[:0].view(0, 2, 3), w[:0].view(0, 2, 3))
    assert empty.shape == (0, 2, 21)


@given(n_src=st.integers(1, 9), n_tok=st.integers(1, 6), top_k=st.integers(1, 5), cols=st.integers(1, 20),
       seed=st.integers(0, 2**16))
def test_property_equal_to_reference(n_src, n_tok, top_k, cols, seed):
    src, rows, w, gt = _case(n_src, n_tok, top_k, cols, torch.float32, seed)
    torch.testing.assert_close(gather_sum_rows_triton(src, rows, w), gather_sum_rows_reference(src, rows, w))
    torch.testing.assert_close(gather_dot_rows_triton(src, rows, gt), gather_dot_rows_reference(src, rows, gt))


def _check_scores(src, rows, gt, gates, phi_sq, metric):
    dot, scores = gather_dot_scores_triton(src, rows, gt, gates, phi_sq, metric)
    assert dot.dtype == scores.dtype == torch.float32 and dot.shape == scores.shape == rows.shape
    torch.testing.assert_close(dot, gather_dot_rows_reference(src, rows, gt), rtol=1e-5, atol=1e-5, equal_nan=True)
    want = score_pairs_reference(gates, gt, phi_sq, metric)
    assert torch.equal(torch.isinf(scores), torch.isinf(want))  # +inf exactly where the reference puts it
    torch.testing.assert_close(scores, want, rtol=1e-5, atol=1e-6)  # fp32 norms summed in another order


@pytest.mark.parametrize("metric", ["lrm", "grad_l2", "grad_abs"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scores_from_the_router_gradients_pass(metric, dtype):
    src, rows, w, gt = _case(7, 6, 3, 21, dtype, seed=5)
    gates = torch.rand(6, 3, device=DEVICE).to(dtype)
    phi_sq = torch.rand(6, 3, device=DEVICE) * 4
    _check_scores(src, rows, gt, gates, phi_sq, metric)
    # Non-finite: a gate, a phi_sq, an entry of g (its whole token) and a gradient whose square overflows fp32.
    gates[0, 1], phi_sq[1, 2] = float("inf"), float("nan")
    gt[2, 3] = float("nan")
    gt[3] = 3e38 if dtype == torch.float32 else gt[3]
    _check_scores(src, rows, gt, gates, phi_sq, metric)
    _, scores = gather_dot_scores_triton(src, rows, gt, gates, phi_sq, metric)
    # A non-finite phi_sq or ||g||^2 counts for every metric, as in score_pairs; the overflow happens in fp32 only.
    assert scores[0, 1] == scores[1, 2] == float("inf") and scores[2].isinf().all()
    assert scores[3].isinf().all() == (dtype == torch.float32)
    assert not scores[4:].isinf().any()


def test_scores_reject_an_unknown_metric():
    src, rows, w, gt = _case(3, 2, 2, 5, torch.float32, seed=2)
    with pytest.raises(ValueError, match="metric must be one of"):
        gather_dot_scores_triton(src, rows, gt, w, w, "random")


@given(n_src=st.integers(1, 9), n_tok=st.integers(1, 6), top_k=st.integers(1, 5), cols=st.integers(1, 20),
       seed=st.integers(0, 2**16), metric=st.sampled_from(["lrm", "grad_l2", "grad_abs"]))
def test_property_scores_equal_to_reference(n_src, n_tok, top_k, cols, seed, metric):
    src, rows, w, gt = _case(n_src, n_tok, top_k, cols, torch.float32, seed)
    phi_sq = w.abs() * 3
    _check_scores(src, rows, gt, w, phi_sq, metric)
