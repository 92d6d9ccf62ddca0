"""Properties of lrmoe.functional.selection: select_within_quota and inclusion_probabilities.

References are plain Python: a brute-force sort per group for "top"; for "sample", the inclusion probabilities by
iterative capping (p = min(1, c * sqrt(score)) summing to the quota) and systematic sampling over the group's pairs
in pair-id order with a given uniform start.
"""

from __future__ import annotations

import decimal
import math
from decimal import Decimal

import numpy as np
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from lrmoe.functional import Selection, inclusion_probabilities, select_within_quota
from lrmoe.ops.selection import U_MARGIN

INF = float("inf")

# ------------------------------------------------------------------------------------------------ references


def _key(s: float) -> float:
    return INF if math.isnan(s) else s


def _members(gids: list[int], g: int) -> list[int]:
    return [i for i, gi in enumerate(gids) if gi == g]


def _take(quota: int, size: int) -> int:
    return max(0, min(quota, size))


def ref_top(scores, gids, quotas):
    """Per group, the quota best pairs by score (NaN = +inf), ties to the lower pair id, listed by pair id."""
    out = []
    for g, q in enumerate(quotas):
        mem = sorted(_members(gids, g), key=lambda i: (-_key(scores[i]), i))
        out.append(sorted(mem[: _take(q, len(mem))]))
    return out


def ref_probabilities(scores, gids, quotas) -> list[float]:
    """Iterative capping in 50-digit decimal arithmetic: cap every pair with c * w >= 1 until none is left."""
    p = [0.0] * len(scores)
    with decimal.localcontext() as ctx:
        ctx.prec = 50
        for g, quota in enumerate(quotas):
            mem = _members(gids, g)
            take = _take(quota, len(mem))
            infs = [i for i in mem if _key(scores[i]) == INF]  # by pair id
            for i in infs[:take]:
                p[i] = 1.0
            q = take - min(take, len(infs))
            fin = [i for i in mem if _key(scores[i]) != INF]
            w = {i: Decimal(max(scores[i], 0.0)).sqrt() for i in fin}
            capped: set[int] = set()
            while True:
                free = [i for i in fin if i not in capped and w[i] > 0]
                left, tot = q - len(capped), sum((w[i] for i in free), Decimal(0))
                newly = {i for i in free if left * w[i] >= tot} if left > 0 and tot > 0 else set()
                if not newly:
                    break
                capped |= newly
            for i in capped:
                p[i] = 1.0
            if left > 0 and tot > 0:
                for i in free:
                    p[i] = float(left * w[i] / tot)
            elif left > 0:  # positive scores cannot fill the quota: spread the rest over the zero-score pairs
                zeros = [i for i in fin if i not in capped]
                for i in zeros:
                    p[i] = left / len(zeros)
    return p


def ref_systematic(p, gids, quotas, uniforms):
    """Kept pairs of every group, in pair-id order: pair i kept iff some u + m (0 <= m < take) is in its interval."""
    out = []
    for g, quota in enumerate(quotas):
        mem = _members(gids, g)
        take = _take(quota, len(mem))
        kept, cum = [], 0.0
        u = min(max(uniforms[g], U_MARGIN), 1.0 - U_MARGIN)  # the op's documented clamp
        for i in mem:
            lo, hi = cum, cum + p[i]
            cum = hi
            if any(lo <= u + m < hi for m in range(take)):
                kept.append(i)
        out.append(kept)
    return out


def _expected_buffer(per_group: list[list[int]], max_rows: int):
    flat = [i for grp in per_group for i in grp][:max_rows]
    ends = np.minimum(np.cumsum([len(grp) for grp in per_group]), max_rows)
    return flat + [-1] * (max_rows - len(flat)), ends


# ------------------------------------------------------------------------------------------------ strategies

_score = st.one_of(
    st.sampled_from([0.0, 0.0, 0.25, 1.0, 1.0, 4.0, 9.0, INF, float("nan"), -1.0]),
    st.floats(0.0, 100.0, width=32),
)


