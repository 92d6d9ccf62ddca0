"""Grouped GEMMs over compact row buffers, as custom ops.

Shapes: N source rows, R buffer rows, E experts (groups), O output features, I input features.

``lrmoe::gather_grouped_mm(x_NI, weight_EOI, rows_R, offsets_E) -> y_RO``
    y[i] = weight[e(i)] @ x[rows[i]] for i < offsets[-1], where e(i) is the group whose [start, end) holds i
    (offsets are cumulative ends); y[i] = 0 past offsets[-1]. Differentiable in x and weight.
``lrmoe::grouped_outer(a_RO, b_NI, rows_R, offsets_E) -> w_EOI``
    w[e] = sum over i in group e of outer(a[i], b[rows[i]]): the weight gradient of the op above.
rows_R = None means the identity (rows[i] = i, so N = R): the rows are already in place, and the CUDA kernels
skip the gather copy.

Why custom ops: a compiled graph then holds one opaque node per GEMM whose fake implementation only needs
shapes, so torch.compile(fullgraph=True) works on every device and dtype (torch._grouped_mm's fake accepts bf16
only). The CPU kernel is the reference: a loop over groups, reading the offsets on the host, which costs no
device synchronisation on CPU. The CUDA kernel uses torch._grouped_mm where its layout rules hold (bf16, 16-byte
aligned rows: measured at ~610 TFLOP/s on the H200) and the Triton kernels of lrmoe_kernels.grouped_gemm (gather
fused into the operand load) for every other dtype or shape; neither reads offsets on the host. Without Triton,
CUDA falls back to the reference loop, which does synchronise. A gathered bf16 GEMM takes a row gather then
torch._grouped_mm, not the gather-fused Triton kernel: inside the compiled layer on the H200 the two were within
the run-to-run spread (docs/performance.md), and the torch path needs no autotuning.
"""

from __future__ import annotations

import torch

from lrmoe.ops._define import define_op
from lrmoe.ops._kernels import kernel_module
from lrmoe.ops._torch_internals import grouped_mm

__all__ = ["gather_grouped_mm", "grouped_outer"]


def _group_bounds(offsets_E: torch.Tensor, n_rows: int) -> list[tuple[int, int, int]]:
    """(group, start, end) of every non-empty group, clipped to the buffer. Host read: reference kernels only."""
    bounds, start = [], 0
    for e, end in enumerate(offsets_E.tolist()):  # CPU tensor in the reference path: no device sync
        end = min(int(end), n_rows)
        if end > start:
            bounds.append((e, start, end))
        start = max(start, end)
    return bounds


def _valid_rows(offsets_E: torch.Tensor, n_rows: int) -> torch.Tensor:
    """[R, 1] bool: rows inside the last group's end."""
    end = offsets_E[-1:].long() if offsets_E.numel() else offsets_E.new_zeros(1, dtype=torch.long)
    return (torch.arange(n_rows, device=offsets_E.device) < end).unsqueeze(1)


def _n_rows(x_NI: torch.Tensor, rows_R: torch.Tensor | None) -> int:
    return x_NI.shape[0] if rows_R is None else rows_R.shape[0]


def _take(x_NI: torch.Tensor, rows_R: torch.Tensor | None, start: int, end: int) -> torch.Tensor:
    return x_NI[start:end] if rows_R is None else x_NI[rows_R[start:end]]


def _rows_in_order(x_NI: torch.Tensor, rows_R: torch.Tensor | None) -> torch.Tensor:
    """x's rows gathered into buffer order, contiguous (torch._grouped_mm's stride rules). On CUDA the Triton row
    gather (lrmoe_kernels.offload), also under torch.compile, where this op is inlined: on one H200 it took
    0.65-0.80 of the time of Inductor's gather kernel for the layers' gathers (benchmarks/single_kernels.py row-gather),
    and padding rows (-1) come out as zeros. Elsewhere index_select, padding rows reading row 0. Either way the
    GEMM's rows for padding lie past the last offset, so their values never reach a result."""
    if rows_R is None:
        return x_NI.contiguous()
    kernels = kernel_module("offload") if x_NI.device.type == "cuda" else None
    if kernels is None:
        return x_NI.index_select(0, rows_R.clamp(min=0))
    return kernels.gather_host_rows_triton(x_NI, rows_R)


