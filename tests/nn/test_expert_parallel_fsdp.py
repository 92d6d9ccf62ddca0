"""FSDP2 beside expert parallelism on a (dp, ep) = (2, 2) mesh of 4 gloo ranks, torchtitan's layout: the experts
in an FSDP unit of their own over dp, the layer (router) over all four ranks.

The layer reads its expert weights directly and never calls ``layer.experts(...)``, so FSDP's gathering of the
experts must be asked for (a forward pre-hook calling ``experts.unshard()``); without it the kernels read half a
rank's experts (an IndexError on CPU, garbage on CUDA), which the layer now refuses with an error saying what to do.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import parallelize_module

from ep_harness import run_ranks
from lrmoe.nn import ExpertParallel, LRMoE

D, FF, E, K, T = 8, 6, 4, 2, 6


def _fsdp_beside_ep(rank, world, retain):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    torch.manual_seed(0)
    ref = LRMoE(D, FF, E, K, retain=retain, selection="top")
    plain = parallelize_module(copy.deepcopy(ref), mesh, ExpertParallel(mesh_dim_name="ep"))
    layer = parallelize_module(copy.deepcopy(ref), mesh, ExpertParallel(mesh_dim_name="ep"))
    fully_shard(layer.experts, mesh=mesh["dp"])
    fully_shard(layer, mesh=mesh["dp", "ep"]._flatten("dp_ep"))
    torch.manual_seed(10 + rank)
    x, c = torch.randn(T, D), torch.randn(T, D)

    with pytest.raises(RuntimeError, match="expected E/W = 2: they were sharded further"):
        layer(x)
    layer.register_forward_pre_hook(lambda module, args: module.experts.unshard())
    out = layer(x)
    want = plain(x)
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-7)

    (out * c).sum().backward()
    (want * c).sum().backward()
    # The plain layer's expert gradients sum its EP group's tokens; FSDP then averages over dp (its default divide
    # factor, the dp size): the mean of the two EP groups' sums.
    for name in ("gate_up_proj", "down_proj"):
        summed = getattr(plain.experts, name).grad.full_tensor()
        dist.all_reduce(summed, group=mesh["dp"].get_group())
        got = getattr(layer.experts, name).grad.full_tensor()
        torch.testing.assert_close(got, summed / 2, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("retain", [1.0, 0.5])
def test_fsdp2_beside_expert_parallelism_needs_the_experts_gathered(retain):
    run_ranks(4, _fsdp_beside_ep, retain)


def _fsdp_single_device_layer(rank, world):
    # Plain data parallelism: FSDP2 over the ranks, the experts in a unit of their own. Without the pre-hook the
    # ops got DTensor weights beside plain tensors and raised "got mixed torch.Tensor and DTensor".
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    plain = LRMoE(D, FF, E, K, retain=0.5, selection="top")
    layer = copy.deepcopy(plain)
    fully_shard(layer.experts, mesh=mesh)
    fully_shard(layer, mesh=mesh)
    torch.manual_seed(10 + rank)
    x = torch.randn(T, D)
    with pytest.raises(RuntimeError, match="the experts' weights are sharded DTensors: they were sharded further"):
        layer(x)
    layer.register_forward_pre_hook(lambda module, args: module.experts.unshard())
    torch.testing.assert_close(layer(x), plain(x), rtol=1e-6, atol=1e-7)


def test_fsdp2_on_a_single_device_layer_needs_the_experts_gathered():
    run_ranks(2, _fsdp_single_device_layer)
