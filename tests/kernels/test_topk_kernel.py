"""lrmoe_kernels.routing.topk_ids_triton (lrmoe::topk_ids's CUDA kernel) picks exactly the reference's ids: the
first k of a stable descending sort, on rows with ties, signed zeros, infinities and NaN, odd widths that leave
padding columns, several rows per program, strided and 16-bit inputs.

Without a GPU the kernel runs in Triton's interpreter (tests/conftest.py switches it on) on CPU tensors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from lrmoe_kernels.routing import topk_ids_triton

from lrmoe.ops.routing import topk_ids_reference
from lrmoe_kernels.launch import interpreting

INTERPRET = interpreting()
DEVICE = "cpu" if INTERPRET else "cuda"
pytestmark = pytest.mark.skipif(
    not INTERPRET and not torch.cuda.is_available(), reason="needs a CUDA device or TRITON_INTERPRET=1"
)
SPECIAL = [0.0, -0.0, 1.0, -1.0, 0.5, float("inf"), -float("inf"), float("nan")]


def _check(x, k):
    got = topk_ids_triton(x.to(DEVICE), k).cpu()
    assert got.dtype == torch.int64 and got.shape == (x.shape[0], k)
    assert torch.equal(got, topk_ids_reference(x, k))


@pytest.mark.parametrize("T,E,k", [(1, 1, 1), (5, 7, 3), (40, 128, 8), (3, 33, 33), (70, 16, 4), (0, 8, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equal_to_reference(T, E, k, dtype):
    # values rounded to one decimal: many ties within a row
    x = torch.randn(T, E, generator=torch.Generator().manual_seed(T + E)).round(decimals=1)
    _check(x.to(dtype), k)


def test_special_values_order_like_a_stable_sort():
    x = torch.tensor([SPECIAL, SPECIAL[::-1], [float("nan")] * 8, [-0.0, 0.0] * 4])
    got = topk_ids_triton(x.to(DEVICE), 8).cpu()
    # by hand: NaN first, then +inf, 1, 0.5, the zeros in column order, -1, -inf
    assert got[0].tolist() == [7, 5, 2, 4, 0, 1, 3, 6]
    assert got[1].tolist() == [0, 2, 5, 3, 6, 7, 4, 1]
    assert got[2].tolist() == got[3].tolist() == list(range(8))
    _check(x, 8)


def test_strided_rows():
    x = torch.randn(12, 40, generator=torch.Generator().manual_seed(5)).round(decimals=1)
    _check(x[::2, ::3], 5)
    _check(x.t()[:, :9], 9)  # column-major


@given(t=st.integers(1, 12), e=st.integers(1, 70), data=st.data())
def test_property_equal_to_reference(t, e, data):
    k = data.draw(st.integers(1, e))
    values = data.draw(st.lists(st.sampled_from(SPECIAL + [2.0, -3.0]), min_size=t * e, max_size=t * e))
    _check(torch.tensor(values).reshape(t, e), k)
