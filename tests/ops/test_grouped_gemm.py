"""lrmoe::gather_grouped_mm and lrmoe::grouped_outer: torch.library.opcheck (schema, fake, autograd registration,
AOT dispatch) on odd shapes, and values against per-row Python loops.
"""

from __future__ import annotations

import pytest
import torch

from lrmoe.ops import gather_grouped_mm, grouped_outer

# (N source rows, I, O, group sizes, padding rows): odd sizes, empty groups, a single group, an empty buffer.
CASES = [
    (7, 5, 3, [2, 0, 3, 1], 2),
    (6, 42, 13, [0, 0, 4], 3),
    (1, 1, 1, [1], 0),
    (5, 3, 2, [0, 0], 1),
    (4, 6, 5, [3], 0),
    (3, 2, 4, [0, 0, 0], 0),
]


def _case(N, I, O, sizes, pad, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    E = len(sizes)
    R = sum(sizes)
    rows = torch.cat([torch.randint(0, N, (R,), generator=g), torch.full((pad,), -1)])
    offsets = torch.cumsum(torch.tensor(sizes), 0).int()
    x = torch.randn(N, I, generator=g).to(dtype)
    w = torch.randn(E, O, I, generator=g).to(dtype)
    a = torch.randn(R + pad, O, generator=g).to(dtype)
    return x, w, a, rows, offsets


def _group_of(i: int, offsets: list[int]) -> int | None:
    return next((e for e, end in enumerate(offsets) if i < end), None)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("requires_grad", [False, True])
def test_opcheck_gather_grouped_mm(case, requires_grad):
    x, w, _, rows, offsets = _case(*case)
    x.requires_grad_(requires_grad)
    w.requires_grad_(requires_grad)
    torch.library.opcheck(gather_grouped_mm, (x, w, rows, offsets))


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("requires_grad", [False, True])
def test_opcheck_grouped_outer(case, requires_grad):
    x, _, a, rows, offsets = _case(*case)
    a.requires_grad_(requires_grad)
    x.requires_grad_(requires_grad)
    torch.library.opcheck(grouped_outer, (a, x, rows, offsets))


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_values_against_loops(case, dtype):
    x, w, a, rows, offsets = _case(*case, dtype=dtype)
    y = torch.ops.lrmoe.gather_grouped_mm(x, w, rows, offsets)
    gw = torch.ops.lrmoe.grouped_outer(a, x, rows, offsets)
    assert y.dtype == dtype and gw.dtype == dtype
    assert y.shape == (rows.shape[0], w.shape[1]) and gw.shape == w.shape
    ends = offsets.tolist()
    y_ref = torch.zeros(y.shape, dtype=torch.float64)
    gw_ref = torch.zeros(gw.shape, dtype=torch.float64)
    for i, r in enumerate(rows.tolist()):
        e = _group_of(i, ends)
        if e is not None:
            y_ref[i] = w[e].double() @ x[r].double()
            gw_ref[e] += torch.outer(a[i].double(), x[r].double())
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(y.double(), y_ref, rtol=tol, atol=tol * x.shape[1])
    torch.testing.assert_close(gw.double(), gw_ref, rtol=tol, atol=tol * max(1, rows.shape[0]))
    assert (y[ends[-1] :] == 0).all()


def test_grouped_outer_is_the_weight_gradient():
    x, w, a, rows, offsets = _case(7, 5, 3, [2, 0, 3, 1], 2, dtype=torch.float64)
    w.requires_grad_(True)
    y = gather_grouped_mm(x, w, rows, offsets)
    (gw,) = torch.autograd.grad(y, w, a)
    torch.testing.assert_close(gw, grouped_outer(a, x, rows.clamp(min=0), offsets))


def test_grouped_outer_gradcheck():
    x, _, a, rows, offsets = _case(5, 3, 2, [2, 0, 1], 2, dtype=torch.float64)
    a.requires_grad_(True)
    x.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda a_, x_: grouped_outer(a_, x_, rows.clamp(min=0), offsets), (a, x))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_rows_past_the_last_offset_never_leak(device):
    # NaN in a's padding rows (past offsets[-1]) stays out of grouped_outer, and gather_grouped_mm's padding rows
    # are exact zeros, on every kernel (on CUDA in bf16: torch._grouped_mm plus the tail-zeroing kernel).
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    x, w, a, rows, offsets = (t.to(device) for t in _case(9, 16, 24, [5, 0, 11, 4], 6, dtype=dtype))
    end = int(offsets[-1])
    clean = grouped_outer(a, x, rows.clamp(min=0), offsets)
    a[end:] = float("nan")
    got = grouped_outer(a, x, rows.clamp(min=0), offsets)
    assert torch.equal(got, clean) and got.isfinite().all()
    y = gather_grouped_mm(x, w, rows, offsets)
    assert y[end:].eq(0).all() and y[:end].isfinite().all() and y[:end].ne(0).any()


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("requires_grad", [False, True])
def test_opcheck_identity_rows(case, requires_grad):
    # rows_R=None: the rows are already in place (x has R rows).
    _, w, a, _, offsets = _case(*case)
    x = torch.randn(a.shape[0], w.shape[2]).requires_grad_(requires_grad)
    w.requires_grad_(requires_grad)
    a.requires_grad_(requires_grad)
    torch.library.opcheck(gather_grouped_mm, (x, w, None, offsets))
    torch.library.opcheck(grouped_outer, (a, x, None, offsets))


