"""The seam between the selective expert step and the kernels that compute the experts (docs/design.md,
"Architecture"): an :class:`ExpertKernels` backend runs the step's grouped GEMMs and SwiGLU, forward over every
routed row and backward over the retained rows only. The step (lrmoe.functional.expert_step) never calls a GEMM
itself, so a faster backend for one GPU family plugs in here without touching the step, the transports or the
layers.

A backend is a frozen object of Python values (hashable: torch.compile treats it as a constant); its methods take
and return tensors only, and run through registered custom ops (or plain PyTorch), so a compiled step traces them
without graph breaks. Backends are registered by name in :data:`BACKENDS` (a step names its backend, a string, so
a compiled graph keys on a constant); "portable" is the backend every device has: lrmoe's own custom ops (CPU
references, Triton kernels on CUDA) and torch._grouped_mm where it is fast.

Shapes: N forward rows, R retained rows (both grouped by instance, instance j's rows ending at ``offsets_I[j]``),
D model dim, F expert hidden dim, I instances, C rows per block of a blocked backward.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch

from lrmoe.functional.retained_rows import take_rows
from lrmoe.functional.transport import TokenRows
from lrmoe.ops import (
    gather_grouped_mm,
    gather_host_rows,
    gather_scale_rows,
    grouped_outer,
    hopper_available,
    hopper_down,
    hopper_gate_up,
    hopper_rows_backward,
    hopper_token_rows_backward,
    swiglu_backward,
    swiglu_backward_scaled,
    swiglu_dot,
    swiglu_sqnorm,
)


@dataclass(frozen=True)
class ExpertGrads:
    """The expert backward's results, None where not asked for: the retained rows' input gradient [R, D] and
    the weights' gradients [I, 2F, D] and [I, D, F]; with :class:`TokenRows` given to a backend that
    ``computes_router_gradient``, ``dot_R`` [R] fp32: <g_t, y_u> of each row's pair, the router's gradient."""

    dx_RD: torch.Tensor | None
    gate_up_IFD: torch.Tensor | None
    down_IDF: torch.Tensor | None
    dot_R: torch.Tensor | None = None


class ExpertKernels(abc.ABC):
    """How the experts' SwiGLU MLPs are computed over grouped rows. Implementations are frozen dataclasses.

    ``computes_router_gradient``: the backend's backward takes the rows as :class:`TokenRows` and returns each
    row's <g_t, y_u> (``ExpertGrads.dot_R``) from its own operands, <g_t W_down^T, phi_u>. A step where every pair
    is kept on one device then saves no expert output y for the router's gradient.
    ``computes_dropped_router_gradient``: it also takes ``TokenRows.all_tok_N`` and returns the router gradient of
    every forward row, the dropped ones' included: a selective step on one device then saves no y either."""

    computes_router_gradient: bool = False
    computes_dropped_router_gradient: bool = False

    @abc.abstractmethod
    def gate_up(self, x_ND: torch.Tensor, rows_N: torch.Tensor | None, offsets_I: torch.Tensor,
                gate_up_IFD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(h_NF2, phi_NF, phi_sq_N): GEMM row i is ``x_ND[rows_N[i]]`` (None: row i) times its instance's
        gate/up weight, h its pre-activation (first F columns gate, last F up), phi = silu(gate) * up and
        ||phi||^2 per row in fp32."""

    @abc.abstractmethod
    def down(self, phi_NF: torch.Tensor, offsets_I: torch.Tensor, down_IDF: torch.Tensor) -> torch.Tensor:
        """y_ND: each row of phi times its instance's down projection."""

    @abc.abstractmethod
    def backward(self, dy: list[torch.Tensor], x_ND: torch.Tensor, rows_R: torch.Tensor | None,
                 offsets_I: torch.Tensor, gate_up_IFD: torch.Tensor, down_IDF: torch.Tensor,
                 h_saved: torch.Tensor | None, h_index_R: torch.Tensor | None,
                 needs: tuple[bool, bool, bool], h_on_host: bool, group_rows: int | None) -> ExpertGrads:
        """The compact expert backward over the retained rows. ``dy`` = [dy_RD] is consumed (popped), so each row
        buffer can be freed after its last use; or :class:`TokenRows` (only where the backend
        ``computes_router_gradient``), and then ``ExpertGrads.dot_R`` comes back too. Row i's input is
        ``x_ND[rows_R[i]]``; its pre-activation is ``h_saved[h_index_R[i]]`` (in pinned host memory with
        ``h_on_host``), or recomputed when ``h_saved`` is None. ``needs`` = (dx, gate/up grad, down grad).
        ``group_rows`` = C: the rows are I blocks of C rows."""


@dataclass(frozen=True)
class PortableKernels(ExpertKernels):
    """lrmoe's custom ops: the gather fused into the first GEMM's operand load (lrmoe::gather_grouped_mm), SwiGLU
    and ||phi||^2 from one read of h, phi and dh from one read of h in the backward, grouped weight gradients that
    read their input rows through the index; torch.bmm over equal blocks for a blocked backward. Given
    :class:`TokenRows`, the SwiGLU backward scales the rows and returns the router's gradient
    (lrmoe::swiglu_backward_scaled)."""

    computes_router_gradient = True
    computes_dropped_router_gradient = True

    def gate_up(self, x_ND, rows_N, offsets_I, gate_up_IFD):
        h_NF2 = gather_grouped_mm(x_ND, gate_up_IFD, rows_N, offsets_I)  # the row gather fused into the GEMM
        phi_NF, phi_sq_N = swiglu_sqnorm(h_NF2)  # and ||phi||^2 per row in fp32, from one read of h
        return h_NF2, phi_NF, phi_sq_N

    def down(self, phi_NF, offsets_I, down_IDF):
        return gather_grouped_mm(phi_NF, down_IDF, None, offsets_I)  # rows in place: no gather

    def backward(self, dy, x_ND, rows_R, offsets_I, gate_up_IFD, down_IDF, h_saved, h_index_R, needs, h_on_host,
                 group_rows):
        if isinstance(dy, TokenRows):
            if group_rows is not None:
                raise ValueError("token rows have no blocked backward: the blocks' rows are padded dy rows")
            return token_rows_backward(dy, x_ND, rows_R, offsets_I, gate_up_IFD, down_IDF, h_saved, h_index_R,
                                       needs, h_on_host)
        if group_rows is not None:
            return ExpertGrads(*_blocked_rows_backward(dy, x_ND, rows_R, gate_up_IFD, down_IDF, h_saved, h_index_R,
                                                       needs, h_on_host, group_rows))
        return ExpertGrads(*expert_rows_backward(dy, x_ND, rows_R, offsets_I, gate_up_IFD, down_IDF, h_saved,
                                                 h_index_R, needs, h_on_host))


@dataclass(frozen=True)
class HopperKernels(ExpertKernels):
    """quack's CuTe-DSL grouped GEMMs on sm_90 (lrmoe.ops.hopper): the row gather in the gate/up GEMM's operand
    load and SwiGLU in its epilogue; in the backward dphi with the SwiGLU derivative in its epilogue, weight
    gradients over each group's rows that read x through the row index. h is kept interleaved (gate and up
    columns alternating), which only this backend reads. A blocked backward (``group_rows``) is the portable
    backend's; the layers do not choose this one for it. Given :class:`TokenRows` (every pair kept, one device) it
    reads g's rows through the token index, scales them in the epilogue and returns the router gradient
    (lrmoe::hopper_token_rows_backward); below retain 1 it takes dy rows and the step keeps y."""

    computes_router_gradient = True

    def gate_up(self, x_ND, rows_N, offsets_I, gate_up_IFD):
        return hopper_gate_up(x_ND, gate_up_IFD, rows_N, offsets_I)

    def down(self, phi_NF, offsets_I, down_IDF):
        return hopper_down(phi_NF, down_IDF, offsets_I)

    def backward(self, dy, x_ND, rows_R, offsets_I, gate_up_IFD, down_IDF, h_saved, h_index_R, needs, h_on_host,
                 group_rows):
        if group_rows is not None:
            raise ValueError("kernels='hopper' has no blocked backward (backward_capacity); use kernels='portable'")
        token_rows = isinstance(dy, TokenRows)
        if token_rows and dy.all_tok_N is not None:
            raise ValueError("kernels='hopper' computes the router gradient of the retained rows only")
        dy_RD = None if token_rows else dy.pop()
        # The retained rows' h as the portable backward finds it (recomputed by the gate/up GEMM over the retained
        # rows, read back from the host, or the saved h and an index), then row-aligned with dy: the GEMM's
        # epilogue reads its operand rows in order.
        h_src, h_rows_R = _rows_h(h_saved, h_index_R, h_on_host, lambda *args: hopper_gate_up(*args)[0], x_ND,
                                  gate_up_IFD, rows_R, offsets_I)
        h_RF2 = h_src if h_rows_R is None else h_src.index_select(0, h_rows_R)
        dot_R = None
        if token_rows:  # g's rows read through the token index, scaled in the epilogue, with the router gradient
            dx_RD, grad_gu, grad_down, dot_R = hopper_token_rows_backward(
                dy.g_TD.to(dy.dtype), dy.tok_R, dy.coef_R, x_ND, rows_R, offsets_I, gate_up_IFD, down_IDF, h_RF2,
                *needs)
        else:
            dx_RD, grad_gu, grad_down = hopper_rows_backward(dy_RD, x_ND, rows_R, offsets_I, gate_up_IFD, down_IDF,
                                                             h_RF2, *needs)
        return ExpertGrads(*(g if need else None for g, need in zip((dx_RD, grad_gu, grad_down), needs)), dot_R)


BACKENDS: dict[str, ExpertKernels] = {"portable": PortableKernels(), "hopper": HopperKernels()}


def choose_kernels(requested: str, x: torch.Tensor, dim: int, hidden_dim: int, blocked: bool) -> str:
    """The backend a step runs with (BackwardOptions.kernels). "auto" is the backend measured fastest for the
    step: "portable" everywhere for now (on one H100 the hopper backend's layer step took 1.05-1.15x the portable
    one's, docs/performance.md). "hopper" where it can run (an sm_90 GPU with quack installed, x in bf16 or fp16,
    ``dim`` and ``hidden_dim`` multiples of 8 for 16-byte rows, no blocked backward); asked where it cannot run,
    it raises, saying why. Decided from shapes, dtypes and the device alone (a constant to torch.compile)."""
    if requested != "hopper":
        return "portable"
    why = None
    if not x.is_cuda:
        why = f"x is on {x.device.type}, not a CUDA GPU"
    elif x.dtype not in (torch.bfloat16, torch.float16):
        why = f"x is {x.dtype}, not bf16 or fp16"
    elif dim % 8 or hidden_dim % 8:
        why = f"dim={dim} and hidden_dim={hidden_dim} must be multiples of 8"
    elif blocked:
        why = "backward_capacity's blocked backward is the portable backend's"
    elif not hopper_available(x.device.index or 0):
        why = "it needs an sm_90 GPU (H100/H200) and the quack-kernels package (pip install lrmoe[hopper])"
    if why is not None:
        raise ValueError(f"kernels='hopper' cannot run here: {why}; use kernels='auto' or 'portable'")
    return "hopper"


def expert_kernels(name: str) -> ExpertKernels:
    """The registered backend called ``name``."""
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(f"kernels must be one of {sorted(BACKENDS)}, got {name!r}") from None


def expert_rows_backward(
    dy: list[torch.Tensor],
    x_ND: torch.Tensor,
    src_rows_R: torch.Tensor | None,
    offsets_E: torch.Tensor,
    gate_up_EFD: torch.Tensor,
    down_EDF: torch.Tensor,
    h_saved: torch.Tensor | None,
    h_index_R: torch.Tensor | None,
    needs: tuple[bool, bool, bool] = (True, True, True),
    h_on_host: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The compact expert backward over retained rows, grouped by expert (``offsets_E``): shared by the
    single-device and the expert-parallel layer.

    ``dy`` = [dy_RD], the output gradient of the retained rows, is consumed (the caller drops its reference), so
    every row buffer is released right after its last use here: the lifetimes lrmoe.memory models. Row i's input
    is ``x_ND[src_rows_R[i]]``. Its gate/up pre-activation h is ``h_saved[h_index_R[i]]`` (activations "save",
    read in place by lrmoe::swiglu_backward; with ``h_on_host``, "offload": read from the pinned host copy, only
    these rows crossing the link), or recomputed from that input when ``h_saved`` is None ("recompute": one
    grouped GEMM over the kept rows). dphi comes first, so that phi and dh come out of one pass over h. ``needs`` = (dx,
    gate/up grad, down grad). Returns (dx_RD, grad_gate_up_EFD, grad_down_EDF), None where not needed.
    """
    dy_RD = dy.pop()
    # Recomputed: rows past the last offset come back as zeros.
    h_src, h_rows_R = _rows_h(h_saved, h_index_R, h_on_host, gather_grouped_mm, x_ND, gate_up_EFD, src_rows_R,
                              offsets_E)
    need_x, need_gu, need_down = needs
    dphi_RF = gather_grouped_mm(dy_RD, down_EDF.transpose(1, 2), None, offsets_E)
    # phi (the down projection's weight-gradient operand) and dh from one read of h (lrmoe::swiglu_backward).
    dh_RF2, phi_RF = swiglu_backward(h_src, h_rows_R, dphi_RF)
    del h_src, dphi_RF
    grad_down = grouped_outer(dy_RD, phi_RF, None, offsets_E) if need_down else None
    del dy_RD, phi_RF
    grad_gu = grouped_outer(dh_RF2, x_ND, src_rows_R, offsets_E) if need_gu else None
    dx_RD = gather_grouped_mm(dh_RF2, gate_up_EFD.transpose(1, 2), None, offsets_E) if need_x else None
    return dx_RD, grad_gu, grad_down


def token_rows_backward(rows: TokenRows, x_ND: torch.Tensor, src_rows_R: torch.Tensor | None,
                        offsets_E: torch.Tensor, gate_up_EFD: torch.Tensor, down_EDF: torch.Tensor,
                        h_saved: torch.Tensor | None, h_index_R: torch.Tensor | None,
                        needs: tuple[bool, bool, bool], h_on_host: bool) -> ExpertGrads:
    """expert_rows_backward for rows given as :class:`TokenRows` (row r's output gradient coef_r * g[tok_r]),
    which also returns the router gradient <g_t, y_u> = <g_t W_down^T, phi_u> of each row, or with
    ``rows.all_tok_N`` of each forward row (dropped ones too; ``ExpertGrads.dot_R`` is then over the forward rows).
    The token rows are gathered once, unscaled (the down projection's two GEMMs read them);
    lrmoe::swiglu_backward_scaled applies the coefficients in fp32, writes coef * phi for the down projection's
    weight gradient and sums the dot from the same pass over h."""
    need_x, need_gu, need_down = needs
    g_TD = rows.g_TD.to(rows.dtype)
    down_EFD = down_EDF.transpose(1, 2)
    if rows.all_tok_N is None:  # the rows are the forward's, or their router gradient is not asked for
        g_RD = take_rows(g_TD, rows.tok_R)
        h_src, h_rows_R = _rows_h(h_saved, h_index_R, h_on_host, gather_grouped_mm, x_ND, gate_up_EFD, src_rows_R,
                                  offsets_E)
        gdown_RF = gather_grouped_mm(g_RD, down_EFD, None, offsets_E)  # g_t W_down^T, unscaled
        dot_N = None
    else:
        # Every forward row's router gradient: g W_down^T at every forward row (the dropped rows' only GEMM), its
        # dot with phi (the saved phi, or phi of the saved h read in place); the retained rows take their rows of
        # it (h_index_R: their rows of the forward, which are h's).
        if h_index_R is None or (rows.all_phi_N is None and (h_saved is None or h_on_host)):
            raise ValueError("the router gradient of every forward row needs the retained rows' forward rows and "
                             "the forward rows' phi, saved or from the saved h")
        gdown_NF = gather_grouped_mm(g_TD, down_EFD, rows.all_tok_N, rows.all_offsets_I)
        # From the saved phi, the same kernel gives the dots of its h bit for bit ("offload" and "save" agree).
        dot_N = (swiglu_dot(h_saved, None, gdown_NF) if rows.all_phi_N is None
                 else swiglu_dot(rows.all_phi_N, None, gdown_NF, True))
        gdown_RF = take_rows(gdown_NF, h_index_R)
        del gdown_NF
        g_RD = take_rows(g_TD, rows.tok_R)
        h_src, h_rows_R = _rows_h(h_saved, h_index_R, h_on_host, gather_grouped_mm, x_ND, gate_up_EFD, src_rows_R,
                                  offsets_E)
    dh_RF2, cphi_RF, dot_R = swiglu_backward_scaled(h_src, h_rows_R, gdown_RF, rows.coef_R)
    if dot_N is not None:
        dot_R = dot_N
    del h_src, gdown_RF, dot_N
    grad_down = grouped_outer(g_RD, cphi_RF, None, offsets_E) if need_down else None  # sum_r g_t^T (coef_r phi_r)
    del g_RD, cphi_RF
    grad_gu = grouped_outer(dh_RF2, x_ND, src_rows_R, offsets_E) if need_gu else None
    dx_RD = gather_grouped_mm(dh_RF2, gate_up_EFD.transpose(1, 2), None, offsets_E) if need_x else None
    return ExpertGrads(dx_RD, grad_gu, grad_down, dot_R)


def _rows_h(h_saved, h_index_R, h_on_host, recompute, *args):
    """(h, row index into it) for the retained rows: the saved h read in place through the index ("save"), or a
    buffer of just these rows, read back from the host copy ("offload") or ``recompute(*args)`` ("recompute")."""
    if h_saved is None:
        return recompute(*args), None
    if h_on_host:
        return gather_host_rows(h_saved, h_index_R), None
    return h_saved, h_index_R


def _block_mm(a_ECI: torch.Tensor, w_EIO: torch.Tensor) -> torch.Tensor:
    """One GEMM per block, as rows: [E, C, I] @ [E, I, O] -> [E * C, O]."""
    return torch.bmm(a_ECI, w_EIO).view(-1, w_EIO.shape[-1])


def _blocked_rows_backward(dy, x_ND, src_rows_R, gate_up_EFD, down_EDF, h_saved, h_index_R, needs, h_on_host,
                           n_rows):
    """expert_rows_backward over E blocks of ``n_rows`` rows: the same steps, each GEMM a torch.bmm on [E, C, .]
    views (the row buffers are contiguous), the inputs' rows gathered once for the weight gradient (and the
    recomputed h)."""
    n_exp, dim = gate_up_EFD.shape[0], x_ND.shape[1]
    dy_ECD = dy.pop().view(n_exp, n_rows, dim)
    need_x, need_gu, need_down = needs
    x_rows_ECD = None
    if h_saved is None or need_gu:  # lrmoe::gather_scale_rows times 1 (exact): its Triton row gather on CUDA
        ones_R = torch.ones(src_rows_R.shape[0], device=x_ND.device)
        x_rows_ECD = gather_scale_rows(x_ND, src_rows_R, ones_R).view(n_exp, n_rows, dim)
    h_src, h_rows_R = _rows_h(h_saved, h_index_R, h_on_host, _block_mm, x_rows_ECD, gate_up_EFD.transpose(1, 2))
    dphi_RF = _block_mm(dy_ECD, down_EDF)
    dh_RF2, phi_RF = swiglu_backward(h_src, h_rows_R, dphi_RF)
    del h_src, dphi_RF
    grad_down = torch.bmm(dy_ECD.transpose(1, 2), phi_RF.view(n_exp, n_rows, phi_RF.shape[1])) if need_down else None
    del dy_ECD, phi_RF
    dh_ECF2 = dh_RF2.view(n_exp, n_rows, dh_RF2.shape[1])  # sizes spelled out: C may be 0 (no tokens)
    grad_gu = torch.bmm(dh_ECF2.transpose(1, 2), x_rows_ECD) if need_gu else None
    del x_rows_ECD
    dx_RD = _block_mm(dh_ECF2, gate_up_EFD) if need_x else None
    return dx_RD, grad_gu, grad_down