def _identity_rows(x_NI: torch.Tensor, rows_R: torch.Tensor | None) -> torch.Tensor:
    """Explicit row indices, for kernels that need them."""
    return torch.arange(x_NI.shape[0], device=x_NI.device) if rows_R is None else rows_R


def _loop_mm(x_NI, weight_EOI, rows_R, offsets_E):
    y_RO = x_NI.new_zeros(_n_rows(x_NI, rows_R), weight_EOI.shape[1])
    for e, start, end in _group_bounds(offsets_E, y_RO.shape[0]):
        y_RO[start:end] = _take(x_NI, rows_R, start, end) @ weight_EOI[e].t()
    return y_RO


def _grouped_mm_ok(*tensors: torch.Tensor) -> bool:
    """Whether torch._grouped_mm takes these operands: bf16 with 16-byte-aligned strides, so a multiple of 8 in
    the last dimension (and, for 3-D weights, in the other one). A 2-D operand's row count is free (groups have any
    size), and must stay unchecked: under expert parallelism it is a received row count, an unbacked SymInt under
    torch.compile, and a test on it would fail the compile (data-dependent guard)."""
    return all(t.dtype == torch.bfloat16 and t.shape[-1] % 8 == 0 and (t.dim() == 2 or t.shape[-2] % 8 == 0)
               for t in tensors)


# ---------------------------------------------------------------------------------------------- gather_grouped_mm


def _gather_grouped_mm_cuda(x_NI, weight_EOI, rows_R, offsets_E):
    if not _grouped_mm_ok(x_NI, weight_EOI):
        kernels = kernel_module("grouped_gemm")
        if kernels is None:
            return _loop_mm(x_NI, weight_EOI, rows_R, offsets_E)
        return kernels.gather_grouped_mm_triton(x_NI, weight_EOI, _identity_rows(x_NI, rows_R), offsets_E)
    offs = offsets_E.int().contiguous()  # a strided column of group ends is read as a flat array otherwise
    y_RO = grouped_mm(_rows_in_order(x_NI, rows_R), weight_EOI.transpose(-2, -1), offs)
    # _grouped_mm leaves rows past the last offset uninitialised: zero them (only them, with the Triton kernel).
    kernels = kernel_module("grouped_gemm")
    if kernels is None:
        return torch.where(_valid_rows(offsets_E, y_RO.shape[0]), y_RO, 0)
    return kernels.zero_rows_past_last_offset_(y_RO, offsets_E)


def _gather_grouped_mm_setup(ctx, inputs, output):
    x_NI, weight_EOI, rows_R, offsets_E = inputs
    ctx.save_for_backward(x_NI, weight_EOI, rows_R, offsets_E)


def _gather_grouped_mm_backward(ctx, grad_y_RO):
    x_NI, weight_EOI, rows_R, offsets_E = ctx.saved_tensors
    grad_x = grad_w = None
    # padding rows carry zero gradient (the op's output is 0 there)
    rows_safe_R = None if rows_R is None else rows_R.clamp(min=0)
    if ctx.needs_input_grad[0]:
        dx_RI = gather_grouped_mm(grad_y_RO, weight_EOI.transpose(1, 2), None, offsets_E)
        grad_x = dx_RI if rows_R is None else torch.zeros_like(x_NI).index_add(0, rows_safe_R, dx_RI)
    if ctx.needs_input_grad[1]:
        grad_w = grouped_outer(grad_y_RO, x_NI, rows_safe_R, offsets_E)
    return grad_x, grad_w, None, None


# Inlined under compile on the torch._grouped_mm path only: the Triton path autotunes, which Inductor would redo.
@define_op("lrmoe::gather_grouped_mm", cuda=_gather_grouped_mm_cuda,
           fake=lambda x_NI, weight_EOI, rows_R, offsets_E: x_NI.new_empty(_n_rows(x_NI, rows_R), weight_EOI.shape[1]),
           grad=(_gather_grouped_mm_setup, _gather_grouped_mm_backward), inline=lambda x, w, *_: _grouped_mm_ok(x, w))
def gather_grouped_mm(
    x_NI: torch.Tensor, weight_EOI: torch.Tensor, rows_R: torch.Tensor | None, offsets_E: torch.Tensor
) -> torch.Tensor:
    return _loop_mm(x_NI, weight_EOI, rows_R, offsets_E)


# -------------------------------------------------------------------------------------------------- grouped_outer


