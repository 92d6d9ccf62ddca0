"""lrmoe::select_within_quota: torch.library.opcheck in both modes, the op's argument checks, non-differentiable
outputs, the CUDA op against the CPU reference (on a GPU), and torch.compile(fullgraph=True) of the functional
entry point (one op in the graph, same result as eager).
"""

from __future__ import annotations

import operator

import pytest
import torch

from lrmoe.functional import select_within_quota as select_fn
from lrmoe.ops import select_within_quota
from lrmoe.ops.selection import select_within_quota_reference

INF, NAN = float("inf"), float("nan")


def _inputs(seed=0, P=11, G=4, gid_dtype=torch.int64):
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(P, generator=g) * 4
    scores[[2, 7]] = torch.tensor([INF, NAN])
    scores[5] = scores[3]  # a tie
    gids = torch.randint(0, G - 1, (P,), generator=g).to(gid_dtype)  # group G - 1 stays empty
    quotas = torch.tensor([2, 9, 0, 1])[:G]
    uniform = torch.rand(G, generator=g, dtype=torch.float64)
    return scores, gids, quotas, uniform


# ------------------------------------------------------------------------------------------------------- opcheck


@pytest.mark.parametrize("max_rows", [0, 5, 14])
@pytest.mark.parametrize("mode", ["top", "sample"])
def test_opcheck(mode, max_rows):
    scores, gids, quotas, uniform = _inputs()
    torch.library.opcheck(select_within_quota, (scores, gids, quotas, max_rows, mode, uniform))
    order = torch.argsort(gids, stable=True)  # the group order given, as the MoE layers give it
    torch.library.opcheck(select_within_quota, (scores, gids, quotas, max_rows, mode, uniform, order))
    ends = torch.bincount(gids, minlength=quotas.shape[0]).cumsum(0).int()  # and the groups' ends
    torch.library.opcheck(select_within_quota, (scores, gids, quotas, max_rows, mode, uniform, order, None, ends))


@pytest.mark.parametrize("mode", ["top", "sample"])
def test_group_ends_change_nothing_and_wrong_ones_are_refused_on_cpu(mode):
    scores, gids, quotas, uniform = _inputs(seed=5)
    order = torch.argsort(gids, stable=True)
    ends = torch.bincount(gids, minlength=quotas.shape[0]).cumsum(0)
    want = select_within_quota(scores, gids, quotas, 9, mode, uniform, order)
    for given in (ends, ends.int()):
        got = select_within_quota(scores, gids, quotas, 9, mode, uniform, order, None, given)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    wrong = ends.clone()
    wrong[0] += 1  # one member moved to the next group
    with pytest.raises(ValueError, match=r"group_ends \(select_within_quota's group_ends_G\) must be the cumulative"):
        select_within_quota(scores, gids, quotas, 9, mode, uniform, order, None, wrong)
    with pytest.raises(ValueError, match="group_ends_G must have the shape of quotas_G"):
        select_fn(scores, gids, quotas, max_rows=9, mode=mode, uniform_G=uniform, group_ends_G=ends[:-1])
    with pytest.raises(TypeError, match="group_ends_G must be an integer tensor"):
        select_fn(scores, gids, quotas, max_rows=9, mode=mode, uniform_G=uniform, group_ends_G=ends.float())


def test_opcheck_top_without_uniform_int32_ids_and_no_pairs():
    scores, gids, quotas, _ = _inputs(gid_dtype=torch.int32)
    torch.library.opcheck(select_within_quota, (scores, gids, quotas, 6, "top", None))
    torch.library.opcheck(select_within_quota, (scores[:0], gids[:0], quotas, 3, "top", None))


def test_opcheck_scores_requiring_grad():
    scores, gids, quotas, uniform = _inputs()
    scores.requires_grad_()
    torch.library.opcheck(select_within_quota, (scores, gids, quotas, 8, "sample", uniform))
    outs = select_within_quota(scores, gids, quotas, 8, "sample", uniform)
    assert not any(t.requires_grad for t in outs)  # the selection is not differentiated


