"""lrmoe::gather_scale_rows: torch.library.opcheck, values against loops written from the
definitions, the outputs' non-differentiability, argument errors, and the expert backward's dy rows gather_scale_rows
replaces."""

from __future__ import annotations

import pytest
import torch

from lrmoe.functional.retained_rows import retained_dy
from lrmoe.ops import gather_scale_rows

# (N source rows, C columns, rows): repeats, unordered, one row, no rows.
CASES = [(6, 5, [4, 0, 4, 2, 5]), (1, 3, [0, 0]), (9, 17, [8, 1, 3]), (4, 2, [])]


def _case(N, C, rows, dtype=torch.float64, index_dtype=torch.int64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(N, C, generator=g).to(dtype), torch.tensor(rows, dtype=index_dtype),
            torch.randn(len(rows), generator=g, dtype=torch.float64).to(torch.float32 if dtype != torch.float64
                                                                          else dtype))


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("requires_grad", [False, True])
def test_opcheck(case, index_dtype, requires_grad):
    src, rows, coef = _case(*case, index_dtype=index_dtype)
    torch.library.opcheck(gather_scale_rows, (src.requires_grad_(requires_grad), rows, coef))


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_values_match_the_definition(case, dtype):
    src, rows, coef = _case(*case, dtype=dtype)
    got = gather_scale_rows(src, rows, coef)
    want = torch.zeros(len(rows), src.shape[1], dtype=torch.float64)
    for i, r in enumerate(rows.tolist()):
        want[i] = src[r].double() * float(coef[i])
    assert got.dtype == dtype and got.shape == want.shape
    tol = dict(rtol=8e-3, atol=1e-6) if dtype == torch.bfloat16 else dict(rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got.double(), want, **tol)


def test_output_does_not_require_grad():
    src, rows, coef = _case(*CASES[0])
    assert not gather_scale_rows(src.requires_grad_(True), rows, coef.requires_grad_(True)).requires_grad


@pytest.mark.parametrize("args,match", [
    (((4, 3), [0, 1], (2,), torch.int64), None),
    (((4,), [0, 1], (2,), torch.int64), "src_NC must be a 2-D float tensor"),
    (((4, 3), [[0, 1]], (2,), torch.int64), "rows_R must be a 1-D int32 or int64 tensor"),
    (((4, 3), [0, 1], (3,), torch.int64), r"coef_R must be a 1-D float tensor with one entry per row of rows_R \(2\)"),
    (((4, 3), [0, 1], (2,), torch.float32), "rows_R must be a 1-D int32 or int64 tensor"),
])
def test_argument_errors_name_the_argument(args, match):
    src_shape, rows, coef_shape, rows_dtype = args
    call = lambda: gather_scale_rows(torch.randn(*src_shape), torch.tensor(rows, dtype=rows_dtype),  # noqa: E731
                                     torch.randn(*coef_shape))
    if match is None:
        assert call().shape == (2, 3)
    else:
        with pytest.raises(ValueError, match=match):
            call()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_retained_dy_eager_equals_its_compiled_form(dtype):
    # The definition, eager and compiled (padding rows, pair -1, are zero).
    g = torch.Generator().manual_seed(3)
    T, K, D = 6, 3, 10
    g_TD = torch.randn(T, D, generator=g).to(dtype)
    gates_TK = torch.rand(T, K, generator=g).to(dtype)
    pair_R = torch.tensor([17, 0, 5, 5, -1, -1])
    weight_R = torch.tensor([1.5, 2.0, 0.5, 1.0, 0.0, 0.0])
    dy, tok, safe = retained_dy(g_TD, gates_TK, pair_R, weight_R, dtype)
    coef = gates_TK.reshape(-1).float()[safe] * weight_R
    want = (g_TD[tok] * coef.unsqueeze(1)).to(dtype)
    assert torch.equal(dy, want)
    assert torch.equal(dy[4:], torch.zeros(2, D, dtype=dtype))
    compiled = torch.compile(retained_dy, fullgraph=True)(g_TD, gates_TK, pair_R, weight_R, dtype)[0]
    assert torch.equal(compiled, want)
