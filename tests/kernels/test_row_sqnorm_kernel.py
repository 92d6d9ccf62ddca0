"""lrmoe_kernels.scoring.row_sqnorm_triton (lrmoe::row_sqnorm's CUDA kernel) equals the reference: fp32 sums of
squares of every row, on odd shapes that cross the row and column blocks, a strided source, bf16 and fp32; a row
with inf or NaN gives a non-finite sum, as PyTorch's does.

Without a GPU the kernel runs in Triton's interpreter (tests/conftest.py switches it on) on CPU tensors."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from lrmoe_kernels.scoring import row_sqnorm_triton

from lrmoe.ops.rows import row_sqnorm_reference

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
pytestmark = pytest.mark.skipif(
    not INTERPRET and not torch.cuda.is_available(), reason="needs a CUDA device or TRITON_INTERPRET=1"
)


def _check(x):
    got = row_sqnorm_triton(x.to(DEVICE)).cpu()
    assert got.dtype == torch.float32 and got.shape == (x.shape[0],)
    torch.testing.assert_close(got, row_sqnorm_reference(x), rtol=1e-5, atol=1e-6)  # summation order differs


@pytest.mark.parametrize("shape", [(1, 1), (3, 130), (9, 257), (33, 64), (0, 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equal_to_reference(shape, dtype):
    _check(torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape))).to(dtype))


def test_strided_source_and_non_finite_rows():
    x = torch.randn(6, 34)[:, ::2]  # stride 2 along the row
    x[1, 3], x[4, 0] = float("inf"), float("nan")
    got = row_sqnorm_triton(x.to(DEVICE)).cpu()
    assert got[1] == float("inf") and got[4].isnan()
    keep = torch.tensor([0, 2, 3, 5])
    torch.testing.assert_close(got[keep], row_sqnorm_reference(x)[keep], rtol=1e-5, atol=1e-6)


@given(n=st.integers(1, 20), c=st.integers(1, 300), seed=st.integers(0, 2**16))
def test_property_equal_to_reference(n, c, seed):
    _check(torch.randn(n, c, generator=torch.Generator().manual_seed(seed)))
