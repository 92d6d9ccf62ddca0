"""The SwiGLU of the experts and its backward over retained rows, as a custom op.

Shapes: N rows of h, R rows out, F the expert hidden dim; h is [N, 2F], gate half first (transformers' Qwen3-MoE
``gate_up_proj`` layout).

``swiglu(h_N2F) -> phi_NF``
    silu(gate) * up in h's dtype (plain PyTorch).
``lrmoe::swiglu_sqnorm(h_N2F) -> (phi_NF, phi_sq_N)``
    The layers' forward SwiGLU: phi as ``swiglu`` gives it, and ||phi_n||^2 in fp32 from the rounded phi, which
    the "lrm" score needs. On CUDA one Triton kernel reading h once and writing phi and the norms (eagerly no SiLU
    temporary, N * F elements). Compiled, the norms' PyTorch form would not fuse with the SwiGLU: AOTAutograd's
    partitioner moves the reduction into the backward and recomputes silu(gate) * up from the saved h there,
    while the kernel reads phi once in forward and backward keeps its [N] result.
``lrmoe::swiglu_backward(h_N2F, rows_R, dphi_RF) -> (dh_R2F, phi_RF)``
    For the rows h_i = h[rows[i]] (h itself when rows is None): the gradient of phi = silu(gate) * up with
    respect to h given dphi, computed in fp32 (fp64 for fp64 h) and rounded to h's dtype once (sigmoid's
    derivative loses too much in bf16), and phi itself, as ``swiglu`` gives it. The expert backward needs both of
    the same rows (phi for the down projection's weight gradient, dh for the gate/up projection's), so one op reads
    h once: on CUDA one Triton kernel (lrmoe_kernels.swiglu) reading the saved h in place through the row index.
    Rows must lie in [0, N) (not checked: that would need a host sync); the CUDA kernel gives zeros for one
    outside, the reference fails.
``lrmoe::swiglu_backward_scaled(h_N2F, rows_R, dphi_RF, coef_R) -> (dh_R2F, cphi_RF, dot_R)``
    The same rows when their output gradient is coef_i times row i of ``dphi_RF``: dh of the scaled dphi (scaled
    in fp32), cphi_i = coef_i * phi_i (the down projection's weight-gradient operand when its other operand is the
    unscaled gradient rows), and dot_i = <dphi_i, phi_i> in fp32 from the unscaled dphi and the rounded phi. The
    one-device dense backward (lrmoe.functional.expert_kernels) feeds it dphi = g W_down^T, the token's gradient
    through the down projection, with coef the gate: then dot is <g_t, y_tk>, the router's gradient, read from
    the backward's own operands instead of a saved y. On CUDA one Triton kernel, each program over all F of its
    rows (no atomics). ``coef_R`` is fp32 (fp64 for fp64 h).
``lrmoe::swiglu_dot(src, rows_R, dphi_RF, src_is_phi=False) -> dot_R``
    dot_i = <dphi_i, phi_i> alone, fp32 (fp64 for fp64 src), phi of the rows of h ([N, 2F]) as ``swiglu`` gives it,
    or with ``src_is_phi`` the rows of phi itself ([N, F], as the forward made it): the router gradient of the
    pairs the selective backward drops, from g W_down^T at their tokens, where no expert output y is saved. On
    CUDA one Triton kernel, the same loop either way: from a saved phi the dots of its h, bit for bit.

The CPU kernels are the references (PyTorch); fp64 runs the references on every device. Neither op is
differentiable (swiglu_backward is a backward already; the layers differentiate the SwiGLU themselves).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import guard_or_false

from lrmoe.ops._define import define_op

__all__ = ["swiglu", "swiglu_backward", "swiglu_backward_scaled", "swiglu_dot", "swiglu_sqnorm"]


def swiglu(h_N2F: torch.Tensor) -> torch.Tensor:
    gate, up = h_N2F.chunk(2, dim=-1)
    return F.silu(gate) * up


def swiglu_backward_reference(h_N2F, rows_R, dphi_RF):
    """phi first, then dh's fp32 working set (the order lrmoe.memory models); fp64 stays fp64."""
    h_R2F = h_N2F if rows_R is None else h_N2F.index_select(0, rows_R)
    phi_RF = swiglu(h_R2F)
    work = torch.promote_types(h_N2F.dtype, torch.float32)
    gate, up = h_R2F.to(work).chunk(2, dim=-1)
    sig = torch.sigmoid(gate)
    dphi = dphi_RF.to(work)
    dgate = dphi * up * sig * (1 + gate * (1 - sig))
    dup = dphi * gate * sig
    return torch.cat([dgate, dup], dim=-1).to(h_N2F.dtype), phi_RF


