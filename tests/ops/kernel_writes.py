"""Which tensors torch.compile believes each inlined Triton kernel writes (run as a script: prints JSON).

Under torch.compile the CUDA calls of the kernel ops are traced into their Triton launches
(lrmoe.ops._kernels.inline_when_compiled, through torch.library.wrap_triton). Functionalization then needs each
kernel's written tensors, which Inductor finds by reading the kernel's TTIR (torch._higher_order_ops.
triton_kernel_wrap.identify_accessed_tensors): every tensor argument reachable backwards from a store's address.
That TTIR is read before Triton inlines the @triton.jit helpers, and the walk goes through a helper call into all
of the call's arguments. So a helper that takes an input's pointer and returns something a store address is built
from makes that input "written": the compiled graph then copies it and writes it back into its base. On the H200
that write-back went wrong when the input was a view of a larger tensor (the expert-parallel plan on the host,
its quotas a view of one packed copy): the backward read memory past the view (a device-side assert).

The analysis needs the TTIR of the real (not interpreted) kernels for a CUDA target, which it builds without a
GPU; so this runs in its own process, with TRITON_INTERPRET unset and a stand-in Triton driver that names an sm_90
target, and launches nothing: the launches are recorded, not run.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402


class _Sm90:
    """Just enough of a Triton driver for TTIR generation."""

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)


def _jit(kernel):
    """The JITFunction of a kernel (an Autotuner wraps one)."""
    return kernel if isinstance(kernel, triton.runtime.jit.JITFunction) else kernel.fn


class _Recorder:
    """Stands in for torch.library.wrap_triton: records kernel[grid](*args, **kwargs), runs nothing."""

    def __init__(self, launches: list, kernel) -> None:
        self.launches, self.kernel = launches, kernel

    def __getitem__(self, grid):
        def record(*args, **kwargs):
            jit = _jit(self.kernel)
            self.launches.append((self.kernel, {**dict(zip(jit.arg_names, args)), **kwargs}))
        return record


def main() -> None:
    triton.runtime.driver.set_active(_Sm90())
    sys.path.insert(0, os.path.dirname(__file__))
    from test_inline_compiled import _cases
    try:
        from torch._higher_order_ops.triton_kernel_wrap import identify_accessed_tensors

        def written(kernel, kwargs):
            return [dep.name for dep in identify_accessed_tensors(kernel, kwargs, {}).read_writes.writes]
    except ImportError:  # torch <= 2.11 (the H200 machine's): the same analysis, writes only
        from torch._higher_order_ops.triton_kernel_wrap import identify_mutated_tensors

        def written(kernel, kwargs):
            return list(identify_mutated_tensors(kernel, kwargs, {}))

    from lrmoe.ops._kernels import INLINED, kernel_module

    launch = kernel_module("launch")
    result = {"inlined": sorted(INLINED), "cases": []}
    cases = [case[:3] for case in _cases("cpu", torch.bfloat16)]
    name, fn, args = next(case for case in cases if case[0] == "select sample")
    cases.append(("select sample, one sort", fn, args[:6]))  # no group order: the global key sort's kernels
    for name, fn, args in cases:
        cuda_kernel, when = INLINED[fn._qualname]
        launches: list = []
        torch.library.wrap_triton = lambda kernel, launches=launches: _Recorder(launches, kernel)
        with launch.traced():
            if when is None or when(*args):
                cuda_kernel(*args)
        inputs = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves(args)
                  if isinstance(t, torch.Tensor)}
        for kernel, kwargs in launches:
            writes = written(kernel, dict(kwargs))
            result["cases"].append({
                "case": name, "op": fn._qualname, "kernel": _jit(kernel).__name__,
                "writes": writes,
                "writes_inputs": [n for n in writes if kwargs[n].untyped_storage().data_ptr() in inputs],
            })
    print(json.dumps(result))


if __name__ == "__main__":
    main()
