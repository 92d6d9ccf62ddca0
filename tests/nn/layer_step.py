"""One forward-backward of a layer, shared by the layer tests (and importable in spawned test processes)."""

from __future__ import annotations

from torch.distributed.tensor import DTensor


def forward_backward(layer, x, c):
    """[output, dx, *parameter grads] of sum(layer(x) * c) from fresh gradients; sharded (DTensor) gradients as
    this rank's local shard."""
    for p in layer.parameters():
        p.grad = None
    x = x.detach().clone().requires_grad_(True)
    out = layer(x)
    (out * c).sum().backward()
    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in layer.parameters()]
    return [out.detach(), x.grad] + grads
