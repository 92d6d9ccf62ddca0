"""The private PyTorch internals lrmoe relies on (lrmoe/ops/_torch_internals.py) exist in this torch, so a torch
upgrade that moves one fails here, by name, before a compiled step misbehaves."""

from __future__ import annotations

import pytest
import torch

import lrmoe.ops  # noqa: F401  (registers the ops, which uses the internals)
from lrmoe.ops import _torch_internals as internals


@pytest.mark.parametrize("name", sorted(internals.INTERNALS))
def test_every_internal_resolves(name):
    assert internals.resolve(internals.INTERNALS[name]) is not None


def test_the_effect_registration_resolves_on_this_torch():
    # Its effect: tests/ops/test_offload.py::test_offload_ops_are_ordered_effects.
    for path in internals.effect_internals(torch.ops.lrmoe.offload_wait):
        assert internals.resolve(path) is not None


def test_a_missing_internal_is_named_in_the_error():
    with pytest.raises(RuntimeError, match=r"needs the PyTorch internal torch\._subclasses\.no_such_thing"):
        internals.resolve("torch._subclasses:no_such_thing")
    with pytest.raises(RuntimeError, match=r"torch\.no_such_module\.X, which torch .* does not have"):
        internals.resolve("torch.no_such_module:X")


def test_traced_tensor_types_are_tensor_classes():
    types = internals.traced_tensor_types()
    assert types[0] is torch.Tensor and all(issubclass(t, torch.Tensor) for t in types)
    assert not internals.export_keeps_custom_ops()  # outside torch.export
