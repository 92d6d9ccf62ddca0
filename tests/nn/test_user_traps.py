"""Paths that used to give a silently wrong or incomplete answer (second-order gradients, eval mode, a retain that
keeps nothing) or a confusing error (a generator under torch.compile, a meta-device layer). Each test failed before
its fix."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

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


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches empty before and after: these tests leave compiled code and graph breaks behind."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_generator_under_compile_fullgraph_names_generator(fresh_dynamo):
    m = LRMoE(D, FF, E, K, retain=0.75, generator=torch.Generator().manual_seed(0))
    with pytest.raises(torch._dynamo.exc.Unsupported) as err:
        torch.compile(m, fullgraph=True, backend="eager")(torch.randn(4, D))
    # Dynamo's headline and explanation, before its hints and traceback: lrmoe's advice is there, not buried
    headline = str(err.value).split("Hint:")[0]
    assert "generator= cannot be used under torch.compile" in headline and "generator=None" in headline
    assert "sampling_seed" not in str(err.value)  # no buffers of that name exist
    m(torch.randn(4, D)).sum().backward()  # eager keeps supporting it


@pytest.mark.parametrize("where", ["layer", "experts", "functional"])
def test_generator_under_compile_without_fullgraph_raises_naming_it(fresh_dynamo, where):
    """Without fullgraph the call raises lrmoe's ValueError too: no silent graph break that runs the step eagerly."""
    gen = torch.Generator().manual_seed(0)
    x, ids, gates = torch.randn(6, D), torch.randint(0, E, (6, K)), torch.rand(6, K)
    if where == "layer":
        call = torch.compile(LRMoE(D, FF, E, K, retain=0.5, generator=gen), backend="eager")
        args = (x,)
    elif where == "experts":
        call = torch.compile(SwiGLUExperts(E, D, FF, retain=0.5, generator=gen), backend="eager")
        args = (x.requires_grad_(), ids, gates)
    else:
        weights = torch.randn(E, 2 * FF, D), torch.randn(E, D, FF)
        call = torch.compile(lambda *a: selective_swiglu_experts(*a, retain=0.5, generator=gen), backend="eager")
        args = (x, *weights, ids, gates)
    with pytest.raises(ValueError, match="generator= cannot be used under torch.compile.*generator=None"):
        call(*args)


def test_generator_layer_compiled_does_not_break_fullgraph_of_another(fresh_dynamo):
    """Compiling a layer with a generator (which raises) leaves nothing behind that splits a later fullgraph
    compile of another layer: Dynamo marks the code objects of a frame whose traced ``raise`` it cannot resume as
    skipped, and those (LRMoE.forward, selective_swiglu_experts) are every layer's."""
    x = torch.randn(4, D, requires_grad=True)
    with pytest.raises(ValueError, match="generator="):
        torch.compile(LRMoE(D, FF, E, K, retain=0.5, generator=torch.Generator()), backend="eager")(x)
    counter = CompileCounterWithBackend("aot_eager")
    m = LRMoE(D, FF, E, K, retain=0.5, activations="offload")
    torch.compile(m, fullgraph=True, backend=counter)(x).sum().backward()
    assert counter.frame_count == 1  # one graph, as fullgraph asks
    assert m.experts.down_proj.grad.abs().sum() > 0


# ---------------------------------------------------------------------------------------------- meta device


@pytest.mark.parametrize("options", [
    dict(retain=1.0),
    dict(retain=0.5, activations="offload"),
    dict(retain=0.5, backward_capacity=1.0, metric="random"),
    dict(retain=0.5, score_func="sigmoid", selection_bias=True, n_group=4, topk_group=2, shared_hidden_dim=8,
         router_dtype=torch.float32),
], ids=["dense", "offload", "capacity", "glm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_meta_layer_on_meta_input_gives_shapes(options, dtype):
    """A layer built on the meta device (deferred init, FSDP's meta-device construction) runs on meta tokens, forward
    and backward, giving the shapes and dtypes a real run gives, with no data."""
    with torch.device("meta"):
        m = LRMoE(D, FF, E, K, **options).to(dtype)
    x = torch.empty(2, 3, D, device="meta", dtype=dtype, requires_grad=True)
    y = m(x)
    assert (y.shape, y.dtype, y.device.type) == (x.shape, dtype, "meta")
    y.sum().backward()
    assert (x.grad.shape, x.grad.device.type) == (x.shape, "meta")
    for p in m.parameters():
        assert p.grad.shape == p.shape and p.grad.device.type == "meta"
    stats = m.stats()
    assert stats.loads.shape == (E,) and stats.loads.device.type == "meta"
    with torch.no_grad():
        assert m.eval()(x).shape == x.shape


def test_meta_experts_module_on_meta_input_gives_shapes():
    with torch.device("meta"):
        experts = SwiGLUExperts(E, D, FF, retain=0.5)
        x = torch.empty(5, D, requires_grad=True)
        ids, gates = torch.zeros(5, K, dtype=torch.int64), torch.empty(5, K)
    y = experts(x, ids, gates)
    assert (y.shape, y.device.type) == ((5, D), "meta")
    y.sum().backward()
    assert experts.gate_up_proj.grad.shape == (E, 2 * FF, D) and x.grad.shape == (5, D)


# ---------------------------------------------------------------------------------------------- validation forwards


def test_validation_forward_does_not_steer_the_selection_bias():
    """update_selection_bias after an eval() + no_grad forward steps from the last training batch's loads."""
    torch.manual_seed(0)
    layer = LRMoE(D, FF, E, K, retain=0.5, score_func="sigmoid", selection_bias=True)
    x_train = torch.randn(64, D)
    x_val = torch.randn(1, D).expand(32, D)  # every token alike: two experts take the whole batch
    train_loads = torch.bincount(layer.route(x_train).expert_ids.flatten(), minlength=E)
    val_loads = torch.bincount(layer.route(x_val).expert_ids.flatten(), minlength=E)
    step = lambda loads: 0.01 * torch.sign(loads.float().mean() - loads.float())  # noqa: E731
    assert not torch.equal(step(train_loads), step(val_loads))  # the two batches would step differently

    layer(x_train).sum().backward()
    layer.eval()
    with torch.no_grad():
        layer(x_val)
    layer.train()
    assert torch.equal(layer.stats().loads, train_loads)
    layer.update_selection_bias(0.01)
    torch.testing.assert_close(layer.gate.e_score_correction_bias, step(train_loads))
    # a training forward without grad still counts (a reentrant checkpoint runs its first forward so)
    with torch.no_grad():
        layer(x_val)
    assert torch.equal(layer.stats().loads, val_loads)
