"""ExpertParallel with replicas and a backward capacity (lrmoe/nn/expert_parallel.py) on 2 and 4 gloo CPU ranks.

The contract: with ``max_replicas`` and ``capacity_factor``, an expert-parallel step still equals the single-device
LRMoE step on the gathered batch under the same global plan. The plan (placement, forward assignment, per-instance
quotas) is read from the layer's statistics; the reference rebuilds from it, by the documented rule, which instance
ran each pair (a source's pairs of expert e in pair order: the first routes[s, e, 0] on rank 0, the next on rank 1,
...), and groups pairs by (source, instance) with the planned quotas. Every expert shard's gradient must then be
the sum of its owner's and its replicas' contributions. Also: each rank's backward rows stay within its capacity,
backward all-to-all rows are the retained rows, and bad configurations raise errors naming the argument.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

from ep_harness import RecordAllToAll, RecordBmm, run_ranks
from lrmoe.functional import ExpertPlan, place_hot_replicas, plan_quotas, route_topk, selective_swiglu_experts
from lrmoe.nn import ExpertParallel, ExpertParallelStats, LRMoE

D, FF, E, K = 8, 6, 8, 2


def tokens_of(rank: int) -> int:
    return 10 + 3 * rank


def skewed_layer(retain, selection, seed, min_retain=0.0):
    """A layer whose router sends most tokens to experts 0 and 1, both owned by rank 0 (x shifted along the
    direction they favour), so rank 0 would be overloaded without replicas and the hot-expert policy places some."""
    torch.manual_seed(seed)
    u = torch.nn.functional.normalize(torch.randn(D), dim=0)
    layer = LRMoE(D, FF, E, K, retain=retain, selection=selection, min_retain=min_retain)
    with torch.no_grad():
        layer.gate.weight[:2] += 4 * u
    return layer, u


def reference_forward(layer: LRMoE, x_TD, token_counts, stats, uniform_SG=None):
    """The single-device step on the gathered batch, pairs grouped by (source, instance) with the EP plan's
    quotas. Pseudo-source x = s * W + w stands for "source s, run on rank w"."""
    n_src = len(token_counts)
    inst_WI = stats.instances
    n_ranks, n_inst = inst_WI.shape
    routing = route_topk(layer.gate(x_TD), layer.top_k, score_func=layer.routing.score_func,
                         norm_topk_prob=layer.routing.norm_topk_prob)
    slot = {(int(inst_WI[w, i]), w): i for w in range(n_ranks) for i in range(n_inst) if inst_WI[w, i] >= 0}
    n_x = n_src * n_ranks
    loads_XE = torch.zeros(n_x, E, dtype=torch.int64)
    quotas_XE = torch.zeros(n_x, E, dtype=torch.int64)
    uniform_XE = torch.zeros(n_x, E)
    for s in range(n_src):
        for w in range(n_ranks):
            for e in range(E):
                if (e, w) in slot:
                    i = slot[(e, w)]
                    loads_XE[s * n_ranks + w, e] = stats.assignment[s, w, i]
                    quotas_XE[s * n_ranks + w, e] = stats.instance_quotas[s, w, i]
                    if uniform_SG is not None:
                        uniform_XE[s * n_ranks + w, e] = uniform_SG[s][w * n_inst + i]
    # Which rank ran each pair, by the documented rule, walking each source's pairs in order.
    ids = routing.expert_ids
    group_TK = torch.empty_like(ids)
    start = 0
    for s, n in enumerate(token_counts):
        seen = [0] * E
        for t in range(start, start + n):
            for k in range(layer.top_k):
                e = int(ids[t, k])
                j, seen[e] = seen[e], seen[e] + 1
                w = 0
                while j >= sum(int(loads_XE[s * n_ranks + v, e]) for v in range(w + 1)):
                    w += 1
                group_TK[t, k] = e * n_x + s * n_ranks + w
        start += n
    plan = ExpertPlan(loads=loads_XE, quotas=quotas_XE, uniform=uniform_XE if uniform_SG is not None else None,
                      group_ids=group_TK)
    return selective_swiglu_experts(
        x_TD, layer.experts.gate_up_proj, layer.experts.down_proj, ids, routing.gates.to(x_TD.dtype),
        backward=layer.backward, plan=plan,
    )


def _matches_reference(rank, world, configs, plan_on="device", backward_blocks=False):
    mesh = init_device_mesh("cpu", (world,))
    counts = [tokens_of(r) for r in range(world)]
    start = sum(counts[:rank])
    rows = slice(start, start + counts[rank])
    n_local = E // world
    for retain, selection, capacity_factor, seed in configs:
        ref, u = skewed_layer(retain, selection, seed)
        x_all = torch.randn(sum(counts), D) + 2 * u
        c_all = torch.randn(sum(counts), D)
        style = ExpertParallel(max_replicas=2, capacity_factor=capacity_factor, plan_on=plan_on,
                               backward_blocks=backward_blocks)
        layer = parallelize_module(copy.deepcopy(ref), mesh, style)
        layer.backward = dataclasses.replace(layer.backward, generator=torch.Generator().manual_seed(1000 + rank))

        x = x_all[rows].clone().requires_grad_(True)
        out = layer(x)
        with RecordBmm() as bmm:
            (out * c_all[rows]).sum().backward()
        stats = layer.stats()
        n_inst = stats.instances.shape[1]

        # The plan is sane and is the one the policy gives on the gathered loads.
        assert torch.equal(stats.instances[:, n_local:], place_hot_replicas(stats.loads, 2))
        assert torch.equal(stats.assignment.sum((1, 2)), stats.loads.sum(1))
        assert (stats.instance_quotas <= stats.assignment).all()
        # Replicas exist and ran pairs: the test exercises them.
        assert int(stats.assignment[:, :, n_local:].sum()) > 0

        uniform_SG = None
        if selection == "sample" and retain < 1.0:  # rank s draws its [G] uniforms once from its generator
            uniform_SG = [torch.rand(world * n_inst, generator=torch.Generator().manual_seed(1000 + s))
                          for s in range(world)]
        xr = x_all.clone().requires_grad_(True)
        ref_out = reference_forward(ref, xr, counts, stats, uniform_SG)
        (ref_out * c_all).sum().backward()

        where = f"rank {rank} retain {retain} {selection} cf {capacity_factor}"
        tol = {"rtol": 1e-5, "atol": 1e-5, "msg": lambda m, where=where: f"{where}: {m}"}
        torch.testing.assert_close(out, ref_out[rows], **tol)
        torch.testing.assert_close(x.grad, xr.grad[rows], **tol)
        router = layer.gate.weight.grad.clone()
        dist.all_reduce(router)
        torch.testing.assert_close(router, ref.gate.weight.grad, **tol)
        experts = slice(rank * n_local, (rank + 1) * n_local)
        for name in ("gate_up_proj", "down_proj"):
            grad = getattr(layer.experts, name).grad
            assert grad.placements[0].is_shard(0)
            torch.testing.assert_close(grad.to_local(), getattr(ref.experts, name).grad[experts], **tol)

        total = sum(counts) * K
        if capacity_factor is None:
            assert int(stats.retained_pairs) == math.floor(retain * total)
        else:
            cap = math.ceil(capacity_factor * math.floor(retain * total) / world)
            assert stats.capacity.tolist() == [cap] * world
            assert (stats.rank_backward_loads <= cap).all()
        if backward_blocks:  # the blocks of the largest instance's rows had padding: the case tested something
            rows_I = stats.instance_quotas[:, rank].sum(0)
            assert int(rows_I.max()) * n_inst > int(rows_I.sum()), where
            # stats().block_padding is the padding of the blocks the backward ran: its first bmm is dy [I, C, D] by
            # down [I, D, F], and 1 - M / (I * C) with that C is the property's value for this rank.
            n_inst_run, n_block, dim = bmm.calls[0]
            assert (n_inst_run, dim) == (n_inst, D) and n_block % 8 == 0, where
            padding = 1 - int(rows_I.sum()) / (n_inst * n_block)
            assert float(stats.block_padding[rank]) == pytest.approx(padding, abs=1e-12), where
        else:
            assert bmm.calls == [], where


def test_block_padding_by_hand():
    """ExpertParallelStats.block_padding from instance quotas [S=2, W=2, I=2]: rank 0's instances keep 2 + 3 = 5
    and 4 + 7 = 11 rows, blocks of 16 (11 rounded up to 8s): 32 slots, 16 of them padding; rank 1's keep 8 and 8,
    blocks of 8: none. A plan with no rows has no padding."""
    def stats_with(quotas):
        fields = dict.fromkeys(f.name for f in dataclasses.fields(ExpertParallelStats))
        return ExpertParallelStats(**{**fields, "instance_quotas": quotas})

    quotas = torch.tensor([[[2, 4], [3, 5]], [[3, 7], [5, 3]]])
    assert stats_with(quotas).block_padding.tolist() == [0.5, 0.0]
    assert stats_with(torch.zeros(2, 2, 2, dtype=torch.int64)).block_padding.tolist() == [0.0, 0.0]


CONFIGS = [(1.0, "top", None, 0), (0.75, "top", None, 1), (0.75, "sample", None, 2), (0.75, "top", 1.0, 3),
           (0.75, "sample", 1.0, 4)]


@pytest.mark.parametrize("world, plan_on", [(2, "device"), (4, "device"), (4, "host")])
def test_replicas_match_single_device_under_the_same_plan(world, plan_on):
    run_ranks(world, _matches_reference, CONFIGS, plan_on)


@pytest.mark.parametrize("world, plan_on", [(2, "host"), (4, "device")])
def test_blocked_backward_matches_single_device_under_the_same_plan(world, plan_on):
    """ExpertParallel(backward_blocks=True): each rank runs its instances' backward on equal zero-padded blocks
    with batched GEMMs, and every gradient is still the single-device reference's (dense, top, sample, capacity)."""
    run_ranks(world, _matches_reference, CONFIGS, plan_on, True)


