"""lrmoe::gather_sum_rows and lrmoe::gather_dot_rows: torch.library.opcheck, values against a loop written from
the definition, gradients (gradcheck in fp64), gather_sum_rows' leading token dims, and argument errors;
lrmoe::gather_dot_scores (the router gradient with the pair scores) against the two ops it stands for."""

from __future__ import annotations

import pytest
import torch

from lrmoe.ops import gather_dot_rows, gather_dot_scores, gather_sum_rows, score_pairs

# (N source rows, C columns, rows [T, K]): repeats, skipped rows (-1), a token with every row skipped, K = 1 and 3.
CASES = [
    (6, 5, [[0, 5], [3, 3], [-1, 2], [-1, -1]]),
    (1, 1, [[0], [0], [-1]]),
    (9, 17, [[8, 1, 4], [0, -1, 7]]),
    (4, 3, []),
]


def _case(N, C, rows, dtype=torch.float64, index_dtype=torch.int64, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows_TK = torch.tensor(rows, dtype=index_dtype).reshape(len(rows), -1 if rows else 2)
    T, K = rows_TK.shape
    return (torch.randn(N, C, generator=g).to(dtype), rows_TK, torch.randn(T, K, generator=g).to(dtype),
            torch.randn(T, C, generator=g).to(dtype))


def _loop_sum(src, rows, w):
    out = torch.zeros(rows.shape[0], src.shape[1], dtype=torch.float64)
    for t in range(rows.shape[0]):
        for k in range(rows.shape[1]):
            if rows[t, k] >= 0:
                out[t] += (1.0 if w is None else float(w[t, k])) * src[rows[t, k]].double()
    return out


def _loop_dot(src, rows, g):
    out = torch.zeros(rows.shape, dtype=torch.float64)
    for t in range(rows.shape[0]):
        for k in range(rows.shape[1]):
            if rows[t, k] >= 0:
                out[t, k] = (g[t].double() * src[rows[t, k]].double()).sum()
    return out


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_opcheck(case, requires_grad, index_dtype):
    src, rows, w, g = _case(*case, index_dtype=index_dtype)
    src, w, g = (t.requires_grad_(requires_grad) for t in (src, w, g))
    torch.library.opcheck(gather_sum_rows, (src, rows, w))
    torch.library.opcheck(gather_sum_rows, (src, rows, None))
    torch.library.opcheck(gather_dot_rows, (src, rows, g))


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_values_match_the_definition(case, dtype):
    src, rows, w, g = _case(*case, dtype=dtype)
    tol = dict(rtol=1e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-6, atol=1e-6)
    got = gather_sum_rows(src, rows, w)
    assert got.dtype == dtype and got.shape == (rows.shape[0], src.shape[1])
    torch.testing.assert_close(got.double(), _loop_sum(src, rows, w), **tol)
    torch.testing.assert_close(gather_sum_rows(src, rows).double(), _loop_sum(src, rows, None), **tol)
    dot = gather_dot_rows(src, rows, g)
    assert dot.dtype == (torch.float64 if dtype == torch.float64 else torch.float32) and dot.shape == rows.shape
    torch.testing.assert_close(dot.double(), _loop_dot(src, rows, g), **tol)


# Leading token dims of gather_sum_rows: CASES[0]'s four tokens as [2, 2, K], and one token as [K].
LEADS = [(2, 2), (1, 4), ()]


@pytest.mark.parametrize("lead", LEADS)
@pytest.mark.parametrize("requires_grad", [False, True])
def test_gather_sum_rows_keeps_the_leading_dims(lead, requires_grad):
    src, rows, w, _ = _case(*CASES[0])
    n_tok = 1 if lead == () else 4
    rows, w = rows[:n_tok], w[:n_tok]
    rows_LK, w_LK = rows.reshape(*lead, 2), w.reshape(*lead, 2)
    src.requires_grad_(requires_grad), w_LK.requires_grad_(requires_grad)
    torch.library.opcheck(gather_sum_rows, (src, rows_LK, w_LK))
    torch.library.opcheck(gather_sum_rows, (src, rows_LK, None))
    got = gather_sum_rows(src, rows_LK, w_LK)
    # Written in that shape by the op: a tensor of its own, not a view of [T, C] rows.
    assert got.shape == (*lead, src.shape[1]) and got._base is None and got.is_contiguous()
    torch.testing.assert_close(got.reshape(n_tok, -1), _loop_sum(src, rows, w), rtol=1e-6, atol=1e-6)
    if requires_grad:
        assert torch.autograd.gradcheck(lambda s, w: gather_sum_rows(s, rows_LK, w), (src, w_LK))
        assert torch.autograd.gradcheck(lambda s: gather_sum_rows(s, rows_LK), (src,))


def test_gather_sum_rows_leading_dims_bad_arguments_are_named():
    src, rows, w, _ = _case(*CASES[0])
    with pytest.raises(ValueError, match=r"weights_TK must be a float tensor of shape \(2, 2, 2\)"):
        gather_sum_rows(src, rows.reshape(2, 2, 2), w)  # weights [T, K] for rows [2, 2, K]
    with pytest.raises(ValueError, match=r"rows_TK must be a \[\.\.\., K\]"):
        gather_sum_rows(src, rows[0, 0], None)  # 0-D rows
    with pytest.raises(ValueError, match="rows_TK must be a 2-D"):
        gather_dot_rows(src, rows.reshape(2, 2, 2), torch.randn(4, src.shape[1], dtype=src.dtype))


def test_skipped_rows_do_not_read_their_source():
    # Row 0 holds inf and NaN; a skipped entry (-1) must not turn into 0 * inf = NaN.
    src = torch.tensor([[float("inf"), float("nan")], [1.0, 2.0]])
    rows = torch.tensor([[-1, 1]])
    assert torch.equal(gather_sum_rows(src, rows, torch.ones(1, 2)), torch.tensor([[1.0, 2.0]]))
    assert torch.equal(gather_dot_rows(src, rows, torch.ones(1, 2)), torch.tensor([[0.0, 3.0]]))


@pytest.mark.parametrize("case", CASES[:3])
def test_gradients(case):
    src, rows, w, g = _case(*case)
    src.requires_grad_(), w.requires_grad_(), g.requires_grad_()
    assert torch.autograd.gradcheck(lambda s, w: gather_sum_rows(s, rows, w), (src, w))
    assert torch.autograd.gradcheck(lambda s: gather_sum_rows(s, rows), (src,))
    assert torch.autograd.gradcheck(lambda s, g: gather_dot_rows(s, rows, g), (src, g))


def test_bad_arguments_are_named():
    src, rows, w, g = _case(*CASES[0])
    with pytest.raises(ValueError, match="src_NC"):
        gather_sum_rows(src[0], rows, w)
    with pytest.raises(ValueError, match="rows_TK"):
        gather_sum_rows(src, rows.float(), w)
    with pytest.raises(ValueError, match="weights_TK"):
        gather_sum_rows(src, rows, w[:, :1])
    with pytest.raises(ValueError, match="g_TC"):
        gather_dot_rows(src, rows, g[:, :2])


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("metric", ["lrm", "grad_l2", "grad_abs"])
def test_gather_dot_scores_is_the_router_gradient_and_the_scores(case, metric):
    src, rows, w, g = _case(*case, dtype=torch.float32)
    phi_sq = w.abs() * 2
    if rows.shape[0]:
        w[0, 0] = float("nan")  # a non-finite gate: that pair's score is +inf, as score_pairs gives it
    torch.library.opcheck(gather_dot_scores, (src, rows, g, w, phi_sq, metric))
    dot, scores = gather_dot_scores(src, rows, g, w, phi_sq, metric)
    assert torch.equal(dot, gather_dot_rows(src, rows, g))
    assert torch.equal(scores, score_pairs(w, g, phi_sq, metric))
    assert rows.shape[0] == 0 or scores[0, 0] == float("inf")
    assert not dot.requires_grad and not scores.requires_grad
    # Forward only: inputs that require grad give outputs that do not (the layers call it in their backward).
    dot, _ = gather_dot_scores(src.requires_grad_(), rows, g, w, phi_sq, metric)
    assert not dot.requires_grad


def test_gather_dot_scores_bad_arguments_are_named():
    src, rows, w, g = _case(*CASES[0])
    with pytest.raises(ValueError, match="metric must be one of .* for lrmoe::gather_dot_scores; got 'random'"):
        gather_dot_scores(src, rows, g, w, w, "random")
    with pytest.raises(ValueError, match="gates_TK"):
        gather_dot_scores(src, rows, g, w[:, :1], w, "lrm")
    with pytest.raises(ValueError, match="phi_sq_TK"):
        gather_dot_scores(src, rows, g, w, w.long(), "lrm")
    with pytest.raises(ValueError, match="g_TC"):
        gather_dot_scores(src, rows, g[:, :2], w, w, "lrm")