def test_op_checks_mode_and_uniform():
    scores, gids, quotas, _ = _inputs()
    with pytest.raises(ValueError, match="mode"):
        select_within_quota(scores, gids, quotas, 4, "best", None)
    with pytest.raises(ValueError, match="uniform"):
        select_within_quota(scores, gids, quotas, 4, "sample", None)  # the op draws nothing


@pytest.mark.parametrize("mode", ["top", "sample"])
def test_op_equals_functional(mode):
    scores, gids, quotas, uniform = _inputs(seed=3)
    sel = select_fn(scores, gids, quotas, max_rows=7, mode=mode, uniform_G=uniform)
    outs = select_within_quota(scores, gids, quotas, 7, mode, uniform)
    for got, want in zip(outs, (sel.pair_ids, sel.weights, sel.counts, sel.offsets)):
        assert torch.equal(got, want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", ["top", "sample"])
def test_cuda_op_equals_cpu_reference(mode):
    g = torch.Generator().manual_seed(1)
    P, G = 5000, 37
    scores = torch.randn(P, generator=g).square()
    scores[torch.randint(0, P, (20,), generator=g)] = INF
    scores[torch.randint(0, P, (20,), generator=g)] = NAN
    scores[torch.randint(0, P, (200,), generator=g)] = 1.0  # ties
    quotas = torch.randint(-2, 200, (G,), generator=g)
    quotas[0] = 1700
    uniform = torch.rand(G, generator=g, dtype=torch.float64)
    spread = torch.randint(0, G, (P,), generator=g)
    hot = torch.where(torch.rand(P, generator=g) < 0.6, 0, spread)  # group 0: ~3,000 members, past one block
    for gids in (spread, hot):
        dev = [t.cuda() for t in (scores, gids, quotas, uniform)]
        order = torch.argsort(dev[1], stable=True)
        for max_rows, given in ((0, None), (1000, None), (6000, None), (6000, order), (1000, order)):
            got = select_within_quota(*dev[:3], max_rows, mode, dev[3], given)
            # Exact against the reference on the same device. "sample" rounds the fp64 cumulative sums of
            # torch.cumsum, whose association differs between devices, so only "top" is compared with the CPU too.
            want_cuda = select_within_quota_reference(*dev[:3], max_rows, mode, dev[3])
            want_cpu = select_within_quota_reference(scores, gids, quotas, max_rows, mode, uniform)
            for x, w, wc in zip(got, want_cuda, want_cpu):
                assert torch.equal(x, w)
                if mode == "top":
                    assert torch.equal(x.cpu(), wc)


# ------------------------------------------------------------------------------------------------ torch.compile


@pytest.mark.parametrize("mode", ["top", "sample"])
def test_compiled_functional_equals_eager_and_is_one_op(mode):
    torch._dynamo.reset()
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm

    scores, gids, quotas, uniform = _inputs(seed=2)
    scores.requires_grad_()  # the functional wrapper detaches: the selection is not differentiated

    def f(s, g, q, u):
        sel = select_fn(s, g, q, max_rows=6, mode=mode, uniform_G=u)
        return sel.pair_ids, sel.weights, sel.counts, sel.offsets

    want = f(scores, gids, quotas, uniform)
    for got in (
        torch.compile(f, fullgraph=True)(scores, gids, quotas, uniform),
        torch.compile(f, fullgraph=True, backend=capture)(scores, gids, quotas, uniform),
    ):
        for x, w in zip(got, want):
            assert torch.equal(x, w)
    (gm,) = graphs
    skip = (torch.Tensor.detach, operator.getitem)  # the op's outputs are one tuple
    calls = [n.target for n in gm.graph.nodes if n.op == "call_function" and n.target not in skip]
    assert calls == [torch.ops.lrmoe.select_within_quota.default], calls
    torch._dynamo.reset()


def test_compiled_sample_drawing_its_own_uniforms_is_one_graph():
    torch._dynamo.reset()
    scores, gids, quotas, _ = _inputs(seed=4)

    def f(s, g, q):
        return select_fn(s, g, q, max_rows=6, mode="sample").counts

    # The draw is random, the counts are not: min(quota, size) clipped to the buffer.
    want = select_fn(scores, gids, quotas, max_rows=6, mode="sample").counts
    assert torch.equal(torch.compile(f, fullgraph=True)(scores, gids, quotas), want)


# ------------------------------------------------------------------------------------------ narrower sort keys


def _hard_scores():
    """fp32 scores that make sort keys collide if anything is lost: neighbouring floats, the smallest subnormals,
    both zeros, negatives (all weight 0), +inf, and ties."""
    tiny = torch.finfo(torch.float32).smallest_normal
    one_up = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0)).item()
    vals = [1.0, one_up, 1.0, 0.0, -0.0, -1.0, -2.0, INF, INF, 1e-45, 3e-45, tiny, tiny, 3.4e38, 0.5, 0.25]
    return torch.tensor(vals, dtype=torch.float32)


