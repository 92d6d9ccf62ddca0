"""The numbers users pass (NumPy scalars, floats where a byte count is meant, bools) and lrmoe.memory's bad inputs
(the standing suite; docs/reliability.md).

A real number is accepted where the meaning is unambiguous (``numbers.Real`` for fractions and factors,
``numbers.Integral`` for counts) and computed with as the Python number it holds; a bool, a string or a tensor is
refused, naming the argument.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lrmoe.functional import (
    instance_experts,
    place_hot_replicas,
    plan_experts,
    plan_quotas,
    route_topk,
    select_within_quota,
    selective_swiglu_experts,
)
from lrmoe.memory import MemoryConfig, layer_memory, plan_memory
from lrmoe.nn import LRMoE, SwiGLUExperts

LOADS = torch.tensor([5, 3, 9, 0, 7])
CFG = MemoryConfig(dim=64, hidden_dim=32, num_experts=8, top_k=2, tokens=128)


@pytest.mark.parametrize("retain", [np.float32(0.75), np.float64(0.75), np.float16(0.75)])
def test_numpy_retain_plans_what_the_python_float_plans(retain):
    assert torch.equal(plan_quotas(LOADS, retain), plan_quotas(LOADS, 0.75))
    assert torch.equal(plan_quotas(LOADS, retain, min_retain=np.float32(0.5), align=np.int64(2)),
                       plan_quotas(LOADS, 0.75, min_retain=0.5, align=2))


def test_a_numpy_float32_retain_is_the_float_it_holds():
    """np.float32(0.7) is 0.699999988...: plan_quotas' budget is floor(that * total), in float64."""
    loads = torch.tensor([10**6])
    assert int(plan_quotas(loads, np.float32(0.7)).sum()) == int(float(np.float32(0.7)) * 10**6) == 699999


def test_numpy_counts_and_factors_route_and_select_as_python_ints():
    logits = torch.randn(6, 8, generator=torch.Generator().manual_seed(0))
    got = route_topk(logits, np.int64(4), scaling=np.float32(2.5), n_group=np.int32(4), topk_group=np.int64(2))
    want = route_topk(logits, 4, scaling=2.5, n_group=4, topk_group=2)
    assert torch.equal(got.expert_ids, want.expert_ids) and torch.equal(got.gates, want.gates)
    sel = select_within_quota(torch.rand(5), torch.tensor([0, 1, 0, 1, 1]), torch.tensor([1, 2]),
                              max_rows=np.int64(3), mode="top", max_group_size=np.int32(3))
    assert sel.pair_ids.shape == (3,)
    assert place_hot_replicas(torch.ones(2, 4, dtype=torch.long), np.int64(1)).shape == (2, 1)
    assert instance_experts(torch.tensor([[3], [-1]]), np.int64(4)).tolist() == [[0, 1, 3], [2, 3, -1]]


def test_the_layer_and_the_expert_function_take_numpy_retain_in_eager_mode():
    torch.manual_seed(0)
    layer = LRMoE(8, 16, 4, 2, retain=np.float32(0.75), min_retain=np.float64(0.25),
                  routed_scaling_factor=np.float32(1.5), n_group=np.int64(2), topk_group=np.int64(1))
    layer(torch.randn(10, 8)).sum().backward()
    assert int(layer.stats().retained_pairs) == int(0.75 * 20)
    experts = SwiGLUExperts(np.int64(4), np.int64(8), np.int64(16), retain=np.float32(0.5))
    assert experts.gate_up_proj.shape == (4, 32, 8)
    ids = torch.tensor([[0, 1], [2, 3], [1, 2]])
    assert plan_experts(ids, np.int64(4), retain=np.float64(0.5)).quotas.sum() == 3
    out = selective_swiglu_experts(torch.randn(3, 8), torch.randn(4, 32, 8), torch.randn(4, 8, 16), ids,
                                   torch.rand(3, 2), retain=np.float32(0.5))
    assert out.shape == (3, 8)


def test_a_numpy_retain_compiles_and_plans_as_its_float():
    # Dynamo and AOTAutograd trace it whole; the numpy scalar plans the same quotas as the Python float.
    torch.manual_seed(0)
    layer = LRMoE(8, 16, 4, 2, retain=np.float32(0.75), selection="top")
    twin = LRMoE(8, 16, 4, 2, retain=0.75, selection="top")
    twin.load_state_dict(layer.state_dict())
    x = torch.randn(10, 8)
    torch.compile(layer, fullgraph=True, backend="aot_eager")(x).sum().backward()
    twin(x).sum().backward()
    assert torch.equal(layer.stats().quotas, twin.stats().quotas)
    torch.testing.assert_close(layer.experts.down_proj.grad, twin.experts.down_proj.grad)


