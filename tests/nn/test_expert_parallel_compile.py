"""torch.compile(fullgraph=True) of an expert-parallel LRMoE layer (with a binding backward capacity, without and
with hot-expert replicas) on 2 gloo CPU ranks gives the eager values.

The split sizes of the all-to-alls are read on the host (``lrmoe.nn._transport.host_splits``, a ``.tolist()``); with
``capture_scalar_outputs`` they become unbacked SymInts, so the layer compiles as one graph with no graph break,
and a step with other loads (other split sizes) reuses it without recompiling. The plan is one opaque op
(``lrmoe::ep_plan``), so every rank's compiled graph computes the same plan as eager.
"""

from __future__ import annotations

import copy

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

from ep_harness import run_ranks
from layer_step import forward_backward
from lrmoe.functional import place_hot_replicas
from lrmoe.nn import ExpertParallel, LRMoE

D, FF, E, K = 8, 6, 8, 2


def tokens_of(rank: int, empty_rank: int | None = None) -> int:
    """Uneven local batches, so the all-to-all splits differ per rank; ``empty_rank`` gets none."""
    return 0 if rank == empty_rank else 10 + 3 * rank


def _hot_unregistered(loads_WE, max_replicas):
    """The "hot" placement as a callable that is not registered: it runs before the plan op, in the layer's graph,
    where lrmoe.functional.expert_parallel.check_placement checks its output."""
    return place_hot_replicas(loads_WE, max_replicas)


