"""lrmoe_kernels.token_rows: the Triton launchers equal the reference ops lrmoe::gather_sum_rows and
lrmoe::gather_dot_rows (their CPU kernels) on tiny odd shapes: K = 1, 3 (padded to 4) and 8, skipped rows (-1),
repeated rows, column counts that cross several blocks with a masked edge, a strided source, fp32 and bf16.

Without a GPU the kernels run in Triton's interpreter (tests/conftest.py switches it on) on CPU tensors."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from lrmoe_kernels.token_rows import gather_dot_rows_triton, gather_sum_rows_triton

from lrmoe.ops.token_rows import gather_dot_rows_reference, gather_sum_rows_reference

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
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


@given(n_src=st.integers(1, 9), n_tok=st.integers(1, 6), top_k=st.integers(1, 5), cols=st.integers(1, 20),
       seed=st.integers(0, 2**16))
def test_property_equal_to_reference(n_src, n_tok, top_k, cols, seed):
    src, rows, w, gt = _case(n_src, n_tok, top_k, cols, torch.float32, seed)
    torch.testing.assert_close(gather_sum_rows_triton(src, rows, w), gather_sum_rows_reference(src, rows, w))
    torch.testing.assert_close(gather_dot_rows_triton(src, rows, gt), gather_dot_rows_reference(src, rows, gt))
