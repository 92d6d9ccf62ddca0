"""``define_op``: one lrmoe custom op from its parts, the way every lrmoe op is registered (lrmoe.ops, and
lrmoe.functional.ep_plan; tests/ops/test_define.py finds no other registration).

An op is a ``torch.library.custom_op`` (schema, CPU kernel) with a fake implementation, an autograd registration,
usually a CUDA kernel that falls back to the reference, sometimes inlining under torch.compile or an ordered
effect. The decorated function gives the schema (its type hints) and is the reference: the CPU kernel, and the
kernel of every device without one of its own::

    @define_op("lrmoe::waterfill", check=_check, fake=_fake, kernels="quotas",
               cuda=lambda kernels, *args: kernels.waterfill_triton(*args),
               reference_if=lambda kernels, loads_G, *_: loads_G.shape[0] > kernels.MAX_GROUPS, inline=True)
    def waterfill(loads_G: torch.Tensor, floors_G: torch.Tensor, budget: torch.Tensor) -> torch.Tensor:
        return waterfill_reference(loads_G, floors_G, budget)

Parts (each called with the op's arguments, as the dispatcher passes them):

- ``fake``: the outputs' shapes and dtypes (register_fake).
- ``check``: argument checks (shapes, dtypes, names; never values: no host sync), run first by the reference, the
  CUDA kernel and the fake alike.
- ``cuda``: the CUDA kernel. With ``kernels`` (an ``lrmoe_kernels`` module name) it is called as
  ``cuda(module, *args)`` and the reference runs instead where Triton is missing or ``reference_if(module, *args)``
  holds (fp64 inputs, sizes past a kernel's limit); without ``kernels``, ``cuda(*args)`` decides everything itself.
- ``grad``: ``FORWARD_ONLY`` (the default: every output non-differentiable, so a backward through them fails loudly
  instead of giving zeros: ops that compute a backward already, or whose caller differentiates them itself),
  ``(setup_context, backward)`` for register_autograd, or None for no registration (an op without outputs).
- ``inline``: True, or a predicate on the arguments: under torch.compile a CUDA call (where the predicate holds)
  is traced into the CUDA kernel's Triton kernels (lrmoe.ops._kernels.inline_when_compiled).
- ``effect``: mark the op an ordered effect (lrmoe.ops._torch_internals.register_ordered_effect), which
  torch.compile keeps where it was called.

Returns the ``CustomOpDef``: callable as the op, ``torch.ops.<namespace>.<name>`` too.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

from lrmoe.ops._kernels import inline_when_compiled, kernel_module
from lrmoe.ops._torch_internals import register_ordered_effect

__all__ = ["FORWARD_ONLY", "define_op"]

FORWARD_ONLY = "forward only"


def define_op(
    name: str,
    *,
    fake: Callable[..., Any],
    check: Callable[..., None] | None = None,
    cuda: Callable[..., Any] | None = None,
    kernels: str | None = None,
    reference_if: Callable[..., bool] | None = None,
    grad: str | tuple[Callable[..., Any], Callable[..., Any]] | None = FORWARD_ONLY,
    inline: bool | Callable[..., bool] = False,
    effect: bool = False,
) -> Callable[[Callable[..., Any]], Any]:
    """The custom op ``name`` from the decorated reference and the parts above (the module docstring)."""

    def checked(fn: Callable[..., Any]) -> Callable[..., Any]:
        if check is None:
            return fn

        @functools.wraps(fn)
        def run(*args, **kwargs):
            check(*args, **kwargs)
            return fn(*args, **kwargs)

        return run

    def define(reference: Callable[..., Any]):
        schema = torch.library.infer_schema(reference, mutates_args=())
        op = torch.library.custom_op(name, checked(reference), mutates_args=(), schema=schema)
        op.register_fake(checked(fake))
        if cuda is not None:
            cuda_kernel = checked(_with_defaults(
                cuda if kernels is None else _triton_or_reference(cuda, kernels, reference_if, reference), reference))
            op.register_kernel("cuda")(cuda_kernel)
            if inline:
                inline_when_compiled(op, name, cuda_kernel, None if inline is True else inline)
        if grad == FORWARD_ONLY:
            _forward_only(op, len(inspect.signature(reference).parameters))
        elif grad is not None:
            setup_context, backward = grad
            op.register_autograd(backward, setup_context=setup_context)
        if effect:
            register_ordered_effect(op)
        return op

    return define


def _with_defaults(kernel, reference):
    """``kernel`` called with every argument of the op, positionally, the omitted ones at their defaults: a
    kernel receives the arguments as the op was called (``gather_sum_rows(src, rows)`` leaves ``weights_TK``
    out), and kernels are written for the whole signature."""
    signature = inspect.signature(reference)

    @functools.wraps(reference)
    def run(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return kernel(*bound.args)

    return run


def _triton_or_reference(cuda, module: str, reference_if, reference):
    """A CUDA kernel that calls ``cuda(kernels, *args)``, or the reference without Triton or where
    ``reference_if(kernels, *args)``."""

    @functools.wraps(reference)
    def run(*args, **kwargs):
        kernels = kernel_module(module)
        if kernels is None or (reference_if is not None and reference_if(kernels, *args, **kwargs)):
            return reference(*args, **kwargs)
        return cuda(kernels, *args, **kwargs)

    return run


def _forward_only(op, n_inputs: int) -> None:
    """An autograd formula for ``op`` that marks every output non-differentiable."""

    def setup(ctx, inputs, output):
        ctx.mark_non_differentiable(*(output if isinstance(output, tuple) else (output,)))

    def backward(ctx, *grads):
        return (None,) * n_inputs  # never called: the outputs are non-differentiable

    op.register_autograd(backward, setup_context=setup)
