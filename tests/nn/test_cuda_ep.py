"""The expert-parallel layer on one GPU (run through the device tool; skipped on CPU-only machines).

An EP group of one rank (NCCL) runs every code path of the EP step: the plan, its host read, all-to-alls (with one
peer), and under torch.compile split sizes that are unbacked SymInts, which is what failed on two GPUs before the
CUDA ops inlined under compile stopped testing row counts. And the plan itself, on CUDA tensors, must not
synchronise (a torch.tensor(..., device="cuda") inside it once did).
"""

from __future__ import annotations

import os
import tempfile
import warnings

import pytest
import torch
import torch.distributed as dist
from cuda_sync import no_host_sync
from layer_step import forward_backward
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

from lrmoe.nn import ExpertParallel, LRMoE
from lrmoe.nn.expert_parallel import plan_expert_parallel

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

D, FF, E, K, T = 64, 48, 8, 2, 96


@pytest.fixture(scope="module")
def mesh():
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl", init_method=f"file://{os.path.join(tmp, 'store')}", rank=0, world_size=1,
                                device_id=torch.device("cuda", torch.cuda.current_device()))
        try:
            yield init_device_mesh("cuda", (1,))
        finally:
            dist.destroy_process_group()


def _layer(mesh, plan_on: str, backward_blocks: bool = False) -> LRMoE:
    torch.manual_seed(0)
    # retain 1 with a capacity: the selective backward (scoring, selection, backward all-to-all of the kept rows),
    # which at one rank keeps every pair, so eager and compiled keep the same pairs whatever the bf16 rounding.
    layer = LRMoE(D, FF, E, K, retain=1.0, selection="top").cuda().bfloat16()
    return parallelize_module(layer, mesh, ExpertParallel(capacity_factor=1.0, plan_on=plan_on,
                                                          backward_blocks=backward_blocks))


@pytest.mark.parametrize("max_replicas, capacity_factor", [(0, None), (0, 1.25), (2, 1.25)])
def test_plan_does_not_synchronise_on_cuda(max_replicas, capacity_factor):
    loads_WE = torch.randint(0, 500, (4, 16), device="cuda")
    with no_host_sync():
        plan = plan_expert_parallel(loads_WE, 0.5, max_replicas=max_replicas, capacity_factor=capacity_factor)
    assert int(plan.quotas.sum()) == int(0.5 * int(loads_WE.sum()))  # the plan was made (budget floor(r * P))


@pytest.mark.parametrize("plan_on, backward_blocks", [("device", False), ("host", False), ("device", True)])
def test_ep_step_synchronises_once(mesh, plan_on, backward_blocks):
    layer = _layer(mesh, plan_on, backward_blocks)
    x, c = torch.randn(T, D, device="cuda", dtype=torch.bfloat16), torch.randn(T, D, device="cuda")
    forward_backward(layer, x, c.bfloat16())  # warm-up (first calls may allocate, compile kernels, ...)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            forward_backward(layer, x, c.bfloat16())
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # Only the sync reports: the first use of the debug mode in a process also warns that it is a prototype
    # ("... does not yet detect all synchronizing operations"), which must not count as a sync.
    syncs = [w for w in seen if "called a synchronizing CUDA operation" in str(w.message)]
    # The one host read of the step: the split sizes (plan on the device) or the load matrix (plan on the host).
    assert len(syncs) == 1, [str(w.message) for w in syncs]


@pytest.mark.parametrize("plan_on, backward_blocks", [("device", False), ("host", False), ("host", True)])
def test_compiled_ep_layer_equals_eager_on_cuda(mesh, plan_on, backward_blocks):
    eager, layer = _layer(mesh, plan_on, backward_blocks), _layer(mesh, plan_on, backward_blocks)
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    c = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        compiled = torch.compile(layer, fullgraph=True)
        got = forward_backward(compiled, x, c)
    want = forward_backward(eager, x, c)
    names = ["output", "input grad", "router grad", "gate_up_proj grad", "down_proj grad"]
    for name, g, w in zip(names, got, want, strict=True):
        err = (g.float() - w.float()).norm() / w.float().norm().clamp(min=1e-12)
        assert err < 2e-2, (name, float(err))
    assert int(layer.stats().retained_pairs) == int(eager.stats().retained_pairs) == T * K


# --------------------------------------------------------------------------- two GPUs (NCCL), where there are two

two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")


@two_gpus
def test_a_rank_that_keeps_no_pairs_gets_its_router_gradient_on_two_gpus():
    """The gloo test's case on NCCL and the CUDA kernels: rank 0 routes one token and keeps none of its pairs (its
    token gather reads zero rows), equal to the single-device reference on the gathered batch."""
    from ep_harness import run_ranks
    from test_expert_parallel import _rank_keeping_no_pairs

    run_ranks(2, _rank_keeping_no_pairs, "cuda", backend="nccl")


@two_gpus
def test_compiled_ep_with_a_rank_without_tokens_equals_eager_on_two_gpus():
    """The gloo compile test's rank-without-tokens case on NCCL: rank 1 has T = 0, hosts experts and a replica."""
    from ep_harness import run_ranks
    from test_expert_parallel_compile import _compiled_matches_eager

    run_ranks(2, _compiled_matches_eager, 1, "host", False, 1, "cuda", backend="nccl")


@two_gpus
def test_fsdp2_on_the_experts_gathers_them_on_two_gpus():
    """The gloo FSDP2 tests on NCCL and the CUDA kernels: the single-device layer over dp = 2, and the EP layer on a
    (dp, ep) = (2, 1) mesh (the EP step with one peer, its experts gathered over dp)."""
    from ep_harness import run_ranks
    from test_expert_parallel_fsdp import _fsdp_beside_ep, _fsdp_single_device_layer

    run_ranks(2, _fsdp_single_device_layer, "cuda", backend="nccl")
    run_ranks(2, _fsdp_beside_ep, 0.5, 0, "cuda", 2, backend="nccl")


@two_gpus
def test_expert_parallel_experts_alone_equal_the_layer_on_two_gpus():
    """The gloo test of ExpertParallel on a SwiGLUExperts of its own on NCCL and the CUDA kernels: the same outputs,
    gradients and statistics as the expert-parallel layer (retain 0.5 sampled; 0.75 top with a replica and a
    binding capacity)."""
    from ep_harness import run_ranks
    from test_expert_parallel_experts import _equals_the_layer

    run_ranks(2, _equals_the_layer, "cuda", backend="nccl")