def _compiled_matches_eager(rank, world, max_replicas, plan_on="device", backward_blocks=False, empty_rank=None,
                            device="cpu", compile_backend="inductor", placement_policy="hot"):
    # device "cuda": rank r on GPU r (tests/nn/test_cuda_ep.py, NCCL), fp32 as here.
    mesh = init_device_mesh(device, (world,))
    torch.manual_seed(0)
    ref = LRMoE(D, FF, E, K, retain=0.75, selection="top").to(device)
    # Experts 0 and 1 (rank 0's) take most tokens, so the backward capacity binds and shapes the quotas, and with
    # max_replicas the hot-expert policy places a replica of one of them on rank 1.
    shift = 2 * torch.nn.functional.normalize(torch.randn(D), dim=0).to(device)
    with torch.no_grad():
        ref.gate.weight[:2] += 2 * shift
    style = {"capacity_factor": 1.0, "max_replicas": max_replicas, "plan_on": plan_on,
             "backward_blocks": backward_blocks, "placement_policy": placement_policy}
    # Two copies of one layer (an expert-parallel layer holds a process group, so it cannot be deep-copied).
    layer = parallelize_module(copy.deepcopy(ref), mesh, ExpertParallel(**style))
    eager = parallelize_module(copy.deepcopy(ref), mesh, ExpertParallel(**style))
    # error_on_recompile: the second step has other loads, so other split sizes; they are unbacked SymInts, not
    # guarded constants, so the compiled graph must serve it as is.
    loads = []
    with torch._dynamo.config.patch(capture_scalar_outputs=True, error_on_recompile=True):
        compiled = torch.compile(layer, fullgraph=True, backend=compile_backend)
        for step in range(2):
            torch.manual_seed(100 * step + rank)
            n_tok = tokens_of(rank, empty_rank)
            x, c = torch.randn(n_tok, D).to(device) + shift, torch.randn(n_tok, D).to(device)
            got = forward_backward(compiled, x, c)
            want = forward_backward(eager, x, c)
            names = ["output", "input grad", "router grad", "gate_up_proj grad", "down_proj grad"]
            for name, g, w in zip(names, got, want):
                torch.testing.assert_close(
                    g, w, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"rank {rank} step {step} {name}: {m}"
                )
            # The compiled forward and backward fed the statistics like eager did.
            s_got, s_want = layer.stats(), eager.stats()
            assert torch.equal(s_got.loads, s_want.loads) and torch.equal(s_got.quotas, s_want.quotas)
            assert int(s_got.dispatch_bytes) == int(s_want.dispatch_bytes)
            assert int(s_got.combine_bytes) == int(s_want.combine_bytes)
            torch.testing.assert_close(s_got.backward_dispatch_bytes, s_want.backward_dispatch_bytes)
            torch.testing.assert_close(s_got.local_retained_pairs, s_want.local_retained_pairs)
            assert float(s_got.backward_calls) == float(s_want.backward_calls) == step + 1
            assert torch.equal(s_got.instances, s_want.instances)
            assert torch.equal(s_got.instance_quotas, s_want.instance_quotas)
            assert torch.equal(s_got.capacity, s_want.capacity)
            assert int(s_got.replica_bytes) == int(s_want.replica_bytes)
            assert int(s_got.replica_grad_bytes) == int(s_want.replica_grad_bytes)
            if max_replicas:  # a replica was placed, so its weights and their gradients crossed ranks
                assert (s_got.instances[:, E // world:] >= 0).any() and int(s_got.replica_bytes) + int(
                    s_got.replica_grad_bytes) > 0
            assert (s_got.rank_backward_loads <= s_got.capacity).all()
            loads.append(s_got.loads)
    # The two steps had different loads, so different split sizes: the no-recompile check is meaningful.
    assert not torch.equal(loads[0], loads[1])


# Two cases go through Inductor: the plan op on the device with the collectives' unbacked split sizes, and the
# host plan with a replica, the blocked backward and a rank without tokens. The others trace with Dynamo and
# AOTAutograd only (backend "aot_eager": the graph, its unbacked sizes and eager's values), since Inductor's code
# for what they add is generated in those two already (each Inductor case costs half a minute of CI).
CASES = {  # id: (max_replicas, plan_on, backward_blocks, empty_rank, backend)
    "capacity": (0, "device", False, None, "inductor"),
    "replicas": (1, "device", False, None, "aot_eager"),
    "replicas-plan-on-host": (1, "host", False, None, "aot_eager"),
    # The blocks' row count is an unbacked SymInt too (read with the split sizes).
    "blocked-backward": (1, "host", True, None, "aot_eager"),
    # Rank 1 has T = 0, a static size its graph is specialised on, while it still hosts experts and a replica for
    # rank 0's tokens. Its backward gathered from size-0 tensors by data-dependent row counts, which Inductor could
    # not lower (rank 0 then waited in the backward all-to-all).
    "blocked-backward-rank-without-tokens": (1, "host", True, 1, "inductor"),
}


def _every_case_compiled_matches_eager(rank, world):
    for name, case in CASES.items():
        torch._dynamo.reset()  # each case compiles afresh (error_on_recompile would see the same forward again)
        try:
            _compiled_matches_eager(rank, world, *case[:4], compile_backend=case[4])
        except Exception as e:
            raise AssertionError(f"case {name!r}") from e
    # A policy that is not registered, with the plan on the host: its output's value checks are data-dependent
    # branches, which a traced graph must not take (they broke the fullgraph compile).
    torch._dynamo.reset()
    _compiled_matches_eager(rank, world, 1, "host", compile_backend="aot_eager", placement_policy=_hot_unregistered)


# Each case compiles forward and backward on 2 ranks (~10 s each on two cores), all in one pair of processes (a
# spawn and its imports cost ~3 s); 4 ranks compile too (checked by hand, ~2.5 min) but cost too much for CI.
def test_compiled_expert_parallel_with_capacity_equals_eager_at_retain_075():
    run_ranks(2, _every_case_compiled_matches_eager)


def test_plan_op_passes_opcheck():
    """The plan op (lrmoe::ep_plan): schema, fake implementation and dispatch agree (torch.library.opcheck)."""
    loads_WE = torch.tensor([[9, 9, 0, 0, 1, 0, 0, 1], [13, 13, 0, 0, 0, 0, 0, 0]])
    for max_replicas, capacity_factor, quota_align in ((0, None, 1), (1, 1.0, 1), (1, None, 4)):
        torch.library.opcheck(torch.ops.lrmoe.ep_plan.default, (loads_WE, None, 0.75, 0.0, "waterfill", max_replicas,
                                                                capacity_factor, "hot", quota_align))
    # A placement computed outside the op (a policy that is not registered) gives the registered policy's plan.
    replicas_WR = place_hot_replicas(loads_WE, 1)
    torch.library.opcheck(torch.ops.lrmoe.ep_plan.default,
                          (loads_WE, replicas_WR, 0.75, 0.0, "waterfill", 1, None, "hot", 1))
    inside = torch.ops.lrmoe.ep_plan(loads_WE, None, 0.75, 0.0, "waterfill", 1, None, "hot", 1)
    outside = torch.ops.lrmoe.ep_plan(loads_WE, replicas_WR, 0.75, 0.0, "waterfill", 1, None, "hot", 1)
    for a, b in zip(inside, outside, strict=True):
        assert torch.equal(a, b)

