"""Properties of lrmoe.functional.quotas: plan_quotas and apportion.

The contract (plan_quotas docstring, docs/design.md, 'The five primitives'): 0 <= quota <= load; retain = 1 gives
quota == load; the total equals the budget floor(retain * total) exactly unless the min_retain floors alone exceed it
(then every expert keeps its floor); each expert's quota is split over sources in proportion to their loads
(largest remainder); deterministic. Checks use exact rationals (fractions.Fraction) where they compare with a
real-valued share.
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from lrmoe.functional import apportion, plan_quotas
from lrmoe.ops import waterfill

POLICIES = ["waterfill", "proportional"]


def _budget(loads_E: list[int], retain: float) -> int:
    # The documented budget, floor(retain * total), in Python float arithmetic (IEEE double, as documented).
    return math.floor(sum(loads_E) * retain)


def _floor_of(load: int, min_retain: float) -> int:
    # ceil(min_retain * load) less the slack 1e-12 * max(product, 1) (0.3 * 10 = 3.0000000000000004 counts as 3),
    # in Python's IEEE doubles.
    want = load * min_retain
    return min(load, max(0, math.ceil(want - 1e-12 * max(want, 1.0))))


def test_floors_round_up_what_is_above_an_integer_and_not_float_noise():
    """An absolute slack of 1e-6 took ceil(0.1000001 * 10) = 2 down to 1 (a review's repro); float noise (0.3 * 10
    = 3.0000000000000004) must not round up."""
    assert plan_quotas(torch.tensor([10, 10]), 0.1000001, min_retain=0.1000001).tolist() == [2, 2]
    assert plan_quotas(torch.tensor([10, 10]), 0.3, min_retain=0.3).tolist() == [3, 3]
    assert plan_quotas(torch.tensor([7, 7]), 0.35, min_retain=0.35).tolist() == [3, 3]  # 2.45 -> 3, past budget 4


# ------------------------------------------------------------------------------------------------ strategies

retains = st.one_of(
    st.sampled_from([0.1, 0.25, 0.3, 0.5, 0.7, 0.75, 0.9, 1.0]),
    st.floats(min_value=1e-3, max_value=1.0, exclude_min=False),
)


@st.composite
def loads_cases(draw, *, min_retain_zero: bool = False):
    S = draw(st.integers(1, 4))
    E = draw(st.integers(1, 8))
    shape = draw(st.sampled_from(["random", "random", "hot", "zeros"]))
    if shape == "random":
        loads = draw(st.lists(st.integers(0, 40), min_size=S * E, max_size=S * E))
    elif shape == "hot":  # one expert takes every token
        hot = draw(st.integers(0, E - 1))
        per_src = draw(st.lists(st.integers(0, 50), min_size=S, max_size=S))
        loads = [per_src[s] if e == hot else 0 for s in range(S) for e in range(E)]
    else:
        loads = [0] * (S * E)
    loads_SE = torch.tensor(loads, dtype=torch.int64).reshape(S, E)
    one_d = S == 1 and draw(st.booleans())
    retain = draw(retains)
    if min_retain_zero or draw(st.booleans()):
        min_retain = 0.0
    else:
        min_retain = retain * draw(st.sampled_from([0.1, 0.5, 0.9, 1.0]) | st.floats(0.0, 1.0))
    policy = draw(st.sampled_from(POLICIES))
    dtype = draw(st.sampled_from([torch.int64, torch.int32]))
    loads_SE = loads_SE.to(dtype)
    return (loads_SE[0] if one_d else loads_SE), retain, min_retain, policy


def _plan(loads, retain, min_retain, policy):
    q = plan_quotas(loads, retain, min_retain=min_retain, policy=policy)
    assert q.dtype == torch.int64
    assert q.shape == loads.shape
    return q


def _as_SE(t: torch.Tensor) -> list[list[int]]:
    return t.reshape(-1, t.shape[-1]).long().tolist()


# ------------------------------------------------------------------------------------------------ properties


@given(loads_cases())
@example((torch.tensor([1, 1, 100]), 0.5, 0.01, "proportional"))
@example((torch.tensor([1, 1, 100]), 0.5, 0.01, "waterfill"))
@example((torch.zeros(2, 3, dtype=torch.int64), 0.5, 0.2, "waterfill"))
@example((torch.tensor([[0, 7, 0], [0, 3, 0], [0, 0, 0], [0, 11, 0]]), 0.4, 0.0, "waterfill"))
def test_quota_contract(case):
    loads, retain, min_retain, policy = case
    q = _plan(loads, retain, min_retain, policy)
    L_SE, Q_SE = _as_SE(loads), _as_SE(q)
    S, E = len(L_SE), len(L_SE[0])
    L_E = [sum(L_SE[s][e] for s in range(S)) for e in range(E)]
    Q_E = [sum(Q_SE[s][e] for s in range(S)) for e in range(E)]

    # 0 <= quota <= load, elementwise (per source and per expert).
    for s in range(S):
        for e in range(E):
            assert 0 <= Q_SE[s][e] <= L_SE[s][e], (s, e, Q_SE, L_SE)

    # Floors: every expert keeps at least min_retain of its load (float slack of 1e-6).
    for e in range(E):
        assert Q_E[e] >= L_E[e] * min_retain - 1e-6, (e, Q_E, L_E, min_retain)

    # Total: the budget exactly, unless the floors alone exceed it, then every expert keeps its floor.
    budget = _budget(L_E, retain)
    floors = [_floor_of(l, min_retain) for l in L_E]
    if sum(floors) <= budget:
        assert sum(Q_E) == budget, (sum(Q_E), budget, Q_E, L_E, retain, min_retain, policy)
    else:
        assert Q_E == floors, (Q_E, floors)

    # Per-source split: sums to the expert quota, each share within 1 of quota_e * load_se / load_e.
    for e in range(E):
        for s in range(S):
            share = Fraction(Q_E[e] * L_SE[s][e], L_E[e]) if L_E[e] else Fraction(0)
            assert abs(Q_SE[s][e] - share) < 1, (s, e, Q_SE, L_SE)


@given(loads_cases(min_retain_zero=True))
def test_retain_one_keeps_everything(case):
    loads, _, _, policy = case
    for min_retain in (0.0, 0.5, 1.0):
        q = _plan(loads, 1.0, min_retain, policy)
        assert torch.equal(q, loads.long())


@given(loads_cases())
def test_waterfill_has_a_common_level(case):
    loads, retain, min_retain, _ = case
    q = _plan(loads, retain, min_retain, "waterfill")
    L_E = [sum(col) for col in zip(*_as_SE(loads))]
    Q_E = [sum(col) for col in zip(*_as_SE(q))]
    F_E = [_floor_of(l, min_retain) for l in L_E]

    def fits(level: int) -> bool:
        # Each expert keeps clamp(level, floor, load), or one more if it is still growing at that level.
        for l, f, qe in zip(L_E, F_E, Q_E):
            base = min(max(level, f), l)
            if not (qe == base or (qe == base + 1 and f <= level < l)):
                return False
        return True

    levels = [lv for lv in range(max(L_E, default=0) + 1) if fits(lv)]
    assert levels, f"no common level explains quotas {Q_E} for loads {L_E} (floors {F_E})"

    if min_retain == 0.0:
        # Untouched below the level, trimmed experts at L or L + 1: the heaviest experts are trimmed first.
        lv = levels[0]
        for l, qe in zip(L_E, Q_E):
            if l <= lv:
                assert qe == l
            else:
                assert qe in (lv, lv + 1)
        for a in range(len(L_E)):
            for b in range(len(L_E)):
                if L_E[a] >= L_E[b]:
                    assert Q_E[a] >= Q_E[b] - 1, (L_E, Q_E)


@given(loads_cases())
def test_proportional_keeps_the_same_fraction(case):
    loads, retain, min_retain, _ = case
    q = _plan(loads, retain, min_retain, "proportional")
    L_E = [sum(col) for col in zip(*_as_SE(loads))]
    Q_E = [sum(col) for col in zip(*_as_SE(q))]
    total = sum(L_E)
    budget = _budget(L_E, retain)
    if min_retain == 0.0:
        # Largest remainder apportionment of the budget: within 1 of budget * load / total ...
        for l, qe in zip(L_E, Q_E):
            share = Fraction(budget * l, total) if total else Fraction(0)
            assert abs(qe - share) < 1, (L_E, Q_E, budget)
        # ... hence within 2 of retain * load.
        for l, qe in zip(L_E, Q_E):
            assert abs(qe - retain * l) < 2
    else:
        # Floors first, then the rest of the budget over what lies above the floors, in proportion.
        F_E = [_floor_of(l, min_retain) for l in L_E]
        rest, room = budget - sum(F_E), total - sum(F_E)
        if rest >= 0:
            for l, f, qe in zip(L_E, F_E, Q_E):
                share = Fraction(rest * (l - f), room) if room else Fraction(0)
                assert qe >= f and abs(qe - f - share) < 1, (L_E, F_E, Q_E, budget)


@given(loads_cases(), st.randoms(use_true_random=False))
def test_deterministic_and_permutation_consistent(case, rnd):
    loads, retain, min_retain, policy = case
    q1 = _plan(loads, retain, min_retain, policy)
    q2 = _plan(loads.clone(), retain, min_retain, policy)
    assert torch.equal(q1, q2)

    loads_SE = loads.reshape(-1, loads.shape[-1])
    q_SE = q1.reshape(loads_SE.shape)
    # Expert quotas depend only on the expert totals: the same with the sources summed or shuffled.
    q_E = _plan(loads_SE.sum(0), retain, min_retain, policy)
    assert torch.equal(q_SE.sum(0), q_E)
    src_perm = list(range(loads_SE.shape[0]))
    rnd.shuffle(src_perm)
    q_perm = _plan(loads_SE[src_perm], retain, min_retain, policy)
    assert torch.equal(q_perm.sum(0), q_E)

    # Permuting experts keeps the total; waterfill's +1 goes by index, but the multiset of quotas is unchanged.
    exp_perm = list(range(loads_SE.shape[1]))
    rnd.shuffle(exp_perm)
    q_eperm = _plan(loads_SE.sum(0)[exp_perm], retain, min_retain, policy)
    assert int(q_eperm.sum()) == int(q_E.sum())
    if policy == "waterfill":
        assert sorted(q_eperm.tolist()) == sorted(q_E.tolist())


@pytest.mark.parametrize("policy", POLICIES)
def test_small_cases_by_hand(policy):
    # All-zero loads: nothing to keep.
    assert plan_quotas(torch.zeros(4, dtype=torch.int64), 0.5, policy=policy).tolist() == [0, 0, 0, 0]
    # One expert takes all tokens: it keeps floor(retain * load).
    assert plan_quotas(torch.tensor([0, 10, 0]), 0.75, policy=policy).tolist() == [0, 7, 0]
    # Split over 4 sources in proportion to their loads: 7 of [4, 0, 4, 2] -> 2.8, 0, 2.8, 1.4 -> 3, 0, 3, 1.
    q = plan_quotas(torch.tensor([[0, 4], [0, 0], [0, 4], [0, 2]]), 0.7, policy=policy)
    assert q.tolist() == [[0, 3], [0, 0], [0, 3], [0, 1]]


def test_waterfill_by_hand():
    # loads 10, 6, 2, 1; budget floor(0.5 * 19) = 9 -> level 3: 2 and 1 untouched, 10 and 6 keep 3 each.
    assert plan_quotas(torch.tensor([10, 6, 2, 1]), 0.5).tolist() == [3, 3, 2, 1]
    # budget floor(0.55 * 19) = 10 -> level 3 keeps 9; the first expert still growing there gets the extra pair.
    assert plan_quotas(torch.tensor([10, 6, 2, 1]), 0.55).tolist() == [4, 3, 2, 1]
    # floors ceil(0.5 * load) = 5, 3, 1, 1 fit in the budget floor(0.75 * 18) = 13 -> level 5: 5, 5, 2, 1.
    assert plan_quotas(torch.tensor([9, 6, 2, 1]), 0.75, min_retain=0.5).tolist() == [5, 5, 2, 1]
    # budget floor(0.5 * 18) = 9 < floors 5 + 3 + 1 + 1 = 10 -> every expert keeps its floor.
    assert plan_quotas(torch.tensor([9, 6, 2, 1]), 0.5, min_retain=0.5).tolist() == [5, 3, 1, 1]


def test_proportional_with_floors_uses_the_budget_exactly():
    # Experts of load 1 round to 0 by proportion, but a floor keeps one pair each; the heavy expert gives way.
    q = plan_quotas(torch.tensor([1, 1, 100]), 0.5, min_retain=0.01, policy="proportional")
    assert int(q.sum()) == 51
    assert q[:2].tolist() == [1, 1]


@given(st.lists(st.integers(0, 30), min_size=1, max_size=6), st.integers(1, 4), st.data())
def test_apportion_largest_remainder(totals, S, data):
    G = len(totals)
    weights = torch.tensor(data.draw(st.lists(st.integers(0, 12), min_size=S * G, max_size=S * G))).reshape(S, G)
    totals_t = torch.tensor([min(t, int(weights[:, g].sum())) for g, t in enumerate(totals)])
    out = apportion(totals_t, weights)
    for g in range(G):
        col, tot, w = out[:, g].tolist(), int(totals_t[g]), weights[:, g].tolist()
        assert sum(col) == tot
        W = sum(w)
        for s in range(S):
            share = Fraction(tot * w[s], W) if W else Fraction(0)
            assert math.floor(share) <= col[s] <= math.floor(share) + 1
            assert col[s] <= w[s]
        # Largest remainders win the extra units, ties to the lower row.
        if W:
            rems = [(-(Fraction(tot * w[s], W) % 1), s) for s in range(S)]
            extra = {s for _, s in sorted(rems)[: tot - sum(math.floor(Fraction(tot * x, W)) for x in w)]}
            assert {s for s in range(S) if col[s] > math.floor(Fraction(tot * w[s], W))} == extra


def test_apportion_gives_a_zero_weight_column_zeros_whatever_its_total():
    # The docstring's promise; the largest-remainder step once handed the total out as ones to the first rows.
    out = apportion(torch.tensor([5, 4]), torch.tensor([[0, 1], [0, 3]]))
    assert out[:, 0].tolist() == [0, 0] and out[:, 1].tolist() == [1, 3]


@pytest.mark.parametrize(
    "total, weights, exc, name",
    [
        (torch.tensor([2.0]), torch.tensor([[1], [1]]), TypeError, "total_G"),
        (torch.tensor([2]), torch.tensor([[1.0], [1.0]]), TypeError, "weights_SG"),
        (torch.tensor([2]), torch.tensor([1, 1]), ValueError, "weights_SG"),
        (torch.tensor([2, 1]), torch.tensor([[1], [1]]), ValueError, "total_G"),
    ],
)
def test_apportion_errors_name_the_argument(total, weights, exc, name):
    with pytest.raises(exc, match=name):
        apportion(total, weights)


@pytest.mark.parametrize("retain", [1.0, 0.75, 0.5])
@pytest.mark.parametrize("policy", ["waterfill", "proportional"])
def test_negative_loads_count_as_zero(retain, policy):
    # No router gives a negative load and refusing one would need a sync: the plan is that of load 0.
    got = plan_quotas(torch.tensor([[5, -3, 4], [2, 6, -1]]), retain, policy=policy)
    assert torch.equal(got, plan_quotas(torch.tensor([[5, 0, 4], [2, 6, 0]]), retain, policy=policy))
    assert (got >= 0).all()


@pytest.mark.parametrize("shape", [(0,), (3, 0)])
def test_no_groups_gives_an_empty_plan(shape):
    got = plan_quotas(torch.zeros(shape, dtype=torch.int64), 0.5)
    assert got.shape == shape and got.dtype == torch.int64


# ------------------------------------------------------------------------------------------------ align


@given(loads_cases(), st.sampled_from([2, 3, 4, 8, 16]))
@example((torch.tensor([600, 600, 600, 600]), 0.5, 0.0, "waterfill"), 128)
@example((torch.tensor([[9, 40, 33], [31, 0, 6]]), 0.6, 0.3, "proportional"), 8)
@example((torch.tensor([[0, 0, 25, 1, 3, 25, 0, 0], [0, 0, 0, 0, 0, 11, 21, 4], [7, 9, 40, 40, 38, 31, 29, 0],
                        [0, 17, 40, 18, 2, 11, 2, 1]]), 0.130859375, 0.114501953125, "proportional"), 3)  # floors
# between multiples (found by Hypothesis: a step from a floor of 13 went to 16, not to the next multiple, 15)
def test_align_keeps_the_contract_and_leaves_one_partial_step(case, align):
    """align rounds trimmed groups' quotas to multiples of align: same total as align=1, each quota within
    align of it and inside [floor, load], untrimmed groups and quotas under align untouched, and at most one
    trimmed group off a multiple (other than ones held at their floor); per-source shares within loads."""
    loads, retain, min_retain, policy = case
    plain = plan_quotas(loads, retain, min_retain=min_retain, policy=policy)
    q = plan_quotas(loads, retain, min_retain=min_retain, policy=policy, align=align)
    assert q.dtype == torch.int64 and q.shape == loads.shape
    L_SE, P_SE, Q_SE = _as_SE(loads), _as_SE(plain), _as_SE(q)
    E = len(L_SE[0])
    L_E, P_E, Q_E = ([sum(col) for col in zip(*m)] for m in (L_SE, P_SE, Q_SE))
    floors = [_floor_of(load, min_retain) for load in L_E]
    assert sum(Q_E) == sum(P_E)
    off = []
    for e in range(E):
        assert floors[e] <= Q_E[e] <= L_E[e], (e, Q_E, L_E, floors)
        assert abs(Q_E[e] - P_E[e]) < align, (e, Q_E, P_E)
        if P_E[e] == L_E[e] or P_E[e] < align:
            assert Q_E[e] == P_E[e]
        elif Q_E[e] < L_E[e] and Q_E[e] % align and Q_E[e] != floors[e]:
            off.append(e)
        assert all(0 <= Q_SE[s][e] <= L_SE[s][e] for s in range(len(L_SE)))
    assert len(off) <= 1, (off, Q_E, L_E, align)


def test_align_by_hand():
    # Four experts of 600 pairs at retain 0.5: waterfill keeps 300 each. With 128-row steps each goes down to
    # 256, freeing 4 x 44 = 176 pairs; equal round-offs go in group order: expert 0 takes a whole step (384),
    # expert 1 the remaining 48 (304).
    q = plan_quotas(torch.tensor([600, 600, 600, 600]), 0.5, align=128)
    assert q.tolist() == [384, 304, 256, 256]
    # A group's step up stops at its load: budget floor(0.97 * 900) = 873, waterfill 291 each; down to 256
    # (35 freed each, 105 in all), then experts 0 and 1 take 44 each up to their load of 300, expert 2 the 17 left.
    q = plan_quotas(torch.tensor([300, 300, 300]), 0.97, align=128)
    assert q.tolist() == [300, 300, 273]
    # Quotas under one step are left alone: rounding them would drop or keep whole experts.
    assert plan_quotas(torch.tensor([40, 40, 40]), 0.5, align=128).tolist() == [20, 20, 20]


# ------------------------------------------------------------------------------------------------ errors

_LOADS = torch.tensor([[3, 0, 5], [1, 2, 0]])


@pytest.mark.parametrize(
    "loads, kwargs, exc, name",
    [
        (_LOADS, {"retain": 0.0}, ValueError, "retain"),
        (_LOADS, {"retain": 1.5}, ValueError, "retain"),
        (_LOADS, {"retain": -0.1}, ValueError, "retain"),
        (_LOADS, {"retain": float("nan")}, ValueError, "retain"),
        (_LOADS, {"retain": torch.tensor(0.5)}, TypeError, "retain"),
        (_LOADS, {"retain": 0.5, "min_retain": 0.6}, ValueError, "min_retain"),
        (_LOADS, {"retain": 0.5, "min_retain": -0.1}, ValueError, "min_retain"),
        (_LOADS, {"retain": 0.5, "policy": "greedy"}, ValueError, "policy"),
        (_LOADS.float(), {"retain": 0.5}, TypeError, "loads_SE"),
        (_LOADS.bool(), {"retain": 0.5}, TypeError, "loads_SE"),
        (_LOADS.reshape(1, 2, 3), {"retain": 0.5}, ValueError, "loads_SE"),
        (torch.tensor(4), {"retain": 0.5}, ValueError, "loads_SE"),
        (_LOADS.tolist(), {"retain": 0.5}, TypeError, "loads_SE"),
        (_LOADS, {"retain": 0.5, "align": 0}, ValueError, "align"),
        (_LOADS, {"retain": 0.5, "align": 2.0}, ValueError, "align"),
        (_LOADS, {"retain": 0.5, "align": True}, ValueError, "align"),
        (_LOADS[0], {"retain": 0.5, "align": 4, "capacity": torch.tensor([9]), "placement": torch.zeros(3).long()},
         ValueError, "align"),
    ],
)
def test_plan_quotas_errors_name_the_argument(loads, kwargs, exc, name):
    retain = kwargs.pop("retain")
    with pytest.raises(exc, match=name):
        plan_quotas(loads, retain, **kwargs)


# ------------------------------------------------------------------------------------- capacity and placement


def _ref_waterfill(loads: list[int], floors: list[int], budget: int) -> list[int]:
    """The documented waterfill, by walking the level up one pair at a time."""
    if sum(floors) > budget:
        return list(floors)

    def kept(level):
        return [min(max(level, f), x) for f, x in zip(floors, loads)]

    level = 0
    while level < max(loads, default=0) and sum(kept(level + 1)) <= budget:
        level += 1
    q = kept(level)
    short = budget - sum(q)
    for g, (f, x) in enumerate(zip(floors, loads)):
        if short > 0 and f <= level < x:
            q[g] += 1
            short -= 1
    return q


@given(data=st.data())
def test_waterfill_op_is_the_rule(data):
    # lrmoe::waterfill (every single-bin water-fill of plan_quotas) against the rule walked one level at a time.
    loads = data.draw(st.lists(st.integers(0, 30), min_size=0, max_size=12))
    floors = [data.draw(st.integers(0, load)) for load in loads]
    budget = data.draw(st.integers(0, sum(loads) + 3))
    got = waterfill(*(torch.tensor(v, dtype=torch.int64) for v in (loads, floors, budget)))
    assert got.dtype == torch.int64 and got.tolist() == _ref_waterfill(loads, floors, budget)


@st.composite
def capacity_cases(draw):
    loads, retain, min_retain, policy = draw(loads_cases())
    G = loads.shape[-1]
    W = draw(st.integers(1, 4))
    placement = draw(st.lists(st.integers(0, W - 1), min_size=G, max_size=G))
    per_rank = [0] * W
    for g, w in enumerate(placement):
        per_rank[w] += int(loads.reshape(-1, G)[:, g].sum())
    # Capacities around the ranks' loads: binding, exact, generous, zero and (ignored as 0) negative.
    capacity = [
        draw(st.sampled_from([0, -2, max(1, x // 3), x // 2, x, x + 5]) | st.integers(0, max(1, x)))
        for x in per_rank
    ]
    return loads, retain, min_retain, policy, torch.tensor(capacity), torch.tensor(placement)


def _capacity_plan(case):
    loads, retain, min_retain, policy, capacity, placement = case
    q = plan_quotas(loads, retain, min_retain=min_retain, policy=policy, capacity=capacity, placement=placement)
    assert q.dtype == torch.int64 and q.shape == loads.shape
    G = loads.shape[-1]
    L_SG, Q_SG = _as_SE(loads), _as_SE(q)
    L_G = [sum(col) for col in zip(*L_SG)]
    Q_G = [sum(col) for col in zip(*Q_SG)]
    W, cap, rank = len(capacity), [max(0, c) for c in capacity.tolist()], placement.tolist()
    floors = [_floor_of(x, min_retain) for x in L_G]
    # Floors that fit their rank's capacity (a rank whose floors do not fit shrinks them by waterfill).
    fl = list(floors)
    for w in range(W):
        gs = [g for g in range(G) if rank[g] == w]
        for g, v in zip(gs, _ref_waterfill([floors[g] for g in gs], [0] * len(gs), cap[w])):
            fl[g] = v
    return L_SG, Q_SG, L_G, Q_G, floors, fl, cap, rank, W


@given(capacity_cases())
@example((torch.tensor([[6, 2, 0, 9], [3, 0, 4, 1]]), 0.75, 0.0, "waterfill", torch.tensor([5, 20]),
          torch.tensor([0, 0, 1, 1])))
@example((torch.tensor([[6, 2, 0, 9], [3, 0, 4, 1]]), 0.75, 0.0, "proportional", torch.tensor([5, 20]),
          torch.tensor([0, 0, 1, 1])))
@example((torch.tensor([10, 10, 10]), 0.9, 0.5, "waterfill", torch.tensor([4, 30]), torch.tensor([0, 0, 1])))
def test_capacity_contract(case):
    L_SG, Q_SG, L_G, Q_G, floors, fl, cap, rank, W = _capacity_plan(case)
    retain, policy = case[1], case[3]
    G = len(L_G)
    for s in range(len(L_SG)):
        for g in range(G):
            assert 0 <= Q_SG[s][g] <= L_SG[s][g]
    load_W = [sum(L_G[g] for g in range(G) if rank[g] == w) for w in range(W)]
    kept_W = [sum(Q_G[g] for g in range(G) if rank[g] == w) for w in range(W)]
    # Capacity holds on every rank.
    for w in range(W):
        assert kept_W[w] <= cap[w], (kept_W, cap, Q_G, L_G, rank)
    # Floors hold where they fit.
    for g in range(G):
        assert Q_G[g] >= fl[g]
        if sum(floors[h] for h in range(G) if rank[h] == rank[g]) <= cap[rank[g]]:
            assert Q_G[g] >= floors[g]
    # The budget is used up to what the capacities hold (proportional: up to one pair per rank of rounding),
    # unless the fitting floors alone exceed it.
    budget = _budget(L_G, retain)
    target = min(budget, sum(min(c, x) for c, x in zip(cap, load_W)))
    if sum(fl) > budget:
        assert Q_G == fl
    elif policy == "waterfill":
        assert sum(Q_G) == target, (Q_G, target, L_G, cap, rank)
    else:
        assert target - W <= sum(Q_G) <= target, (Q_G, target, L_G, cap, rank)


@given(capacity_cases())
def test_capacity_waterfill_matches_the_documented_rule(case):
    _, _, L_G, Q_G, _, fl, cap, rank, W = _capacity_plan((*case[:3], "waterfill", *case[4:]))
    G = len(L_G)
    # Per rank: the rank's capacity waterfilled over its groups bounds them; then one global waterfill.
    bound = list(L_G)
    for w in range(W):
        gs = [g for g in range(G) if rank[g] == w]
        for g, v in zip(gs, _ref_waterfill([L_G[g] for g in gs], [fl[g] for g in gs], cap[w])):
            bound[g] = v
    want = _ref_waterfill(bound, fl, min(_budget(L_G, case[1]), sum(bound)))
    assert Q_G == want, (Q_G, want, L_G, cap, rank)


@given(capacity_cases())
def test_generous_capacity_changes_nothing(case):
    loads, retain, min_retain, policy, _, placement = case
    W = int(placement.max()) + 1 if placement.numel() else 1
    generous = torch.full((W,), int(loads.sum()))
    q = plan_quotas(loads, retain, min_retain=min_retain, policy=policy, capacity=generous, placement=placement)
    assert torch.equal(q, plan_quotas(loads, retain, min_retain=min_retain, policy=policy))


@given(capacity_cases())
def test_capacity_proportional_keeps_one_fraction_where_there_is_room(case):
    _, _, L_G, Q_G, _, fl, cap, rank, W = _capacity_plan((*case[:3], "proportional", *case[4:]))
    G = len(L_G)
    kept_W = [sum(Q_G[g] for g in range(G) if rank[g] == w) for w in range(W)]
    # Groups on ranks below capacity all keep floor + rho * (load - floor) for one rho, up to rounding.
    free = [g for g in range(G) if kept_W[rank[g]] < cap[rank[g]] - W]
    room = sum(L_G[g] - fl[g] for g in free)
    if room and sum(fl) <= _budget(L_G, case[1]):
        rho = Fraction(sum(Q_G[g] - fl[g] for g in free), room)
        for g in free:
            assert abs(Q_G[g] - fl[g] - rho * (L_G[g] - fl[g])) < 2, (Q_G, L_G, fl, cap, rank)


def test_capacity_by_hand():
    # Groups 0, 1 on rank 0 (capacity 5), groups 2, 3 on rank 1. Loads 9, 2, 4, 10; budget floor(0.75 * 25) = 18.
    loads, placement = torch.tensor([9, 2, 4, 10]), torch.tensor([0, 0, 1, 1])
    # Without capacity: level 6 keeps 6 + 2 + 4 + 6 = 18.
    assert plan_quotas(loads, 0.75).tolist() == [6, 2, 4, 6]
    # Rank 0 holds 5 (3 + 2 at level 3); rank 1 takes the rest of the budget: 4 + 9 = 13.
    q = plan_quotas(loads, 0.75, capacity=torch.tensor([5, 20]), placement=placement)
    assert q.tolist() == [3, 2, 4, 9]
    # Both ranks bound: 5 + 10 = 15 < 18, the budget cannot be met.
    q = plan_quotas(loads, 0.75, capacity=torch.tensor([5, 10]), placement=placement)
    assert q.tolist() == [3, 2, 4, 6]
    # min_retain 0.5: floors 5, 1, 2, 5; rank 0's floors (6) exceed its capacity 5, so they shrink to 4, 1.
    q = plan_quotas(loads, 0.75, min_retain=0.5, capacity=torch.tensor([5, 20]), placement=placement)
    assert q[:2].tolist() == [4, 1] and int(q.sum()) == 18


@pytest.mark.parametrize(
    "kwargs, exc, name",
    [
        ({"capacity": torch.tensor([4, 4])}, ValueError, "placement"),  # two values, three groups
        ({"capacity": torch.tensor([4.0, 4.0, 4.0])}, TypeError, "capacity"),
        ({"placement": torch.tensor([0, 1, 1])}, ValueError, "capacity"),
        ({"capacity": torch.tensor([4.0, 4.0]), "placement": torch.tensor([0, 1, 1])}, TypeError, "capacity"),
        ({"capacity": torch.tensor([4, 4]), "placement": torch.tensor([0, 1])}, ValueError, "placement"),
        ({"capacity": torch.tensor([[4, 4]]), "placement": torch.tensor([0, 1, 1])}, ValueError, "capacity"),
        ({"capacity": torch.tensor([4, 4]), "placement": torch.tensor([0.0, 1.0, 1.0])}, TypeError, "placement"),
    ],
)
def test_capacity_errors_name_the_argument(kwargs, exc, name):
    with pytest.raises(exc, match=name):
        plan_quotas(_LOADS, 0.5, **kwargs)


@given(data=st.data())
def test_per_group_capacity_is_placement_one_group_per_rank(data):
    """capacity [G] without placement is placement = arange(G) with capacity [G] (per rank): the waterfill path
    takes min(load, capacity) directly instead of the per-rank waterfills, and must give the same quotas."""
    loads, retain, min_retain, policy = data.draw(loads_cases())
    L_G = loads.reshape(-1, loads.shape[-1]).sum(0).tolist()
    capacity = torch.tensor([data.draw(st.sampled_from([0, -1, x // 3, x // 2, x, x + 3]) | st.integers(0, x + 1))
                             for x in L_G], dtype=torch.int64)
    got = plan_quotas(loads, retain, min_retain=min_retain, policy=policy, capacity=capacity)
    ranks = torch.arange(len(L_G))
    assert torch.equal(got, plan_quotas(loads, retain, min_retain=min_retain, policy=policy, capacity=capacity,
                                        placement=ranks))
    assert (got.reshape(-1, len(L_G)).sum(0) <= capacity.clamp(min=0)).all()  # no group above its capacity


@given(capacity_cases())
def test_zero_min_retain_shortcut_equals_the_general_path(case):
    """At min_retain 0 the floors are zeros without arithmetic and the capacity plan skips their waterfill; a tiny
    positive min_retain (1e-18: its floors, under the slack, are also all zero) goes through the general path: the
    quotas must agree.
    (Retain 1 without capacity returns the loads without planning: test_retain_one_keeps_everything.)"""
    loads, retain, _, policy, capacity, placement = case
    kw = dict(policy=policy, capacity=capacity, placement=placement)
    got = plan_quotas(loads, retain, min_retain=0.0, **kw)
    assert torch.equal(got, plan_quotas(loads, retain, min_retain=1e-18, **kw))
    assert torch.equal(plan_quotas(loads, retain, **{**kw, "capacity": None, "placement": None}),
                       plan_quotas(loads, retain, min_retain=1e-18, policy=policy))
