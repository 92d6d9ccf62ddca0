"""Bad inputs and edge cases of every public function of lrmoe.functional (the standing suite; docs/reliability.md).

Each refused case asserts the error type and that the message names the argument. Each accepted edge case
(empty inputs, non-finite values, skewed routing, retain at its ends) asserts the documented result.
"""

from __future__ import annotations

import pytest
import torch

from lrmoe.functional import (
    apportion,
    backward_capacity_rows,
    balanced_capacity,
    compact_and_gemm,
    expert_loads,
    inclusion_probabilities,
    instance_experts,
    place_hot_replicas,
    plan_experts,
    plan_quotas,
    retained_rows_bound,
    route_to_replicas,
    route_topk,
    router_logits,
    score_pairs,
    select_within_quota,
    selective_swiglu_experts,
)

T, D, F, E, K = 6, 4, 3, 4, 2
META = torch.device("meta")
IDS = torch.tensor([[0, 1], [2, 3], [1, 2], [0, 3], [1, 0], [2, 1]])
LOADS = torch.tensor([3, 4, 3, 2])
S5, G5, Q2 = torch.rand(5), torch.tensor([0, 1, 0, 1, 1]), torch.tensor([1, 2])


def _experts(**over):
    args = dict(x_TD=torch.randn(T, D), gate_up_EFD=torch.randn(E, 2 * F, D), down_EDF=torch.randn(E, D, F),
                expert_ids_TK=IDS, gates_TK=torch.rand(T, K))
    return args | over