@st.composite
def selection_cases(draw):
    G = draw(st.integers(1, 5))
    P = draw(st.integers(0, 12))
    one_group = draw(st.booleans()) and G > 0
    if one_group:  # one group takes everything, the others are empty
        hot = draw(st.integers(0, G - 1))
        gids = [hot] * P
    else:
        gids = draw(st.lists(st.integers(0, G - 1), min_size=P, max_size=P))
    scores = draw(st.lists(_score, min_size=P, max_size=P))
    quotas = draw(st.lists(st.integers(0, P + 2), min_size=G, max_size=G))
    max_rows = draw(st.one_of(st.just(P), st.integers(0, P + 3)))
    gid_dtype = draw(st.sampled_from([torch.int64, torch.int32]))
    seed = draw(st.integers(0, 2**31 - 1))
    return scores, gids, quotas, max_rows, gid_dtype, seed


def _tensors(scores, gids, quotas, gid_dtype=torch.int64):
    return (
        torch.tensor(scores, dtype=torch.float32),
        torch.tensor(gids, dtype=gid_dtype),
        torch.tensor(quotas, dtype=torch.int64),
    )


def _check_layout(sel: Selection, gids, quotas, max_rows):
    """Invariants shared by both modes; returns the kept ids of each group in buffer order."""
    G = len(quotas)
    assert sel.pair_ids.shape == (max_rows,) and sel.pair_ids.dtype == torch.int64
    assert sel.weights.shape == (max_rows,) and sel.weights.dtype == torch.float32
    assert sel.counts.shape == (G,) and sel.counts.dtype == torch.int32
    assert sel.offsets.shape == (G,) and sel.offsets.dtype == torch.int32
    takes = [_take(q, len(_members(gids, g))) for g, q in enumerate(quotas)]
    ends = np.minimum(np.cumsum(takes), max_rows) if G else np.zeros(0)
    np.testing.assert_array_equal(sel.offsets.numpy(), ends)
    np.testing.assert_array_equal(sel.counts.numpy(), np.diff(np.concatenate([[0], ends])))
    ids = sel.pair_ids.tolist()
    per_group, start = [], 0
    for g in range(G):
        seg = ids[start : int(ends[g])]
        assert all(i >= 0 and gids[i] == g for i in seg), (g, seg, gids)
        per_group.append(seg)
        start = int(ends[g])
    kept = [i for i in ids if i >= 0]
    assert len(kept) == len(set(kept)), f"a pair appears twice: {ids}"
    assert all(i == -1 for i in ids[start:]), ids
    assert (sel.weights[start:] == 0).all()
    return per_group


# ------------------------------------------------------------------------------------------------ "top"


@given(selection_cases())
@example(([1.0], [0], [1], 1, torch.int64, 0))  # P = 1, G = 1
@example(([], [], [3, 0], 0, torch.int64, 0))  # empty groups, empty buffer
@example(([2.0, float("nan"), 2.0, 5.0], [0, 0, 0, 0], [2, 9], 4, torch.int64, 0))  # NaN first, quota > size
@example(([INF, float("nan"), 3.0, -INF, -1.0], [0, 0, 0, 0, 0], [4], 5, torch.int64, 0))  # NaN ties +inf
def test_top_matches_brute_force(case):
    scores, gids, quotas, max_rows, gid_dtype, _ = case
    sel = select_within_quota(*_tensors(scores, gids, quotas, gid_dtype), max_rows=max_rows, mode="top")
    _check_layout(sel, gids, quotas, max_rows)
    want_ids, want_ends = _expected_buffer(ref_top(scores, gids, quotas), max_rows)
    assert sel.pair_ids.tolist() == want_ids
    np.testing.assert_array_equal(sel.offsets.numpy(), want_ends)
    assert (sel.weights[: int(want_ends[-1])] == 1).all()