@pytest.mark.parametrize("call, exc, match", [
    (lambda: plan_quotas(LOADS, True), TypeError, "retain must be a real number"),
    (lambda: plan_quotas(LOADS, np.bool_(True)), TypeError, "retain must be a real number"),
    (lambda: plan_quotas(LOADS, 0.5, min_retain=False), TypeError, "min_retain must be a real number"),
    (lambda: plan_quotas(LOADS, np.float32("nan")), ValueError, r"retain must be in \(0, 1\]"),
    (lambda: plan_quotas(LOADS, 0.5, align=np.float64(2.0)), ValueError, "align must be a positive int"),
    (lambda: route_topk(torch.randn(3, 8), np.float64(2.0)), ValueError, "top_k must be an int"),
    (lambda: route_topk(torch.randn(3, 8), 2, scaling=np.bool_(True)), ValueError, "scaling must be a finite"),
    (lambda: route_topk(torch.randn(3, 8), 2, scaling=torch.tensor(2.0)), ValueError, "scaling must be a finite"),
    (lambda: select_within_quota(torch.rand(2), torch.tensor([0, 0]), torch.tensor([1]), max_rows=True),
     ValueError, "max_rows must be an int"),
    (lambda: LRMoE(8, 16, 4, 2, retain=np.float64(1.5)), ValueError, r"retain must be in \(0, 1\]"),
], ids=["retain bool", "retain numpy bool", "min_retain bool", "retain numpy nan", "align numpy float",
        "top_k numpy float", "scaling numpy bool", "scaling tensor", "max_rows bool", "LRMoE numpy retain > 1"])
def test_bools_and_non_numbers_are_refused_naming_the_argument(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


# ------------------------------------------------------------------------------------------------ lrmoe.memory


@pytest.mark.parametrize("budget", [6e9, np.float64(6e9), np.int64(6_000_000_000), 6e9 + 0.75])
def test_plan_memory_takes_a_real_byte_budget_rounded_down(budget):
    """A float budget (6e9, as users write gigabytes) plans as its whole bytes, rounded down."""
    plan = plan_memory(CFG, budget)
    assert plan.budget_bytes == 6_000_000_000 and type(plan.budget_bytes) is int
    assert plan == plan_memory(CFG, 6_000_000_000)


def test_a_float_budget_one_byte_short_is_short():
    cheapest = plan_memory(CFG, 10**12, retain_choices=[0.25]).memory.peak
    assert plan_memory(CFG, float(cheapest), retain_choices=[0.25]).headroom == 0
    with pytest.raises(ValueError, match=f"budget_bytes={cheapest - 1} is 1 bytes short"):
        plan_memory(CFG, cheapest - 0.5, retain_choices=[0.25])


@pytest.mark.parametrize("call, exc, match", [
    (lambda: plan_memory(CFG, "6e9"), TypeError, "budget_bytes must be a number of bytes"),
    (lambda: plan_memory(CFG, True), TypeError, "budget_bytes must be a number of bytes"),
    (lambda: plan_memory(CFG, torch.tensor(6e9)), TypeError, "budget_bytes must be a number of bytes"),
    (lambda: plan_memory(CFG, float("inf")), ValueError, "budget_bytes must be finite"),
    (lambda: plan_memory(CFG, float("nan")), ValueError, "budget_bytes must be finite"),
    (lambda: plan_memory(CFG, 10), ValueError, r"budget_bytes=10 is \d+ bytes short"),
    (lambda: plan_memory(CFG, 6e9, max_replicas=1), ValueError, "max_replicas > 0 needs world_size > 1"),
    (lambda: plan_memory(CFG, 6e9, retain_choices=[]), ValueError, "retain_choices must not be empty"),
    (lambda: plan_memory(CFG, 6e9, retain_choices=[1.5]), ValueError, r"retain must be in \(0, 1\]"),
    (lambda: plan_memory(CFG, 6e9, prefer="speed"), ValueError, "prefer must be one of"),
    (lambda: layer_memory(CFG, retain=0.0), ValueError, r"retain must be in \(0, 1\]"),
    (lambda: layer_memory(CFG, retain="0.5"), TypeError, "retain must be a real number"),
    (lambda: layer_memory(CFG, policy="disk"), ValueError, "policy must be one of"),
    (lambda: layer_memory(CFG, replicas=1), ValueError, "replicas need expert parallelism"),
    (lambda: layer_memory(CFG, replicas=-1), ValueError, "replicas must be a non-negative int"),
    (lambda: layer_memory(CFG, retain=0.5, backward_capacity=0.5), ValueError, "backward_capacity must be"),
    (lambda: MemoryConfig(dim=0, hidden_dim=32, num_experts=8, top_k=2, tokens=128), ValueError,
     "dim must be a positive int"),
    (lambda: MemoryConfig(dim=64, hidden_dim=32, num_experts=8, top_k=9, tokens=128), ValueError, "top_k must be"),
    (lambda: MemoryConfig(dim=64, hidden_dim=32, num_experts=8, top_k=2, tokens=128, world_size=3), ValueError,
     "num_experts=8 must be divisible by world_size=3"),
    (lambda: MemoryConfig(dim=64, hidden_dim=32, num_experts=8, top_k=2, tokens=128, param_dtype=torch.int8),
     TypeError, "param_dtype must be a floating-point"),
    (lambda: MemoryConfig(dim=64, hidden_dim=32, num_experts=8, top_k=2, tokens=128, selection="best"), ValueError,
     "selection must be one of"),
    (lambda: MemoryConfig(dim=64, hidden_dim=32, num_experts=8, top_k=2, tokens=128, grads_preallocated=1),
     TypeError, "grads_preallocated must be a bool"),
], ids=["budget str", "budget bool", "budget tensor", "budget inf", "budget nan", "budget short",
        "replicas one device", "no retain choices", "retain choice > 1", "prefer", "layer retain 0", "layer retain str",
        "layer policy", "layer replicas one device", "layer replicas -1", "layer capacity < 1", "config dim 0",
        "config top_k > E", "config E % W", "config int dtype", "config selection", "config grads_preallocated"])
def test_memory_bad_inputs_are_refused_naming_the_argument(call, exc, match):
    with pytest.raises(exc, match=match):
        call()