def _check_h(op: str, h_N2F: torch.Tensor) -> None:
    if h_N2F.dim() != 2 or h_N2F.shape[1] % 2 or not h_N2F.is_floating_point():
        raise ValueError(f"lrmoe::{op}: h_N2F must be a 2-D float tensor with an even number of columns [N, 2F], "
                         f"got shape {tuple(h_N2F.shape)} and dtype {h_N2F.dtype}")


def _check(h_N2F: torch.Tensor, rows_R: torch.Tensor | None, dphi_RF: torch.Tensor,
           op: str = "swiglu_backward") -> None:
    _check_h(op, h_N2F)
    if rows_R is not None and (rows_R.dim() != 1 or rows_R.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"lrmoe::{op}: rows_R must be a 1-D int32 or int64 tensor or None, got shape "
                         f"{tuple(rows_R.shape)} and dtype {rows_R.dtype}")
    n_out = h_N2F.shape[0] if rows_R is None else rows_R.shape[0]
    want = (n_out, h_N2F.shape[1] // 2)
    # Row counts may be unbacked sizes under torch.compile (expert parallelism): refuse only a certain mismatch.
    if (dphi_RF.dim() != 2 or guard_or_false(dphi_RF.shape[0] != n_out) or dphi_RF.shape[1] != want[1]
            or not dphi_RF.is_floating_point()):
        raise ValueError(f"lrmoe::{op}: dphi_RF must be a float tensor of shape {want} (the rows of h "
                         f"taken, F), got shape {tuple(dphi_RF.shape)} and dtype {dphi_RF.dtype}")


def _fake_backward(h_N2F, rows_R, dphi_RF):
    n_out = dphi_RF.shape[0]
    return h_N2F.new_empty(n_out, h_N2F.shape[1]), h_N2F.new_empty(n_out, h_N2F.shape[1] // 2)


def _fp64(kernels, h_N2F, *_) -> bool:
    """The kernels compute in fp32: fp64 takes the reference."""
    return h_N2F.dtype == torch.float64


@define_op("lrmoe::swiglu_backward", check=_check, fake=_fake_backward, kernels="swiglu",
           cuda=lambda kernels, *args: kernels.swiglu_backward_triton(*args), reference_if=_fp64, inline=True)
def swiglu_backward(h_N2F: torch.Tensor, rows_R: torch.Tensor | None, dphi_RF: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    return swiglu_backward_reference(h_N2F, rows_R, dphi_RF)  # a backward already: forward only


def swiglu_backward_scaled_reference(h_N2F, rows_R, dphi_RF, coef_R):
    """phi, its dot with the unscaled dphi, then dh's fp32 working set; fp64 stays fp64."""
    h_R2F = h_N2F if rows_R is None else h_N2F.index_select(0, rows_R)
    work = torch.promote_types(h_N2F.dtype, torch.float32)
    phi_RF = swiglu(h_R2F).to(work)
    dphi_raw = dphi_RF.to(work)
    dot_R = (dphi_raw * phi_RF).sum(-1)
    coef = coef_R.to(work).unsqueeze(1)
    gate, up = h_R2F.to(work).chunk(2, dim=-1)
    sig = torch.sigmoid(gate)
    dphi = dphi_raw * coef
    dgate = dphi * up * sig * (1 + gate * (1 - sig))
    dup = dphi * gate * sig
    return torch.cat([dgate, dup], dim=-1).to(h_N2F.dtype), (phi_RF * coef).to(h_N2F.dtype), dot_R


def _check_scaled(h_N2F, rows_R, dphi_RF, coef_R) -> None:
    _check(h_N2F, rows_R, dphi_RF, "swiglu_backward_scaled")
    want = torch.promote_types(h_N2F.dtype, torch.float32)
    if coef_R.dim() != 1 or guard_or_false(coef_R.shape[0] != dphi_RF.shape[0]) or coef_R.dtype != want:
        raise ValueError(f"lrmoe::swiglu_backward_scaled: coef_R must be a 1-D {want} tensor with one entry per row "
                         f"of dphi_RF ({dphi_RF.shape[0]}), got shape {tuple(coef_R.shape)} and dtype "
                         f"{coef_R.dtype}")


def _fake_scaled(h_N2F, rows_R, dphi_RF, coef_R):
    n_out = dphi_RF.shape[0]
    return (h_N2F.new_empty(n_out, h_N2F.shape[1]), h_N2F.new_empty(n_out, h_N2F.shape[1] // 2),
            h_N2F.new_empty(n_out, dtype=torch.promote_types(h_N2F.dtype, torch.float32)))


@define_op("lrmoe::swiglu_backward_scaled", check=_check_scaled, fake=_fake_scaled, kernels="swiglu",
           cuda=lambda kernels, *args: kernels.swiglu_backward_scaled_triton(*args), reference_if=_fp64, inline=True)
def swiglu_backward_scaled(h_N2F: torch.Tensor, rows_R: torch.Tensor | None, dphi_RF: torch.Tensor,
                           coef_R: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return swiglu_backward_scaled_reference(h_N2F, rows_R, dphi_RF, coef_R)  # a backward already: forward only


def swiglu_dot_reference(src, rows_R, dphi_RF, src_is_phi=False):
    src_rows = src if rows_R is None else src.index_select(0, rows_R)
    work = torch.promote_types(src.dtype, torch.float32)
    return (dphi_RF.to(work) * (src_rows if src_is_phi else swiglu(src_rows)).to(work)).sum(-1)


def _check_dot(src, rows_R, dphi_RF, src_is_phi=False) -> None:
    if not src_is_phi:
        _check(src, rows_R, dphi_RF, "swiglu_dot")
        return
    if src.dim() != 2 or not src.is_floating_point() or dphi_RF.dim() != 2 or src.shape[1] != dphi_RF.shape[1]:
        raise ValueError(f"lrmoe::swiglu_dot: with src_is_phi, src must be a 2-D float tensor [N, F] with dphi_RF's "
                         f"F columns, got shapes {tuple(src.shape)} and {tuple(dphi_RF.shape)}")
    if rows_R is not None and (rows_R.dim() != 1 or rows_R.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"lrmoe::swiglu_dot: rows_R must be a 1-D int32 or int64 tensor or None, got shape "
                         f"{tuple(rows_R.shape)} and dtype {rows_R.dtype}")
    n_out = src.shape[0] if rows_R is None else rows_R.shape[0]
    if guard_or_false(dphi_RF.shape[0] != n_out) or not dphi_RF.is_floating_point():
        raise ValueError(f"lrmoe::swiglu_dot: dphi_RF must be a float tensor of shape {(n_out, src.shape[1])} (the "
                         f"rows of phi taken, F), got shape {tuple(dphi_RF.shape)} and dtype {dphi_RF.dtype}")


def _fake_dot(src, rows_R, dphi_RF, src_is_phi=False):
    return src.new_empty(dphi_RF.shape[0], dtype=torch.promote_types(src.dtype, torch.float32))


@define_op("lrmoe::swiglu_dot", check=_check_dot, fake=_fake_dot, kernels="swiglu",
           cuda=lambda kernels, *args: kernels.swiglu_dot_triton(*args), reference_if=_fp64, inline=True)
def swiglu_dot(src: torch.Tensor, rows_R: torch.Tensor | None, dphi_RF: torch.Tensor,
               src_is_phi: bool = False) -> torch.Tensor:
    return swiglu_dot_reference(src, rows_R, dphi_RF, src_is_phi)  # a backward already: forward only


def swiglu_sqnorm_reference(h_N2F):
    phi_NF = swiglu(h_N2F)
    return phi_NF, phi_NF.float().square().sum(-1)


def _fake_sqnorm(h_N2F):
    return h_N2F.new_empty(h_N2F.shape[0], h_N2F.shape[1] // 2), h_N2F.new_empty(h_N2F.shape[0], dtype=torch.float32)


@define_op("lrmoe::swiglu_sqnorm", check=lambda h_N2F: _check_h("swiglu_sqnorm", h_N2F), fake=_fake_sqnorm,
           kernels="swiglu", cuda=lambda kernels, h_N2F: kernels.swiglu_sqnorm_triton(h_N2F), reference_if=_fp64,
           inline=True)
def swiglu_sqnorm(h_N2F: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return swiglu_sqnorm_reference(h_N2F)