@given(selection_cases(), st.sampled_from(["top", "sample"]))
def test_small_buffer_is_a_prefix_of_a_big_one(case, mode):
    scores, gids, quotas, max_rows, _, seed = case
    t = _tensors(scores, gids, quotas)
    u = torch.from_numpy(np.random.default_rng(seed).uniform(size=len(quotas)))
    big = select_within_quota(*t, max_rows=len(scores) + 2, mode=mode, uniform_G=u)
    small = select_within_quota(*t, max_rows=max_rows, mode=mode, uniform_G=u)
    n = min(max_rows, len(scores) + 2)
    assert torch.equal(small.pair_ids[:n], big.pair_ids[:n])
    assert torch.equal(small.weights[:n], big.weights[:n])
    assert torch.equal(small.offsets, big.offsets.clamp(max=max_rows))


@given(selection_cases(), st.sampled_from(["top", "sample"]))
def test_given_group_order_selects_the_same(case, mode):
    # A caller's group order (the stable argsort of the group ids, as an MoE layer has it from its dispatch) only
    # spares the selection its own sort: the same buffer, weights and offsets.
    scores, gids, quotas, max_rows, gid_dtype, seed = case
    t = _tensors(scores, gids, quotas, gid_dtype)
    u = torch.from_numpy(np.random.default_rng(seed).uniform(size=len(quotas)))
    order = torch.argsort(t[1], stable=True)
    want = select_within_quota(*t, max_rows=max_rows, mode=mode, uniform_G=u)
    got = select_within_quota(*t, max_rows=max_rows, mode=mode, uniform_G=u, group_order_P=order)
    for name in ("pair_ids", "weights", "counts", "offsets"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name


# ------------------------------------------------------------------------------------------------ "sample"


@given(selection_cases())
@example(([9.0, 0.0, 0.0, 1.0], [0, 0, 0, 0], [3], 4, torch.int64, 5))  # zero scores fill in
@example(([INF, INF, INF, 1.0], [0, 0, 0, 1], [2, 0], 4, torch.int64, 3))  # more +inf than the quota; quota 0
def test_inclusion_probabilities_match_reference(case):
    scores, gids, quotas, _, gid_dtype, _ = case
    p = inclusion_probabilities(*_tensors(scores, gids, quotas, gid_dtype))
    assert p.dtype == torch.float64 and p.shape == (len(scores),)
    np.testing.assert_allclose(p.numpy(), ref_probabilities(scores, gids, quotas), rtol=1e-9, atol=1e-12)


@given(selection_cases())
def test_inclusion_probability_properties(case):
    scores, gids, quotas, _, _, _ = case
    p = inclusion_probabilities(*_tensors(scores, gids, quotas)).tolist()
    s = [_key(x) for x in scores]
    for g, quota in enumerate(quotas):
        mem = _members(gids, g)
        take = _take(quota, len(mem))
        assert math.isclose(math.fsum(p[i] for i in mem), take, abs_tol=1e-9)
        assert all(-1e-12 <= p[i] <= 1 + 1e-12 for i in mem)
        positive = [i for i in mem if s[i] > 0]
        uncapped = [i for i in positive if 1e-12 < p[i] < 1 - 1e-12 and s[i] < INF]
        capped = [i for i in mem if p[i] >= 1 - 1e-12]
        # Proportional to sqrt(score) among the uncapped positive pairs.
        if uncapped:
            ratios = [p[i] / math.sqrt(s[i]) for i in uncapped]
            assert max(ratios) <= min(ratios) * (1 + 1e-9), ratios
        # Capped pairs have the largest scores (ties with uncapped pairs impossible).
        if capped and uncapped:
            assert min(s[i] for i in capped) > max(s[i] for i in uncapped)
        # Zero (or negative) scores only get probability when the positive ones are all kept for sure.
        if any(p[i] > 0 for i in mem if s[i] <= 0):
            assert all(p[i] >= 1 - 1e-12 for i in positive)
        # +inf (and NaN) scores come first.
        n_inf = sum(1 for i in mem if s[i] == INF)
        assert sum(1 for i in mem if s[i] == INF and p[i] >= 1 - 1e-12) == min(n_inf, take)


@given(selection_cases())
def test_sample_matches_systematic_sampling_reference(case):
    scores, gids, quotas, max_rows, gid_dtype, seed = case
    u = np.random.default_rng(seed).uniform(size=len(quotas))
    sel = select_within_quota(
        *_tensors(scores, gids, quotas, gid_dtype), max_rows=max_rows, mode="sample", uniform_G=torch.from_numpy(u)
    )
    per_group = _check_layout(sel, gids, quotas, max_rows)
    p_ref = ref_probabilities(scores, gids, quotas)
    want = ref_systematic(p_ref, gids, quotas, u.tolist())
    # Counts are exact for every draw (the quota, or the group size when smaller).
    for g, grp in enumerate(want):
        assert len(grp) == _take(quotas[g], len(_members(gids, g)))
    want_ids, _ = _expected_buffer(want, max_rows)
    assert sel.pair_ids.tolist() == want_ids
    # Within a group: pair-id order. Weights: 1 / p.
    for grp in per_group:
        assert grp == sorted(grp)
    n = int(sel.offsets[-1])
    kept = sel.pair_ids[:n].tolist()
    np.testing.assert_allclose(sel.weights[:n].numpy(), [1.0 / p_ref[i] for i in kept], rtol=1e-6)
    p_lib = inclusion_probabilities(*_tensors(scores, gids, quotas))
    np.testing.assert_array_equal(sel.weights[:n].numpy(), (1.0 / p_lib[kept]).float().numpy())


@given(selection_cases(), st.sampled_from([0.0, 5e-324, 1e-300, 1e-17, 1.0 - 2.0**-53]))
@example(([0.5, 0.1, 0.9, 0.3, 0.7, 0.2], [0, 1, 0, 1, 0, 1], [2, 1], 3, torch.int64, 0), 0.0)
@example(([1.0, 1.0, 0.25, 0.75, 4.0], [0, 0, 0, 0, 0], [4], 5, torch.int64, 0), 0.0)
def test_sample_keeps_the_quota_and_the_sure_pairs_at_extreme_uniforms(case, u):
    # torch.rand returns exactly 0 once in 2^24 draws. A group after the first starts its cumulative sum at a
    # running total minus the previous groups' sum, which need not round to 0, and a pair with p = 1 starts its
    # interval at an integer only up to rounding: a point u + m at such an end must still hit the right pair, or
    # the group keeps one pair fewer than its quota (first example) or drops a sure pair (second: score 4 has
    # p = 1, its interval [3, 4) after p summing to 3 in some rounding).
    scores, gids, quotas, max_rows, gid_dtype, _ = case
    u_G = [u] * len(quotas)
    sel = select_within_quota(
        *_tensors(scores, gids, quotas, gid_dtype), max_rows=max_rows, mode="sample",
        uniform_G=torch.tensor(u_G, dtype=torch.float64),
    )
    _check_layout(sel, gids, quotas, max_rows)
    want = ref_systematic(ref_probabilities(scores, gids, quotas), gids, quotas, u_G)
    for g, grp in enumerate(want):
        assert len(grp) == _take(quotas[g], len(_members(gids, g)))
    assert sel.pair_ids.tolist() == _expected_buffer(want, max_rows)[0]
    if sum(len(grp) for grp in want) <= max_rows:  # every kept pair fits the buffer: the sure ones are in it
        p = inclusion_probabilities(*_tensors(scores, gids, quotas, gid_dtype))
        assert set(torch.nonzero(p == 1.0).flatten().tolist()) <= set(sel.pair_ids.tolist())


@given(selection_cases())
def test_sample_with_generator_is_reproducible(case):
    scores, gids, quotas, max_rows, _, seed = case
    t = _tensors(scores, gids, quotas)
    a = select_within_quota(*t, max_rows=max_rows, mode="sample", generator=torch.Generator().manual_seed(seed))
    b = select_within_quota(*t, max_rows=max_rows, mode="sample", generator=torch.Generator().manual_seed(seed))
    _check_layout(a, gids, quotas, max_rows)
    for f in ("pair_ids", "weights", "counts", "offsets"):
        assert torch.equal(getattr(a, f), getattr(b, f))


def test_sample_inclusion_frequencies_match_probabilities():
    # One small group, replicated into many independent groups of one call (each group draws its own start).
    base = [4.0, 1.0, 0.25, 0.0, 9.0, 100.0, 0.5, 2.0]
    quota, reps = 3, 4000
    scores = torch.tensor(base * reps)
    gids = torch.arange(reps).repeat_interleave(len(base))
    quotas = torch.full((reps,), quota)
    p = ref_probabilities(base, [0] * len(base), [quota])
    # Hand check of the reference: sqrt scores 2, 1, .5, 0, 3, 10, .707, 1.414: 10 is capped, 2 left over 8.62.
    assert p[5] == 1.0 and p[3] == 0.0 and math.isclose(sum(p), quota)
    sel = select_within_quota(
        scores, gids, quotas, max_rows=quota * reps, mode="sample", generator=torch.Generator().manual_seed(123)
    )
    assert (sel.counts == quota).all()
    ids = sel.pair_ids
    assert (ids >= 0).all()
    hits = torch.zeros(len(base), dtype=torch.float64).index_add_(
        0, ids % len(base), torch.ones(ids.shape[0], dtype=torch.float64)
    )
    freq = (hits / reps).tolist()
    for i, (f, pi) in enumerate(zip(freq, p)):
        tol = 5 * math.sqrt(pi * (1 - pi) / reps) + 1e-12
        assert abs(f - pi) <= tol, (i, f, pi, tol)
    # Horvitz-Thompson: the weighted count of kept pairs estimates the group size.
    est = sel.weights.double().sum().item() / reps
    assert abs(est - (len(base) - 1)) < 0.2  # the zero-score pair is never kept, so it is not estimated


def test_sample_draws_differ_between_seeds():
    scores = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    gids = torch.zeros(6, dtype=torch.int64)
    seen = {
        tuple(
            select_within_quota(
                scores, gids, torch.tensor([2]), max_rows=2, mode="sample",
                generator=torch.Generator().manual_seed(s),
            ).pair_ids.tolist()
        )
        for s in range(30)
    }
    assert len(seen) > 1
    assert all(len(set(x)) == 2 for x in seen)


@pytest.mark.parametrize("mode", ["top", "sample"])
def test_quota_equal_to_size_keeps_all_with_weight_one_and_quota_zero_keeps_none(mode):
    scores = torch.tensor([0.0, 3.0, 1.0, float("nan"), 2.0, 0.5])
    gids = torch.tensor([0, 1, 0, 1, 1, 2])
    sel = select_within_quota(scores, gids, torch.tensor([2, 3, 0]), max_rows=6, mode=mode)
    assert sel.counts.tolist() == [2, 3, 0]
    assert sel.offsets.tolist() == [2, 5, 5]
    assert sorted(sel.pair_ids[:2].tolist()) == [0, 2]
    assert sorted(sel.pair_ids[2:5].tolist()) == [1, 3, 4]
    assert sel.pair_ids[5].item() == -1
    assert sel.weights.tolist() == [1.0] * 5 + [0.0]


@pytest.mark.parametrize("mode", ["top", "sample"])
def test_negative_quota_keeps_none(mode):
    sel = select_within_quota(
        torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0, 1, 1]), torch.tensor([-2, 1]), max_rows=3, mode=mode
    )
    assert sel.counts.tolist() == [0, 1]
    assert sel.pair_ids[0].item() in (1, 2) and sel.pair_ids[1:].tolist() == [-1, -1]