@pytest.mark.parametrize("case", CASES)
def test_identity_rows_equal_explicit_arange_with_gradients(case):
    _, w, a, _, offsets = _case(*case, dtype=torch.float64)
    R = a.shape[0]
    x = torch.randn(R, w.shape[2], dtype=torch.float64)
    ident = torch.arange(R)
    results = []
    for rows in (ident, None):
        xi, wi, ai = (t.clone().requires_grad_(True) for t in (x, w, a))
        y = gather_grouped_mm(xi, wi, rows, offsets)
        g = grouped_outer(ai, xi, rows, offsets)
        (y.sum() + g.square().sum()).backward()
        results.append((y, g, xi.grad, wi.grad, ai.grad))
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_grouped_mm_path_ignores_row_counts_so_unbacked_ones_compile():
    """The _grouped_mm path depends on dtype and strides only. Under expert parallelism the operands' row count is
    received from other ranks (an unbacked SymInt when compiled): testing it (it once required a multiple of 8)
    failed the compile of the expert-parallel layer on CUDA with a data-dependent guard."""
    from lrmoe.ops.grouped_gemm import _grouped_mm_ok

    w_EOI = torch.zeros(3, 24, 16, dtype=torch.bfloat16)
    assert _grouped_mm_ok(torch.zeros(13, 16, dtype=torch.bfloat16), w_EOI)  # 13 rows: not a multiple of 8
    assert not _grouped_mm_ok(torch.zeros(13, 12, dtype=torch.bfloat16), w_EOI)  # 24-byte rows: misaligned
    assert not _grouped_mm_ok(torch.zeros(16, 16), w_EOI)  # fp32
    assert not _grouped_mm_ok(torch.zeros(16, 16, dtype=torch.bfloat16), torch.zeros(3, 20, 16, dtype=torch.bfloat16))

    def f(x_ND, n_rows):
        n = n_rows.item()
        torch._check(n >= 0)
        torch._check(n <= x_ND.shape[0])
        rows = x_ND[:n]
        return rows.sum() if _grouped_mm_ok(rows, w_EOI) else -rows.sum()

    x_ND = torch.ones(20, 16, dtype=torch.bfloat16)
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        got = torch.compile(f, fullgraph=True, backend="aot_eager")(x_ND, torch.tensor(13))
    assert got.item() == 13 * 16


def test_grouped_mm_takes_aligned_bf16_only():
    """torch._grouped_mm runs bf16 operands whose last dims are multiples of 8 (16-byte rows), gathered or not;
    any other dtype or width goes to the Triton kernels."""
    from lrmoe.ops.grouped_gemm import _grouped_mm_ok

    x_NI, w_EOI = torch.zeros(13, 16, dtype=torch.bfloat16), torch.zeros(3, 24, 16, dtype=torch.bfloat16)
    assert _grouped_mm_ok(x_NI, w_EOI)
    assert not _grouped_mm_ok(x_NI.float(), w_EOI.float())  # fp32: never _grouped_mm
    assert not _grouped_mm_ok(x_NI[:, :12], w_EOI[:, :, :12])  # 24-byte rows
    assert not _grouped_mm_ok(x_NI, w_EOI[:, :20])  # a weight's other dim not a multiple of 8


