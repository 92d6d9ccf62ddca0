"""FSDP2 over an LRMoE layer's experts in a unit of their own, torchtitan's layout: beside expert parallelism on a
(dp, ep) = (2, 2) mesh of 4 gloo ranks, and over plain data parallelism on 2.

Both layers run their experts through ``layer.experts(...)``, so FSDP's hooks on that module gather the weights
before it, free them after, and reduce-scatter their gradients in backward, with no help from the user. Before
that, the layers read the weights directly and saw half a rank's experts (an IndexError on CPU, garbage on CUDA).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import parallelize_module

from ep_harness import run_ranks
from lrmoe.nn import ExpertParallel, LRMoE

D, FF, E, K, T = 8, 6, 4, 2, 6


def _expert_grads_match(layer, summed_grads, n_dp, msg):
    # FSDP averages over dp (its default divide factor, the dp size): the mean of the dp groups' sums.
    for name, summed in summed_grads.items():
        got = getattr(layer.experts, name).grad.full_tensor()
        torch.testing.assert_close(got, summed / n_dp, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, name=name: f"{msg} {name}: {m}")


def _fsdp_beside_ep(rank, world, retain, max_replicas, device="cpu", n_dp=2):
    mesh = init_device_mesh(device, (n_dp, world // n_dp), mesh_dim_names=("dp", "ep"))
    torch.manual_seed(0)
    ref = LRMoE(D, FF, E, K, retain=retain, selection="top").to(device)
    u = torch.nn.functional.normalize(torch.randn(D, device=device), dim=0)
    if max_replicas:  # most tokens to experts 0 and 1, both on EP rank 0, so the hot-expert policy replicates them
        with torch.no_grad():
            ref.gate.weight[:2] += 4 * u
    style = ExpertParallel(mesh_dim_name="ep", max_replicas=max_replicas)
    plain = parallelize_module(copy.deepcopy(ref), mesh, style)
    layer = parallelize_module(copy.deepcopy(ref), mesh, style)
    fully_shard(layer.experts, mesh=mesh["dp"])
    fully_shard(layer, mesh=mesh["dp", "ep"]._flatten("dp_ep"))
    # Each rank holds 1/dp of its EP shard until experts(...) gathers it.
    n_held = E // mesh["ep"].size() // n_dp
    assert layer.experts.gate_up_proj.to_local().shape[0] == n_held
    torch.manual_seed(10 + rank)
    x, c = torch.randn(T, D, device=device) + 2 * u * max_replicas, torch.randn(T, D, device=device)

    for step in range(2):  # the second step after the weights were freed and gathered again
        out, want = layer(x), plain(x)
        torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-7, msg=lambda m: f"step {step} output: {m}")
        assert layer.experts.gate_up_proj.to_local().shape[0] == n_held, "the gathered experts were not freed"
        (out * c).sum().backward()
        (want * c).sum().backward()
        summed = {}
        for name in ("gate_up_proj", "down_proj"):
            summed[name] = getattr(plain.experts, name).grad.full_tensor()
            dist.all_reduce(summed[name], group=mesh["dp"].get_group())
        _expert_grads_match(layer, summed, n_dp, f"step {step}")
        if max_replicas:  # the replica path ran only if the plan placed some
            assert plain.stats().instances.ge(0).sum() > E
        layer.zero_grad()
        plain.zero_grad()
        x = x.flip(0) * 1.5


@pytest.mark.parametrize("retain,max_replicas", [(1.0, 0), (0.5, 0), (0.5, 1)])
def test_fsdp2_on_the_experts_beside_expert_parallelism_gathers_them(retain, max_replicas):
    run_ranks(4, _fsdp_beside_ep, retain, max_replicas)


def _fsdp_single_device_layer(rank, world, device="cpu"):
    mesh = init_device_mesh(device, (world,))
    torch.manual_seed(0)
    plain = LRMoE(D, FF, E, K, retain=0.5, selection="top").to(device)
    layer = copy.deepcopy(plain)
    fully_shard(layer.experts, mesh=mesh)
    fully_shard(layer, mesh=mesh)
    torch.manual_seed(10 + rank)
    x, c = torch.randn(T, D, device=device), torch.randn(T, D, device=device)
    out, want = layer(x), plain(x)
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-7)
    (out * c).sum().backward()
    (want * c).sum().backward()
    summed = {}
    for name in ("gate_up_proj", "down_proj"):
        summed[name] = getattr(plain.experts, name).grad.clone()
        dist.all_reduce(summed[name])
    _expert_grads_match(layer, summed, world, "plain data parallelism")

    # Mixed precision: the sharded weights stay fp32 while experts(...) computes in bf16; the layer's dtype check
    # must not refuse the bf16 input for them.
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    mixed = copy.deepcopy(plain)
    fully_shard(mixed.experts, mesh=mesh, mp_policy=bf16)
    fully_shard(mixed, mesh=mesh, mp_policy=bf16)
    torch.testing.assert_close(mixed(x), copy.deepcopy(plain).bfloat16()(x.bfloat16()), rtol=0, atol=0)

    # Weights sharded some other way reach experts(...) as DTensors: a clear error, not the ops' own.
    other = copy.deepcopy(plain)
    for name in ("gate_up_proj", "down_proj"):
        weight = distribute_tensor(getattr(other.experts, name).detach(), mesh, [Shard(0)])
        other.experts.register_parameter(name, torch.nn.Parameter(weight))
    with pytest.raises(RuntimeError, match="the experts' weights are DTensors: they are sharded"):
        other(x)


def test_fsdp2_on_the_experts_of_a_single_device_layer_gathers_them():
    run_ranks(2, _fsdp_single_device_layer)

