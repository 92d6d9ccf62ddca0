"""FSDP2 and an in-place op on the layer's output (issue 35, item 2). fully_shard's pre-backward hook sits on the
module's output tensors; were the output a view (a reshape of the experts' [T, D] rows), an in-place op on it
would drop that hook, the parameters would stay unsharded and every rank would keep its own unreduced gradient.
The layer writes its output in x's shape instead, so the hook survives: here under FSDP2 on 2 gloo ranks, eager
and compiled, through the functional API's ``out_shape`` and under expert parallelism."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import parallelize_module

from ep_harness import run_ranks
from lrmoe.functional import selective_swiglu_experts
from lrmoe.nn import ExpertParallel, LRMoE

D, FF, E, K = 16, 32, 8, 2


def _fsdp_inplace(rank, world, shape):
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    ref = LRMoE(D, FF, E, K, retain=1.0)
    layer = fully_shard(copy.deepcopy(ref), mesh=mesh)
    xs = [torch.randn(*shape, D, generator=torch.Generator().manual_seed(10 + r)) for r in range(world)]
    cs = [torch.randn(*shape, D, generator=torch.Generator().manual_seed(20 + r)) for r in range(world)]
    y = layer(xs[rank])
    assert y._base is None, "the layer's output is a view: FSDP2's pre-backward hook would be lost to an in-place op"
    y += 1.0
    (y * cs[rank]).sum().backward()
    for r in range(world):  # reference: every rank's loss on the unsharded layer; FSDP2 averages over ranks
        ((ref(xs[r]) + 1.0) * cs[r]).sum().backward()
    for (name, p), q in zip(layer.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad / world, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("shape", [(6,), (2, 3)])
def test_fsdp2_inplace_on_output_keeps_gradients_reduced(shape):
    run_ranks(2, _fsdp_inplace, shape)


# ------------------------------------------------------------------------------- the output is not a view


@pytest.mark.parametrize("shared", [None, 24])
@pytest.mark.parametrize("compiled", [False, True])
def test_output_in_x_shape_is_not_a_view(shared, compiled):
    # Eager and torch.compile(fullgraph=True) (AOTAutograd decides how a compiled output that aliases an
    # intermediate comes back): the output of x [2, 3, D] is a tensor of its own, and an in-place op on it gives
    # the gradients of the out-of-place op.
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = LRMoE(D, FF, E, K, retain=1.0, shared_hidden_dim=shared)
    run = torch.compile(layer, fullgraph=True) if compiled else layer
    x, c = torch.randn(2, 3, D), torch.randn(2, 3, D)
    grads = []
    for inplace in (True, False):
        layer.zero_grad()
        xx = x.clone().requires_grad_()
        y = run(xx)
        assert y.shape == x.shape and y._base is None
        if inplace:
            y += 1.0
        else:
            y = y + 1.0
        (y * c).sum().backward()
        grads.append([xx.grad, *(p.grad.clone() for p in layer.parameters())])
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("out_shape", [(2, 3, D), (6, D), (1, 6, 1, D)])
def test_functional_out_shape_is_the_reshaped_output(out_shape):
    torch.manual_seed(0)
    x = torch.randn(6, D, requires_grad=True)
    gate_up, down = torch.randn(E, 2 * FF, D, requires_grad=True), torch.randn(E, D, FF, requires_grad=True)
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(6)])
    gates = torch.rand(6, K, requires_grad=True)
    c = torch.randn(6, D)
    shaped = selective_swiglu_experts(x, gate_up, down, ids, gates, out_shape=out_shape)
    assert shaped.shape == out_shape and shaped._base is None
    want = selective_swiglu_experts(x, gate_up, down, ids, gates)
    torch.testing.assert_close(shaped.reshape(6, D), want, rtol=0, atol=0)
    inputs = (x, gate_up, down, gates)
    got_grads = torch.autograd.grad((shaped * c.view(out_shape)).sum(), inputs)
    want_grads = torch.autograd.grad((want * c).sum(), inputs)
    for got, wanted in zip(got_grads, want_grads):
        torch.testing.assert_close(got, wanted, rtol=0, atol=0)


def _expert_parallel_output(rank, world):
    # The expert-parallel layer writes its output in x's shape too; at retain 1 it equals the single-device layer's
    # on the rank's own tokens, in-place op and gradient of x included.
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    ref = LRMoE(D, FF, E, K, retain=1.0, shared_hidden_dim=24)
    layer = parallelize_module(copy.deepcopy(ref), mesh, ExpertParallel())
    x = torch.randn(2, 3, D, generator=torch.Generator().manual_seed(10 + rank))
    c = torch.randn(2, 3, D, generator=torch.Generator().manual_seed(20 + rank))
    xs, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    y = layer(xs)
    assert y.shape == x.shape and y._base is None
    y_ref = ref(xr)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    y += 1.0
    (y * c).sum().backward()
    ((y_ref + 1.0) * c).sum().backward()
    torch.testing.assert_close(xs.grad, xr.grad, rtol=1e-5, atol=1e-6)


def test_expert_parallel_output_in_x_shape_is_not_a_view():
    run_ranks(2, _expert_parallel_output)