def test_probabilities_by_hand():
    gids = torch.zeros(3, dtype=torch.int64)
    # sqrt: 2, 1, 0; quota 1 -> 2/3, 1/3, 0.
    p = inclusion_probabilities(torch.tensor([4.0, 1.0, 0.0]), gids, torch.tensor([1]))
    torch.testing.assert_close(p, torch.tensor([2 / 3, 1 / 3, 0.0], dtype=torch.float64))
    # sqrt: 10, 1, 1; quota 2 -> 10 capped at 1, the other unit split 1/2, 1/2.
    p = inclusion_probabilities(torch.tensor([100.0, 1.0, 1.0]), gids, torch.tensor([2]))
    torch.testing.assert_close(p, torch.tensor([1.0, 0.5, 0.5], dtype=torch.float64))
    # One positive score, quota 3 of 4: the positive one is certain, the zeros share the other 2.
    gids4 = torch.zeros(4, dtype=torch.int64)
    p = inclusion_probabilities(torch.tensor([3.0, 0.0, 0.0, 0.0]), gids4, torch.tensor([3]))
    torch.testing.assert_close(p, torch.tensor([1.0, 2 / 3, 2 / 3, 2 / 3], dtype=torch.float64))
    # NaN counts as +inf: certain.
    p = inclusion_probabilities(torch.tensor([1.0, float("nan"), 1.0]), gids, torch.tensor([1]))
    torch.testing.assert_close(p, torch.tensor([0.0, 1.0, 0.0], dtype=torch.float64))


