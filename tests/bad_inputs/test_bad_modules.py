"""Bad inputs and edge cases of lrmoe.nn (the standing suite; docs/reliability.md): LRMoE, SwiGLUExperts,
swap_experts, from_transformers, replace_moe_blocks, ExpertParallel, and checkpoints that do not fit.

Each refused case asserts the error type and that the message names the argument; each accepted edge case asserts
the documented result. ExpertParallel's checks run in one process on a fake 2-rank process group (torch's "fake"
backend: no collective runs, and every check here comes before the first one).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lrmoe.nn import ExpertParallel, LRMoE, SwiGLUExperts, from_transformers, replace_moe_blocks, swap_experts

D, FF, E, K = 8, 16, 4, 2
META = torch.device("meta")


def _layer(**options):
    torch.manual_seed(0)
    return LRMoE(D, FF, E, K, **options)


def _experts():
    torch.manual_seed(0)
    return SwiGLUExperts(E, D, FF)


def _ids(t=3):
    return torch.tensor([[0, 1], [2, 3], [1, 2]])[:t]


REFUSED = [
    # LRMoE's configuration
    ("LRMoE dim 0", lambda: LRMoE(0, FF, E, K), ValueError, "dim must be an int >= 1"),
    ("LRMoE dim float", lambda: LRMoE(8.0, FF, E, K), ValueError, "dim must be an int"),
    ("LRMoE top_k > E", lambda: LRMoE(D, FF, E, E + 1), ValueError, r"top_k must be an int in \[1, num_experts=4\]"),
    ("LRMoE retain 0", lambda: LRMoE(D, FF, E, K, retain=0.0), ValueError, r"retain must be in \(0, 1\]"),
    ("LRMoE retain > 1", lambda: LRMoE(D, FF, E, K, retain=1.01), ValueError, r"retain must be in \(0, 1\]"),
    ("LRMoE retain bool", lambda: LRMoE(D, FF, E, K, retain=True), TypeError, "retain must be a real number"),
    ("LRMoE retain str", lambda: LRMoE(D, FF, E, K, retain="0.5"), TypeError, "retain must be a real number"),
    ("LRMoE min_retain", lambda: LRMoE(D, FF, E, K, retain=0.5, min_retain=0.75), ValueError, "min_retain"),
    ("LRMoE selection", lambda: LRMoE(D, FF, E, K, selection="best"), ValueError, "selection must be one of"),
    ("LRMoE metric", lambda: LRMoE(D, FF, E, K, metric="l1"), ValueError, "metric must be one of"),
    ("LRMoE policy", lambda: LRMoE(D, FF, E, K, policy="greedy"), ValueError, "policy must be one of"),
    ("LRMoE activations", lambda: LRMoE(D, FF, E, K, activations="disk"), ValueError, "activations must be one of"),
    ("LRMoE quota_align", lambda: LRMoE(D, FF, E, K, quota_align=0), ValueError, "quota_align"),
    ("LRMoE capacity < 1", lambda: LRMoE(D, FF, E, K, retain=0.5, backward_capacity=0.5), ValueError,
     "backward_capacity must be a finite float >= 1"),
    ("LRMoE capacity at retain 1", lambda: LRMoE(D, FF, E, K, backward_capacity=1.5), ValueError,
     "backward_capacity needs retain < 1"),
    ("LRMoE n_group", lambda: LRMoE(D, FF, E, K, n_group=3, topk_group=1), ValueError, "n_group must be a positive"),
    ("LRMoE router_dtype", lambda: LRMoE(D, FF, E, K, router_dtype=torch.long), TypeError, "router_dtype"),
    ("LRMoE scaling", lambda: LRMoE(D, FF, E, K, routed_scaling_factor=0.0), ValueError, "routed_scaling_factor"),
    ("LRMoE generator", lambda: LRMoE(D, FF, E, K, generator=0), TypeError, "generator must be a torch.Generator"),
    ("LRMoE selection_bias", lambda: LRMoE(D, FF, E, K, selection_bias=1), TypeError, "selection_bias must be a bool"),
    ("LRMoE save_outputs", lambda: LRMoE(D, FF, E, K, save_outputs="yes"), TypeError, "save_outputs must be a bool"),
    # LRMoE's input
    ("LRMoE x list", lambda: _layer()([[0.0] * D]), ValueError, "x must be a tensor"),
    ("LRMoE x 0-d", lambda: _layer()(torch.tensor(1.0)), ValueError, "x must be a tensor"),
    ("LRMoE x last dim", lambda: _layer()(torch.randn(3, D + 1)), ValueError, "x must have last dimension dim=8"),
    ("LRMoE x dtype", lambda: _layer()(torch.randn(3, D).double()), TypeError, "x has dtype torch.float64"),
    ("LRMoE x int", lambda: _layer()(torch.ones(3, D, dtype=torch.long)), TypeError, "x has dtype torch.int64"),
    ("LRMoE x meta", lambda: _layer()(torch.randn(3, D, device=META)), ValueError, "x on meta"),
    ("LRMoE update bias", lambda: _layer().update_selection_bias(1e-3), ValueError, "selection_bias=True"),
    ("LRMoE update rate", lambda: _layer(selection_bias=True).update_selection_bias(-1.0), ValueError,
     "rate must be a finite number > 0"),
    # SwiGLUExperts
    ("SwiGLUExperts E 0", lambda: SwiGLUExperts(0, D, FF), ValueError, "num_experts must be an int >= 1"),
    ("SwiGLUExperts option", lambda: SwiGLUExperts(E, D, FF, retian=0.5), TypeError, r"unknown expert options"),
    ("SwiGLUExperts retain", lambda: SwiGLUExperts(E, D, FF, retain=2.0), ValueError, "retain must be in"),
    ("SwiGLUExperts x D", lambda: _experts()(torch.randn(3, D + 1), _ids(), torch.rand(3, K)), ValueError,
     r"gate_up_EFD must be \[E, 2F, D=9\]"),
    ("SwiGLUExperts gates shape", lambda: _experts()(torch.randn(3, D), _ids(), torch.rand(3, K + 1)), ValueError,
     "gates_TK"),
    ("SwiGLUExperts int gates", lambda: _experts()(torch.randn(3, D), _ids(), torch.ones(3, K, dtype=torch.long)),
     TypeError, "gates_TK"),
    ("SwiGLUExperts float ids", lambda: _experts()(torch.randn(3, D), _ids().float(), torch.rand(3, K)), TypeError,
     "expert_ids_TK"),
    ("SwiGLUExperts id >= E", lambda: _experts()(torch.randn(3, D), _ids() + 2, torch.rand(3, K)), ValueError,
     r"expert_ids must be in \[0, num_experts=4\)"),
    ("SwiGLUExperts call option", lambda: _experts()(torch.randn(3, D), _ids(), torch.rand(3, K), retain=0.0),
     ValueError, "retain must be in"),
    # swap_experts, from_transformers, replace_moe_blocks
    ("swap_experts str", lambda: swap_experts("model"), TypeError, "model must be an nn.Module"),
    ("swap_experts no experts", lambda: swap_experts(torch.nn.Linear(2, 2)), ValueError, "holds no experts module"),
    ("swap_experts option", lambda: swap_experts(_fused_holder(), retian=0.5), TypeError, "unknown expert options"),
    ("swap_experts itself", lambda: swap_experts(_experts()), ValueError, "SwiGLUExperts already"),
    ("from_transformers Linear", lambda: from_transformers(torch.nn.Linear(2, 2)), ValueError,
     "from_transformers takes a transformers"),
    ("replace_moe_blocks str", lambda: replace_moe_blocks("model"), TypeError, "model must be an nn.Module"),
    ("replace_moe_blocks none", lambda: replace_moe_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2))), ValueError,
     "holds no transformers MoE block"),
    # ExpertParallel's options
    ("ExpertParallel replicas", lambda: ExpertParallel(max_replicas=-1), ValueError, "max_replicas"),
    ("ExpertParallel capacity", lambda: ExpertParallel(capacity_factor="2"), TypeError, "capacity_factor"),
    ("ExpertParallel capacity < 1", lambda: ExpertParallel(capacity_factor=0.5), ValueError, "capacity_factor"),
    ("ExpertParallel policy", lambda: ExpertParallel(placement_policy=3), TypeError, "placement_policy"),
    ("ExpertParallel plan_on", lambda: ExpertParallel(plan_on="gpu"), ValueError, "plan_on"),
    ("ExpertParallel blocks", lambda: ExpertParallel(backward_blocks=1), TypeError, "backward_blocks"),
]


def _fused_holder():
    """A module holding fused SwiGLU experts as transformers' experts modules do, for swap_experts."""
    holder = torch.nn.Module()
    holder.experts = torch.nn.Module()
    holder.experts.gate_up_proj = torch.nn.Parameter(torch.randn(E, 2 * FF, D))
    holder.experts.down_proj = torch.nn.Parameter(torch.randn(E, D, FF))
    holder.experts.act_fn = torch.nn.SiLU()
    return holder


