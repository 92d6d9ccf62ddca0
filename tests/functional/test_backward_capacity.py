"""``backward_capacity``: the plan keeps at most C pairs per expert, handing what a capped expert cannot keep to the
others, and the selective backward on E zero-padded blocks of C rows with batched GEMMs gives the gradients of
the grouped backward with the same kept pairs."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from lrmoe.functional.experts import (
    ExpertPlan,
    backward_capacity_rows,
    plan_experts,
    retained_rows_bound,
    selective_swiglu_experts,
)
from lrmoe.functional.retained_rows import pad_to_blocks
from lrmoe.nn import LRMoE


def _problem(T, D, F, E, K, skew, seed, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=gen) + skew * torch.linspace(0, 3, E)  # skew > 0: hot last experts
    gates, ids = logits.softmax(-1).topk(K, dim=-1)
    x = torch.randn(T, D, generator=gen, dtype=dtype)
    w_gu = torch.randn(E, 2 * F, D, generator=gen, dtype=dtype) / D**0.5
    w_d = torch.randn(E, D, F, generator=gen, dtype=dtype) / F**0.5
    return x, w_gu, w_d, ids, gates.to(dtype)


def _grads(x, w_gu, w_d, ids, gates, g, **kw):
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, w_gu, w_d, gates)]
    out = selective_swiglu_experts(leaves[0], leaves[1], leaves[2], ids, leaves[3], **kw)
    out.backward(g)
    return [out.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("selection", ["top", "sample"])
@pytest.mark.parametrize("activations", ["save", "recompute", "offload"])
@pytest.mark.parametrize("skew, factor", [(0.0, 3.0), (2.0, 1.0)])
def test_blocked_backward_equals_the_grouped_one_with_the_clamped_plan(selection, activations, skew, factor):
    # A plan made without the capacity, given to the blocked backward, is clamped to C there. skew 0 with a roomy
    # factor: no quota reaches C, the plans are the same. skew 2 with factor 1: the hot experts' quotas are
    # clamped, and the grouped backward is given the same clamped plan.
    T, D, F, E, K, retain = 48, 16, 12, 6, 2, 0.5
    x, w_gu, w_d, ids, gates = _problem(T, D, F, E, K, skew, seed=3)
    g = torch.randn(T, D, dtype=x.dtype, generator=torch.Generator().manual_seed(4))
    plan = plan_experts(ids, E, retain=retain, selection=selection, generator=torch.Generator().manual_seed(5))
    cap = backward_capacity_rows(T, K, E, retain, factor)
    clamped = ExpertPlan(loads=plan.loads, quotas=plan.quotas.clamp(max=cap), uniform=plan.uniform)
    assert bool((plan.quotas > cap).any()) == (skew > 0)  # the two cases are the ones the comment names
    kw = dict(retain=retain, selection=selection, activations=activations)
    want = _grads(x, w_gu, w_d, ids, gates, g, plan=clamped, **kw)
    got = _grads(x, w_gu, w_d, ids, gates, g, plan=plan, backward_capacity=factor, **kw)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@given(T=st.integers(1, 60), E=st.integers(1, 12), K=st.integers(1, 4), retain=st.floats(0.05, 0.95),
       factor=st.floats(1.0, 3.0), skew=st.floats(0.0, 4.0), min_retain=st.sampled_from([0.0, 0.02]),
       seed=st.integers(0, 2**16))
def test_plan_keeps_at_most_c_per_expert_and_hands_the_rest_on(T, E, K, retain, factor, skew, min_retain, seed):
    K = min(K, E)
    assume(min_retain > 0 or retain * T * K >= 1)  # a budget of 0 pairs is refused (tests/nn/test_user_traps.py)
    _, _, _, ids, _ = _problem(T, 4, 4, E, K, skew, seed)
    plain = plan_experts(ids, E, retain=retain, min_retain=min_retain, selection="top")
    plan = plan_experts(ids, E, retain=retain, min_retain=min_retain, selection="top", backward_capacity=factor)
    cap = backward_capacity_rows(T, K, E, retain, factor)
    assert torch.equal(plan.loads, plain.loads)
    assert bool((plan.quotas >= 0).all() and (plan.quotas <= plan.loads).all() and (plan.quotas <= cap).all())
    # No pair wasted: the budget, or all the capacities hold, or the floors where they alone exceed the budget.
    # floor(retain * P), a product that lands within rounding of an integer counted as that integer: in double
    # 0.3333333333333333 * 75 is 24.999999999999996 in Python and 25.0 in torch, which the plan computes in.
    budget = math.floor(retain * T * K + 1e-9)
    floors = torch.minimum((plan.loads.double() * min_retain - 1e-6).ceil().clamp(min=0).long(), plan.loads)
    hold = int(plan.loads.clamp(max=cap).sum())
    assert int(plan.quotas.sum()) == max(min(budget, hold), int(floors.clamp(max=cap).sum()))
    if bool((plain.quotas <= cap).all()):  # a capacity that binds nowhere changes nothing
        assert torch.equal(plan.quotas, plain.quotas)


def test_layer_plans_clamped_quotas_and_counts_the_kept_pairs():
    torch.manual_seed(0)
    T, D, F, E, K, retain, factor = 64, 16, 12, 8, 2, 0.75, 1.0
    layer = LRMoE(D, F, E, K, retain=retain, selection="top", backward_capacity=factor)
    assert "backward_capacity=1.0" in repr(layer) and "quota_align" not in repr(layer)  # only options set show
    with torch.no_grad():  # route most tokens to expert 0, so that its quota would pass C
        layer.gate.weight[0] = 0.0
        layer.gate.weight[0, 0] = 20.0
    x = torch.randn(T, D)
    x[:, 0] = x[:, 0].abs() + 1.0
    layer(x).sum().backward()
    stats = layer.stats()
    cap = backward_capacity_rows(T, K, E, retain, factor)
    assert int(stats.loads[0]) > cap and int(stats.quotas.max()) == cap  # clamped where the plan wanted more
    assert bool((stats.quotas <= stats.loads).all())
    # The probe counts the pairs kept, not the padded rows: the plan's total, all the capacities can hold here.
    kept = layer._stats_probe.totals()["retained_pairs"]
    assert int(kept) == int(stats.quotas.sum()) == int(stats.loads.clamp(max=cap).sum()) < math.floor(retain * T * K)


@given(counts=st.lists(st.integers(0, 5), min_size=1, max_size=6), tail=st.integers(0, 4), extra=st.integers(0, 3))
def test_pad_to_blocks_puts_each_group_first_in_its_block(counts, tail, extra):
    cap = max(counts) + extra
    if cap == 0:
        cap = 1
    n_rows = sum(counts) + tail
    pair_R = torch.cat([torch.randperm(100)[: sum(counts)], torch.full((tail,), -1)])
    weight_R = torch.cat([torch.rand(sum(counts)) + 0.5, torch.zeros(tail)])
    offsets_E = torch.tensor(counts).cumsum(0).int()
    pair_B, weight_B, off_B = pad_to_blocks(pair_R, weight_R, offsets_E, cap)
    assert pair_B.shape == weight_B.shape == (len(counts) * cap,) and n_rows == pair_R.shape[0]
    assert off_B.tolist() == [cap * (e + 1) for e in range(len(counts))] and off_B.dtype == torch.int32
    start = 0
    for e, n in enumerate(counts):
        block = slice(e * cap, (e + 1) * cap)
        assert pair_B[block][:n].tolist() == pair_R[start:start + n].tolist()
        assert torch.equal(weight_B[block][:n], weight_R[start:start + n])
        assert (pair_B[block][n:] == -1).all() and (weight_B[block][n:] == 0).all()
        start += n


@given(T=st.integers(1, 300), K=st.integers(1, 8), E=st.integers(1, 64), retain=st.floats(0.01, 0.99),
       factor=st.floats(1.0, 4.0))
def test_capacity_rows_hold_the_scaled_balanced_quota_in_whole_steps_of_8(T, K, E, retain, factor):
    K = min(K, E)
    rows = backward_capacity_rows(T, K, E, retain, factor)
    balanced = factor * math.floor(retain * T * K) / E
    assert 1 <= rows <= T and rows >= min(T, balanced) - 1e-9
    if rows < T and balanced > 0:  # a whole number of 8-row steps, less than one step above the balanced quota
        assert rows % 8 == 0 and rows < balanced + 8


@pytest.mark.parametrize("kwargs, match", [
    (dict(backward_capacity=0.0), "backward_capacity must be a finite float >= 1"),
    (dict(backward_capacity=0.9), "backward_capacity must be a finite float >= 1"),
    (dict(backward_capacity=float("nan")), "backward_capacity must be a finite float >= 1"),
    (dict(backward_capacity=float("inf")), "backward_capacity must be a finite float >= 1"),
    (dict(backward_capacity=True), "backward_capacity must be a finite float >= 1"),
    (dict(backward_capacity=1.0, retain=1.0), "needs retain < 1"),
    (dict(backward_capacity=1.0, quota_align=8), "quota_align"),
    (dict(backward_capacity=1.0, policy="proportional"), "policy='waterfill'"),
])
def test_bad_backward_capacity_is_refused_by_the_layer_and_the_function(kwargs, match):
    kwargs = {"retain": 0.5, **kwargs}
    with pytest.raises(ValueError, match=match):
        LRMoE(16, 12, 6, 2, **kwargs)
    x, w_gu, w_d, ids, gates = _problem(8, 16, 12, 6, 2, 0.0, seed=0)
    with pytest.raises(ValueError, match=match):
        selective_swiglu_experts(x, w_gu, w_d, ids, gates, **kwargs)


@pytest.mark.parametrize("args, name", [
    ((8, 2, 0, 0.5, 1.0), "n_experts"), ((8, 2, 4, 0.5, float("inf")), "factor"),
    ((8, 2, 4, 0.5, float("nan")), "factor"), ((8, 2, 4, 0.5, 0.5), "factor"), ((8, 2, 4, 1.5, 1.0), "retain"),
    ((-1, 2, 4, 0.5, 1.0), "n_tokens"),
])
def test_backward_capacity_rows_refuses_what_has_no_capacity(args, name):
    with pytest.raises(ValueError, match=name):
        backward_capacity_rows(*args)


@pytest.mark.parametrize("args", [(-1, 4, 0.5), (8, -1, 0.5), (8, 4, -0.5), (8, 4, 0.0)])
def test_retained_rows_bound_refuses_negative_counts_and_retain_outside_0_1(args):
    with pytest.raises(ValueError, match="retained_rows_bound"):
        retained_rows_bound(*args)


def test_selective_swiglu_experts_checks_the_probe_and_devices():
    x, w_gu, w_d, ids, gates = _problem(8, 16, 12, 6, 2, 0.0, seed=0)
    with pytest.raises(ValueError, match="stats_probe"):
        selective_swiglu_experts(x, w_gu, w_d, ids, gates, retain=0.5, stats_probe=torch.zeros(2, requires_grad=True))
    # A probe that does not require grad would get no .grad: no statistics, and nothing said.
    with pytest.raises(ValueError, match="stats_probe must require grad"):
        selective_swiglu_experts(x, w_gu, w_d, ids, gates, retain=0.5, stats_probe=torch.zeros(3))
    with pytest.raises(ValueError, match="down_EDF on meta"):
        selective_swiglu_experts(x, w_gu, w_d.to("meta"), ids, gates, retain=0.5)


def test_backward_capacity_is_refused_with_pairs_grouped_by_source():
    x, w_gu, w_d, ids, gates = _problem(8, 16, 12, 6, 2, 0.0, seed=0)
    sources = torch.arange(8) % 2
    with pytest.raises(ValueError, match="per expert on one device"):
        selective_swiglu_experts(x, w_gu, w_d, ids, gates, retain=0.5, backward_capacity=1.0, source_ids_T=sources,
                                 num_sources=2)
    plan = plan_experts(ids, 6, retain=0.5, source_ids_T=sources, num_sources=2)
    with pytest.raises(ValueError, match="per expert on one device"):
        selective_swiglu_experts(x, w_gu, w_d, ids, gates, retain=0.5, backward_capacity=1.0, plan=plan)


@given(T=st.integers(1, 40), E=st.integers(1, 9), K=st.integers(1, 4), retain=st.floats(0.05, 0.95),
       factor=st.floats(1.0, 3.0), skew=st.floats(0.0, 3.0), selection=st.sampled_from(["top", "sample"]),
       seed=st.integers(0, 2**16))
def test_blocked_backward_property(T, E, K, retain, factor, skew, selection, seed):
    # Any routing, retain and factor: the blocked backward gives the grouped backward's gradients for the plan
    # clamped to C (empty experts, experts below C, clamped ones, C = T).
    K = min(K, E)
    assume(retain * T * K >= 1)  # a budget of 0 pairs is refused (tests/nn/test_user_traps.py)
    D, F = 8, 6
    x, w_gu, w_d, ids, gates = _problem(T, D, F, E, K, skew, seed)
    g = torch.randn(T, D, dtype=x.dtype, generator=torch.Generator().manual_seed(seed + 1))
    plan = plan_experts(ids, E, retain=retain, selection=selection, generator=torch.Generator().manual_seed(seed))
    cap = backward_capacity_rows(T, K, E, retain, factor)
    clamped = ExpertPlan(loads=plan.loads, quotas=plan.quotas.clamp(max=cap), uniform=plan.uniform)
    kw = dict(retain=retain, selection=selection)
    want = _grads(x, w_gu, w_d, ids, gates, g, plan=clamped, **kw)
    got = _grads(x, w_gu, w_d, ids, gates, g, plan=plan, backward_capacity=factor, **kw)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
