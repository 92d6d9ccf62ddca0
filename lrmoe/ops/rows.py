"""Row op of the layers: a row gather with a per-row scale.

Shapes: N source rows, C columns, R rows out.

``lrmoe::gather_scale_rows(src_NC, rows_R, coef_R) -> out_RC``
    out[i] = src[rows[i]] * coef[i], computed in fp32 (or fp64 for fp64 inputs) and rounded once to src's dtype.
    The expert backward's output-gradient rows: dy_i = alpha_i / p_i * g[token(i)] (lrmoe.functional.retained_rows.
    retained_dy). PyTorch needs three passes for it (gather, fp32 product, cast) and an fp32 copy of the rows,
    R * C * 4 bytes (512 MiB at the Qwen3 shape, retain 1); on CUDA this is one Triton kernel
    (lrmoe_kernels.offload's row gather, which also reads pinned host memory) and no temporary.
    Rows must lie in [0, N) (not checked: that would need a host sync); the CUDA kernel gives zeros for one outside,
    the reference fails.

The CPU kernel is the reference; fp64 runs the reference on every device. Not differentiable (the layers call
it inside their autograd.Function). Under torch.compile (lrmoe.ops._kernels.inline_when_compiled) a CUDA graph
holds the Triton kernel itself: with the x-row gather it writes the backward's dy and x rows (two launches) in
0.68-0.80 of the time of Inductor's one fused gather of both on an H200 (benchmarks/single_kernels.py row-gather).
"""

from __future__ import annotations

import torch
from torch.fx.experimental.symbolic_shapes import guard_or_false

from lrmoe.ops._define import define_op

__all__ = ["gather_scale_rows"]


def gather_scale_rows_reference(src_NC, rows_R, coef_R):
    acc = torch.float64 if torch.float64 in (src_NC.dtype, coef_R.dtype) else torch.float32
    return (src_NC.index_select(0, rows_R).to(acc) * coef_R.to(acc).unsqueeze(1)).to(src_NC.dtype)


def check_float_matrix(op: str, arg: str, t: torch.Tensor) -> None:
    """The row ops' check of a source matrix (lrmoe::``op``'s argument ``arg``): 2-D and floating point."""
    if t.dim() != 2 or not t.is_floating_point():
        raise ValueError(f"lrmoe::{op}: {arg} must be a 2-D float tensor, got shape {tuple(t.shape)} and dtype "
                         f"{t.dtype}")


def _check(src_NC: torch.Tensor, rows_R: torch.Tensor, coef_R: torch.Tensor) -> None:
    check_float_matrix("gather_scale_rows", "src_NC", src_NC)
    if rows_R.dim() != 1 or rows_R.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"lrmoe::gather_scale_rows: rows_R must be a 1-D int32 or int64 tensor, got shape "
                         f"{tuple(rows_R.shape)} and dtype {rows_R.dtype}")
    # Row counts may be unbacked sizes under torch.compile: refuse only a certain mismatch.
    if coef_R.dim() != 1 or guard_or_false(coef_R.shape[0] != rows_R.shape[0]) or not coef_R.is_floating_point():
        raise ValueError(f"lrmoe::gather_scale_rows: coef_R must be a 1-D float tensor with one entry per row of "
                         f"rows_R ({rows_R.shape[0]}), got shape {tuple(coef_R.shape)} and dtype {coef_R.dtype}")


def _fake(src_NC, rows_R, coef_R):
    return src_NC.new_empty(rows_R.shape[0], src_NC.shape[1])


def _fp64(kernels, src_NC, rows_R, coef_R) -> bool:
    """The kernel computes in fp32: fp64 takes the reference."""
    return torch.float64 in (src_NC.dtype, coef_R.dtype)


@define_op("lrmoe::gather_scale_rows", check=_check, fake=_fake, kernels="offload",
           cuda=lambda kernels, *args: kernels.gather_host_rows_triton(*args), reference_if=_fp64, inline=True)
def gather_scale_rows(src_NC: torch.Tensor, rows_R: torch.Tensor, coef_R: torch.Tensor) -> torch.Tensor:
    return gather_scale_rows_reference(src_NC, rows_R, coef_R)
