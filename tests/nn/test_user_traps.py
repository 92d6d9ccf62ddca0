"""Paths that used to give a silently wrong or incomplete answer (second-order gradients, FSDP2 with an in-place
op on the output, eval mode, a retain that keeps nothing) or a confusing error (a generator under torch.compile).
Each test failed before its fix."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from ep_harness import run_ranks
from lrmoe.functional import selective_swiglu_experts
from lrmoe.nn import LRMoE, SwiGLUExperts

D, FF, E, K = 16, 32, 8, 2


def _rel(a, b):
    return float((a - b).norm() / b.norm())


# ---------------------------------------------------------------------------------------------- second order


@pytest.mark.parametrize("retain", [1.0, 0.75])
def test_create_graph_through_the_layer_raises(retain):
    torch.manual_seed(0)
    m = LRMoE(D, FF, E, K, retain=retain)
    x, v = torch.randn(4, D, requires_grad=True), torch.randn(4, D)
    with pytest.raises(RuntimeError, match="create_graph=True"):
        torch.autograd.grad((m(x) * v).sum(), x, create_graph=True)
    # the first-order gradient is still there without create_graph
    gx, = torch.autograd.grad((m(x) * v).sum(), x)
    assert gx.abs().sum() > 0


def test_create_graph_through_the_functional_experts_raises():
    torch.manual_seed(0)
    x = torch.randn(5, D, requires_grad=True)
    gu, down = torch.randn(E, 2 * FF, D, requires_grad=True), torch.randn(E, D, FF, requires_grad=True)
    ids = torch.randint(0, E, (5, K))
    gates = torch.rand(5, K, requires_grad=True)
    out = selective_swiglu_experts(x, gu, down, ids, gates)
    with pytest.raises(RuntimeError, match="create_graph=True"):
        torch.autograd.grad(out.square().sum(), [x, down], create_graph=True)


# ---------------------------------------------------------------------------------------------- eval mode


def test_eval_backward_is_exact_and_train_backward_is_not():
    torch.manual_seed(0)
    sparse = LRMoE(D, FF, E, K, retain=0.5)
    dense = LRMoE(D, FF, E, K, retain=1.0)
    dense.load_state_dict(sparse.state_dict())
    for p in [*sparse.parameters(), *dense.parameters()]:
        p.requires_grad_(False)
    x, v = torch.randn(64, D), torch.randn(64, D)

    def input_grad(m):
        xx = x.clone().requires_grad_()
        (m(xx) * v).sum().backward()
        return xx.grad

    want = input_grad(dense)
    assert _rel(input_grad(sparse.train()), want) > 0.05  # selective: approximate (retain 0.5 keeps half the pairs)
    torch.testing.assert_close(input_grad(sparse.eval()), want, rtol=1e-5, atol=1e-6)
    forced = LRMoE(D, FF, E, K, retain=0.5, selective_in_eval=True)
    forced.load_state_dict(sparse.state_dict())
    forced.requires_grad_(False)
    assert _rel(input_grad(forced.eval()), want) > 0.05  # the explicit opt-in keeps selecting in eval mode


def test_eval_backward_exact_for_the_experts_module():
    torch.manual_seed(0)
    experts = SwiGLUExperts(E, D, FF, retain=0.5).eval()
    dense = SwiGLUExperts(E, D, FF, retain=1.0)
    dense.load_state_dict(experts.state_dict())
    x = torch.randn(40, D)
    ids = torch.randint(0, E, (40, K))
    gates = torch.rand(40, K)
    grads = []
    for m in (experts, dense):
        xx = x.clone().requires_grad_()
        m(xx, ids, gates).square().sum().backward()
        grads.append((xx.grad, m.down_proj.grad))
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------- retain that keeps nothing


def test_retain_that_keeps_no_pair_is_refused():
    m = LRMoE(D, FF, E, K, retain=1e-9)
    with pytest.raises(ValueError, match="retain"):
        m(torch.randn(4, D))
    # a min_retain floor keeps pairs, so the same retain is fine with it
    m = LRMoE(D, FF, E, K, retain=1e-9, min_retain=0.5)
    m(torch.randn(4, D)).sum().backward()
    assert m.experts.down_proj.grad.abs().sum() > 0


# ---------------------------------------------------------------------------------------------- generator + compile


def test_generator_under_compile_is_refused_with_advice():
    torch._dynamo.reset()
    m = LRMoE(D, FF, E, K, retain=0.75, generator=torch.Generator().manual_seed(0))
    with pytest.raises(Exception, match="generator=None"):
        torch.compile(m, fullgraph=True)(torch.randn(4, D))
    m(torch.randn(4, D)).sum().backward()  # eager keeps supporting it


# ---------------------------------------------------------------------------------------------- FSDP2 + in-place


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