@pytest.mark.parametrize("call, exc, match", [case[1:] for case in REFUSED], ids=[case[0] for case in REFUSED])
def test_refused_naming_the_argument(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_swiglu_experts_refuse_meta_tokens_naming_them():
    with pytest.raises(ValueError, match="x_TD on meta"):
        _experts()(torch.randn(3, D, device=META), _ids(), torch.rand(3, K))


# ------------------------------------------------------------------------------------------------ checkpoints


@pytest.mark.parametrize("change, match", [
    (lambda sd: sd.update({"experts.gate_up_proj": torch.zeros(E, 2, D)}), "size mismatch for experts.gate_up_proj"),
    (lambda sd: sd.pop("gate.weight"), r'Missing key\(s\) in state_dict: "gate.weight"'),
    (lambda sd: sd.update({"experts.w1": torch.zeros(1)}), r'Unexpected key\(s\) in state_dict: "experts.w1"'),
])
def test_a_checkpoint_that_does_not_fit_is_refused_naming_the_tensor(change, match):
    layer = _layer()
    state = layer.state_dict()
    change(state)
    with pytest.raises(RuntimeError, match=match):
        layer.load_state_dict(state)


def test_the_layers_state_dict_holds_only_weights():
    """Statistics buffers are not checkpointed: a state_dict of the same configuration always loads."""
    layer = _layer(retain=0.5)
    layer(torch.randn(5, D)).sum().backward()
    assert sorted(layer.state_dict()) == ["experts.down_proj", "experts.gate_up_proj", "gate.weight"]
    other = LRMoE(D, FF, E, K, retain=0.75)
    other.load_state_dict(layer.state_dict())
    assert torch.equal(other.experts.down_proj, layer.experts.down_proj)


# ------------------------------------------------------------------------------------------------ edge cases


def test_no_tokens_give_an_empty_output_and_zero_gradients():
    layer = _layer(retain=0.5)
    x = torch.zeros(0, D, requires_grad=True)
    out = layer(x)
    assert out.shape == (0, D)
    out.sum().backward()
    assert (layer.experts.down_proj.grad == 0).all() and (layer.gate.weight.grad == 0).all()
    assert int(layer.stats().total_pairs) == 0


def test_leading_dimensions_are_kept():
    out = _layer()(torch.randn(2, 3, D))
    assert out.shape == (2, 3, D)


def test_a_nan_output_gradient_shows_in_the_expert_gradients_at_any_retain():
    """The documented NaN/Inf promise at the layer: a non-finite output gradient scores +inf, its pairs are kept
    first, so the experts that token reached get NaN gradients instead of a silently clean update."""
    layer = _layer(retain=0.5, selection="top")
    x = torch.randn(16, D)
    grad = torch.randn(16, D)
    grad[5, 0] = float("nan")
    layer(x).backward(grad)
    reached = set(layer.route(x).expert_ids[5].tolist())
    nan_experts = set(layer.experts.down_proj.grad.isnan().flatten(1).any(1).nonzero().flatten().tolist())
    assert nan_experts == reached


def test_all_tokens_on_one_expert_trim_it_and_keep_the_budget():
    """Skewed routing: a router that sends every token to experts 0 and 1 at retain 0.5 keeps floor(0.5 P) pairs,
    trimmed evenly between the two hot experts (waterfill), and the output stays exact."""
    layer = _layer(retain=0.5, selection="top")
    dense = _layer()
    with torch.no_grad():
        for m in (layer, dense):
            m.gate.weight.zero_()
            m.gate.weight[:2] = 10.0  # logits 10 * sum(x) for experts 0, 1: with x > 0 they win
    x = torch.rand(20, D) + 0.1
    out = layer(x)
    torch.testing.assert_close(out, dense(x))
    out.sum().backward()
    stats = layer.stats()
    assert stats.loads.tolist() == [20, 20, 0, 0] and stats.quotas.tolist() == [10, 10, 0, 0]


# ------------------------------------------------------------------------------------------------ ExpertParallel


@pytest.fixture(scope="module")
def two_rank_mesh():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("module, style, match", [
    (lambda: LRMoE(D, FF, 3, 1), lambda: ExpertParallel(), r"num_experts=3 is not divisible by the EP mesh size W=2"),
    (lambda: SwiGLUExperts(5, D, FF), lambda: ExpertParallel(), r"num_experts=5 is not divisible"),
    (lambda: LRMoE(D, FF, E, K), lambda: ExpertParallel(max_replicas=3), r"max_replicas=3 exceeds the 2 experts"),
    (lambda: LRMoE(D, FF, E, K), lambda: ExpertParallel(mesh_dim_name="tp"), r"mesh_dim_name='tp' is not"),
])
def test_expert_parallel_refuses_what_a_mesh_cannot_hold(two_rank_mesh, module, style, match):
    from torch.distributed.tensor.parallel import parallelize_module

    with pytest.raises(ValueError, match=match):
        parallelize_module(module(), two_rank_mesh, style())


def test_expert_parallel_refuses_other_modules(two_rank_mesh):
    from torch.distributed.tensor.parallel import parallelize_module

    with pytest.raises(TypeError, match="ExpertParallel applies to lrmoe.nn.LRMoE layers"):
        parallelize_module(torch.nn.Linear(D, D), two_rank_mesh, ExpertParallel())
