"""Finding the Triton kernels (``lrmoe_kernels``) from lrmoe.ops.

Installing lrmoe (``pip install -e .`` or a wheel) maps the import package ``lrmoe_kernels`` to the folder
``kernels/``. That folder has no ``__init__.py``, so from a checkout it is never importable as ``kernels`` (a
namespace portion yields to Hugging Face's ``kernels`` package, which transformers imports). Without Triton there
is nothing to load and the callers fall back to their pure-PyTorch reference; with Triton but without the install,
the first CUDA call says how to install rather than running the slow reference silently.

Kernel modules are imported lazily, at the first CUDA call, so importing lrmoe stays cheap and does not fix
Triton's interpreter mode (TRITON_INTERPRET must be set before any @triton.jit function is defined).

``inline_when_compiled`` lets torch.compile trace an op's CUDA calls into its kernels (see there).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from lrmoe.ops._torch_internals import export_keeps_custom_ops, register_functional_rule, traced_tensor_types

__all__ = ["INLINED", "inline_when_compiled", "kernel_module"]

_PACKAGE = "lrmoe_kernels"


@functools.cache
def kernel_module(name: str) -> ModuleType | None:
    """``lrmoe_kernels.<name>``, or None when Triton is not installed (the callers then run their reference)."""
    if importlib.util.find_spec("triton") is None:
        return None
    if importlib.util.find_spec(_PACKAGE) is None:
        raise ImportError(
            f"lrmoe's Triton kernels (import package {_PACKAGE!r}, the repository's kernels/ folder) are not "
            "installed: install lrmoe (pip install -e <checkout>, or pip install --no-deps --no-build-isolation "
            "-e <checkout> on a machine without a package registry)")
    return importlib.import_module(f"{_PACKAGE}.{name}")


# Ops inlined under compile: qualified name -> (CUDA kernel, when); tests/ops/test_inline_compiled.py checks what
# their Triton kernels declare they write (see tests/ops/kernel_writes.py).
INLINED: dict[str, tuple[Callable[..., Any], Callable[..., bool] | None]] = {}


def inline_when_compiled(op, name: str, cuda_kernel: Callable[..., Any], when: Callable[..., bool] | None) -> None:
    """Let torch.compile see through CUDA calls of ``op`` (the custom op ``name``): its compiled graph then holds
    the Triton kernels (and PyTorch ops) of ``cuda_kernel`` instead of one opaque op call, and Inductor launches
    them with its own launcher. Measured on the H200's host: lrmoe::gather_sum_rows took 80 µs of host time per
    call, its Triton launcher alone 44 µs, an aten index_select 20 µs; the compiled layer's step at retain 0.5 went
    from 4.7 to 2.9 ms of host time with the ops inlined (docs/performance.md).

    How (with PyTorch internals, lrmoe.ops._torch_internals says which and why): AOTAutograd functionalizes the
    graph it traces; for ``op`` with CUDA tensors only (and ``when(*args)``, if given), the functionalization runs
    ``cuda_kernel`` itself, with the kernels' launches recorded through ``torch.library.wrap_triton``
    (lrmoe_kernels.launch.traced). Everything else keeps the opaque op: CPU calls
    (so CPU graphs still call the reference), tensor subclasses, torch.export, machines without Triton. Eager
    calls are unaffected. Autograd is unaffected too: it sits above functionalization, so the op's backward
    formula runs first and its ops are inlined the same way.
    """
    plain_types = traced_tensor_types()

    def decompose(mode, func, types, args, kwargs):
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]  # the ops take no lists
        plain = all(t in plain_types for t in types)
        launcher = kernel_module("launch")
        if (plain and launcher is not None and tensors and all(t.device.type == "cuda" for t in tensors)
                and not export_keeps_custom_ops() and (when is None or when(*args, **kwargs))):
            with mode, launcher.traced():
                return cuda_kernel(*args, **kwargs)
        return mode.__torch_dispatch__(func, types, args, kwargs)

    register_functional_rule(op, decompose)
    INLINED[name] = (cuda_kernel, when)

