"""Properties of lrmoe.functional.routing: route_topk and expert_loads.

References are NumPy: softmax/sigmoid in float64, and the choice checked against the returned fp32 scores plus
the bias added in fp32 (the same IEEE operation the router performs), so ties cannot make the check flaky.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from cuda_sync import no_host_sync
from hypothesis import given
from hypothesis import strategies as st

from lrmoe.functional import Routing, expert_loads, plan_experts, route_topk, router_logits

# ------------------------------------------------------------------------------------------------ references


def _np_scores(logits_TE: np.ndarray, score_func: str) -> np.ndarray:
    x = logits_TE.astype(np.float64)
    if score_func == "softmax":
        z = np.exp(x - x.max(-1, keepdims=True))
        return z / z.sum(-1, keepdims=True)
    return 1.0 / (1.0 + np.exp(-x))


def _np_gates(scores64_TE, ids_TK, norm_topk_prob, scaling):
    g = np.take_along_axis(scores64_TE, ids_TK, axis=1)
    if norm_topk_prob:
        g = g / g.sum(-1, keepdims=True)
    return g * scaling


def _check_topk_choice(choice_TE: np.ndarray, ids_TK: np.ndarray, allowed_TE: np.ndarray | None = None):
    """Tie-robust top-k check: every chosen value >= every unchosen (allowed) value, ids distinct,
    and listed in non-increasing order of the choice value."""
    T, E = choice_TE.shape
    for t in range(T):
        ids = ids_TK[t].tolist()
        assert len(set(ids)) == len(ids), f"token {t}: repeated expert ids {ids}"
        assert all(0 <= i < E for i in ids)
        chosen = choice_TE[t, ids]
        assert np.all(np.diff(chosen) <= 0), f"token {t}: ids not ordered by biased score {chosen}"
        pool = [e for e in range(E) if e not in ids and (allowed_TE is None or allowed_TE[t, e])]
        if pool:
            assert chosen.min() >= choice_TE[t, pool].max(), f"token {t}: {ids} is not a top-k of {choice_TE[t]}"


# ------------------------------------------------------------------------------------------------ strategies


@st.composite
def routing_cases(draw):
    T = draw(st.integers(1, 6))
    E = draw(st.integers(1, 9))
    k = draw(st.integers(1, E))
    tied = draw(st.booleans())
    if tied:  # many exact ties: the choice must still be a valid top-k with distinct ids
        vals = st.sampled_from([-2.0, 0.0, 0.0, 1.0, 3.0])
        logits = np.array(draw(st.lists(vals, min_size=T * E, max_size=T * E)), dtype=np.float32).reshape(T, E)
    else:
        seed = draw(st.integers(0, 2**31 - 1))
        logits = (np.random.default_rng(seed).standard_normal((T, E)) * 3).astype(np.float32)
    score_func = draw(st.sampled_from(["softmax", "sigmoid"]))
    use_bias = draw(st.booleans())
    bias = None
    if use_bias:
        bias = np.array(
            draw(st.lists(st.floats(-1.0, 1.0, width=32), min_size=E, max_size=E)), dtype=np.float32
        )
    norm = draw(st.booleans())
    scaling = draw(st.sampled_from([1.0, 2.5, 0.3]))
    return logits, k, score_func, bias, norm, scaling


@st.composite
def grouped_cases(draw):
    n_group = draw(st.integers(1, 4))
    group_size = draw(st.integers(1, 4))
    E = n_group * group_size
    topk_group = draw(st.integers(1, n_group))
    k = draw(st.integers(1, topk_group * group_size))
    T = draw(st.integers(1, 5))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((T, E)) * 3).astype(np.float32)
    bias = (rng.standard_normal(E) * 0.1).astype(np.float32) if draw(st.booleans()) else None
    score_func = draw(st.sampled_from(["softmax", "sigmoid"]))
    return logits, k, score_func, bias, n_group, topk_group


# ------------------------------------------------------------------------------------------------ properties


@given(routing_cases())
def test_route_topk_matches_numpy_reference(case):
    logits, k, score_func, bias, norm, scaling = case
    T, E = logits.shape
    r = route_topk(
        torch.from_numpy(logits),
        k,
        score_func=score_func,
        bias_E=None if bias is None else torch.from_numpy(bias),
        norm_topk_prob=norm,
        scaling=scaling,
    )
    assert isinstance(r, Routing)
    assert r.expert_ids.shape == (T, k) and r.expert_ids.dtype == torch.int64
    assert r.gates.shape == (T, k) and r.gates.dtype == torch.float32
    assert r.scores.shape == (T, E) and r.scores.dtype == torch.float32

    scores64 = _np_scores(logits, score_func)
    np.testing.assert_allclose(r.scores.numpy(), scores64, rtol=1e-5, atol=1e-7)

    # The choice: top-k of scores (+ bias). The bias is added in fp32, as the router does.
    choice = r.scores.numpy() if bias is None else r.scores.numpy() + bias
    ids = r.expert_ids.numpy()
    _check_topk_choice(choice, ids)

    # Gates never see the bias: unbiased scores of the chosen experts, renormalised, scaled.
    np.testing.assert_allclose(r.gates.numpy(), _np_gates(scores64, ids, norm, scaling), rtol=1e-5, atol=1e-7)


@given(grouped_cases())
def test_group_limited_routing_matches_brute_force(case):
    logits, k, score_func, bias, n_group, topk_group = case
    T, E = logits.shape
    gs = E // n_group
    r = route_topk(
        torch.from_numpy(logits),
        k,
        score_func=score_func,
        bias_E=None if bias is None else torch.from_numpy(bias),
        n_group=n_group,
        topk_group=topk_group,
    )
    choice = r.scores.numpy() if bias is None else r.scores.numpy() + bias
    ids = r.expert_ids.numpy()
    for t in range(T):
        groups = choice[t].reshape(n_group, gs)
        top2 = -np.sort(-groups, axis=1)[:, : min(2, gs)]
        gscore = top2[:, 0] + (top2[:, 1] if gs > 1 else 0)
        allowed_groups = set(np.argsort(-gscore, kind="stable")[:topk_group].tolist())
        chosen_groups = {int(e) // gs for e in ids[t]}
        assert len(chosen_groups) <= topk_group
        assert chosen_groups <= allowed_groups, f"token {t}: groups {chosen_groups} not in {allowed_groups}"
        allowed = np.array([e // gs in allowed_groups for e in range(E)])
        _check_topk_choice(choice[t : t + 1], ids[t : t + 1], allowed[None])
    np.testing.assert_allclose(
        r.gates.numpy(), _np_gates(_np_scores(logits, score_func), ids, True, 1.0), rtol=1e-5, atol=1e-7
    )


def test_group_limited_routing_excludes_best_expert_of_a_weak_group():
    # Group 0 = experts {0, 1}: one very strong expert, one very weak. Group 1 = {2, 3}: two good ones.
    # Group scores (sum of best two) favour group 1, so expert 0 must not be chosen despite the best logit.
    logits = torch.tensor([[5.0, -20.0, 4.0, 4.0]])
    r = route_topk(logits, 2, score_func="sigmoid", n_group=2, topk_group=1)
    assert sorted(r.expert_ids[0].tolist()) == [2, 3]
    plain = route_topk(logits, 2, score_func="sigmoid")
    assert 0 in plain.expert_ids[0].tolist()


def test_group_limited_routing_breaks_group_ties_to_the_lower_group():
    # One expert a group (experts 0 and 3 tie): torch.topk of the group ratings picked group 3 on CPU, where the
    # docs promise the lower id, as for experts.
    assert route_topk(torch.tensor([[1.0, -2.0, -1.0, 1.0]]), 1, n_group=4, topk_group=1).expert_ids.tolist() == [[0]]
    # Four groups of two; groups 1 and 3 rate 1.0 alike (sigmoid(0) + sigmoid(0), sigmoid(-1) + sigmoid(1)) below
    # groups 2 and 0: three groups kept, so 0, 1 and 2, and the five best experts of those (group 3 instead would
    # bring expert 7, sigmoid(1), into the choice).
    logits = torch.tensor([[2.0, -1.0, 0.0, 0.0, 2.0, 1.0, -1.0, 1.0]])
    r = route_topk(logits, 5, score_func="sigmoid", n_group=4, topk_group=3)
    assert r.expert_ids.tolist() == [[0, 4, 5, 2, 3]]


def test_sigmoid_gates_of_underflowing_scores_are_finite_as_in_transformers():
    # Sigmoid scores that underflow (logit -200: exactly 0 in fp32) or nearly so (-60: ~1e-26). transformers'
    # DeepSeek-V3 / GLM-4.5 routers divide by sum + 1e-20: gates 0 and ~s / 1e-20, never NaN.
    logits = torch.tensor([[-200.0, -200.0, -300.0, -250.0], [-60.0, -61.0, -200.0, -200.0]])
    r = route_topk(logits, 2, score_func="sigmoid")
    assert torch.isfinite(r.gates).all()
    s = torch.sigmoid(logits).gather(1, r.expert_ids)
    torch.testing.assert_close(r.gates, s / (s.sum(-1, keepdim=True) + 1e-20), rtol=1e-6, atol=0)
    assert r.gates[0].eq(0).all() and r.gates[1].gt(0).all()


def test_bias_changes_choice_not_gates():
    torch.manual_seed(0)
    logits = torch.randn(7, 6)
    bias = torch.zeros(6)
    bias[4] = 100.0  # expert 4 wins every token's first slot
    r = route_topk(logits, 2, bias_E=bias, norm_topk_prob=False)
    assert (r.expert_ids[:, 0] == 4).all()
    scores64 = _np_scores(logits.numpy(), "softmax")
    np.testing.assert_allclose(r.gates[:, 0].numpy(), scores64[:, 4], rtol=1e-6)
    # A constant bias changes nothing at all.
    base = route_topk(logits, 3)
    shifted = route_topk(logits, 3, bias_E=torch.full((6,), 0.25))
    assert torch.equal(base.expert_ids, shifted.expert_ids)
    torch.testing.assert_close(base.gates, shifted.gates)


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_k_equals_E_and_single_token(score_func):
    torch.manual_seed(1)
    logits = torch.randn(1, 5)
    r = route_topk(logits, 5, score_func=score_func, norm_topk_prob=True)
    assert sorted(r.expert_ids[0].tolist()) == [0, 1, 2, 3, 4]
    torch.testing.assert_close(r.gates.sum(), torch.tensor(1.0))
    if score_func == "softmax":  # all experts chosen and renormalised: gates are the probabilities themselves
        torch.testing.assert_close(r.gates[0], r.scores[0, r.expert_ids[0]])


@given(routing_cases())
def test_gate_gradient_matches_fixed_choice_reference(case):
    logits, k, score_func, bias, norm, scaling = case
    x = torch.from_numpy(logits).double().requires_grad_(True)
    r = route_topk(
        x, k, score_func=score_func, bias_E=None if bias is None else torch.from_numpy(bias),
        norm_topk_prob=norm, scaling=scaling,
    )
    w = torch.linspace(-1, 1, r.gates.numel(), dtype=torch.float32).reshape(r.gates.shape)
    (gx,) = torch.autograd.grad((r.gates * w).sum(), x)

    x_ref = torch.from_numpy(logits).double().requires_grad_(True)
    s = x_ref.softmax(-1) if score_func == "softmax" else x_ref.sigmoid()
    g = s.gather(1, r.expert_ids)
    if norm:
        g = g / g.sum(-1, keepdim=True)
    (gx_ref,) = torch.autograd.grad((g * scaling * w.double()).sum(), x_ref)
    torch.testing.assert_close(gx, gx_ref, rtol=1e-4, atol=1e-6)


@given(st.integers(1, 8), st.integers(1, 6), st.integers(0, 2**31 - 1))
def test_expert_loads_is_bincount(T, E, seed):
    ids = torch.from_numpy(np.random.default_rng(seed).integers(0, E, size=(T, min(E, 3))))
    loads = expert_loads(ids, E)
    assert loads.dtype == torch.int64
    np.testing.assert_array_equal(loads.numpy(), np.bincount(ids.numpy().ravel(), minlength=E))


@pytest.mark.parametrize("dtype", [torch.int16, torch.uint8, torch.int32])
def test_expert_loads_and_plans_take_any_integer_ids(dtype):
    # scatter_add_ takes int64 indices only: int16 and uint8 ids raised inside expert_loads (and plan_experts).
    ids = torch.tensor([[0, 3], [2, 3], [1, 3]])
    assert expert_loads(ids.to(dtype), 4).tolist() == [1, 1, 1, 3]
    got, want = plan_experts(ids.to(dtype), 4, retain=0.5), plan_experts(ids, 4, retain=0.5)
    assert torch.equal(got.quotas, want.quotas) and torch.equal(got.loads, want.loads)


@pytest.mark.parametrize(
    "ids, E, exc, name",
    [
        (torch.zeros(3, 2, dtype=torch.int64), 0, ValueError, "num_experts"),
        (torch.zeros(3, 2, dtype=torch.int64), 2.5, ValueError, "num_experts"),
        (torch.zeros(3, 2, dtype=torch.int64), True, ValueError, "num_experts"),
        (torch.zeros(3, 2), 4, TypeError, "expert_ids"),
    ],
)
def test_expert_loads_errors_name_the_argument(ids, E, exc, name):
    with pytest.raises(exc, match=name):
        expert_loads(ids, E)


_IDS = torch.tensor([[0, 1], [2, 3], [1, 2]])


@pytest.mark.parametrize(
    "args, kwargs, exc, name",
    [
        # 1-D ids would broadcast against source_ids_T into loads of more pairs than the tokens route.
        ((torch.tensor([3, 2, 0, 2, 2]), 4), {"retain": 0.5, "source_ids_T": torch.zeros(5, dtype=torch.int64)},
         ValueError, "expert_ids_TK"),
        ((_IDS.float(), 4), {}, TypeError, "expert_ids_TK"),
        ((_IDS, 0), {}, ValueError, "num_experts"),
        ((_IDS, 4.0), {}, ValueError, "num_experts"),
        ((_IDS, 4), {"selection": "x"}, ValueError, "selection"),
        ((_IDS, 4), {"retain": 0.5, "generator": 3}, TypeError, "generator must be a torch.Generator"),
    ],
)
def test_plan_experts_errors_name_the_argument(args, kwargs, exc, name):
    with pytest.raises(exc, match=name):
        plan_experts(*args, **kwargs)


# ------------------------------------------------------------------------------------------------ errors

_L = torch.randn(3, 8)


@pytest.mark.parametrize(
    "args, kwargs, exc, name",
    [
        ((_L, 9), {}, ValueError, "top_k"),
        ((_L, 0), {}, ValueError, "top_k"),
        ((_L, -1), {}, ValueError, "top_k"),
        ((_L, 2.0), {}, ValueError, "top_k"),
        ((_L, True), {}, ValueError, "top_k"),
        ((torch.randn(8), 2), {}, ValueError, "logits_TE"),
        ((torch.randn(2, 3, 8), 2), {}, ValueError, "logits_TE"),
        ((torch.zeros(3, 8, dtype=torch.int64), 2), {}, TypeError, "logits_TE"),
        ((_L.tolist(), 2), {}, TypeError, "logits_TE"),
        ((_L, 2), {"bias_E": torch.zeros(7)}, ValueError, "bias_E"),
        ((_L, 2), {"bias_E": torch.zeros(1, 8)}, ValueError, "bias_E"),
        ((_L, 2), {"bias_E": torch.zeros(8, dtype=torch.int64)}, TypeError, "bias_E"),
        ((_L, 2), {"score_func": "tanh"}, ValueError, "score_func"),
        ((_L, 2), {"n_group": 3, "topk_group": 1}, ValueError, "n_group"),
        ((_L, 2), {"n_group": 0, "topk_group": 1}, ValueError, "n_group"),
        ((_L, 2), {"n_group": 4}, ValueError, "topk_group"),
        ((_L, 2), {"n_group": 4, "topk_group": 5}, ValueError, "topk_group"),
        ((_L, 2), {"n_group": 4, "topk_group": 0}, ValueError, "topk_group"),
        ((_L, 5), {"n_group": 4, "topk_group": 2}, ValueError, "top_k"),
        ((_L, 2), {"n_group": 2.0, "topk_group": 1}, ValueError, "n_group"),
        ((_L, 2), {"scaling": 0.0}, ValueError, "scaling"),
        ((_L, 2), {"scaling": -1.0}, ValueError, "scaling"),
        ((_L, 2), {"scaling": float("inf")}, ValueError, "scaling"),
        ((_L, 2), {"scaling": float("nan")}, ValueError, "scaling"),
        ((_L, 2), {"scaling": True}, ValueError, "scaling"),
    ],
)
def test_route_topk_errors_name_the_argument(args, kwargs, exc, name):
    with pytest.raises(exc, match=name):
        route_topk(*args, **kwargs)


# ------------------------------------------------------------------------------------------------ router_logits


def _bf16_pair(T, D, E, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=gen).bfloat16()
    w = (torch.randn(E, D, generator=gen) / D**0.5).bfloat16()
    return x, w


def _assert_fp32_logits(got, x, w):
    """Products of bf16 numbers are exact in fp32, so fp32 logits of bf16 x, w equal the float64 product up to fp32
    summation error (bounded by (D + 1) * 2^-24 * sum |x w|); bf16 logits miss by ~2^-9 of each logit."""
    assert got.dtype == torch.float32 and got.shape == (x.shape[0], w.shape[0])
    x64, w64 = x.double().cpu(), w.double().cpu()
    bound = (x.shape[1] + 1) * 2.0**-24 * (x64.abs() @ w64.abs().t()) + 1e-30
    assert bool(((got.double().cpu() - x64 @ w64.t()).abs() <= bound).all())


def _assert_fp32_backward(gx, gw, x, w, g):
    """Gradients equal to an fp32 backward's through fp32 copies (transformers' GLM router): within one bf16 ulp of
    the float64 gradient, plus fp32 summation error (n * 2^-24 * sum |g x|, n the summed length)."""
    assert gx.dtype == gw.dtype == torch.bfloat16
    g64, x64, w64 = g.double().cpu(), x.double().cpu(), w.double().cpu()
    T, E = g.shape
    for got, want, sums in ((gx, g64 @ w64, 3 * E * 2.0**-24 * (g64.abs() @ w64.abs())),
                            (gw, g64.t() @ x64, (T + 3) * 2.0**-24 * (g64.abs().t() @ x64.abs()))):
        ulp = torch.where(want == 0, 2.0**-133, 2.0 ** (torch.floor(torch.log2(want.abs())) - 7))
        assert bool(((got.double().cpu() - want).abs() <= ulp + sums + 1e-30).all())


@given(T=st.integers(1, 40), D=st.integers(1, 96), E=st.integers(1, 24), seed=st.integers(0, 2**16))
def test_router_logits_fp32_from_bf16_is_the_fp32_product(T, D, E, seed):
    x, w = _bf16_pair(T, D, E, seed)
    _assert_fp32_logits(router_logits(x, w, torch.float32), x, w)


@given(T=st.integers(1, 40), D=st.integers(1, 96), E=st.integers(1, 24), seed=st.integers(0, 2**16))
def test_router_logits_fp32_gradients_match_an_fp32_backward(T, D, E, seed):
    x, w = _bf16_pair(T, D, E, seed)
    g = torch.randn(T, E, generator=torch.Generator().manual_seed(seed + 1))
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    _assert_fp32_backward(*torch.autograd.grad(router_logits(xr, wr, torch.float32), (xr, wr), g), x, w, g)


def test_router_logits_fp32_gradient_keeps_the_fp32_gradients_low_bits():
    """The backward keeps all 24 bits of the fp32 gradient: with g = (1 + 2^-9 + 2^-20, -1 - 2^-9) on two equal
    weight rows the input gradient is 2^-20 * w, which the first bf16 part of g alone (1, -1) or the first two
    (1 + 2^-9, -1 - 2^-9) would make 0."""
    w = torch.tensor([[1.0, -2.0, 0.5], [1.0, -2.0, 0.5]]).bfloat16().requires_grad_()
    x = torch.tensor([[0.25, 1.0, -3.0]]).bfloat16().requires_grad_()
    g = torch.tensor([[1.0 + 2.0**-9 + 2.0**-20, -1.0 - 2.0**-9]])
    gx, gw = torch.autograd.grad(router_logits(x, w, torch.float32), (x, w), g)
    torch.testing.assert_close(gx.float(), 2.0**-20 * w.detach().float()[:1], rtol=0, atol=0)
    torch.testing.assert_close(gw, (g.double().t() @ x.detach().double()).bfloat16(), rtol=0, atol=0)


def test_router_logits_other_dtypes_are_a_linear_of_copies():
    x, w = _bf16_pair(8, 16, 4, 0)
    torch.testing.assert_close(router_logits(x, w), torch.nn.functional.linear(x, w), rtol=0, atol=0)
    torch.testing.assert_close(router_logits(x, w, torch.bfloat16), torch.nn.functional.linear(x, w), rtol=0, atol=0)
    got = router_logits(x.half(), w.half(), torch.float32)  # fp16: no split (its low part could underflow)
    torch.testing.assert_close(got, torch.nn.functional.linear(x.float(), w.float()), rtol=0, atol=0)
    got = router_logits(x.float(), w.float(), torch.float64)
    assert got.dtype == torch.float64


def test_router_logits_compiles_fullgraph_and_matches_eager():
    x, w = _bf16_pair(24, 32, 8, 3)
    g = torch.randn(24, 8)

    def step(fn):
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        logits = fn(xr, wr, torch.float32)
        return (logits, *torch.autograd.grad(logits, (xr, wr), g))

    torch._dynamo.reset()
    for got, want in zip(step(torch.compile(router_logits, fullgraph=True)), step(router_logits)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "args, exc, name",
    [
        ((torch.zeros(4), torch.zeros(2, 4)), ValueError, "x_TD"),
        ((torch.zeros(3, 4, dtype=torch.int64), torch.zeros(2, 4)), TypeError, "x_TD"),
        ((torch.zeros(3, 4), torch.zeros(2, 5)), ValueError, "weight_ED"),
        ((torch.zeros(3, 4), torch.zeros(2, 4), torch.int32), TypeError, "dtype"),
        ((torch.zeros(3, 4), torch.zeros(2, 4), "float32"), TypeError, "dtype"),
        ((torch.zeros(3, 4), torch.zeros(2, 4, dtype=torch.float64)), TypeError, "weight_ED"),
    ],
)
def test_router_logits_errors_name_the_argument(args, exc, name):
    with pytest.raises(exc, match=name):
        router_logits(*args)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("compiled", [False, True])
def test_cuda_fp32_router_logits_from_bf16_and_never_sync(compiled):
    """On CUDA the logits and the backward's three parts run as bf16 GEMMs with fp32 accumulation (torch.mm's
    out_dtype) where the CPU multiplies fp32 copies: the same bounds against float64, and no host synchronisation."""
    import lrmoe.functional.routing as routing_module

    assert routing_module._MM_OUT_DTYPE  # the tensor-core path is what runs here
    torch._dynamo.reset()
    x, w = _bf16_pair(512, 256, 64, 0)
    g = torch.randn(512, 64, generator=torch.Generator().manual_seed(1))
    xc, wc, gc = x.cuda(), w.cuda(), g.cuda()
    fn = torch.compile(router_logits, fullgraph=True) if compiled else router_logits

    def step():
        xr, wr = xc.clone().requires_grad_(), wc.clone().requires_grad_()
        logits = fn(xr, wr, torch.float32)
        return (logits, *torch.autograd.grad(logits, (xr, wr), gc))

    step()  # first call: lazy initialisation and compilation may synchronise
    with no_host_sync():
        logits, gx, gw = step()
    _assert_fp32_logits(logits, x, w)
    _assert_fp32_backward(gx, gw, x, w, g)


def test_router_logits_keep_the_dtype_asked_for_under_autocast():
    # router_dtype=torch.float32 promises logits of fp32 copies; autocast would otherwise run the linear in bf16.
    x, w = torch.randn(6, 8), torch.randn(4, 8)
    want = router_logits(x, w, torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = router_logits(x, w, torch.float32)
        plain = router_logits(x, w)  # no dtype: a plain linear, which autocasts
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert plain.dtype == torch.bfloat16


@pytest.mark.parametrize("bad", [-1, 8, 13])
def test_expert_loads_refuses_ids_out_of_range_on_cpu(bad):
    ids = torch.tensor([[0, 7], [bad, 3]])
    with pytest.raises(ValueError, match=rf"expert_ids must be in \[0, num_experts=8\), got ids from {min(bad, 0)}"):
        expert_loads(ids, 8)