def test_transpose_in_place_is_the_transpose_and_shares_storage():
    from lrmoe.ops.grouped_gemm import _transpose_in_place

    a_RO = torch.randn(10, 4)
    t_OR = _transpose_in_place(a_RO)
    assert t_OR.shape == (4, 10) and t_OR.stride() == a_RO.t().stride() and torch.equal(t_OR, a_RO.t())
    assert t_OR.data_ptr() == a_RO.data_ptr()
    view_RO = torch.randn(12, 4)[2:]  # row-major with a storage offset: the view keeps it
    assert torch.equal(_transpose_in_place(view_RO), view_RO.t())
    strided_RO = torch.randn(10, 8)[:, ::2]  # not row-major: plain .t()
    assert torch.equal(_transpose_in_place(strided_RO), strided_RO.t())


def _bf16_buffers_of(code: str, shape: tuple[int, int]) -> int:
    """How many bf16 buffers of this shape (any strides, either orientation) a generated module allocates."""
    import re

    found = re.findall(r"empty_strided_\w+\(\((\d+), (\d+)\), \([^)]*\), torch\.bfloat16", code)
    return sum(tuple(sorted(map(int, f))) == tuple(sorted(shape)) for f in found)


@pytest.mark.parametrize("transpose", ["t", "in_place"])
def test_compiled_gemms_sharing_a_pointwise_operand_write_it_once(transpose):
    """The layer's backward feeds dh (a pointwise result) to two grouped GEMMs: dx = dh W (row-major) and the
    weight gradient dh^T x (through a transpose). Under torch.compile, `.t()` made Inductor compute and write dh
    twice (once per reader, seen in the H200's generated code); _transpose_in_place (what grouped_outer's inlined
    CUDA kernel uses) makes it write dh once. The control case shows that the count can fail."""
    from torch._inductor.utils import run_and_get_code

    from lrmoe.ops.grouped_gemm import _transpose_in_place

    R, F2, D = 64, 32, 16
    g = torch.Generator().manual_seed(0)
    h_RF2, x_RD = (torch.randn(*s, generator=g).bfloat16() for s in ((R, F2), (R, D)))
    w_EDF2 = torch.randn(4, D, F2, generator=g).bfloat16()
    offs_E = torch.tensor([16, 32, 48, 64], dtype=torch.int32)
    flip = _transpose_in_place if transpose == "in_place" else torch.t

    def backward(h_RF2, x_RD, w_EDF2, offs_E):
        # cheap arithmetic: on the CPU Inductor realises a node with two readers when it holds exp or sigmoid
        # (on CUDA it does not, so the real dh was written twice); mul/add keep the CPU graph like the CUDA one
        dh_RF2 = (h_RF2.float() * 2 + 1).to(h_RF2.dtype)
        grad_w = torch._grouped_mm(flip(dh_RF2), x_RD, offs=offs_E)
        dx_RD = torch._grouped_mm(dh_RF2, w_EDF2.transpose(1, 2), offs=offs_E)
        return grad_w, dx_RD

    torch._dynamo.reset()
    got, (code,) = run_and_get_code(torch.compile(backward, fullgraph=True), h_RF2, x_RD, w_EDF2, offs_E)
    want = backward(h_RF2, x_RD, w_EDF2, offs_E)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert _bf16_buffers_of(code, (R, F2)) == (1 if transpose == "in_place" else 2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the ops are inlined on CUDA only)")
def test_compiled_layer_backward_writes_dh_once_on_cuda():
    """The compiled layer's backward on CUDA holds one [P, 2F] bf16 buffer, dh (the gate/up gradient of the rows),
    read by both the input-gradient GEMM and the weight-gradient GEMM (with `.t()` the H200 generated code held two
    at the Qwen3 shape)."""
    from torch._inductor.utils import run_and_get_code

    from lrmoe.nn import LRMoE

    torch.manual_seed(0)
    T, D, F, E, K = 32, 64, 48, 4, 2
    layer = LRMoE(dim=D, hidden_dim=F, num_experts=E, top_k=K, retain=1.0).cuda().bfloat16()
    compiled = torch.compile(layer, fullgraph=True)
    x_TD = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    torch._dynamo.reset()
    _, codes = run_and_get_code(lambda: compiled(x_TD).sum().backward())
    assert len(codes) == 2  # forward, backward
    assert _bf16_buffers_of(codes[1], (T * K, 2 * F)) == 1
