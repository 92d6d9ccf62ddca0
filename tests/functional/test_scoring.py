"""Properties of lrmoe.functional.scoring.score_pairs, against formulas evaluated in float64 NumPy."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lrmoe.functional import score_pairs

METRICS = ["lrm", "grad_l2", "grad_abs"]


def _np_reference(gates_TK, g_TD, phi_TK, metric):
    a = gates_TK.astype(np.float64)
    g = g_TD.astype(np.float64)
    phi = phi_TK.astype(np.float64)
    gsq = (g * g).sum(-1, keepdims=True)
    if metric == "lrm":
        return a * a * gsq * phi
    if metric == "grad_l2":
        return a * a * gsq
    return np.abs(a) * np.abs(g).sum(-1, keepdims=True)


# Moderate magnitudes: no fp32 overflow in intermediate products (overflow is covered separately).
_vals = st.floats(-30.0, 30.0, width=32, allow_subnormal=False)
_pos = st.floats(0.0, 30.0, width=32, allow_subnormal=False)


@st.composite
def score_cases(draw):
    T = draw(st.integers(0, 5))
    K = draw(st.integers(1, 4))
    D = draw(st.integers(1, 6))

    def arr(elems, shape):
        n = int(np.prod(shape))
        return np.array(draw(st.lists(elems, min_size=n, max_size=n)), dtype=np.float32).reshape(shape)

    return arr(_vals, (T, K)), arr(_vals, (T, D)), arr(_pos, (T, K))


@given(score_cases(), st.sampled_from(METRICS), st.sampled_from([torch.float32, torch.bfloat16, torch.float64]))
def test_scores_match_formula(case, metric, dtype):
    gates, g, phi = (torch.from_numpy(a).to(dtype) for a in case)
    out = score_pairs(gates, g, phi, metric=metric)
    assert out.dtype == torch.float32
    assert out.shape == gates.shape
    # Reference from the values the function actually received (bf16-rounded when bf16), in float64.
    ref = _np_reference(*(t.double().numpy() for t in (gates, g, phi)), metric)
    np.testing.assert_allclose(out.numpy(), ref, rtol=2e-5, atol=1e-30)
    assert (out >= 0).all()


@given(score_cases(), st.sampled_from(METRICS + ["random"]), st.data())
def test_non_finite_inputs_give_inf_for_affected_pairs_only(case, metric, data):
    gates, g, phi = (a.copy() for a in case)
    T, K = gates.shape
    if T == 0:
        return
    bad = st.sampled_from([np.nan, np.inf, -np.inf])
    affected = np.zeros((T, K), dtype=bool)
    for _ in range(data.draw(st.integers(1, 3))):
        where = data.draw(st.sampled_from(["gate", "grad", "phi"]))
        t = data.draw(st.integers(0, T - 1))
        if where == "gate":
            k = data.draw(st.integers(0, K - 1))
            gates[t, k] = data.draw(bad)
            affected[t, k] = True
        elif where == "phi":
            k = data.draw(st.integers(0, K - 1))
            phi[t, k] = data.draw(bad)
            affected[t, k] = True
        else:  # a bad gradient entry poisons every pair of that token
            g[t, data.draw(st.integers(0, g.shape[1] - 1))] = data.draw(bad)
            affected[t, :] = True
    gen = torch.Generator().manual_seed(0)
    out = score_pairs(
        torch.from_numpy(gates), torch.from_numpy(g), torch.from_numpy(phi), metric=metric, generator=gen
    ).numpy()
    assert np.all(out[affected] == np.inf)
    assert np.all(np.isfinite(out[~affected]))
    if metric != "random":
        with np.errstate(all="ignore"):  # the reference multiplies the poisoned entries too
            ref = _np_reference(gates, g, phi, metric)
        np.testing.assert_allclose(out[~affected], ref[~affected], rtol=2e-5, atol=1e-30)


def test_overflowing_product_is_inf():
    gates = torch.tensor([[1e20, 1.0]])
    g = torch.tensor([[1e10, 0.0]])
    phi = torch.tensor([[1.0, 2.0]])
    out = score_pairs(gates, g, phi, metric="lrm")
    assert out[0, 0] == float("inf")
    assert out[0, 1] == pytest.approx(1e20 * 2.0, rel=1e-6)


@given(st.integers(0, 6), st.integers(1, 4), st.integers(0, 2**31 - 1))
def test_random_metric_is_uniform_and_reproducible(T, K, seed):
    gates, g, phi = torch.rand(T, K), torch.randn(T, 3), torch.rand(T, K)
    a = score_pairs(gates, g, phi, metric="random", generator=torch.Generator().manual_seed(seed))
    b = score_pairs(gates, g, phi, metric="random", generator=torch.Generator().manual_seed(seed))
    assert a.dtype == torch.float32 and a.shape == (T, K)
    assert torch.equal(a, b)
    assert ((a >= 0) & (a < 1)).all()


def test_random_metric_does_not_depend_on_inputs_and_varies_with_seed():
    gates, g, phi = torch.rand(64, 4), torch.randn(64, 3), torch.rand(64, 4)
    a = score_pairs(gates, g, phi, metric="random", generator=torch.Generator().manual_seed(1))
    b = score_pairs(gates * 7, g, phi, metric="random", generator=torch.Generator().manual_seed(1))
    c = score_pairs(gates, g, phi, metric="random", generator=torch.Generator().manual_seed(2))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    # 256 draws: mean of U[0, 1) within 5 standard errors of 1/2.
    assert abs(a.mean().item() - 0.5) < 5 * (1 / 12 / a.numel()) ** 0.5


def test_lrm_by_hand():
    # alpha = 0.5, ||g||^2 = 3^2 + 4^2 = 25, ||phi||^2 = 2 -> 0.25 * 25 * 2 = 12.5; grad_abs: 0.5 * 7 = 3.5.
    gates, g, phi = torch.tensor([[0.5]]), torch.tensor([[3.0, -4.0]]), torch.tensor([[2.0]])
    assert score_pairs(gates, g, phi).item() == 12.5
    assert score_pairs(gates, g, phi, metric="grad_l2").item() == 6.25
    assert score_pairs(gates, g, phi, metric="grad_abs").item() == 3.5


@pytest.mark.parametrize(
    "gates, g, phi, kwargs, exc, name",
    [
        (torch.rand(3, 2), torch.rand(4, 5), torch.rand(3, 2), {}, ValueError, "grad_out_TD"),
        (torch.rand(3, 2), torch.rand(3, 5), torch.rand(3, 3), {}, ValueError, "phi_sqnorm_TK"),
        (torch.rand(3, 2), torch.rand(3, 5), torch.rand(2, 3), {}, ValueError, "phi_sqnorm_TK"),
        (torch.rand(6), torch.rand(3, 5), torch.rand(6), {}, ValueError, "gates_TK"),
        (torch.rand(3, 2), torch.rand(3, 5, 1), torch.rand(3, 2), {}, ValueError, "grad_out_TD"),
        (torch.ones(3, 2, dtype=torch.int64), torch.rand(3, 5), torch.rand(3, 2), {}, TypeError, "gates_TK"),
        (torch.rand(3, 2), torch.rand(3, 5), torch.rand(3, 2), {"metric": "l1"}, ValueError, "metric"),
        (torch.rand(3, 2), torch.rand(3, 5, device="meta"), torch.rand(3, 2), {}, ValueError, "grad_out_TD on meta"),
    ],
)
def test_score_pairs_errors_name_the_argument(gates, g, phi, kwargs, exc, name):
    with pytest.raises(exc, match=name):
        score_pairs(gates, g, phi, **kwargs)