# (id, call, error type, a pattern the message must contain: the argument's name and what was expected)
REFUSED = [
    # route_topk
    ("route_topk list logits", lambda: route_topk([[0.0] * E] * T, 2), TypeError, "logits_TE must be a torch.Tensor"),
    ("route_topk 1-D logits", lambda: route_topk(torch.randn(E), 2), ValueError, "logits_TE must have 2"),
    ("route_topk int logits", lambda: route_topk(torch.ones(T, E, dtype=torch.long), 2), TypeError, "logits_TE"),
    ("route_topk top_k > E", lambda: route_topk(torch.randn(T, E), E + 1), ValueError, r"top_k must be an int in"),
    ("route_topk top_k str", lambda: route_topk(torch.randn(T, E), "2"), ValueError, "top_k"),
    ("route_topk top_k bool", lambda: route_topk(torch.randn(T, E), True), ValueError, "top_k"),
    ("route_topk bias shape", lambda: route_topk(torch.randn(T, E), 2, bias_E=torch.zeros(E + 1)), ValueError,
     r"bias_E must have shape \[4\]"),
    ("route_topk score_func", lambda: route_topk(torch.randn(T, E), 2, score_func="relu"), ValueError, "score_func"),
    ("route_topk scaling nan", lambda: route_topk(torch.randn(T, E), 2, scaling=float("nan")), ValueError,
     "scaling must be a finite number"),
    ("route_topk n_group alone", lambda: route_topk(torch.randn(T, E), 2, n_group=2), ValueError,
     "n_group and topk_group"),
    # router_logits
    ("router_logits weight D", lambda: router_logits(torch.randn(T, D), torch.randn(E, D + 1)), ValueError,
     "weight_ED must be"),
    ("router_logits int dtype", lambda: router_logits(torch.randn(T, D), torch.randn(E, D), torch.long), TypeError,
     "dtype must be a floating-point"),
    ("router_logits dtypes differ", lambda: router_logits(torch.randn(T, D), torch.randn(E, D).double()), TypeError,
     "same dtype"),
    # expert_loads
    ("expert_loads float ids", lambda: expert_loads(IDS.float(), E), TypeError, "expert_ids must be an integer"),
    ("expert_loads id >= E", lambda: expert_loads(IDS, 3), ValueError, r"expert_ids must be in \[0, num_experts=3\)"),
    ("expert_loads E 0", lambda: expert_loads(IDS, 0), ValueError, "num_experts must be an int >= 1"),
    # plan_quotas
    ("plan_quotas list", lambda: plan_quotas([3, 4], 0.5), TypeError, "loads_SE must be a torch.Tensor"),
    ("plan_quotas float loads", lambda: plan_quotas(LOADS.float(), 0.5), TypeError, "loads_SE must be an integer"),
    ("plan_quotas 3-D loads", lambda: plan_quotas(LOADS.view(1, 1, E), 0.5), ValueError, "loads_SE must have 1 or 2"),
    ("plan_quotas retain 0", lambda: plan_quotas(LOADS, 0.0), ValueError, r"retain must be in \(0, 1\]"),
    ("plan_quotas retain > 1", lambda: plan_quotas(LOADS, 1.5), ValueError, r"retain must be in \(0, 1\]"),
    ("plan_quotas retain nan", lambda: plan_quotas(LOADS, float("nan")), ValueError, r"retain must be in \(0, 1\]"),
    ("plan_quotas retain inf", lambda: plan_quotas(LOADS, float("inf")), ValueError, r"retain must be in \(0, 1\]"),
    ("plan_quotas retain tensor", lambda: plan_quotas(LOADS, torch.tensor(0.5)), TypeError, "retain must be a real"),
    ("plan_quotas retain str", lambda: plan_quotas(LOADS, "0.5"), TypeError, "retain must be a real"),
    ("plan_quotas min_retain > retain", lambda: plan_quotas(LOADS, 0.5, min_retain=0.6), ValueError, "min_retain"),
    ("plan_quotas policy", lambda: plan_quotas(LOADS, 0.5, policy="greedy"), ValueError, "policy must be one of"),
    ("plan_quotas align 0", lambda: plan_quotas(LOADS, 0.5, align=0), ValueError, "align must be a positive int"),
    ("plan_quotas capacity shape", lambda: plan_quotas(LOADS, 0.5, capacity=torch.tensor([4, 4])), ValueError,
     "capacity without placement"),
    ("plan_quotas placement alone", lambda: plan_quotas(LOADS, 0.5, placement=torch.zeros(E, dtype=torch.long)),
     ValueError, "placement needs capacity"),
    # apportion
    ("apportion float total", lambda: apportion(torch.tensor([2.0]), torch.tensor([[1], [1]])), TypeError, "total_G"),
    ("apportion columns", lambda: apportion(torch.tensor([2, 1]), torch.tensor([[1], [1]])), ValueError, "total_G"),
    # score_pairs
    ("score_pairs T differs", lambda: score_pairs(torch.rand(T, K), torch.rand(T + 1, D), torch.rand(T, K)),
     ValueError, "grad_out_TD must have T=6 rows"),
    ("score_pairs phi shape", lambda: score_pairs(torch.rand(T, K), torch.rand(T, D), torch.rand(T, K + 1)),
     ValueError, "phi_sqnorm_TK must have the shape"),
    ("score_pairs meta grad", lambda: score_pairs(torch.rand(T, K), torch.rand(T, D, device=META), torch.rand(T, K)),
     ValueError, "grad_out_TD on meta"),
    ("score_pairs metric", lambda: score_pairs(torch.rand(T, K), torch.rand(T, D), torch.rand(T, K), metric="l1"),
     ValueError, "metric must be one of"),
    ("score_pairs generator", lambda: score_pairs(torch.rand(T, K), torch.rand(T, D), torch.rand(T, K),
                                                  metric="random", generator=0), TypeError, "generator"),
    # select_within_quota, inclusion_probabilities
    ("select ids shape", lambda: select_within_quota(S5, G5[:4], Q2, max_rows=4), ValueError, "group_ids_P must"),
    ("select int scores", lambda: select_within_quota(S5.long(), G5, Q2, max_rows=4), TypeError, "scores_P"),
    ("select max_rows -1", lambda: select_within_quota(S5, G5, Q2, max_rows=-1), ValueError, "max_rows must be an int"),
    ("select max_rows float", lambda: select_within_quota(S5, G5, Q2, max_rows=4.0), ValueError, "max_rows"),
    ("select mode", lambda: select_within_quota(S5, G5, Q2, max_rows=4, mode="best"), ValueError, "mode must be"),
    ("select uniform shape", lambda: select_within_quota(S5, G5, Q2, max_rows=4, uniform_G=torch.rand(3)),
     ValueError, r"uniform_G must have shape \[2\]"),
    ("select meta quotas", lambda: select_within_quota(S5, G5, Q2.to(META), max_rows=4), ValueError, "quotas_G on meta"),
    ("select ends shape", lambda: select_within_quota(S5, G5, Q2, max_rows=4, group_ends_G=torch.tensor([2])),
     ValueError, "group_ends_G must have the shape"),
    ("inclusion ids shape", lambda: inclusion_probabilities(S5, G5[:4], Q2), ValueError, "group_ids_P"),
    # expert instances
    ("route_to_replicas S != W", lambda: route_to_replicas(torch.ones(2, E, dtype=torch.long),
                                                           torch.ones(E, 3, dtype=torch.long)), ValueError,
     "counts_SE has 2 sources but capacity_EW has 3 ranks"),
    ("route_to_replicas float", lambda: route_to_replicas(torch.ones(2, E), torch.ones(E, 2, dtype=torch.long)),
     TypeError, "counts_SE"),
    ("place_hot_replicas E % W", lambda: place_hot_replicas(torch.ones(3, E, dtype=torch.long), 1), ValueError,
     "E a positive multiple of W"),
    ("place_hot_replicas -1", lambda: place_hot_replicas(torch.ones(2, E, dtype=torch.long), -1), ValueError,
     "max_replicas must be an int >= 0"),
    ("instance_experts float E", lambda: instance_experts(torch.tensor([[3], [-1]]), 4.0), TypeError,
     "num_experts must be an int"),
    ("instance_experts E % W", lambda: instance_experts(torch.tensor([[3], [-1]]), 3), ValueError, "num_experts"),
    ("balanced_capacity E", lambda: balanced_capacity(torch.tensor([2, 0, 5, 7, 1, 1, 1, 1]),
                                                      torch.tensor([[0], [2]])), ValueError, "experts_WI has I=1"),
    # compact_and_gemm
    ("gemm weight I", lambda: compact_and_gemm(torch.randn(3, 2), torch.randn(2, 4, 3), torch.zeros(1).long(),
                                               torch.tensor([1, 1])), ValueError, "weight_EOI must be"),
    ("gemm offsets E", lambda: compact_and_gemm(torch.randn(3, 2), torch.randn(2, 4, 2), torch.zeros(1).long(),
                                                torch.tensor([1])), ValueError, "offsets_E must have one entry"),
    ("gemm dtypes", lambda: compact_and_gemm(torch.randn(3, 2), torch.randn(2, 4, 2).double(), torch.zeros(1).long(),
                                             torch.tensor([1, 1])), TypeError, "weight_EOI dtype"),
    ("gemm meta weight", lambda: compact_and_gemm(torch.randn(3, 2), torch.randn(2, 4, 2, device=META),
                                                  torch.zeros(1).long(), torch.tensor([1, 1])), ValueError,
     "weight_EOI on meta"),
    # plan_experts, selective_swiglu_experts, the static bounds
    ("plan_experts 1-D ids", lambda: plan_experts(IDS.flatten(), E), ValueError, "expert_ids_TK must have 2"),
    ("plan_experts selection", lambda: plan_experts(IDS, E, selection="best"), ValueError, "selection must be"),
    ("experts down shape", lambda: selective_swiglu_experts(**_experts(down_EDF=torch.randn(E, D, F + 1))),
     ValueError, r"down_EDF must be \[E=4, D=4, F=3\]"),
    ("experts gates shape", lambda: selective_swiglu_experts(**_experts(gates_TK=torch.rand(T, K + 1))), ValueError,
     "gates_TK"),
    ("experts x dtype", lambda: selective_swiglu_experts(**_experts(x_TD=torch.randn(T, D).double())), TypeError,
     "must share a dtype"),
    ("experts meta weight", lambda: selective_swiglu_experts(**_experts(down_EDF=torch.randn(E, D, F, device=META))),
     ValueError, "down_EDF on meta"),
    ("experts retain", lambda: selective_swiglu_experts(**_experts(), retain=2.0), ValueError, "retain must be in"),
    ("experts metric", lambda: selective_swiglu_experts(**_experts(), metric="x"), ValueError, "metric must be"),
    ("experts out_shape D", lambda: selective_swiglu_experts(**_experts(), out_shape=(2, 3, D + 1)), ValueError,
     r"out_shape must be \[\.\.\., D=4\] holding the T=6 tokens"),
    ("experts out_shape T", lambda: selective_swiglu_experts(**_experts(), out_shape=(2, 2, D)), ValueError,
     r"out_shape must be \[\.\.\., D=4\] holding the T=6 tokens of x_TD in its leading dims, got \(2, 2, 4\)"),
    ("experts out_shape type", lambda: selective_swiglu_experts(**_experts(), out_shape=6), TypeError,
     "out_shape must be a tuple of ints"),
    ("retained_rows_bound retain", lambda: retained_rows_bound(10, E, 0.0), ValueError, "retained_rows_bound needs"),
    ("backward_capacity_rows factor", lambda: backward_capacity_rows(T, K, E, 0.5, 0.5), ValueError,
     "backward_capacity_rows needs"),
]


