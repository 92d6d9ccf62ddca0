"""Every private PyTorch internal lrmoe.ops relies on, in one place, for torch 2.11 to 2.14.

Public ``torch.library`` API covers the rest of the ops (custom_op, register_kernel/fake/autograd,
register_torch_dispatch, wrap_triton). It does not cover these two needs:

1. Inlining an op's CUDA kernels under torch.compile, for CUDA tensors only (lrmoe.ops._kernels.
   inline_when_compiled). torch.library.triton_op is the public form of the idea, but it decomposes the op on every
   device, so a CPU graph would trace the reference inline (which reads offsets on the host: a data-dependent
   failure) instead of keeping the op whole. So the op registers a rule for ``FunctionalTensorMode`` (the mode
   AOTAutograd traces under) through the public CustomOpDef.register_torch_dispatch, with the private mode class,
   tensor classes and torch.export's switch that keeps custom Triton ops whole, as triton_op itself does.
2. Marking an op effectful (lrmoe.ops.offload: the offload copy must stay in the forward graph, and offload_wait,
   which has no output, must not be dropped). torch 2.13 has CustomOpDef.register_effect, whose argument type
   lives in torch._library.effects; torch 2.11 (the GPU machine's) only the private
   torch._higher_order_ops.effects._register_effectful_op.

Each internal is looked up when first used and a missing one raises an error naming it and this torch version
(lrmoe.ops registers its ops at import, so lrmoe's import fails then, not a compiled step later).
tests/ops/test_torch_internals.py resolves all of them, so a torch upgrade that moves one fails there first.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["INTERNALS", "effect_internals", "export_keeps_custom_ops", "register_functional_rule",
           "register_ordered_effect", "resolve", "traced_tensor_types"]

# What each need uses, as "module:attribute". Effects: one of the two forms suffices (see _effect_registrar).
INTERNALS = {
    "FunctionalTensorMode": "torch._subclasses.functional_tensor:FunctionalTensorMode",
    "FunctionalTensor": "torch._subclasses.functional_tensor:FunctionalTensor",
    "FakeTensor": "torch._subclasses.fake_tensor:FakeTensor",
    "export_decomposition_disabled": "torch.export._trace:custom_triton_ops_decomposition_disabled",
}
_EFFECTS_2_13 = "torch._library.effects:EffectType"
_EFFECTS_2_11 = "torch._higher_order_ops.effects:_register_effectful_op"


def resolve(path: str) -> Any:
    """The object at ``path`` ("module:attribute"), or a RuntimeError naming it."""
    module, attr = path.split(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise RuntimeError(f"lrmoe.ops needs the PyTorch internal {module}.{attr}, which torch {torch.__version__} "
                           f"does not have ({e}); see lrmoe/ops/_torch_internals.py") from e


def traced_tensor_types() -> tuple[type, ...]:
    """The tensor classes an op sees while AOTAutograd traces it: plain, functional and fake (no other subclass)."""
    return torch.Tensor, resolve(INTERNALS["FunctionalTensor"]), resolve(INTERNALS["FakeTensor"])


def register_functional_rule(op, rule: Callable[..., Any]) -> None:
    """Run ``rule(mode, func, types, args, kwargs)`` when ``op`` is called under FunctionalTensorMode."""
    op.register_torch_dispatch(resolve(INTERNALS["FunctionalTensorMode"]), rule)


def export_keeps_custom_ops() -> bool:
    """Whether torch.export is tracing with custom Triton ops kept whole (a graph of Triton kernels does not
    serialise), as torch.library.triton_op asks it."""
    return resolve(INTERNALS["export_decomposition_disabled"])()


def register_ordered_effect(op) -> None:
    """Mark the custom op ``op`` (a torch.library.custom_op) effectful (EffectType.ORDERED): torch.compile keeps it
    where it was called and threads an effect token through it; ops without outputs too (with_effects then
    returns the token alone)."""
    if hasattr(op, "register_effect"):  # torch >= 2.13
        op.register_effect(resolve(_EFFECTS_2_13).ORDERED)
        return
    register = resolve(_EFFECTS_2_11)
    effects = importlib.import_module("torch._higher_order_ops.effects")
    effect_type = getattr(effects, "_EffectType", None) or resolve("torch._higher_order_ops.effects:EffectType")
    register(op._opoverload, effect_type.ORDERED)


def effect_internals(op) -> list[str]:
    """The internals register_ordered_effect uses for ``op`` on this torch (for the test)."""
    return [_EFFECTS_2_13] if hasattr(op, "register_effect") else [_EFFECTS_2_11]