def _blocked_equals_grouped(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    for activations in ("save", "recompute", "offload"):
        for rank0_tokens in (0, 5):  # rank 0 with no tokens: no rows to send, some to receive
            torch.manual_seed(0)
            ref = LRMoE(D, FF, E, K, retain=0.5, selection="top", activations=activations)
            results = []
            for blocks in (False, True):
                layer = parallelize_module(copy.deepcopy(ref), mesh, ExpertParallel(backward_blocks=blocks))
                torch.manual_seed(1 + rank)
                x = torch.randn(rank0_tokens if rank == 0 else 7, D, requires_grad=True)
                c = torch.randn(x.shape)
                (layer(x) * c).sum().backward()
                results.append([x.grad, layer.gate.weight.grad, layer.experts.gate_up_proj.grad.to_local(),
                                layer.experts.down_proj.grad.to_local()])
            for got, want in zip(results[1], results[0]):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6,
                                           msg=lambda m, a=activations: f"rank {rank} {a}: {m}")


def test_blocked_backward_equals_grouped_for_every_activation_policy_and_an_empty_rank():
    run_ranks(2, _blocked_equals_grouped)


# ------------------------------------------------------------------------------------- capacity and payloads




def _capacity_and_payloads(rank, world, max_replicas, capacity_factor, retain, plan_on="device"):
    mesh = init_device_mesh("cpu", (world,))
    base, u = skewed_layer(retain, "top", 0)
    layer = parallelize_module(base, mesh, ExpertParallel(max_replicas=max_replicas,
                                                          capacity_factor=capacity_factor, plan_on=plan_on))
    torch.manual_seed(10 + rank)
    x = (torch.randn(48, D) + 2 * u).requires_grad_(True)
    with RecordAllToAll() as fwd:
        out = layer(x)
    with RecordAllToAll() as bwd:
        out.square().sum().backward()
    stats = layer.stats()
    row = D * 4
    weight_row = (2 * FF * D + D * FF) * 4
    # Forward: replica weights (with replicas), then dispatch and combine; backward: retained rows, input-gradient
    # rows, then the replica weight gradients back to their owners.
    fwd_rows = [c for c in fwd.messages() if c[2] != weight_row]
    (d_send, d_recv, d_bytes), _ = fwd_rows
    bwd_rows = [c for c in bwd.messages() if c[2] != weight_row]
    (b_send, b_recv, b_bytes), _ = bwd_rows
    assert d_bytes == row and b_bytes == row + 4
    if max_replicas:
        (w_send, w_recv, _), = [c for c in fwd.calls if c[2] == weight_row]
        (g_send, g_recv, _), = [c for c in bwd.calls if c[2] == weight_row]
        assert (g_send, g_recv) == (w_recv, w_send)  # gradients go back the way the weights came
        assert int(stats.replica_bytes) == weight_row * (sum(w_send) - w_send[rank])
        assert int(stats.replica_grad_bytes) == weight_row * (sum(g_send) - g_send[rank])
        n_rep = int((stats.instances[rank, E // world:] >= 0).sum())
        assert sum(w_recv) == n_rep

    # Rows entering this rank's expert backward: within its capacity, computed here from the documented formula.
    P = int(stats.loads.sum())
    budget = math.floor(retain * P)
    cap = math.ceil(capacity_factor * budget / world)
    assert sum(b_recv) == int(stats.rank_backward_loads[rank]) <= cap
    assert sum(d_recv) == int(stats.rank_loads[rank])

    # Globally: backward rows are the budget, or what the capacities can hold when pairs return to the instance
    # that ran them: sum over ranks of min(capacity, forward rows). Backward bytes per row are constant, so they
    # fall in proportion to the retained rows.
    sent = torch.tensor([sum(d_send), sum(b_send), sum(b_recv)], dtype=torch.float64)
    dist.all_reduce(sent)
    holdable = sum(min(cap, int(n)) for n in stats.rank_loads)
    assert sent[0] == P and sent[1] == sent[2] == min(budget, holdable)
    if max_replicas:
        # Replicas spread the forward load, so the capacities hold the whole budget.
        assert holdable >= budget
    else:
        # Without replicas the hot owner's capacity cuts the budget: what replicas are for.
        assert holdable < budget
    # The capacity bound: the same layer's quotas without capacity would have overloaded some rank.
    G = stats.assignment.shape[1] * stats.assignment.shape[2]
    uncapped = plan_quotas(stats.assignment.reshape(world, G), retain).view_as(stats.assignment).sum((0, 2))
    assert int(uncapped.max()) > cap, (uncapped.tolist(), cap)


# plan_on="host": the plan on CPU tensors, then packed into one copy to the layer's device (here also the CPU, so
# this checks the packing and that every invariant still holds; the device-to-host path runs on the GPU).
@pytest.mark.parametrize("world, max_replicas, plan_on", [(2, 0, "device"), (4, 1, "device"), (4, 1, "host")])
def test_backward_load_within_capacity_and_bytes_follow_retained_rows(world, max_replicas, plan_on):
    run_ranks(world, _capacity_and_payloads, max_replicas, 1.0, 0.5, plan_on)


@pytest.mark.parametrize("capacity_factor", [None, 1.25])
def test_plan_moved_to_the_device_in_one_copy_keeps_every_tensor(capacity_factor):
    from lrmoe.functional.expert_parallel import plan_expert_parallel, plan_to as _plan_to

    loads_WE = torch.tensor([[9, 0, 3, 1, 7, 2], [4, 4, 0, 8, 1, 5], [0, 6, 2, 2, 3, 9]])
    plan = plan_expert_parallel(loads_WE, 0.5, max_replicas=1, capacity_factor=capacity_factor)
    moved = _plan_to(plan, loads_WE)
    for name in ("loads", "instances", "routes", "assignment", "instance_quotas", "quotas", "capacity"):
        want, got = getattr(plan, name), getattr(moved, name)
        if want is None:
            assert got is None, name
        else:
            assert got.dtype == want.dtype and torch.equal(got, want), name


# ------------------------------------------------------------------------------------------------ bad configs


# The replication arguments ExpertParallel and plan_expert_parallel share (one check for both).
_BAD_REPLICATION = [
    ({"max_replicas": -1}, ValueError, "max_replicas"),
    ({"max_replicas": 1.5}, ValueError, "max_replicas"),
    ({"max_replicas": True}, ValueError, "max_replicas"),  # a bool is not a count
    ({"capacity_factor": 0.5}, ValueError, "capacity_factor"),  # too small to hold the budget
    ({"capacity_factor": -1.0}, ValueError, "capacity_factor"),
    ({"capacity_factor": float("nan")}, ValueError, "capacity_factor"),
    ({"capacity_factor": float("inf")}, ValueError, "capacity_factor"),
    ({"capacity_factor": "2"}, TypeError, "capacity_factor"),
    ({"capacity_factor": True}, TypeError, "capacity_factor"),
    ({"placement_policy": 3}, TypeError, "placement_policy"),  # neither callable nor a name
    ({"placement_policy": "coldest"}, ValueError, "placement_policy"),  # a name not registered
]


@pytest.mark.parametrize(
    "kwargs, exc, name",
    _BAD_REPLICATION + [
        ({"plan_on": "gpu"}, ValueError, "plan_on"),
        ({"backward_blocks": 1}, TypeError, "backward_blocks"),
    ],
)
def test_style_arguments_are_checked(kwargs, exc, name):
    with pytest.raises(exc, match=name):
        ExpertParallel(**kwargs)


_LOADS_WE = torch.tensor([[9, 0, 3, 1], [4, 4, 0, 8]])  # W = 2 ranks, E = 4 experts


def _no_replicas(loads_WE, max_replicas):
    return torch.full((loads_WE.shape[0], int(max_replicas)), -1, dtype=torch.int64)


@pytest.mark.parametrize(
    "loads, kwargs, exc, name",
    [(_LOADS_WE, kwargs, exc, name) for kwargs, exc, name in _BAD_REPLICATION] + [
        # At most E - E/W = 2 replicas: a rank holds at most one instance of an expert (5 was accepted).
        (_LOADS_WE, {"max_replicas": 3}, ValueError, "max_replicas"),
        # True as 1 replica slot, with a policy that does not check it (the default refuses bools itself).
        (_LOADS_WE, {"max_replicas": True, "placement_policy": _no_replicas}, ValueError, "max_replicas"),
        (_LOADS_WE.float() + 0.7, {}, TypeError, "loads_WE"),  # plan_quotas refuses floats; they were truncated
        (_LOADS_WE.bool(), {}, TypeError, "loads_WE"),
        (_LOADS_WE[:, :3], {}, ValueError, "loads_WE"),  # E % W != 0: was an opaque reshape error
        (_LOADS_WE[:0], {}, ValueError, "loads_WE"),  # W = 0
        (_LOADS_WE[0], {}, ValueError, "loads_WE"),
    ],
)
def test_plan_arguments_are_checked_as_the_style_checks_them(loads, kwargs, exc, name):
    """plan_expert_parallel is public: it refuses what ExpertParallel refuses (capacity_factor 0.5 planned too few
    quotas, -1 or nan none at all), before planning."""
    from lrmoe.nn.expert_parallel import plan_expert_parallel

    with pytest.raises(exc, match=name):
        plan_expert_parallel(loads, 0.5, **kwargs)


def _policy_returning(value):
    return lambda loads_WE, max_replicas: value


# _LOADS_WE: rank 0 owns experts 0 and 1, rank 1 owns 2 and 3. Each of these used to plan on: the ids past E or
# below -1 as an opaque index error, the others as split sizes the ranks disagree on.
@pytest.mark.parametrize("replicas, exc, match", [
    (torch.tensor([[0, -1], [-1, -1]]), ValueError, "rank that owns it"),  # rank 0 replicating its own expert 0
    (torch.tensor([[-1, -1], [1, 1]]), ValueError, "two replica slots"),  # expert 1 twice on rank 1
    (torch.tensor([[4, -1], [0, -1]]), ValueError, r"outside \[-1, E=4\)"),
    (torch.tensor([[-2, -1], [0, -1]]), ValueError, r"outside \[-1, E=4\)"),
    (torch.tensor([[2.0, -1.0], [0.0, -1.0]]), TypeError, "integer expert ids"),
    ([[2, -1], [0, -1]], ValueError, "tensor of expert ids"),
    (torch.tensor([[2], [0]]), ValueError, r"\[W=2, max_replicas=2\]"),
])
def test_a_placement_policys_output_is_checked(replicas, exc, match):
    from lrmoe.nn.expert_parallel import plan_expert_parallel

    with pytest.raises(exc, match=match):
        plan_expert_parallel(_LOADS_WE, 0.5, max_replicas=2, placement_policy=_policy_returning(replicas))
    # The same ids, valid: rank 0 replicating 2 and 3, rank 1 replicating 0.
    plan = plan_expert_parallel(_LOADS_WE, 0.5, max_replicas=2,
                                placement_policy=_policy_returning(torch.tensor([[2, 3], [0, -1]])))
    assert plan.instances.tolist() == [[0, 1, 2, 3], [2, 3, 0, -1]]


def test_plan_accepts_the_limits_and_any_integer_loads():
    from lrmoe.nn.expert_parallel import plan_expert_parallel

    want = plan_expert_parallel(_LOADS_WE, 0.5, max_replicas=2, capacity_factor=1)  # E - E/W, an int factor
    got = plan_expert_parallel(_LOADS_WE.int(), 0.5, max_replicas=2, capacity_factor=1.0)
    assert want.instances.shape == (2, 4)
    for a, b in zip(dataclasses.astuple(want), dataclasses.astuple(got)):
        assert (a is None and b is None) or (a.dtype == b.dtype == torch.int64 and torch.equal(a, b))


def _configurations(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    # A rank holds at most one instance of an expert: E - E/W replicas at most.
    with pytest.raises(ValueError, match="max_replicas"):
        parallelize_module(LRMoE(D, FF, E, K), mesh, ExpertParallel(max_replicas=E - E // world + 1))
    # A placement policy that returns the wrong shape.
    bad = parallelize_module(LRMoE(D, FF, E, K), mesh,
                             ExpertParallel(max_replicas=1, placement_policy=lambda loads, r: loads[:, :r + 1]))
    with pytest.raises(ValueError, match="placement_policy"):
        bad(torch.randn(4, D))
    # One that replicates the rank's own expert: every rank raises in its plan (before any split-size mismatch).
    for plan_on in ("host", "device"):
        own = parallelize_module(LRMoE(D, FF, E, K), mesh, ExpertParallel(
            max_replicas=1, plan_on=plan_on,
            placement_policy=lambda loads, r: torch.arange(loads.shape[0]).unsqueeze(1) * (E // world)))
        with pytest.raises(ValueError, match="rank that owns it"):
            own(torch.randn(4, D))
    # A replaceable policy: "no replicas" gives the owners-only layer, bit for bit.
    torch.manual_seed(0)
    base = LRMoE(D, FF, E, K, retain=0.5, selection="top")
    torch.manual_seed(1 + rank)
    x, c = torch.randn(12, D), torch.randn(12, D)
    results = []
    for style in (ExpertParallel(), ExpertParallel(max_replicas=1, placement_policy=lambda loads, r: torch.full(
            (loads.shape[0], r), -1, dtype=torch.int64))):
        layer = parallelize_module(copy.deepcopy(base), mesh, style)
        xi = x.clone().requires_grad_(True)
        out = layer(xi)
        (out * c).sum().backward()
        results.append([out, xi.grad, layer.experts.down_proj.grad.to_local(), layer.stats().quotas])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_configurations_with_replicas():
    run_ranks(2, _configurations)
