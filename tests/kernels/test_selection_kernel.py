"""lrmoe_kernels.selection through its launcher (lrmoe.ops.selection.select_within_quota_triton, the CUDA kernel of
lrmoe::select_within_quota) equals the reference (the op's CPU kernel) exactly: pair_ids, weights, counts and
offsets, in both modes, on tiny odd cases: empty groups, quota 0, negative and above the group size, ties, +-inf,
NaN and -0.0 scores, a buffer too small for the quotas, fewer pairs than groups.

Without a GPU the kernels run in Triton's interpreter (tests/conftest.py switches it on) on CPU tensors, at Python
speed: shapes stay tiny. On a GPU the same tests run on CUDA tensors.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from lrmoe.ops._kernels import kernel_module
from lrmoe.ops.selection import argsort_ids, select_within_quota_reference, select_within_quota_triton

INTERPRET = kernel_module("launch") is not None and kernel_module("launch").interpreting()
DEVICE = "cpu" if INTERPRET else "cuda"
pytestmark = [
    pytest.mark.skipif(
        not INTERPRET and not torch.cuda.is_available(), reason="needs a CUDA device or TRITON_INTERPRET=1"
    ),
    # The interpreter evaluates with NumPy, which warns on 1/p for the p = 0 pairs (never kept, as in the reference).
    pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning"),
]
pytest.importorskip("triton")

INF, NAN = float("inf"), float("nan")


def assert_same(scores, gids, quotas, max_rows, uniform=None, gid_dtype=torch.int64, u_dtype=torch.float64,
                every_path=True):
    t = (
        torch.tensor(scores, dtype=torch.float32, device=DEVICE),
        torch.tensor(gids, dtype=gid_dtype, device=DEVICE),
        torch.tensor(quotas, dtype=torch.int64, device=DEVICE),
    )
    if uniform is None:
        uniform = [(0.37 + 0.29 * g) % 1.0 for g in range(len(quotas))]
    u = torch.tensor(uniform, dtype=u_dtype, device=DEVICE)
    order = argsort_ids(t[1])
    # The cumulative group sizes, counted here on the host from the lists (the layer has them from its dispatch).
    ends = torch.tensor([sum(g <= e for g in gids) for e in range(len(quotas))], dtype=torch.int32, device=DEVICE)
    for mode in ("top", "sample"):
        want = select_within_quota_reference(*t, max_rows, mode, u)
        # The Triton path sorting the group ids itself, and given their order (as the MoE layer gives it).
        # max_group_size: the per-group register sort of "sample" (any bound >= every group's size): the pair
        # count, and a looser one as the layers give it (their token count, far above a group's size), so that a
        # group is sorted in a block below the bound's (the kernel sorts each group in the smallest of several
        # blocks that holds it). ends: the plan reads the groups' starts and sizes instead of searching for them.
        bound = max(len(scores), 1)
        paths = ((None, None, None), (order, None, None), (order, bound, None), (None, None, ends),
                 (order, 8 * bound + 5, ends))
        # every_path=False: the kernel finding everything itself, and given everything (as the layers call it).
        for given_order, bound, given_ends in paths if every_path else paths[::4]:
            got = select_within_quota_triton(*t, max_rows, mode, u, given_order, bound, given_ends)
            # A custom op's outputs may alias neither its inputs nor each other (PyTorch rejects it on CUDA).
            ptrs = [x.untyped_storage().data_ptr() for x in (*got, *t, u) if x.numel() > 0]
            assert len(set(ptrs)) == len(ptrs), (mode, "outputs share storage")
            for name, w, g in zip(("pair_ids", "weights", "counts", "offsets"), want, got):
                assert g.dtype == w.dtype and g.shape == w.shape, (mode, name)
                assert torch.equal(g, w), (mode, name, given_order is None, given_ends is None, g.tolist(),
                                           w.tolist())


CASES = {
    "one pair": ([1.0], [0], [1], 1),
    "no pairs": ([], [], [3, 0], 2),
    "no pairs, no rows": ([], [], [1], 0),
    "empty groups": ([3.0, 1.0, 2.0, 5.0], [1, 1, 3, 3], [2, 1, 4, 1], 8),
    "quota above size and zero": ([2.0, 1.0, 4.0, 3.0, 0.5], [0, 0, 1, 1, 1], [9, 0], 5),
    "negative quota": ([1.0, 2.0, 3.0], [0, 1, 1], [-2, 1], 3),
    "ties to lower id": ([1.0, 2.0, 1.0, 2.0, 1.0, 1.0], [0, 0, 0, 0, 0, 0], [3], 6),
    "+-0 tie": ([0.0, -0.0, 0.0, -0.0, 1.0], [0, 0, 0, 0, 0], [3], 5),
    "inf and nan": ([INF, NAN, 3.0, -INF, -1.0, NAN], [0, 0, 0, 0, 0, 0], [4], 6),
    "more inf than quota": ([INF, INF, INF, 1.0], [0, 0, 0, 1], [2, 0], 4),
    "buffer too small": ([5.0, 1.0, 4.0, 2.0, 3.0, 6.0], [0, 1, 0, 1, 2, 2], [2, 2, 2], 3),
    "buffer cuts mid group": ([5.0, 1.0, 4.0, 2.0, 3.0, 6.0], [0, 1, 0, 1, 1, 1], [1, 4], 3),
    "fewer pairs than groups": ([2.0, 7.0], [4, 1], [1, 1, 1, 1, 1, 1], 3),
    "zero scores fill in": ([9.0, 0.0, 0.0, 1.0], [0, 0, 0, 0], [3], 4),
    "group ids unsorted": ([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0], [2, 0, 2, 1, 0, 2, 1], [2, 1, 3], 7),
    "buffer bigger than pairs": ([1.0, 3.0, 2.0], [0, 0, 0], [2], 9),
    # Groups of 3 and 20: sorted in different blocks of the per-group sort ("sample" given a bound).
    "a large group": ([float((i * 7) % 13) for i in range(23)], [1] * 10 + [0] * 3 + [1] * 10, [2, 11], 16),
}


@pytest.mark.parametrize("name", list(CASES))
def test_cases_equal_reference(name):
    assert_same(*CASES[name])


def test_int32_group_ids_and_extreme_uniforms():
    scores = [4.0, 1.0, 0.25, 0.0, 9.0, 100.0, 0.5, 2.0]
    for u in (0.0, 0.5, 1.0 - 2.0**-53):
        assert_same(scores, [0] * 8, [3], 8, uniform=[u], gid_dtype=torch.int32)
    for u in (0.0, 0.3, 1.0 - 2.0**-24):  # fp32 uniforms (the layers draw them so), read as fp64 by both
        assert_same(scores, [0] * 8, [3], 8, uniform=[u], u_dtype=torch.float32)
    # u = 0 in every group after the first: its first interval must start at exactly 0 (a review found the
    # reference keeping one pair fewer than the quota there).
    assert_same([0.5, 0.1, 0.9, 0.3, 0.7, 0.2], [0, 1, 0, 1, 0, 1], [2, 1], 3, uniform=[0.0, 0.0])


def test_many_groups_loop_the_plan_kernel():
    # More groups than one step of the plan takes (BLOCK_G: 256 on a GPU, 16 under the interpreter): the running
    # end carries over.
    from lrmoe.ops._kernels import kernel_module

    G = 3 * kernel_module("selection").BLOCK_G + 5
    gids = [g for g in range(0, G, 7) for _ in range(2)] + [G - 1]
    scores = [float((i * 37) % 11) for i in range(len(gids))]
    assert_same(scores, gids, [1] * G, len(gids), uniform=[0.5] * G)


_score = st.one_of(
    st.sampled_from([0.0, -0.0, 0.25, 1.0, 1.0, 4.0, INF, NAN, -1.0, -INF]),
    st.floats(0.0, 100.0, width=32),
)


@st.composite
def cases(draw):
    G = draw(st.integers(1, 5))
    P = draw(st.integers(0, 12))
    gids = draw(st.lists(st.integers(0, G - 1), min_size=P, max_size=P))
    scores = draw(st.lists(_score, min_size=P, max_size=P))
    quotas = draw(st.lists(st.integers(-1, P + 2), min_size=G, max_size=G))
    max_rows = draw(st.integers(0, P + 3))
    uniform = draw(st.lists(st.floats(0.0, 1.0, exclude_max=True), min_size=G, max_size=G))
    return scores, gids, quotas, max_rows, uniform


@given(cases())
@example(([1.0, 1.0, 1.0], [0, 0, 0], [2], 3, [0.999]))
def test_random_cases_equal_reference(case):
    # The two ends of the launcher's paths per random case (the named cases above take all five): the interpreter
    # runs each path at Python speed, and this test was the suite's slowest on two cores.
    assert_same(*case, every_path=False)


def _probabilities_both(scores, gids, quotas):
    """(Triton, reference) fp64 inclusion probabilities in pair order for one case."""
    from lrmoe.ops._kernels import kernel_module
    from lrmoe.ops.selection import group_sizes, nan_as_inf, probabilities, sample_weights

    kernels = kernel_module("selection")
    s = torch.tensor(scores, dtype=torch.float32, device=DEVICE)
    g = torch.tensor(gids, dtype=torch.int64, device=DEVICE)
    q = torch.tensor(quotas, dtype=torch.int64, device=DEVICE)
    by_score, _, _ = kernels.score_order(s, g, 0)
    plan = kernels.plan_groups(g, by_score, q, len(scores))
    got = kernels.sample_probabilities(sample_weights(nan_as_inf(s)), by_score, plan)
    sizes, starts, take = group_sizes(g, q)
    return got, probabilities(nan_as_inf(s), g, take, sizes, starts)


@pytest.mark.parametrize("name", list(CASES))
def test_sample_probabilities_kernel_is_bit_identical(name):
    scores, gids, quotas, _ = CASES[name]
    got, want = _probabilities_both(scores, gids, quotas)
    assert got.dtype == torch.float64 and torch.equal(got, want), (got.tolist(), want.tolist())
    assert torch.equal(torch.signbit(got), torch.signbit(want))  # +-0 too


@given(cases())
@example(([3.0] * 9 + [1e-30] * 4, [0] * 13, [5], 13, [0.5]))  # a tail of tiny weights after large ones, 4 rounds
def test_sample_probabilities_random_cases(case):
    scores, gids, quotas, _, _ = case
    got, want = _probabilities_both(scores, gids, quotas)
    assert torch.equal(got, want) and torch.equal(torch.signbit(got), torch.signbit(want))


def test_sample_probabilities_groups_larger_than_a_block():
    # Groups of 2,500 and 1,100 members (more than one 1,024-wide block, scan distances up to 2,048) and an empty
    # one, with ties, zeros, negatives and +inf among the scores.
    gen = torch.Generator().manual_seed(5)
    gids = torch.cat([torch.zeros(2500, dtype=torch.int64), torch.full((1100,), 2, dtype=torch.int64)])
    gids = gids[torch.randperm(gids.shape[0], generator=gen)]
    scores = torch.rand(gids.shape[0], generator=gen).mul(4).round().sub(0.5)  # ties, negatives
    scores[::97] = float("inf")
    scores[5::13] *= 1e-6
    got, want = _probabilities_both(scores.tolist(), gids.tolist(), [900, 7, 1000])
    assert torch.equal(got, want)
    assert abs(float(got[gids == 0].sum()) - 900) < 1e-6 and abs(float(got[gids == 2].sum()) - 1000) < 1e-6


@pytest.mark.parametrize("quota, max_rows", [(23, 80), (1, 80), (44, 80), (50, 80), (30, 20)])
def test_top_groups_across_blocks_with_ties_at_the_threshold(quota, max_rows):
    # "top" runs one program per group over blocks of its members (16 under the interpreter): groups of 45 and 30
    # members, scores from few distinct values so the threshold value repeats across blocks and the ties kept
    # must be the lowest pair ids; +inf, NaN and both zeros among them; quotas cutting inside the ties, the whole
    # group, more than the group; a buffer that cuts the second group.
    gen = torch.Generator().manual_seed(7)
    gids = torch.cat([torch.zeros(45, dtype=torch.int64), torch.ones(30, dtype=torch.int64)])
    gids = gids[torch.randperm(75, generator=gen)]
    scores = torch.randint(0, 4, (75,), generator=gen).float()
    scores[[3, 40]] = INF
    scores[[11, 60]] = NAN
    scores[[5, 6, 50]] = -0.0
    assert_same(scores.tolist(), gids.tolist(), [quota, quota // 2 + 1], max_rows)


@pytest.mark.parametrize("take", [1, 7, 11, 20])
def test_top_threshold_in_the_low_digits(take):
    # Scores one ulp apart around 1.0, shuffled, with repeats: their keys share the top three 8-bit digits, so the
    # threshold is decided by the last radix step; ties at it go to the lowest pair ids. Groups of 12 and 20
    # members: under the interpreter (blocks of 16) one is counted in registers, the other re-read per pass.
    gen = torch.Generator().manual_seed(11)
    ulps = torch.randint(0, 9, (32,), generator=gen)
    scores = (torch.ones(32).view(torch.int32) + ulps.int()).view(torch.float32)
    gids = torch.cat([torch.zeros(12, dtype=torch.int64), torch.ones(20, dtype=torch.int64)])
    gids = gids[torch.randperm(32, generator=gen)]
    assert_same(scores.tolist(), gids.tolist(), [min(take, 12), take], 32)
