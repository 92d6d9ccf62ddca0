"""Compile every Triton kernel of lrmoe_kernels for an NVIDIA sm_90 GPU (H100/H200), on a machine without one.

    python tests/kernels/sm90_compile.py              # one line per compiled kernel variant, exit 1 on a failure
    python tests/kernels/sm90_compile.py --resources  # and each one's registers and stack (spills) for sm_90

Run by tests/kernels/test_sm90_compile.py in a subprocess without TRITON_INTERPRET (the interpreter replaces the
kernels by Python functions that cannot be compiled). The CPU tests run the kernels in Triton's interpreter, which
accepts some programs the GPU compiler rejects (and the other way round); this compiles them for real, through
Triton's NVIDIA backend and its bundled ptxas, for the kernels and constexpr values the launchers really choose.

How: the launchers (lrmoe_kernels.*) run on small CPU tensors with ``JITFunction.run`` replaced by a recorder
(after Triton's heuristics have added their constexprs), so nothing launches; each recorded call goes through
Triton's own argument binder, as a GPU launch would (argument types, constexprs, alignment and divisibility
specialisations), and ``triton.compile`` turns it into a cubin for ``GPUTarget("cuda", 90, 32)``. Where a
launcher picks blocks or flags by whether the interpreter is on, the GPU's choice is taken; the grouped GEMMs'
launchers are run once per config the autotuner would try.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import torch

from lrmoe.ops._kernels import kernel_module

if kernel_module("launch").interpreting():
    raise SystemExit("sm90_compile.py compiles real kernels: run it without TRITON_INTERPRET=1")

import triton  # noqa: E402
from triton import knobs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)

recorded: list[tuple[JITFunction, tuple, dict]] = []


def _record(self, *args, grid=None, warmup=False, **kwargs):
    recorded.append((self, args, kwargs))


def compile_inputs(fn: JITFunction, args: tuple, kwargs: dict):
    """(ASTSource, constexprs, options, specialisation key) of one recorded launch, made by Triton's own launch
    path (its argument binder and _pack_args: Triton internals, as of 3.7.1), so the kernel gets the
    specialisations a GPU launch gives it: 16-byte-aligned pointers and integers divisible by 16 marked as such
    (without them loads are not vectorised and loops not pipelined), and integers equal to 1 as constants."""
    backend = make_backend(TARGET)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    kwargs = dict(kwargs, debug=kwargs.get("debug", fn.debug) or knobs.runtime.debug,
                  instrumentation_mode=knobs.compilation.instrumentation_mode)
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound_args, specialization, options)
    return ASTSource(fn, signature, constexprs, attrs), constexprs, options, repr(specialization)


def run_launchers() -> None:
    """Every launcher, every branch that picks another kernel or constexpr, on tiny CPU tensors."""
    from lrmoe.ops._kernels import kernel_module
    from lrmoe.ops.selection import select_within_quota_triton

    sel = kernel_module("selection")
    gen = torch.Generator().manual_seed(0)
    scores = torch.rand(64, generator=gen)
    for gid_dtype in (torch.int64, torch.int32):
        gids = torch.randint(0, 5, (64,), generator=gen).to(gid_dtype)
        quotas = torch.tensor([3, 9, 0, 4, 2])
        order = torch.argsort(gids, stable=True)
        for uniform in (torch.rand(5, dtype=torch.float64), torch.rand(5)):
            select_within_quota_triton(scores, gids, quotas, 20, "sample", uniform, order)
            select_within_quota_triton(scores, gids, quotas, 20, "sample", uniform, order, 64)  # per-group sort
        select_within_quota_triton(scores, gids, quotas, 20, "top", None, order)
    experts = torch.randint(0, 128, (512,), generator=gen)  # the layers' case: 128 experts, one plan step
    select_within_quota_triton(torch.rand(512), experts, torch.full((128,), 3), 400, "top", None)
    # "sample" sorting groups of up to T pairs in registers, at the benchmark's T (the largest sort the layers'
    # benchmarks unroll; smaller T unroll fewer levels of the same code)
    select_within_quota_triton(torch.rand(512), experts, torch.full((128,), 3), 400, "sample", torch.rand(128),
                               torch.argsort(experts, stable=True), 8192)
    # The group ends given (read by the plan instead of searched): in-kernel plan, plan kernel, both modes.
    ends = torch.bincount(experts, minlength=128).cumsum(0).int()
    order = torch.argsort(experts, stable=True)
    select_within_quota_triton(torch.rand(512), experts, torch.full((128,), 3), 400, "top", None, order, None, ends)
    select_within_quota_triton(torch.rand(512), experts, torch.full((128,), 3), 400, "sample", torch.rand(128),
                               order, 8192, ends)
    many = torch.randint(0, 3 * sel.BLOCK_G, (64,), generator=gen)  # more groups than one plan step
    select_within_quota_triton(scores, many, torch.ones(3 * sel.BLOCK_G, dtype=torch.int64), 20, "top", None)
    many_ends = torch.bincount(many, minlength=3 * sel.BLOCK_G).cumsum(0)
    select_within_quota_triton(scores, many, torch.ones(3 * sel.BLOCK_G, dtype=torch.int64), 20, "top", None,
                               torch.argsort(many, stable=True), None, many_ends)

    tok = kernel_module("token_rows")
    for dtype in (torch.bfloat16, torch.float32):
        src = torch.randn(40, 96).to(dtype)
        rows = torch.randint(-1, 40, (8, 4), generator=gen)
        tok.gather_sum_rows_triton(src, rows, torch.rand(8, 4).to(dtype))
        tok.gather_sum_rows_triton(src, rows, None)
        tok.gather_dot_rows_triton(src, rows, torch.randn(8, 96).to(dtype))
        for metric in ("lrm", "grad_l2", "grad_abs"):  # lrmoe::gather_dot_scores
            tok.gather_dot_scores_triton(src, rows, torch.randn(8, 96).to(dtype), torch.rand(8, 4).to(dtype),
                                         torch.rand(8, 4), metric)

    score = kernel_module("scoring")
    for dtype in (torch.bfloat16, torch.float32):
        for metric in score.METRIC_IDS:
            score.score_pairs_triton(torch.rand(16, 4).to(dtype), torch.randn(16, 256).to(dtype),
                                     torch.rand(16, 4), metric)

    rte = kernel_module("routing")
    for dtype, experts, k in ((torch.float32, 128, 8), (torch.bfloat16, 60, 4), (torch.float32, 256, 8)):
        rte.topk_ids_triton(torch.randn(4096, experts).to(dtype), k)  # lrmoe::topk_ids: the router's choice
    qts = kernel_module("quotas")
    for groups in (128, 2048):  # lrmoe::waterfill, 4 and 8 warps
        loads = torch.randint(0, 900, (groups,), generator=gen)
        qts.waterfill_triton(loads, loads // 4, loads.sum() // 2)

    swi = kernel_module("swiglu")
    swi._blocks = _as_on_gpu(swi._blocks)
    swi._sqnorm_blocks = _as_on_gpu(swi._sqnorm_blocks)
    for dtype in (torch.bfloat16, torch.float32):
        h = torch.randn(40, 2 * 768).to(dtype)  # the Qwen3 F: full column blocks
        for rows in (torch.randint(0, 40, (24,), generator=gen), torch.randint(0, 40, (24,), generator=gen).int(),
                     None):
            swi.swiglu_backward_triton(h, rows, torch.randn(40 if rows is None else 24, 768).to(dtype))
            swi.swiglu_backward_scaled_triton(h, rows, torch.randn(40 if rows is None else 24, 768).to(dtype),
                                              torch.rand(40 if rows is None else 24))
            swi.swiglu_dot_triton(h, rows, torch.randn(40 if rows is None else 24, 768).to(dtype))
            swi.swiglu_dot_triton(h[:, :768], rows, torch.randn(40 if rows is None else 24, 768).to(dtype), True)
        swi.swiglu_sqnorm_triton(h)  # lrmoe::swiglu_sqnorm

    off = kernel_module("offload")
    off._blocks = _as_on_gpu(off._blocks)  # the GPU's tiles, not the interpreter's
    with as_interpreted(True):  # only to pass the launchers' device checks: the kernels are recorded, not run
        _offload_and_grouped_gemm(off, kernel_module("grouped_gemm"), gen)


def _offload_and_grouped_gemm(off, gg, gen) -> None:
    for dtype in (torch.bfloat16, torch.float32):
        off.gather_host_rows_triton(torch.randn(30, 512).to(dtype), torch.randint(0, 30, (12,), generator=gen))
        off.gather_host_rows_triton(torch.randn(30, 512).to(dtype), torch.randint(0, 30, (12,), generator=gen),
                                    torch.rand(12))  # lrmoe::gather_scale_rows
        host = off._blocks(512, torch.empty((), dtype=dtype).element_size(), on_host=True)  # a pinned source's tiles
        off.gather_host_rows_triton(torch.randn(30, 512).to(dtype), torch.randint(0, 30, (12,), generator=gen),
                                    blocks=host)

    with as_interpreted(False):
        gg.zero_rows_past_last_offset_(torch.randn(48, 512).to(torch.bfloat16), torch.tensor([10, 20, 30, 40]).int())
    gg._dot_flags = _as_on_gpu(gg._dot_flags)
    gg._gather_grouped_mm, gg._grouped_outer = gg._gather_grouped_mm_kernel, gg._grouped_outer_kernel  # no autotune
    gg._weight_operand = _as_on_gpu(gg._weight_operand)  # TMA descriptors for 16-bit weights only
    gg._a_operand = _as_on_gpu(gg._a_operand)  # and for 16-bit a_RO in grouped_outer
    gg._grouped_outer_tma = gg._grouped_outer_kernel
    gg._has_tma = lambda device: True  # the sm_90 target has TMA (the CPU tensors' device does not)
    for dtype in (torch.bfloat16, torch.float32):
        # The configs the autotuner would try on this problem (fp32 and narrow problems: the smallest only).
        shape = dict(O=128, I=256, dtype_bytes=torch.empty((), dtype=dtype).element_size())
        x, w = torch.randn(64, 256).to(dtype), torch.randn(4, 128, 256).to(dtype)
        rows, offsets = torch.randint(0, 64, (48,), generator=gen), torch.tensor([10, 20, 30, 40]).int()
        for config in gg._prune_small(gg._gpu_configs(), shape):
            gg._interpreter_config = lambda c=config: dict(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages)
            gg.gather_grouped_mm_triton(x, w, rows, offsets)  # bf16: the weight through a TMA descriptor
            gg.gather_grouped_mm_triton(x, w.transpose(1, 2).contiguous().transpose(1, 2), rows, offsets)  # its
            gg.gather_grouped_mm_triton(x, w, rows, offsets, b_desc=False)  # transpose's descriptor; pointers
        for config in gg._prune_small(gg._outer_gpu_configs(), shape):
            gg._interpreter_config = lambda c=config: dict(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages)
            gg.grouped_outer_triton(torch.randn(48, 128).to(dtype), x, rows, offsets, a_tma=False)
        for config in gg._prune_small(gg._outer_tma_gpu_configs(), shape):  # bf16: a_RO through the ragged TMA
            gg._interpreter_config = lambda c=config: dict(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages)
            gg.grouped_outer_triton(torch.randn(48, 128).to(dtype), x, rows, offsets)


def as_interpreted(on: bool):
    """lrmoe_kernels.launch.as_interpreted: launchers choose as if Triton's interpreter were ``on``."""
    from lrmoe.ops._kernels import kernel_module

    return kernel_module("launch").as_interpreted(on)