@pytest.mark.parametrize("call, exc, match", [case[1:] for case in REFUSED], ids=[case[0] for case in REFUSED])
def test_refused_naming_the_argument(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


# ------------------------------------------------------------------------------------------------ empty inputs


def test_empty_inputs_give_empty_or_zero_results():
    """T = 0 tokens, P = 0 pairs, G = 0 groups: shapes follow the sizes, every count is 0, padding is -1 / 0."""
    routing = route_topk(torch.randn(0, E), 2)
    assert routing.expert_ids.shape == routing.gates.shape == (0, 2)
    assert expert_loads(routing.expert_ids, E).tolist() == [0] * E
    assert plan_quotas(torch.zeros(0, dtype=torch.long), 0.5).shape == (0,)
    assert plan_quotas(torch.zeros(E, dtype=torch.long), 0.5).tolist() == [0] * E
    sel = select_within_quota(torch.zeros(0), torch.zeros(0, dtype=torch.long), Q2, max_rows=3)
    assert sel.pair_ids.tolist() == [-1] * 3 and sel.weights.tolist() == [0.0] * 3 and sel.offsets.tolist() == [0, 0]
    assert score_pairs(torch.zeros(0, K), torch.zeros(0, D), torch.zeros(0, K)).shape == (0, K)
    y = compact_and_gemm(torch.zeros(0, 2), torch.randn(2, 3, 2), torch.full((4,), -1), torch.tensor([0, 0]))
    assert y.shape == (4, 3) and (y == 0).all()
    out = selective_swiglu_experts(**_experts(x_TD=torch.zeros(0, D), expert_ids_TK=IDS[:0],
                                              gates_TK=torch.zeros(0, K)), retain=0.5)
    assert out.shape == (0, D)
    assert retained_rows_bound(0, E, 0.5) == 0 and backward_capacity_rows(0, K, E, 0.5, 1.0) == 0


# ------------------------------------------------------------------------------------------------ NaN and Inf


@pytest.mark.parametrize("where", ["gate", "grad_out", "phi"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("metric", ["lrm", "grad_l2", "grad_abs", "random"])
def test_a_non_finite_input_scores_plus_inf(where, value, metric):
    """docs/api.md, score_pairs: any non-finite gate, gradient row or ||phi||^2 gives +inf, every metric."""
    gates, grad, phi = torch.rand(T, K), torch.rand(T, D), torch.rand(T, K)
    {"gate": gates[2], "grad_out": grad[2], "phi": phi[2]}[where][0] = value
    scores = score_pairs(gates, grad, phi, metric=metric)
    # A gradient row is the token's: both its pairs; a gate or ||phi||^2 is one pair's (for "grad_l2", "grad_abs"
    # and "random", a non-finite ||phi||^2 still marks the pair: the kernels read it whatever the metric).
    want = {(2, 0), (2, 1)} if where == "grad_out" else {(2, 0)}
    assert {tuple(i) for i in torch.isinf(scores).nonzero().tolist()} == want
    assert (scores[torch.isinf(scores)] > 0).all() and not scores.isnan().any()


@pytest.mark.parametrize("mode", ["top", "sample"])
def test_non_finite_scores_are_retained_first(mode):
    """NaN counts as +inf: such pairs come first, within the quota (weight 1: p = 1 under "sample")."""
    scores = torch.tensor([0.5, float("nan"), 9.0, float("inf"), 0.1, 2.0])
    groups = torch.zeros(6, dtype=torch.long)
    sel = select_within_quota(scores, groups, torch.tensor([2]), max_rows=2, mode=mode)
    assert sorted(sel.pair_ids.tolist()) == [1, 3] and sel.weights.tolist() == [1.0, 1.0]
    p = inclusion_probabilities(scores, groups, torch.tensor([2]))
    assert p.tolist() == [0.0, 1.0, 0.0, 1.0, 0.0, 0.0]


def test_a_nan_gradient_reaches_the_expert_gradient_instead_of_being_dropped():
    """A diverging token keeps its pairs in backward at any retain: the expert weight gradient shows its NaN."""
    torch.manual_seed(0)
    args = _experts(gate_up_EFD=torch.randn(E, 2 * F, D, requires_grad=True),
                    down_EDF=torch.randn(E, D, F, requires_grad=True))
    out = selective_swiglu_experts(**args, retain=0.5, selection="top")
    grad = torch.ones_like(out)
    grad[4, 0] = float("nan")
    out.backward(grad)
    touched = IDS[4].tolist()  # token 4's experts
    nan_E = args["down_EDF"].grad.isnan().flatten(1).any(1)
    assert nan_E.nonzero().flatten().tolist() == sorted(touched)


# ------------------------------------------------------------------------------------------------ extremes


def test_retain_one_keeps_every_pair_and_skewed_routing_trims_only_the_hot_expert():
    loads = torch.tensor([0, 0, 40, 0, 2, 0])
    assert torch.equal(plan_quotas(loads, 1.0), loads)
    # Every pair on one expert but two: waterfill trims only the hot one, the budget exactly.
    quotas = plan_quotas(loads, 0.5)
    assert quotas.tolist() == [0, 0, 19, 0, 2, 0] and int(quotas.sum()) == 21
    # All tokens routed to one expert: the selection keeps its quota, in a buffer of the bound's size.
    P = 40
    sel = select_within_quota(torch.rand(P), torch.full((P,), 2), quotas, max_rows=retained_rows_bound(P, 6, 0.5))
    assert sel.counts.tolist() == [0, 0, 19, 0, 0, 0] and int(sel.offsets[-1]) == 19
    # Expert instances: all demand on one expert's single instance: every pair still assigned, to its owner.
    split = route_to_replicas(torch.tensor([[0, 9], [0, 7]]), torch.tensor([[4, 4], [0, 3]]))
    assert split.sum(-1).tolist() == [[0, 9], [0, 7]] and split[:, 1, 0].sum() == 0
