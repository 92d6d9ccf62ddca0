"""ExpertParallel (lrmoe/nn/expert_parallel.py) on gloo CPU process groups of 2 and 4 ranks.

The contract: an expert-parallel step equals the single-device LRMoE step on the gathered batch whose plan groups
pairs by (source rank, expert) with the same quotas (plan_experts(..., source_ids_T=...)): forward output, input
gradient, router gradient (summed over ranks: each rank's router sees its own tokens) and every expert shard's
gradient; the backward all-to-all carries exactly the retained rows; bad configurations raise before any
communication.
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

from ep_harness import RecordAllToAll, run_ranks
from lrmoe.functional import plan_experts, plan_quotas, route_topk, selective_swiglu_experts
from lrmoe.nn import ExpertParallel, LRMoE, SwiGLUExperts
from lrmoe.nn.expert_parallel import ExpertParallelDispatcher
from lrmoe.functional.expert_parallel import expert_major_order

D, FF, E, K = 8, 6, 8, 2


def tokens_of(rank: int) -> int:
    """Uneven local batches, so the all-to-all splits differ per rank."""
    return 10 + 3 * rank


# ------------------------------------------------------------------------------------------------ reference


def reference_forward(layer: LRMoE, x_TD, token_counts, uniform_SE=None):
    """The single-device LRMoE step on the gathered batch, pairs grouped by (source rank, expert)."""
    n_src = len(token_counts)
    source_ids_T = torch.repeat_interleave(torch.arange(n_src), torch.tensor(token_counts)).to(x_TD.device)
    routing = layer.route(x_TD)  # the layer's routing options (bias, groups, scaling) included
    plan = plan_experts(routing.expert_ids, layer.num_experts, backward=layer.backward, draw_uniform=False,
                        source_ids_T=source_ids_T, num_sources=n_src)
    plan = dataclasses.replace(plan, uniform=uniform_SE)
    out = selective_swiglu_experts(
        x_TD, layer.experts.gate_up_proj, layer.experts.down_proj, routing.expert_ids, routing.gates.to(x_TD.dtype),
        backward=layer.backward, plan=plan,
    )
    return layer.add_shared(x_TD, out)


def _matches_reference(rank, world, configs, layer_kwargs=None):
    mesh = init_device_mesh("cpu", (world,))
    counts = [tokens_of(r) for r in range(world)]
    start = sum(counts[:rank])
    rows = slice(start, start + counts[rank])
    n_local = E // world
    for retain, selection, seed, align in configs:
        torch.manual_seed(seed)
        ref = LRMoE(D, FF, E, K, retain=retain, selection=selection, quota_align=align, **(layer_kwargs or {}))
        if ref.routing.selection_bias:  # the same seeded bias on every rank, large enough to change choices
            with torch.no_grad():
                ref.gate.e_score_correction_bias.copy_(torch.randn(E) * 0.3)
        x_all, c_all = torch.randn(sum(counts), D), torch.randn(sum(counts), D)
        layer = parallelize_module(copy.deepcopy(ref), mesh, ExpertParallel())
        layer.backward = dataclasses.replace(layer.backward, generator=torch.Generator().manual_seed(1000 + rank))

        x = x_all[rows].clone().requires_grad_(True)
        out = layer(x)
        (out * c_all[rows]).sum().backward()

        uniform_SE = None
        if selection == "sample" and retain < 1.0:  # rank s draws its [E] uniforms once from its generator
            uniform_SE = torch.stack([torch.rand(E, generator=torch.Generator().manual_seed(1000 + s))
                                      for s in range(world)])
        xr = x_all.clone().requires_grad_(True)
        ref_out = reference_forward(ref, xr, counts, uniform_SE)
        (ref_out * c_all).sum().backward()

        tol = dict(rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank} retain {retain} {selection}: {m}")
        torch.testing.assert_close(out, ref_out[rows], **tol)
        torch.testing.assert_close(x.grad, xr.grad[rows], **tol)
        # Replicated parameters (the router, shared experts) see this rank's tokens: summed over ranks.
        for name, p in layer.named_parameters():
            if not name.startswith("experts."):
                grad = p.grad.clone()
                dist.all_reduce(grad)
                torch.testing.assert_close(grad, ref.get_parameter(name).grad, **tol)
        experts = slice(rank * n_local, (rank + 1) * n_local)
        for name in ("gate_up_proj", "down_proj"):
            grad = getattr(layer.experts, name).grad
            assert grad.placements[0].is_shard(0)
            torch.testing.assert_close(grad.to_local(), getattr(ref.experts, name).grad[experts], **tol)
        if layer.routing.selection_bias:  # balancing from the global loads: the same step on every rank
            before = layer.gate.e_score_correction_bias.clone()
            layer.update_selection_bias(0.01)
            loads_E = layer.stats().loads.sum(0).float()
            torch.testing.assert_close(layer.gate.e_score_correction_bias - before,
                                       0.01 * torch.sign(loads_E.mean() - loads_E))
            biases = [torch.empty(E) for _ in range(world)]
            dist.all_gather(biases, layer.gate.e_score_correction_bias)
            assert all(torch.equal(b, biases[0]) for b in biases)
        # The plan is the reference's, on every rank.
        stats = layer.stats()
        assert int(stats.total_pairs) == sum(counts) * K
        assert int(stats.retained_pairs) == math.floor(retain * sum(counts) * K)
        assert float(stats.backward_calls) == 1.0
        assert torch.equal(stats.quotas, plan_quotas(stats.loads, retain, align=align))
        if align > 1:  # the aligned plan is not the plain one here, so the comparisons above saw the alignment
            assert not torch.equal(stats.quotas, plan_quotas(stats.loads, retain))


# (retain, selection, seed, quota_align)
CONFIGS = [(1.0, "top", 0, 1), (0.75, "top", 2, 1), (0.75, "sample", 2, 1), (0.5, "sample", 3, 1), (0.5, "top", 4, 1),
           (0.75, "top", 5, 2)]


@pytest.mark.parametrize("world", [2, 4])
def test_matches_single_device_with_source_expert_quotas(world):
    run_ranks(world, _matches_reference, CONFIGS)


def _one_rank_is_the_single_device_layer(rank, world):
    """One EP rank is the one-device layer: the same step with the all-to-all transport (to itself) instead of
    the identity transport. ExpertParallel(backward=...) gives the layer its options object."""
    from lrmoe.functional import BackwardOptions

    mesh = init_device_mesh("cpu", (world,))
    for opts in (BackwardOptions(), BackwardOptions(retain=0.5, selection="top", activations="recompute")):
        torch.manual_seed(0)
        base = LRMoE(D, FF, E, K)
        single = copy.deepcopy(base)
        single.backward = opts
        layer = parallelize_module(copy.deepcopy(base), mesh, ExpertParallel(backward=opts))
        assert layer.backward is opts
        results = []
        for module in (layer, single):
            torch.manual_seed(1)
            x, c = torch.randn(20, D, requires_grad=True), torch.randn(20, D)
            out = module(x)
            (out * c).sum().backward()
            down = module.experts.down_proj.grad
            results.append([out, x.grad, module.gate.weight.grad, getattr(down, "_local_tensor", down)])
        for got, want in zip(*results, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert torch.equal(layer.stats().quotas[0], single.stats().quotas)


def test_one_rank_is_the_single_device_layer():
    run_ranks(1, _one_rank_is_the_single_device_layer)


def test_glm_style_routing_and_shared_experts_match_single_device():
    """The GLM-4.5 / DeepSeek-V3 block (sigmoid, selection bias, groups, scaled gates, a shared expert) under
    expert parallelism: the same contract, the shared expert's gradient summed over ranks like the router's."""
    glm = dict(score_func="sigmoid", routed_scaling_factor=2.5, n_group=4, topk_group=2, selection_bias=True,
               shared_hidden_dim=4)
    run_ranks(2, _matches_reference, [(1.0, "top", 0, 1), (0.75, "sample", 2, 1), (0.5, "top", 4, 1)], glm)


def _autocast_equals_a_bf16_copy(rank, world, max_replicas):
    # Under torch.autocast(bf16) with fp32 parameters, the experts run in bf16 on bf16 casts of x and the local
    # weights (and of replicas fetched from them): the same numbers as a bf16 copy of the layer, with the expert
    # gradients reaching the fp32 shards.
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(7)
    ref = LRMoE(D, FF, E, K, retain=0.5, selection="top", shared_hidden_dim=4)
    with torch.no_grad():
        ref.gate.weight[0] = 1.0  # expert 0 (on rank 0) hot for positive tokens: a replica goes to rank 1
    kw = dict(max_replicas=max_replicas)
    layer = parallelize_module(copy.deepcopy(ref), mesh, ExpertParallel(**kw))
    half = parallelize_module(copy.deepcopy(ref).to(torch.bfloat16), mesh, ExpertParallel(**kw))
    x_all = torch.randn(sum(tokens_of(r) for r in range(world)), D).abs().to(torch.bfloat16)
    start = sum(tokens_of(r) for r in range(rank))
    x = x_all[start:start + tokens_of(rank)]
    x32 = x.float().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x32)
    out.float().square().sum().backward()
    xh = x.clone().requires_grad_(True)
    out_h = half(xh)
    out_h.float().square().sum().backward()
    assert out.dtype == torch.bfloat16 and torch.equal(out, out_h)
    assert (layer.stats().instances[:, E // world:] >= 0).any() == (max_replicas > 0)  # replicas placed when allowed
    # x's gradient sums three paths (router, experts, shared expert): in fp32 for fp32 x, in bf16 for the copy.
    torch.testing.assert_close(x32.grad, xh.grad.float(), rtol=2e-2, atol=2e-2)
    for name in ("gate_up_proj", "down_proj"):
        got, want = getattr(layer.experts, name).grad, getattr(half.experts, name).grad
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.to_local(), want.to_local().float(), rtol=0, atol=0)


@pytest.mark.parametrize("max_replicas", [0, 2])
def test_autocast_runs_the_experts_in_its_dtype(max_replicas):
    run_ranks(2, _autocast_equals_a_bf16_copy, max_replicas)


def _rank_keeping_no_pairs(rank, world, device="cpu"):
    # Rank 0 routes one token, whose share of the quota rounds to 0: it keeps no pairs, and its backward's token
    # gather ran on an empty dx (an IndexError on that rank, the others then hanging in the next collective).
    # device "cuda": rank r on GPU r (tests/nn/test_cuda_ep.py, NCCL).
    mesh = init_device_mesh(device, (world,))
    counts = [1, 40]
    torch.manual_seed(0)
    ref = LRMoE(8, 6, 4, 1, retain=0.5, selection="top").to(device)
    layer = parallelize_module(copy.deepcopy(ref), mesh, ExpertParallel())
    x_all = torch.randn(sum(counts), 8).to(device)
    rows = slice(sum(counts[:rank]), sum(counts[:rank + 1]))
    x = x_all[rows].clone().requires_grad_(True)
    out = layer(x)
    out.sum().backward()
    assert int(layer.stats().quotas[0].sum()) == 0 and int(layer.stats().loads[0].sum()) == 1  # the case under test
    xr = x_all.clone().requires_grad_(True)
    reference_forward(ref, xr, counts).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad[rows], rtol=1e-5, atol=1e-6)


def test_a_rank_that_keeps_no_pairs_gets_its_router_gradient():
    run_ranks(2, _rank_keeping_no_pairs)


# ------------------------------------------------------------------------- checks every rank decides alike


def _one_token_beside_eight(rank, world):
    # Rank 0 with 1 token, rank 1 with 8 at retain 0.2: the step plans floor(0.2 * 18) = 3 of its P = 18 pairs, a
    # valid step. The retain check once used rank 0's own estimate W * T * K = 4 pairs (floor(0.8) = 0): rank 0
    # raised, and rank 1 waited in the load all-gather until the process group's timeout.
    mesh = init_device_mesh("cpu", (world,))
    counts = [1, 8]
    torch.manual_seed(0)
    ref = LRMoE(16, 24, 4, 2, retain=0.2, selection="top")
    layer = parallelize_module(copy.deepcopy(ref), mesh, ExpertParallel())
    x_all, c_all = torch.randn(sum(counts), 16), torch.randn(sum(counts), 16)
    rows = slice(sum(counts[:rank]), sum(counts[:rank + 1]))
    x = x_all[rows].clone().requires_grad_(True)
    out = layer(x)
    (out * c_all[rows]).sum().backward()
    assert int(layer.stats().total_pairs) == 18 and int(layer.stats().retained_pairs) == 3

    # The single-device step on the gathered batch with the same (source, expert) quotas (the module docstring).
    xr = x_all.clone().requires_grad_(True)
    ref_out = reference_forward(ref, xr, counts)
    (ref_out * c_all).sum().backward()
    tol = dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out, ref_out[rows], **tol)
    torch.testing.assert_close(x.grad, xr.grad[rows], **tol)
    router = layer.gate.weight.grad.clone()
    dist.all_reduce(router)  # each rank's router sees its own tokens
    torch.testing.assert_close(router, ref.gate.weight.grad, **tol)
    mine = slice(rank * 2, (rank + 1) * 2)
    for name in ("gate_up_proj", "down_proj"):
        torch.testing.assert_close(getattr(layer.experts, name).grad.to_local(),
                                   getattr(ref.experts, name).grad[mine], **tol)
    assert ref.experts.down_proj.grad.abs().sum() > 0  # the 3 kept pairs reached the experts


def test_a_step_valid_over_all_ranks_runs_on_every_rank():
    run_ranks(2, _one_token_beside_eight, timeout_s=30)


def _invalid_step_on_every_rank(rank, world):
    # A step invalid over all ranks raises the same error on every rank, and the ranks stay in step: the next
    # step runs.
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    ref = LRMoE(16, 24, 4, 2, retain=0.2, selection="top")
    layer = parallelize_module(copy.deepcopy(ref), mesh, ExpertParallel())
    x_all = torch.randn(2 * world, 16)
    # One token per rank: P = 4 pairs over both ranks, floor(0.2 * 4) = 0 kept; a backward would give every
    # expert a zero gradient: refused on every rank.
    x = x_all[rank:rank + 1].clone().requires_grad_(True)
    with pytest.raises(ValueError, match=r"retain=0\.2 keeps floor\(retain \* P\) = 0 of the step's P = 4"):
        layer(x)
    # The same step without a backward (training mode, no grad) runs, and its forward is exact.
    with torch.no_grad():
        out = layer(x)
        want = ref(x_all[:world])[rank:rank + 1]
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    # Two tokens per rank (P = 8, floor(1.6) = 1): runs with a backward.
    x2 = x_all[2 * rank:2 * rank + 2].clone().requires_grad_(True)
    layer(x2).square().sum().backward()
    assert torch.isfinite(x2.grad).all()


def test_a_step_invalid_over_all_ranks_raises_on_every_rank():
    run_ranks(2, _invalid_step_on_every_rank, timeout_s=30)


def _expert_id_out_of_range_on_one_rank(rank, world):
    # A model's own experts module given an expert id out of range on rank 0 only: every rank refuses the step
    # (rank 0 alone used to raise, in expert_loads, and rank 1 waited in the load all-gather), and the next runs.
    from lrmoe.nn import SwiGLUExperts

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(1)
    experts = parallelize_module(SwiGLUExperts(4, 16, 24, retain=0.5), mesh, ExpertParallel())
    ids = torch.randint(0, 4, (3, 2))
    gates = torch.rand(3, 2)
    x = torch.randn(3, 16)
    bad = ids.clone()
    if rank == 0:
        bad[1, 0] = 4
    with pytest.raises(ValueError, match=r"expert_ids_TK must be in \[0, num_experts=4\), got 1 pairs outside it "
                                         r"\(pairs per EP rank: \{0: 1\}\); every EP rank refuses"):
        experts(x, bad, gates)
    assert torch.isfinite(experts(x, ids, gates)).all()


def test_an_expert_id_out_of_range_on_one_rank_raises_on_every_rank():
    run_ranks(2, _expert_id_out_of_range_on_one_rank, timeout_s=30)


# ---------------------------------------------------------------------------------------- backward payloads




def _backward_sends_retained_rows(rank, world, retain):
    mesh = init_device_mesh("cpu", (world,))
    n_local = E // world
    torch.manual_seed(0)
    layer = parallelize_module(LRMoE(D, FF, E, K, retain=retain, selection="top"), mesh, ExpertParallel())
    torch.manual_seed(10 + rank)
    x = torch.randn(64, D, requires_grad=True)
    with RecordAllToAll() as fwd:
        out = layer(x)
    with RecordAllToAll() as bwd:
        out.square().sum().backward()
    stats = layer.stats()
    loads, quotas = stats.loads, stats.quotas
    mine = slice(rank * n_local, (rank + 1) * n_local)
    row = D * 4  # fp32 rows

    # Forward: every pair goes out, and comes back with its fp32 ||phi||^2 (in a second all-to-all beside the rows).
    assert fwd.calls[2] == (fwd.calls[1][0], fwd.calls[1][1], 4) and len(fwd.calls) == 3
    (d_send, d_recv, d_bytes), (c_send, c_recv, c_bytes) = fwd.messages()
    assert d_send == loads[rank].view(world, n_local).sum(1).tolist() and d_bytes == row
    assert d_recv == loads[:, mine].sum(1).tolist()
    assert (c_send, c_recv, c_bytes) == (d_recv, d_send, row + 4)
    # Backward: exactly quotas[rank, e] rows per expert leave (plus a 4-byte row index below retain 1), and the
    # input-gradient rows of exactly those pairs come back.
    assert len(bwd.calls) == (2 if retain == 1.0 else 3)  # below retain 1 the row indices travel beside the rows
    (b_send, b_recv, b_bytes), (r_send, r_recv, r_bytes) = bwd.messages()
    assert b_send == quotas[rank].view(world, n_local).sum(1).tolist()
    assert b_recv == quotas[:, mine].sum(1).tolist()
    assert b_bytes == (row if retain == 1.0 else row + 4)
    assert (r_send, r_recv, r_bytes) == (b_recv, b_send, row)

    # The statistics report the same bytes (to peers: the chunk a rank sends itself is a local copy).
    def peer(rows, nbytes):
        return nbytes * (sum(rows) - rows[rank])

    assert int(stats.dispatch_bytes) == peer(d_send, d_bytes)
    assert int(stats.combine_bytes) == peer(c_send, c_bytes)
    assert float(stats.backward_dispatch_bytes) == peer(b_send, b_bytes)
    assert float(stats.backward_combine_bytes) == peer(r_send, r_bytes)
    assert float(stats.local_retained_pairs) == sum(b_send) == int(quotas[rank].sum())
    # Bytes fall in proportion to retain: globally, backward rows are floor(retain * P) of the P forward rows.
    sent = torch.tensor([sum(d_send), sum(b_send)], dtype=torch.float64)
    dist.all_reduce(sent)
    assert sent[1] == math.floor(retain * sent[0])


@pytest.mark.parametrize("world, retain", [(2, 0.5), (4, 0.5), (2, 1.0)])
def test_backward_all_to_all_sends_exactly_the_retained_rows(world, retain):
    run_ranks(world, _backward_sends_retained_rows, retain)


# ---------------------------------------------------------------------------------- meshes and bad configs


def _configurations(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    with pytest.raises(ValueError, match="divisible"):
        parallelize_module(LRMoE(D, FF, world + 1, K), mesh, ExpertParallel())
    with pytest.raises(TypeError, match="LRMoE"):
        parallelize_module(torch.nn.Linear(D, D), mesh, ExpertParallel())
    with pytest.raises(ValueError, match="quota_align"):  # aligned steps and capacities do not mix
        parallelize_module(LRMoE(D, FF, E, K, quota_align=8), mesh, ExpertParallel(capacity_factor=1.5))
    with pytest.raises(ValueError, match="backward_capacity"):  # one device's per-expert blocks: not under EP
        parallelize_module(LRMoE(D, FF, E, K, retain=0.5, backward_capacity=1.0), mesh, ExpertParallel())
    # activations="recompute" (h not saved, recomputed for the kept rows) gives the gradients of "save";
    # "offload" (h kept in host memory, the kept rows read back) gives them bit for bit.
    torch.manual_seed(0)
    results = []
    for activations in ("save", "recompute", "offload"):
        torch.manual_seed(0)
        layer = parallelize_module(LRMoE(D, FF, E, K, retain=0.5, selection="top", activations=activations), mesh,
                                   ExpertParallel(max_replicas=1))
        torch.manual_seed(1 + rank)
        xi, c = torch.randn(12, D, requires_grad=True), torch.randn(12, D)
        (layer(xi) * c).sum().backward()
        results.append([xi.grad, layer.gate.weight.grad, layer.experts.gate_up_proj.grad.to_local(),
                        layer.experts.down_proj.grad.to_local()])
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for got, want in zip(results[2], results[0]):
        assert torch.equal(got, want)
    assert results[0][2].abs().sum() > 0
    twice = parallelize_module(LRMoE(D, FF, E, K), mesh, ExpertParallel())
    with pytest.raises(ValueError, match="already"):
        parallelize_module(twice, mesh, ExpertParallel())
    # By composition: the layer and its experts keep their classes and their state_dict keys; the expert-parallel
    # step is an object the layer holds, whose records are no state_dict entries.
    keys = list(LRMoE(D, FF, E, K).state_dict())
    assert type(twice) is LRMoE and type(twice.experts) is SwiGLUExperts
    assert list(twice.state_dict()) == keys
    assert isinstance(twice._dispatcher, ExpertParallelDispatcher) and twice.experts._dispatcher is None

    mesh_2d = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "ep"))
    with pytest.raises(ValueError, match="1-D"):
        parallelize_module(LRMoE(D, FF, E, K), mesh_2d, ExpertParallel())
    with pytest.raises(ValueError, match="mesh_dim_name"):
        parallelize_module(LRMoE(D, FF, E, K), mesh_2d, ExpertParallel(mesh_dim_name="tp"))

    # A named dimension of a larger mesh gives the same layer as the equivalent 1-D mesh.
    torch.manual_seed(0)
    base = LRMoE(D, FF, E, K, retain=0.5, selection="top")
    torch.manual_seed(1 + rank)
    x, c = torch.randn(16, D), torch.randn(16, D)
    results = []
    for m, style in ((mesh, ExpertParallel()), (mesh_2d, ExpertParallel(mesh_dim_name="ep"))):
        layer = parallelize_module(copy.deepcopy(base), m, style)
        assert layer.experts.down_proj.to_local().shape[0] == E // world
        assert isinstance(layer, LRMoE) and not hasattr(layer.gate.weight, "placements")  # router: plain tensor
        xi = x.clone().requires_grad_(True)
        out = layer(xi)
        (out * c).sum().backward()
        results.append([out, xi.grad, layer.gate.weight.grad, layer.experts.down_proj.grad.to_local()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # state_dict keeps the names; expert entries are DTensors with the global shape.
    state = parallelize_module(copy.deepcopy(base), mesh, ExpertParallel()).state_dict()
    assert set(state) == set(base.state_dict())
    assert state["experts.gate_up_proj"].shape == base.experts.gate_up_proj.shape

    # A rank without tokens still takes part in every all-to-all (its peers' rows still reach its experts).
    layer = parallelize_module(copy.deepcopy(base), mesh, ExpertParallel())
    x = torch.randn(0 if rank == 1 else 5, D, requires_grad=True)
    out = layer(x)
    out.square().sum().backward()
    assert out.shape == x.shape and x.grad.shape == x.shape
    assert torch.isfinite(layer.experts.down_proj.grad.to_local()).all()


def test_configurations_and_named_mesh_dimension():
    run_ranks(2, _configurations)


# ------------------------------------------------------------------------------------ single-process pieces


def test_expert_major_order():
    counts_WE = torch.tensor([[1, 0, 2, 3], [4, 1, 0, 2]])  # W = 2 ranks, E = 4, L = 2
    # Rank 1 receives source-major blocks (s0,e2) (s0,e3) (s1,e2) (s1,e3) of sizes 2, 3, 0, 2.
    counts_SL = counts_WE[:, 2:]
    perm = expert_major_order(counts_SL, 7)
    # expert-major: e2 from s0 (rows 0, 1), e2 from s1 (none), e3 from s0 (2, 3, 4), e3 from s1 (5, 6)
    assert perm.tolist() == [0, 1, 2, 3, 4, 5, 6]
    perm = expert_major_order(torch.tensor([[1, 2], [3, 1]]), 7)
    # blocks: (s0,l0)=[0] (s0,l1)=[1,2] (s1,l0)=[3,4,5] (s1,l1)=[6] -> l0: 0, 3, 4, 5; l1: 1, 2, 6
    assert perm.tolist() == [0, 3, 4, 5, 1, 2, 6]


@pytest.mark.parametrize("selection", ["top", "sample"])
def test_source_grouped_plan_equals_per_source_runs(selection):
    """The single-device reference the EP tests compare with: pairs grouped by (source, expert) with quotas
    plan_quotas(loads_SE) make the expert gradients the sum of independent per-source selective steps, each
    keeping quotas[s] of its own pairs. That is exactly the decomposition expert parallelism computes."""
    torch.manual_seed(3)
    counts = [9, 14, 5]
    layer = LRMoE(D, FF, E, K, retain=0.6, selection=selection)
    x, c = torch.randn(sum(counts), D), torch.randn(sum(counts), D)
    uniform_SE = torch.rand(len(counts), E) if selection == "sample" else None
    xr = x.clone().requires_grad_(True)
    (reference_forward(layer, xr, counts, uniform_SE) * c).sum().backward()
    want = [xr.grad] + [p.grad.clone() for p in layer.parameters()]

    layer.zero_grad()
    routing = route_topk(layer.gate(x), K)
    source_ids_T = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    loads_SE = torch.zeros(len(counts), E, dtype=torch.int64).index_put_(
        (source_ids_T.repeat_interleave(K), routing.expert_ids.reshape(-1)),
        torch.ones(sum(counts) * K, dtype=torch.int64), accumulate=True,
    )
    quotas_SE = plan_quotas(loads_SE, 0.6)
    grads_x = []
    for s, (xs, cs) in enumerate(zip(x.split(counts), c.split(counts))):
        xs = xs.clone().requires_grad_(True)
        r = route_topk(layer.gate(xs), K)
        plan = plan_experts(r.expert_ids, E, retain=0.6, selection=selection, draw_uniform=False)
        plan = dataclasses.replace(plan, quotas=quotas_SE[s], uniform=None if uniform_SE is None else uniform_SE[s])
        out = selective_swiglu_experts(xs, layer.experts.gate_up_proj, layer.experts.down_proj, r.expert_ids,
                                       r.gates, retain=0.6, selection=selection, plan=plan)
        (out * cs).sum().backward()
        grads_x.append(xs.grad)
    got = [torch.cat(grads_x)] + [p.grad for p in layer.parameters()]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    # and the grouping matters: the plain per-expert plan keeps other pairs
    layer.zero_grad()
    (layer(x) * c).sum().backward()
    assert not torch.allclose(layer.experts.down_proj.grad, want[-1], rtol=1e-3, atol=1e-4)


def test_source_grouped_plan_shapes_and_retain_one():
    torch.manual_seed(0)
    ids = torch.randint(0, E, (20, K))
    src = torch.arange(20) % 3
    plan = plan_experts(ids, E, retain=0.5, selection="sample", source_ids_T=src, num_sources=3)
    assert plan.loads.shape == plan.quotas.shape == plan.uniform.shape == (3, E)
    assert torch.equal(plan.group_ids, ids * 3 + src.unsqueeze(1))
    assert torch.equal(plan.quotas.sum(0), plan_quotas(plan.loads.sum(0), 0.5))  # same per-expert quotas
    assert int(plan.loads.sum()) == 20 * K
    with pytest.raises(ValueError, match="source_ids_T"):
        plan_experts(ids, E, source_ids_T=src[:5], num_sources=3)
    with pytest.raises(ValueError, match="num_sources"):
        plan_experts(ids, E, source_ids_T=src, num_sources=0)
    # retain 1 with source groups is the dense step
    layer = LRMoE(D, FF, E, K)
    x, c = torch.randn(20, D), torch.randn(20, D)
    xr = x.clone().requires_grad_(True)
    (reference_forward(layer, xr, [7, 13]) * c).sum().backward()
    want = [xr.grad] + [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    xd = x.clone().requires_grad_(True)
    (layer(xd) * c).sum().backward()
    for g, w in zip([xd.grad] + [p.grad for p in layer.parameters()], want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("world, n_exp, seed", [(2, 8, 0), (4, 16, 1), (3, 6, 2), (1, 4, 3)])
def test_owner_only_plan_equals_the_transport(world, n_exp, seed):
    """Without replicas the plan routes every pair to its expert's owner directly; that must be exactly what the
    transport (route_to_replicas under balanced_capacity, the path with replicas) gives for owners only, and the
    quotas at retain 1 without capacity must be the loads (no planning)."""
    from lrmoe.functional import balanced_capacity, instance_experts, route_to_replicas
    from lrmoe.nn.expert_parallel import plan_expert_parallel

    gen = torch.Generator().manual_seed(seed)
    loads_WE = torch.randint(0, 9, (world, n_exp), generator=gen)
    loads_WE[0, 0] = 0  # empty blocks and experts too
    loads_WE[:, -1] = 0
    inst_WI = instance_experts(torch.empty(world, 0, dtype=torch.int64), n_exp)
    routes = route_to_replicas(loads_WE, balanced_capacity(loads_WE.sum(0), inst_WI))
    for retain, capacity_factor in ((1.0, None), (0.5, None), (0.75, 1.25)):
        plan = plan_expert_parallel(loads_WE, retain, capacity_factor=capacity_factor)
        assert torch.equal(plan.instances, inst_WI)
        assert torch.equal(plan.routes, routes)
        assert torch.equal(plan.assignment, loads_WE.view(world, world, -1))  # block (s, w, i): loads[s, w * L + i]
        assert torch.equal(plan.quotas, plan.instance_quotas.reshape(world, n_exp))
        if retain == 1.0:
            assert torch.equal(plan.quotas, loads_WE)
        else:
            assert int(plan.quotas.sum()) <= int(retain * int(loads_WE.sum()))