def _as_on_gpu(fn):
    """``fn`` evaluated as on a GPU (lrmoe_kernels.launch.as_interpreted(False)): the blocks and flags it picks."""
    def wrapped(*args, **kwargs):
        with as_interpreted(False):
            return fn(*args, **kwargs)
    return wrapped


def resources(cubin: bytes) -> str:
    """Registers, stack (register spills live there) and static shared memory per thread block, from the cubin,
    by the cuobjdump bundled with Triton's NVIDIA backend."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+).*?STACK:(\d+).*?SHARED:(\d+)", out, re.S)
    return "registers {} stack {} B static shared {} B".format(*found.groups()) if found else "no resource line"


def main() -> int:
    show_resources = "--resources" in sys.argv[1:]
    JITFunction.run = _record
    run_launchers()
    seen, failed = set(), 0
    for fn, args, kwargs in recorded:
        src, constexprs, options, specialization = compile_inputs(fn, args, kwargs)
        key = (fn.fn.__name__, specialization, repr(sorted(options.__dict__.items())))
        if key in seen:
            continue
        seen.add(key)
        consts = ", ".join(f"{fn.arg_names[path[0]]}={value}" for path, value in constexprs.items()
                           if fn.params[path[0]].is_constexpr)
        what = f"{fn.fn.__name__} {consts} warps={options.num_warps} stages={options.num_stages}"
        try:
            compiled = triton.compile(src, target=TARGET, options=options.__dict__)
            extra = resources(compiled.asm["cubin"]) if show_resources else f"{len(compiled.asm['cubin'])} B of cubin"
            print(f"ok     {what} ({extra})")
        except Exception as e:  # noqa: BLE001 - report every kernel, then fail
            failed += 1
            print(f"FAILED {what}: {type(e).__name__}: {str(e)[:1500]}")
    print(f"{len(seen)} kernel variants, {failed} failed")
    return 1 if failed or not seen else 0


if __name__ == "__main__":
    sys.exit(main())