def _loop_outer(a_RO, b_NI, rows_R, offsets_E):
    w_EOI = a_RO.new_zeros(offsets_E.shape[0], a_RO.shape[1], b_NI.shape[1])
    for e, start, end in _group_bounds(offsets_E, a_RO.shape[0]):
        w_EOI[e] = a_RO[start:end].t() @ _take(b_NI, rows_R, start, end)
    return w_EOI


def _grouped_outer_cuda(a_RO, b_NI, rows_R, offsets_E):
    if not _grouped_mm_ok(a_RO, b_NI):
        kernels = kernel_module("grouped_gemm")
        if kernels is None:
            return _loop_outer(a_RO, b_NI, rows_R, offsets_E)
        return kernels.grouped_outer_triton(a_RO, b_NI, _identity_rows(b_NI, rows_R), offsets_E)
    # Rows past the last offset belong to no group, and _grouped_mm's grouped-K form reads none of them (NaN there
    # cannot leak: tests/ops/test_grouped_gemm.py), so no masking pass.
    offs = offsets_E.int().contiguous()
    return grouped_mm(_transpose_in_place(a_RO), _rows_in_order(b_NI, rows_R), offs)


def _transpose_in_place(a_RO: torch.Tensor) -> torch.Tensor:
    """a.t(), as an as_strided view when a is row-major: the same tensor in eager, but under torch.compile (where
    this CUDA kernel is inlined) as_strided makes Inductor write a once. The layer's dh is a pointwise result read
    by two GEMMs, one of them (this op) through a transpose; Inductor does not realise a cheap pointwise node with
    two readers, and it materialises a transposed view of an unrealised node as a buffer of its own, so it computed
    and wrote dh twice (201 MB more per step at the Qwen3 shape, seen in the generated code on the H200).
    as_strided's lowering realises its input first, so the view becomes a reinterpretation of the one buffer
    (tests/ops/test_grouped_gemm.py). Only strides are tested, never the row count (an unbacked size under expert
    parallelism)."""
    if a_RO.dim() == 2 and a_RO.stride(1) == 1 and a_RO.stride(0) == a_RO.shape[1]:
        return a_RO.as_strided((a_RO.shape[1], a_RO.shape[0]), (1, a_RO.shape[1]))
    return a_RO.t()


def _grouped_outer_setup(ctx, inputs, output):
    a_RO, b_NI, rows_R, offsets_E = inputs
    ctx.save_for_backward(a_RO, b_NI, rows_R, offsets_E)


def _grouped_outer_backward(ctx, grad_w_EOI):
    # w[e] = sum_i a[i] b[rows[i]]^T, so da[i] = grad_w[e(i)] b[rows[i]] and
    # db[n] = sum over rows[i] = n of grad_w[e(i)]^T a[i]: both are gather_grouped_mm (zero past the last group).
    # This also makes gather_grouped_mm twice differentiable.
    a_RO, b_NI, rows_R, offsets_E = ctx.saved_tensors
    grad_w_EOI = grad_w_EOI.contiguous()  # autograd may hand an expanded (stride 0) tensor; _grouped_mm rejects it
    grad_a = grad_b = None
    if ctx.needs_input_grad[0]:
        grad_a = gather_grouped_mm(b_NI, grad_w_EOI, rows_R, offsets_E)
    if ctx.needs_input_grad[1]:
        db_RI = gather_grouped_mm(a_RO, grad_w_EOI.transpose(1, 2), None, offsets_E)
        grad_b = db_RI if rows_R is None else torch.zeros_like(b_NI).index_add(0, rows_R.clamp(min=0), db_RI)
    return grad_a, grad_b, None, None


@define_op("lrmoe::grouped_outer", cuda=_grouped_outer_cuda,
           fake=lambda a_RO, b_NI, rows_R, offsets_E: a_RO.new_empty(offsets_E.shape[0], a_RO.shape[1], b_NI.shape[1]),
           grad=(_grouped_outer_setup, _grouped_outer_backward), inline=lambda a, b, *_: _grouped_mm_ok(a, b))
def grouped_outer(
    a_RO: torch.Tensor, b_NI: torch.Tensor, rows_R: torch.Tensor | None, offsets_E: torch.Tensor
) -> torch.Tensor:
    return _loop_outer(a_RO, b_NI, rows_R, offsets_E)
