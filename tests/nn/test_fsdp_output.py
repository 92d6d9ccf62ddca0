"""FSDP2 and an in-place op on the layer's output (issue 35, item 2). fully_shard's pre-backward hook sits on the
module's output tensors; were the output a view (a reshape of the experts' [T, D] rows), an in-place op on it
would drop that hook, the parameters would stay unsharded and every rank would keep its own unreduced gradient.
The layer writes its output in x's shape instead, so the hook survives."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from ep_harness import run_ranks
from lrmoe.nn import LRMoE

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