@pytest.mark.parametrize("seed", range(5))
def test_group_sort_by_fp32_key_equals_sort_by_fp64_weight(seed):
    # probabilities() orders each group's pairs by max(score, 0) in fp32 instead of the fp64 weight
    # sqrt(max(score, 0)) it uses: the permutation must be the same, ties (to the lower pair id) included.
    from lrmoe.ops.selection import _group_sort, sample_weights

    g = torch.Generator().manual_seed(seed)
    scores = _hard_scores()[torch.randperm(16, generator=g)].repeat(3)
    gids = torch.randint(0, 4, (scores.shape[0],), generator=g)
    by_weight = _group_sort(gids, sample_weights(scores), descending=True)
    by_key = _group_sort(gids, scores.clamp(min=0), descending=True)
    assert torch.equal(by_weight, by_key)


def test_argsort_ids_is_the_stable_int64_argsort():
    from lrmoe.ops import argsort_ids

    ids = torch.randint(0, 300, (5000,), generator=torch.Generator().manual_seed(0))
    assert torch.equal(argsort_ids(ids), torch.argsort(ids, stable=True))
    assert torch.equal(argsort_ids(ids.int()), torch.argsort(ids, stable=True))


# ------------------------------------------------------------------------------------- lrmoe::inclusion_probabilities


def test_inclusion_probabilities_opcheck():
    from lrmoe.ops.selection import inclusion_probabilities as op

    scores, gids, quotas, _ = _inputs()
    torch.library.opcheck(op, (scores, gids, quotas))
    # Scores that require grad: the op's autograd registration (non-differentiable outputs) is checked too; without
    # one, opcheck's aot_dispatch test failed.
    torch.library.opcheck(op, (scores.clone().requires_grad_(True), gids, quotas))


def test_compiled_inclusion_probabilities_do_not_recompile_as_the_pair_count_grows():
    # Traced inline, the reference's segmented scan loops ceil(log2 P) times: each new power of two of P was a
    # recompile, and fullgraph failed at the recompile limit (found in review). As one op: one dynamic graph.
    from lrmoe.functional import inclusion_probabilities

    torch._dynamo.reset()
    counts = torch._dynamo.utils.counters
    counts.clear()
    fn = torch.compile(inclusion_probabilities, fullgraph=True)
    g = torch.Generator().manual_seed(0)
    for P in (10, 12, 20, 40, 70, 130, 260, 520, 1030, 2050, 4100):
        scores, gids = torch.rand(P, generator=g), torch.randint(0, 4, (P,), generator=g)
        quotas = torch.full((4,), 3)
        assert torch.equal(fn(scores, gids, quotas), inclusion_probabilities(scores, gids, quotas))
    assert counts["stats"]["unique_graphs"] <= 2, dict(counts["stats"])


def test_inclusion_probabilities_refuse_mismatched_sizes():
    from lrmoe.functional import inclusion_probabilities

    with pytest.raises(ValueError, match="group_ids_P"):
        inclusion_probabilities(torch.rand(5), torch.zeros(6, dtype=torch.int64), torch.tensor([1]))
