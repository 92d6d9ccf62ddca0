"""Fixtures shared by the layer tests."""

from __future__ import annotations

import pytest


def _forward_backward(layer, x, c):
    """Forward and backward of sum(layer(x) * c) from fresh gradients: [output, dx, *parameter grads]."""
    for p in layer.parameters():
        p.grad = None
    x = x.detach().clone().requires_grad_(True)
    out = layer(x)
    (out * c).sum().backward()
    return [out.detach(), x.grad] + [p.grad for p in layer.parameters()]


@pytest.fixture
def fwd_bwd():
    return _forward_backward