@given(st.lists(st.floats(0.0, 2.0**127, width=32), min_size=1, max_size=8), st.integers(0, 2**31 - 1))
def test_sample_with_full_quota_keeps_everything_with_weight_exactly_one(scores, seed):
    # retain = 1 must reproduce the dense backward: every pair kept, every weight exactly 1, whatever the scores.
    P = len(scores)
    sel = select_within_quota(
        torch.tensor(scores), torch.zeros(P, dtype=torch.int64), torch.tensor([P]), max_rows=P, mode="sample",
        generator=torch.Generator().manual_seed(seed),
    )
    assert sorted(sel.pair_ids.tolist()) == list(range(P))
    assert (sel.weights == 1).all()


@example([0.25, 0.25, 1.0, 1.9253617673202504e-24], 3)
@example([1.0, 1e-24, 1e-24], 2)
@given(st.lists(st.floats(0.0, 2.0**20, width=32), min_size=1, max_size=8), st.integers(0, 8))
def test_probabilities_of_tiny_scores_next_to_capped_ones(scores, quota):
    # Capped pairs that dwarf the rest must not cost the rest their precision.
    gids = [0] * len(scores)
    p = inclusion_probabilities(*_tensors(scores, gids, [quota]))
    np.testing.assert_allclose(p.numpy(), ref_probabilities(scores, gids, [quota]), rtol=1e-9, atol=0)


