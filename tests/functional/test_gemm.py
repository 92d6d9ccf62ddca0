"""Properties of lrmoe.functional.gemm.compact_and_gemm, against a per-row Python loop, and a compiled pipeline
(plan_quotas -> select_within_quota -> compact_and_gemm) against eager.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lrmoe.functional import compact_and_gemm, plan_quotas, select_within_quota


def ref_loop(x_NI: torch.Tensor, w_EOI: torch.Tensor, rows: list[int], offsets: list[int]) -> torch.Tensor:
    """y[i] = w[e(i)] @ x[rows[i]], e(i) the first group whose end exceeds i; zero past offsets[-1].
    Built from differentiable torch ops, one row at a time, so autograd through it is the reference gradient."""
    zero_O = 0 * (w_EOI[0] @ x_NI[0])  # zero, but part of the graph, so that autograd.grad always works
    out = []
    for i in range(len(rows)):
        e = next((g for g, end in enumerate(offsets) if i < end), None)
        out.append(zero_O if e is None else w_EOI[e] @ x_NI[rows[i]])
    return torch.stack(out) if out else zero_O.reshape(1, -1)[:0]


@st.composite
def gemm_cases(draw):
    N = draw(st.integers(1, 6))
    I = draw(st.integers(1, 5))
    O = draw(st.integers(1, 5))
    E = draw(st.integers(1, 4))
    sizes = draw(st.lists(st.integers(0, 3), min_size=E, max_size=E))  # empty groups included
    pad = draw(st.integers(0, 3))
    n_rows = sum(sizes)
    rows = draw(st.lists(st.integers(0, N - 1), min_size=n_rows, max_size=n_rows)) + [-1] * pad
    offsets = np.cumsum(sizes).tolist()
    int_dtype = draw(st.sampled_from([torch.int64, torch.int32]))
    seed = draw(st.integers(0, 2**31 - 1))
    return N, I, O, E, rows, offsets, int_dtype, seed


def _data(N, I, O, E, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, I, generator=g).to(dtype), torch.randn(E, O, I, generator=g).to(dtype)


@given(gemm_cases())
def test_forward_and_gradients_match_loop_reference_fp64(case):
    N, I, O, E, rows, offsets, int_dtype, seed = case
    x, w = _data(N, I, O, E, seed, torch.float64)
    x.requires_grad_(True)
    w.requires_grad_(True)
    y = compact_and_gemm(x, w, torch.tensor(rows, dtype=int_dtype), torch.tensor(offsets, dtype=int_dtype))
    assert y.shape == (len(rows), O) and y.dtype == torch.float64
    x_r, w_r = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    y_r = ref_loop(x_r, w_r, rows, offsets)
    torch.testing.assert_close(y, y_r, rtol=1e-12, atol=1e-12)
    # Rows past the last group are exactly zero, not garbage.
    assert (y[offsets[-1] :] == 0).all()

    gy = torch.randn(y.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 1))
    gx, gw = torch.autograd.grad(y, (x, w), gy)
    gx_r, gw_r = torch.autograd.grad(y_r, (x_r, w_r), gy)
    torch.testing.assert_close(gx, gx_r, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gw, gw_r, rtol=1e-12, atol=1e-12)


@given(gemm_cases(), st.sampled_from([torch.float32, torch.bfloat16]))
def test_low_precision_against_fp32_reference(case, dtype):
    N, I, O, E, rows, offsets, int_dtype, seed = case
    x, w = _data(N, I, O, E, seed, dtype)
    x.requires_grad_(True)
    w.requires_grad_(True)
    y = compact_and_gemm(x, w, torch.tensor(rows, dtype=int_dtype), torch.tensor(offsets, dtype=int_dtype))
    assert y.dtype == dtype
    # Reference in float64 from the same (rounded) inputs; tolerance from the output dtype.
    x_r = x.detach().double().requires_grad_(True)
    w_r = w.detach().double().requires_grad_(True)
    y_r = ref_loop(x_r, w_r, rows, offsets)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(y.double(), y_r, rtol=tol, atol=tol * I)
    gy = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    gx, gw = torch.autograd.grad(y, (x, w), gy)
    assert gx.dtype == dtype and gw.dtype == dtype
    gx_r, gw_r = torch.autograd.grad(y_r, (x_r, w_r), gy.double())
    scale = max(len(rows), 1) * max(O, I)
    torch.testing.assert_close(gx.double(), gx_r, rtol=tol, atol=tol * scale)
    torch.testing.assert_close(gw.double(), gw_r, rtol=tol, atol=tol * scale)


def test_gradcheck_tiny_case():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(3, 2, 3, dtype=torch.float64, generator=g, requires_grad=True)
    rows = torch.tensor([2, 0, 2, 3, 1, -1, -1])  # row 2 gathered twice; two padding rows
    offsets = torch.tensor([2, 2, 5])  # the middle group is empty
    assert torch.autograd.gradcheck(lambda a, b: compact_and_gemm(a, b, rows, offsets), (x, w))
    assert torch.autograd.gradgradcheck(lambda a, b: compact_and_gemm(a, b, rows, offsets), (x, w))


def test_offsets_past_the_buffer_are_clipped():
    x = torch.randn(3, 2, dtype=torch.float64)
    w = torch.randn(2, 4, 2, dtype=torch.float64)
    rows, offsets = [0, 1, 2], [2, 7]  # the second group would run past R = 3
    y = compact_and_gemm(x, w, torch.tensor(rows), torch.tensor(offsets))
    torch.testing.assert_close(y, ref_loop(x, w, rows, offsets))


def test_empty_buffer_and_all_empty_groups():
    x = torch.randn(3, 2)
    w = torch.randn(2, 4, 2)
    assert compact_and_gemm(x, w, torch.zeros(0, dtype=torch.int64), torch.tensor([0, 0])).shape == (0, 4)
    y = compact_and_gemm(x, w, torch.tensor([-1, -1]), torch.tensor([0, 0]))
    assert y.shape == (2, 4) and (y == 0).all()


@pytest.mark.parametrize(
    "x, w, rows, offsets, exc, name",
    [
        (torch.randn(3, 2), torch.randn(2, 4, 2, dtype=torch.float64), torch.zeros(1, dtype=torch.int64),
         torch.tensor([1, 1]), TypeError, "weight_EOI"),
        (torch.randn(3, 2), torch.randn(2, 4, 3), torch.zeros(1, dtype=torch.int64), torch.tensor([1, 1]),
         ValueError, "weight_EOI"),
        (torch.randn(3, 2), torch.randn(2, 4, 2), torch.zeros(1, dtype=torch.int64), torch.tensor([1, 1, 1]),
         ValueError, "offsets_E"),
        (torch.randn(3, 2), torch.randn(4, 2), torch.zeros(1, dtype=torch.int64), torch.tensor([1, 1]),
         ValueError, "weight_EOI"),
        (torch.randn(3), torch.randn(2, 4, 2), torch.zeros(1, dtype=torch.int64), torch.tensor([1, 1]),
         ValueError, "x_NI"),
        (torch.ones(3, 2, dtype=torch.int64), torch.randn(2, 4, 2), torch.zeros(1, dtype=torch.int64),
         torch.tensor([1, 1]), TypeError, "x_NI"),
        (torch.randn(3, 2), torch.randn(2, 4, 2), torch.zeros(1), torch.tensor([1, 1]), TypeError, "rows_R"),
        (torch.randn(3, 2), torch.randn(2, 4, 2), torch.zeros(1, dtype=torch.int64), torch.tensor([1.0, 1.0]),
         TypeError, "offsets_E"),
        (torch.randn(3, 2), torch.randn(2, 4, 2, device="meta"), torch.zeros(1, dtype=torch.int64),
         torch.tensor([1, 1]), ValueError, "weight_EOI on meta"),
    ],
)
def test_compact_and_gemm_errors_name_the_argument(x, w, rows, offsets, exc, name):
    with pytest.raises(exc, match=name):
        compact_and_gemm(x, w, rows, offsets)


# ------------------------------------------------------------------------------------------------ compile


def _pipeline(loads_E, scores_P, group_ids_P, x_PI, w_EOI, retain: float, policy: str):
    quotas_E = plan_quotas(loads_E, retain, policy=policy)
    sel = select_within_quota(scores_P, group_ids_P, quotas_E, max_rows=x_PI.shape[0], mode="top")
    y_RO = compact_and_gemm(x_PI, w_EOI, sel.pair_ids, sel.offsets)
    return y_RO * sel.weights.unsqueeze(1), sel.pair_ids, sel.offsets, quotas_E


def test_compiled_pipeline_matches_eager():
    torch._dynamo.reset()
    compiled = torch.compile(_pipeline, fullgraph=True, dynamic=False)
    g = torch.Generator().manual_seed(0)
    E, P, I, O = 4, 23, 5, 3
    gids = torch.cat([torch.full((11,), 1), torch.randint(0, E, (P - 11,), generator=g)])  # one hot expert
    loads = torch.zeros(E, dtype=torch.int64).scatter_add_(0, gids, torch.ones(P, dtype=torch.int64))
    scores = torch.rand(P, generator=g)
    x = torch.randn(P, I, generator=g)
    w = torch.randn(E, O, I, generator=g)
    for retain in (0.5, 1.0):  # same shapes: one graph, two plans
        xe, we = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        xc, wc = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        eager = _pipeline(loads, scores, gids, xe, we, retain, "waterfill")
        comp = compiled(loads, scores, gids, xc, wc, retain, "waterfill")
        for a, b in zip(comp[1:], eager[1:]):
            assert torch.equal(a, b)
        torch.testing.assert_close(comp[0], eager[0])
        assert int(eager[2][-1]) == int(np.floor(P * retain))
        gy = torch.randn(eager[0].shape, generator=g)
        ge = torch.autograd.grad(eager[0], (xe, we), gy)
        gc = torch.autograd.grad(comp[0], (xc, wc), gy)
        for a, b in zip(gc, ge):
            torch.testing.assert_close(a, b)


def test_compiled_pipeline_takes_any_pair_count_in_one_graph():
    # dynamic=True: the pair count is symbolic; three counts, one graph, eager's values and selections.
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(_pipeline, fullgraph=True, dynamic=True)
    g = torch.Generator().manual_seed(1)
    E, I, O = 4, 5, 3
    for P in (23, 31, 40):
        gids = torch.randint(0, E, (P,), generator=g)
        loads = torch.zeros(E, dtype=torch.int64).scatter_add_(0, gids, torch.ones(P, dtype=torch.int64))
        scores, x, w = torch.rand(P, generator=g), torch.randn(P, I, generator=g), torch.randn(E, O, I, generator=g)
        comp = compiled(loads, scores, gids, x, w, 0.5, "waterfill")
        eager = _pipeline(loads, scores, gids, x, w, 0.5, "waterfill")
        for a, b in zip(comp[1:], eager[1:]):
            assert torch.equal(a, b)
        torch.testing.assert_close(comp[0], eager[0])
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
