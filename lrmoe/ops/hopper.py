"""The experts' GEMMs on Hopper GPUs (sm_90) through quack's CuTe-DSL kernels, as custom ops: the "hopper" backend
of lrmoe.functional.expert_kernels.

Shapes: N rows (grouped by instance, instance j's rows ending at ``offsets_I[j]``), I instances, D model dim, F
expert hidden dim. Weights in transformers' Qwen3-MoE layout: ``gate_up_IFD`` [I, 2F, D] (gate rows first),
``down_IDF`` [I, D, F]. h, the gate/up pre-activation, is kept *interleaved* here, [N, 2F] with columns
(gate_0, up_0, gate_1, up_1, ...): quack's SwiGLU epilogue writes it so and its derivative reads it so. Nothing
outside this backend reads h's columns (the transports and the activation policies move whole rows).

``lrmoe::hopper_gate_up(x_ND, gate_up_IFD, rows_N, offsets_I) -> (h_NF2, phi_NF, phi_sq_N)``
    Row i is ``x_ND[rows_N[i]]`` (x itself when rows_N is None) times its instance's gate/up weight: one grouped
    GEMM with the row gather in its operand load and SwiGLU in its epilogue (quack ``gemm_gated``), h interleaved,
    phi = silu(gate) * up, and ||phi||^2 per row in fp32 from the rounded phi.
``lrmoe::hopper_down(phi_NF, down_IDF, offsets_I) -> y_ND``
    Each row of phi times its instance's down projection (quack ``gemm``, variable rows per group).
``lrmoe::hopper_rows_backward(dy_RD, x_ND, rows_R, offsets_I, gate_up_IFD, down_IDF, h_RF2, need_dx, need_gate_up,
need_down) -> (dx_RD, grad_gate_up_IFD, grad_down_IDF)``
    The expert backward over R retained rows whose interleaved h rows are ``h_RF2`` (row-aligned with dy): dphi
    through the down projection with the SwiGLU derivative in its epilogue (``gemm_dgated``, which gives phi
    again), the down projection's weight gradient over variable K (each group's rows), the input gradient, and the
    gate/up weight gradient reading x's rows through ``rows_R`` (no gathered copy). Outputs not needed are empty
    [0] tensors. Rows past the last offset are not computed (the buffers' padding: their dx rows are not defined,
    and no caller reads them).
``lrmoe::hopper_token_rows_backward(g_TD, tok_R, coef_R, x_ND, rows_R, offsets_I, gate_up_IFD, down_IDF, h_RF2,
need_dx, need_gate_up, need_down) -> (dx_RD, grad_gate_up_IFD, grad_down_IDF, dot_R)``
    The same for rows whose output gradient is ``coef_R[r] * g_TD[tok_R[r]]`` (lrmoe.functional.transport's
    TokenRows), with each row's router gradient dot_R = <g_t W_down^T, phi_r> in fp32 (fp64 for fp64 h, on the
    CPU): one ``gemm_dgated`` reads
    g's rows through ``tok_R`` (no gathered copy), scales g W_down^T by coef in its epilogue before the SwiGLU
    derivative, sums <phi, g W_down^T> unscaled (``colvec_reduce``) and writes coef * phi, the down projection's
    weight-gradient operand against the unscaled g rows, which that GEMM reads through ``tok_R`` too.

The CPU kernels are references in PyTorch (lrmoe's portable ops, with h interleaved), so the backend's composition
is tested in CI; the CUDA kernels need the optional ``quack-kernels`` package (``pip install lrmoe[hopper]``) on an
sm_90 GPU, bf16 or fp16, with D and F multiples of 8 (16-byte rows). quack runs untuned (its default tile
configuration): its autotuner synchronises with the host and benchmarks on every new shape.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util

import torch

from lrmoe.ops._define import define_op
from lrmoe.ops.grouped_gemm import gather_grouped_mm, grouped_outer
from lrmoe.ops.swiglu import swiglu_backward, swiglu_backward_scaled, swiglu_sqnorm

__all__ = ["hopper_available", "hopper_down", "hopper_gate_up", "hopper_rows_backward", "hopper_token_rows_backward",
           "interleave_halves", "split_interleaved"]


@functools.cache
def _quack():
    """quack.gemm_interface, imported at the first CUDA call (it compiles kernels and needs a GPU)."""
    if importlib.util.find_spec("quack") is None:
        raise ImportError("lrmoe's hopper kernels need the quack-kernels package (pip install lrmoe[hopper]); "
                          "kernels='portable' runs without it")
    return importlib.import_module("quack.gemm_interface")


@torch.compiler.assume_constant_result
def hopper_available(device_index: int) -> bool:
    """Whether the hopper backend can run on CUDA device ``device_index``: an sm_90 GPU and quack installed.
    A constant to torch.compile (evaluated while tracing)."""
    return (torch.cuda.is_available() and torch.cuda.get_device_capability(device_index) == (9, 0)
            and importlib.util.find_spec("quack") is not None)


def interleave_halves(h_N2F: torch.Tensor) -> torch.Tensor:
    """[N, 2F] (gate columns, then up columns) -> [N, 2F] interleaved (gate_0, up_0, gate_1, up_1, ...)."""
    gate, up = h_N2F.chunk(2, dim=-1)
    return torch.stack([gate, up], dim=-1).reshape(h_N2F.shape)


def split_interleaved(h_NF2: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`interleave_halves`."""
    n, f2 = h_NF2.shape
    return h_NF2.view(n, f2 // 2, 2).transpose(1, 2).reshape(n, f2)


def _cu_seqlens(offsets_I: torch.Tensor) -> torch.Tensor:
    """[I + 1] int32 group starts and ends (quack's cu_seqlens) from lrmoe's [I] cumulative ends."""
    return torch.cat([offsets_I.new_zeros(1), offsets_I]).int()


# --- gate/up with SwiGLU ----------------------------------------------------------------------------------------


def _gate_up_fake(x_ND, gate_up_IFD, rows_N, offsets_I):
    n = x_ND.shape[0] if rows_N is None else rows_N.shape[0]
    f2 = gate_up_IFD.shape[1]
    return x_ND.new_empty(n, f2), x_ND.new_empty(n, f2 // 2), x_ND.new_empty(n, dtype=torch.float32)


def _gate_up_cuda(x_ND, gate_up_IFD, rows_N, offsets_I):
    idx = None if rows_N is None else rows_N.int()
    h_NF2, phi_NF = _quack().gemm_gated(x_ND, gate_up_IFD.mT, activation="swiglu", cu_seqlens_m=_cu_seqlens(offsets_I),
                                        A_idx=idx, concat_layout=("B",), tuned=False)
    # ||phi||^2 by one reduction over the bf16 rows, accumulated in fp32 (no fp32 copy of phi: N * F * 4 bytes).
    return h_NF2, phi_NF, torch.linalg.vector_norm(phi_NF, dim=-1, dtype=torch.float32).square()


@define_op("lrmoe::hopper_gate_up", fake=_gate_up_fake, cuda=_gate_up_cuda)
def hopper_gate_up(x_ND: torch.Tensor, gate_up_IFD: torch.Tensor, rows_N: torch.Tensor | None,
                   offsets_I: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    h_N2F = gather_grouped_mm(x_ND, gate_up_IFD, rows_N, offsets_I)
    phi_NF, phi_sq_N = swiglu_sqnorm(h_N2F)
    return interleave_halves(h_N2F), phi_NF, phi_sq_N


# --- down projection --------------------------------------------------------------------------------------------


def _down_cuda(phi_NF, down_IDF, offsets_I):
    return _quack().gemm(phi_NF, down_IDF.mT, cu_seqlens_m=_cu_seqlens(offsets_I), tuned=False)


@define_op("lrmoe::hopper_down", cuda=_down_cuda,
           fake=lambda phi_NF, down_IDF, offsets_I: phi_NF.new_empty(phi_NF.shape[0], down_IDF.shape[1]))
def hopper_down(phi_NF: torch.Tensor, down_IDF: torch.Tensor, offsets_I: torch.Tensor) -> torch.Tensor:
    return gather_grouped_mm(phi_NF, down_IDF, None, offsets_I)


# --- backward over retained rows --------------------------------------------------------------------------------


def _rows_backward_fake(dy_RD, x_ND, rows_R, offsets_I, gate_up_IFD, down_IDF, h_RF2, need_dx, need_gate_up,
                        need_down):
    return (dy_RD.new_empty(dy_RD.shape if need_dx else (0,)),
            gate_up_IFD.new_empty(gate_up_IFD.shape if need_gate_up else (0,)),
            down_IDF.new_empty(down_IDF.shape if need_down else (0,)))


def _rows_backward_cuda(dy_RD, x_ND, rows_R, offsets_I, gate_up_IFD, down_IDF, h_RF2, need_dx, need_gate_up,
                        need_down):
    q = _quack()
    cu = _cu_seqlens(offsets_I)
    # dh (interleaved, as h) and phi from one GEMM: dphi = dy @ down with the SwiGLU derivative in its epilogue.
    dh_RF2, phi_RF = q.gemm_dgated(dy_RD, down_IDF, h_RF2, activation="swiglu", cu_seqlens_m=cu,
                                   dynamic_scheduler=False, tuned=False)
    # sum over each group's rows of dy_r phi_r^T: variable K, A = dy^T (m-major)
    grad_down = q.gemm(dy_RD.mT, phi_RF, cu_seqlens_k=cu, tuned=False) if need_down else dy_RD.new_empty(0)
    return (*_gate_up_grads_cuda(q, cu, dh_RF2, x_ND, rows_R, gate_up_IFD, need_dx, need_gate_up), grad_down)


def _gate_up_grads_cuda(q, cu, dh_RF2, x_ND, rows_R, gate_up_IFD, need_dx, need_gate_up):
    """(dx_RD, grad_gate_up_IFD) from the interleaved dh, empty [0] tensors where not needed."""
    grad_gu, dx_RD = dh_RF2.new_empty(0), dh_RF2.new_empty(0)
    if need_gate_up:  # x's rows read through the index; the result written back in gate-then-up row order
        grad_gu = torch.empty_like(gate_up_IFD)
        idx = None if rows_R is None else rows_R.int()
        q.gemm(x_ND.mT, dh_RF2, out=grad_gu.mT, cu_seqlens_k=cu, A_idx=idx, concat_layout=("out",), tuned=False)
    if need_dx:  # dh's interleaved columns meet the weight's gate-then-up rows through the concat layout
        dx_RD = q.gemm(dh_RF2, gate_up_IFD, cu_seqlens_m=cu, concat_layout=("B",), tuned=False)
    return dx_RD, grad_gu


@define_op("lrmoe::hopper_rows_backward", fake=_rows_backward_fake, cuda=_rows_backward_cuda)
def hopper_rows_backward(dy_RD: torch.Tensor, x_ND: torch.Tensor, rows_R: torch.Tensor | None,
                         offsets_I: torch.Tensor, gate_up_IFD: torch.Tensor, down_IDF: torch.Tensor,
                         h_RF2: torch.Tensor, need_dx: bool, need_gate_up: bool,
                         need_down: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dphi_RF = gather_grouped_mm(dy_RD, down_IDF.transpose(1, 2), None, offsets_I)
    dh_R2F, phi_RF = swiglu_backward(split_interleaved(h_RF2), None, dphi_RF)
    grad_down = grouped_outer(dy_RD, phi_RF, None, offsets_I) if need_down else dy_RD.new_empty(0)
    return (*_gate_up_grads_reference(dh_R2F, x_ND, rows_R, offsets_I, gate_up_IFD, need_dx, need_gate_up),
            grad_down)


def _gate_up_grads_reference(dh_R2F, x_ND, rows_R, offsets_I, gate_up_IFD, need_dx, need_gate_up):
    """(dx_RD, grad_gate_up_IFD) from dh in halves (gate columns, then up), empty [0] tensors where not needed."""
    grad_gu = grouped_outer(dh_R2F, x_ND, rows_R, offsets_I) if need_gate_up else dh_R2F.new_empty(0)
    dx_RD = (gather_grouped_mm(dh_R2F, gate_up_IFD.transpose(1, 2), None, offsets_I) if need_dx
             else dh_R2F.new_empty(0))
    return dx_RD, grad_gu


# --- backward over token rows, with the router gradient ----------------------------------------------------------


def _token_rows_fake(g_TD, tok_R, coef_R, x_ND, rows_R, offsets_I, gate_up_IFD, down_IDF, h_RF2, need_dx,
                     need_gate_up, need_down):
    n_rows = tok_R.shape[0]
    return (g_TD.new_empty((n_rows, g_TD.shape[1]) if need_dx else (0,)),
            gate_up_IFD.new_empty(gate_up_IFD.shape if need_gate_up else (0,)),
            down_IDF.new_empty(down_IDF.shape if need_down else (0,)),
            g_TD.new_empty(n_rows, dtype=torch.promote_types(h_RF2.dtype, torch.float32)))


def _token_rows_cuda(g_TD, tok_R, coef_R, x_ND, rows_R, offsets_I, gate_up_IFD, down_IDF, h_RF2, need_dx,
                     need_gate_up, need_down):
    q = _quack()
    cu = _cu_seqlens(offsets_I)
    tok = tok_R.int()
    # g W_down^T at each row's token (g read through the index), scaled by coef before the SwiGLU derivative;
    # <phi, g W_down^T> summed unscaled; coef * phi written.
    dh_RF2, cphi_RF, dot_R = q.gemm_dgated(g_TD, down_IDF, h_RF2, activation="swiglu", colvec_scale=coef_R.float(),
                                           colvec_reduce=True, cu_seqlens_m=cu, A_idx=tok, dynamic_scheduler=False,
                                           tuned=False)
    # sum over each group's rows of g_t (coef phi)^T: variable K, g's rows through the index
    grad_down = (q.gemm(g_TD.mT, cphi_RF, cu_seqlens_k=cu, A_idx=tok, tuned=False) if need_down
                 else g_TD.new_empty(0))
    return (*_gate_up_grads_cuda(q, cu, dh_RF2, x_ND, rows_R, gate_up_IFD, need_dx, need_gate_up), grad_down, dot_R)


@define_op("lrmoe::hopper_token_rows_backward", fake=_token_rows_fake, cuda=_token_rows_cuda)
def hopper_token_rows_backward(g_TD: torch.Tensor, tok_R: torch.Tensor, coef_R: torch.Tensor, x_ND: torch.Tensor,
                               rows_R: torch.Tensor | None, offsets_I: torch.Tensor, gate_up_IFD: torch.Tensor,
                               down_IDF: torch.Tensor, h_RF2: torch.Tensor, need_dx: bool, need_gate_up: bool,
                               need_down: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g_RD = g_TD.index_select(0, tok_R)
    gdown_RF = gather_grouped_mm(g_RD, down_IDF.transpose(1, 2), None, offsets_I)
    dh_R2F, cphi_RF, dot_R = swiglu_backward_scaled(split_interleaved(h_RF2), None, gdown_RF,
                                                    coef_R.to(torch.promote_types(h_RF2.dtype, torch.float32)))
    grad_down = grouped_outer(g_RD, cphi_RF, None, offsets_I) if need_down else g_TD.new_empty(0)
    return (*_gate_up_grads_reference(dh_R2F, x_ND, rows_R, offsets_I, gate_up_IFD, need_dx, need_gate_up),
            grad_down, dot_R)