def test_probabilities_do_not_depend_on_other_groups_scale():
    # A group of small scores placed after a group of huge ones gets the same probabilities as on its own.
    small = [1.0, 4.0, 9.0, 0.0, 0.0]
    want = torch.tensor([1 / 6, 2 / 6, 3 / 6, 0.0, 0.0], dtype=torch.float64)
    alone = inclusion_probabilities(torch.tensor(small), torch.zeros(5, dtype=torch.int64), torch.tensor([1]))
    torch.testing.assert_close(alone, want)
    for big in (1e10, 1e30, 3e38):
        p = inclusion_probabilities(
            torch.tensor([big, big / 4] + small), torch.tensor([0, 0, 1, 1, 1, 1, 1]), torch.tensor([1, 1])
        )
        torch.testing.assert_close(p[2:], want)
        torch.testing.assert_close(p[:2], torch.tensor([2 / 3, 1 / 3], dtype=torch.float64))


# ------------------------------------------------------------------------------------------------ errors

_S, _G, _Q = torch.rand(5), torch.tensor([0, 1, 0, 1, 1]), torch.tensor([1, 2])


@pytest.mark.parametrize(
    "args, kwargs, exc, name",
    [
        ((_S, _G[:4], _Q), {"max_rows": 4}, ValueError, "group_ids_P"),
        ((_S.reshape(5, 1), _G, _Q), {"max_rows": 4}, ValueError, "scores_P"),
        ((_S, _G.float(), _Q), {"max_rows": 4}, TypeError, "group_ids_P"),
        ((_S, _G, _Q.float()), {"max_rows": 4}, TypeError, "quotas_G"),
        ((_S.long(), _G, _Q), {"max_rows": 4}, TypeError, "scores_P"),
        ((_S, _G, _Q), {"max_rows": -1}, ValueError, "max_rows"),
        ((_S, _G, _Q), {"max_rows": 4.0}, ValueError, "max_rows"),
        ((_S, _G, _Q), {"max_rows": torch.tensor(4)}, ValueError, "max_rows"),
        ((_S, _G, _Q), {"max_rows": 4, "mode": "best"}, ValueError, "mode"),
        ((_S, _G, _Q), {"max_rows": 4, "mode": "sample", "uniform_G": torch.rand(3)}, ValueError, "uniform_G"),
        ((_S, _G, _Q), {"max_rows": 4, "mode": "sample", "uniform_G": [0.1, 0.2]}, TypeError, "uniform_G"),
        ((_S, _G, _Q), {"max_rows": 4, "mode": "sample", "uniform_G": torch.tensor([0, 1])}, TypeError, "uniform_G"),
        ((_S, _G, _Q), {"max_rows": 4, "group_order_P": torch.arange(4)}, ValueError, "group_order_P"),
        ((_S, _G, _Q), {"max_rows": 4, "group_order_P": torch.arange(5).int()}, TypeError, "group_order_P"),
        ((_S, _G, _Q), {"max_rows": 4, "group_order_P": torch.arange(5.0)}, TypeError, "group_order_P"),
        ((_S, _G, _Q), {"max_rows": 4, "max_group_size": -1}, ValueError, "max_group_size"),
        ((_S, _G, _Q), {"max_rows": 4, "max_group_size": 4.0}, ValueError, "max_group_size"),
    ],
)
def test_select_errors_name_the_argument(args, kwargs, exc, name):
    with pytest.raises(exc, match=name):
        select_within_quota(*args, **kwargs)


def test_the_default_mode_is_the_unbiased_sample_as_in_the_layer():
    """select_within_quota's default mode is LRMoE's default selection, "sample": weights 1/p (the kept pairs'
    weighted count estimates the group size), drawn from the global RNG when no generator or uniforms are given."""
    import inspect

    from lrmoe.nn import LRMoE

    assert (inspect.signature(select_within_quota).parameters["mode"].default
            == inspect.signature(LRMoE).parameters["selection"].default == "sample")
    scores, gids, quotas = torch.tensor([4.0, 1.0, 9.0, 0.25, 2.0]), torch.zeros(5, dtype=torch.int64), torch.tensor([2])
    torch.manual_seed(7)
    got = select_within_quota(scores, gids, quotas, max_rows=2)
    torch.manual_seed(7)
    want = select_within_quota(scores, gids, quotas, max_rows=2, mode="sample")
    assert torch.equal(got.pair_ids, want.pair_ids) and torch.equal(got.weights, want.weights)
    p = inclusion_probabilities(scores, gids, quotas)
    torch.testing.assert_close(got.weights.double(), 1 / p[got.pair_ids], rtol=1e-6, atol=0)
    assert (got.weights > 1).any()  # not "top"'s weight 1
