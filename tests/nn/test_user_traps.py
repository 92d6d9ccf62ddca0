"""Paths that used to give a silently wrong or incomplete answer (second-order gradients, eval mode, a retain that
keeps nothing) or a confusing error (a generator under torch.compile). Each test failed before its fix."""

from __future__ import annotations

import pytest
import torch

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
    m = LRMoE(D, FF, E, K, retain=1e-9, min_retain=1e-9)  # ceil(min_retain * load) = 1 per expert
    m(torch.randn(4, D)).sum().backward()
    assert m.experts.down_proj.grad.abs().sum() > 0


def test_retain_that_keeps_no_pair_runs_where_no_backward_can():
    # T = 1 at retain 0.3 keeps floor(0.3 * 2) = 0 of P = 2 pairs: refused where a backward can run, but a forward
    # alone is exact at any retain. Training mode under no_grad used to raise about weight gradients.
    from lrmoe.functional import plan_experts

    torch.manual_seed(0)
    m = LRMoE(D, FF, E, K, retain=0.3)  # training mode
    dense = LRMoE(D, FF, E, K)
    dense.load_state_dict(m.state_dict())
    x = torch.randn(1, D)
    with torch.no_grad():
        torch.testing.assert_close(m(x), dense(x), rtol=0, atol=0)
    m.requires_grad_(False)  # grad mode on, nothing requiring grad
    torch.testing.assert_close(m(x), dense(x).detach(), rtol=0, atol=0)
    m.requires_grad_(True)
    with pytest.raises(ValueError, match=r"retain=0\.3 keeps floor\(retain \* P\) = 0 of the step's P = 2"):
        m(x)
    # Planning runs no backward: it plans the zero quotas; the call that runs the step refuses them.
    plan = plan_experts(torch.tensor([[0, 1]]), E, retain=0.3)
    assert int(plan.quotas.sum()) == 0 and int(plan.loads.sum()) == 2


# ---------------------------------------------------------------------------------------------- generator + compile


def test_generator_under_compile_is_refused_with_advice():
    torch._dynamo.reset()
    m = LRMoE(D, FF, E, K, retain=0.75, generator=torch.Generator().manual_seed(0))
    with pytest.raises(Exception, match="generator=None"):
        torch.compile(m, fullgraph=True)(torch.randn(4, D))
    m(torch.randn(4, D)).sum().backward()  # eager keeps supporting it
