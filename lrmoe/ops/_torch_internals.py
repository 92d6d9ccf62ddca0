"""Every private PyTorch name lrmoe uses, in one place, for torch 2.11 to 2.14 (tests/test_private_torch_names.py
fails on one used anywhere else in lrmoe/).

Public ``torch.library`` API covers the rest of the ops (custom_op, register_kernel/fake/autograd,
register_torch_dispatch, wrap_triton). It does not cover these needs:

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
3. Private functions with no public form, called as they are (compiled code must see the torch function itself):
   ``grouped_mm`` (torch._grouped_mm, the CUDA grouped GEMM of lrmoe.ops.grouped_gemm), ``torch_check``
   (torch._check: unbacked row counts are >= 0, lrmoe.nn._transport), ``current_graph_task_id``
   (torch._C._current_graph_task_id: whether autograd is running a backward, lrmoe.nn.lrmoe.recomputing),
   ``register_dataclass`` (torch.utils._pytree's: the functional plans as pytrees) and
   ``functional_collectives`` (torch.distributed._functional_collectives: traceable collectives, lrmoe.nn.
   _transport).

The internals of needs 1 and 2 are looked up when first used and a missing one raises an error naming it and this
torch version (lrmoe.ops registers its ops at import, so lrmoe's import fails then, not a compiled step later).
tests/ops/test_torch_internals.py resolves all of them, those of need 3 too, so a torch upgrade that moves one
fails there first.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
import torch.utils._pytree

__all__ = ["INTERNALS", "current_graph_task_id", "effect_internals", "export_keeps_custom_ops",
           "functional_collectives", "grouped_mm", "register_dataclass", "register_functional_rule",
           "register_ordered_effect", "resolve", "torch_check", "traced_tensor_types"]

# What each need uses, as "module:attribute". Effects: one of the two forms suffices (see register_ordered_effect).
INTERNALS = {
    "FunctionalTensorMode": "torch._subclasses.functional_tensor:FunctionalTensorMode",
    "FunctionalTensor": "torch._subclasses.functional_tensor:FunctionalTensor",
    "FakeTensor": "torch._subclasses.fake_tensor:FakeTensor",
    "export_decomposition_disabled": "torch.export._trace:custom_triton_ops_decomposition_disabled",
    "grouped_mm": "torch:_grouped_mm",
    "torch_check": "torch:_check",
    "current_graph_task_id": "torch._C:_current_graph_task_id",
    "register_dataclass": "torch.utils._pytree:register_dataclass",
    "all_to_all_single": "torch.distributed._functional_collectives:all_to_all_single",
    "wait_tensor": "torch.distributed._functional_collectives:wait_tensor",
}
_FUNCTIONAL_COLLECTIVES = "torch.distributed._functional_collectives"
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


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """torch._grouped_mm(a, b, offs=offs): group g multiplies a's and b's rows (or columns) up to offs[g]."""
    return torch._grouped_mm(a, b, offs=offs)


def torch_check(condition) -> None:
    """torch._check: ``condition`` holds (eager: raises if not; traced: the compiler may assume it)."""
    torch._check(condition)


def current_graph_task_id() -> int:
    """torch._C._current_graph_task_id: the id of the backward autograd is running on this thread, -1 outside."""
    return torch._C._current_graph_task_id()


def register_dataclass(cls: type) -> type:
    """torch.utils._pytree.register_dataclass: ``cls``'s fields are a pytree's children (torch.compile flattens
    and rebuilds it); returns ``cls``."""
    torch.utils._pytree.register_dataclass(cls)
    return cls


def functional_collectives() -> ModuleType:
    """torch.distributed._functional_collectives: collectives that return tensors (waited on with wait_tensor),
    which torch.compile traces."""
    return importlib.import_module(_FUNCTIONAL_COLLECTIVES)


def effect_internals(op) -> list[str]:
    """The internals register_ordered_effect uses for ``op`` on this torch (for the test)."""
    return [_EFFECTS_2_13] if hasattr(op, "register_effect") else [_EFFECTS_2_11]
