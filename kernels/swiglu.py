"""The SwiGLU backward of the retained rows, with the SwiGLU itself, in one pass (the kernel behind
``lrmoe::swiglu_backward``), and the forward SwiGLU with ||phi||^2 (behind ``lrmoe::swiglu_sqnorm``).

Shapes: N rows of h, R rows out, F the expert hidden dim (h is [N, 2F], gate half first).

``swiglu_backward_triton(h_N2F, rows_R, dphi_RF) -> (dh_R2F, phi_RF)``
    With h_i = h[rows[i]] (h itself when rows is None), gate = h_i[:F], up = h_i[F:], s = sigmoid(gate), in fp32:
    dh_i = [dphi_i * up * s * (1 + gate * (1 - s)),  dphi_i * gate * s], rounded to h's dtype once;
    phi_i = silu(gate) * up, each factor rounded to h's dtype as eager PyTorch rounds them (silu, then the product).
    Rows outside [0, N) are not read: their outputs are zero (as for zero h).
``swiglu_backward_scaled_triton(h_N2F, rows_R, dphi_RF, coef_R) -> (dh_R2F, cphi_RF, dot_R)``
    The same for rows whose output gradient is coef_i * (row i of dphi): with dphi_i scaled by coef_i in fp32,
    dh_i as above; cphi_i = coef_i * phi_i (fp32 product of the rounded phi, rounded once); and
    dot_i = sum over f of dphi_if * phi_if in fp32 (the unscaled dphi, the rounded phi). Each program runs over
    all F columns of its rows, so the row sums need no atomics.
``swiglu_dot_triton(src, rows_R, dphi_RF, src_is_phi) -> dot_R``
    dot_i = sum over f of dphi_if * phi_if in fp32, phi of h_i = src[rows[i]] as above (rounded), or with
    ``src_is_phi`` phi_i = src[rows[i]] itself ([N, F]): the dot alone, for rows whose gradient the backward does
    not compute. The same loop and reduction either way, so a phi saved by the forward gives the dot of its h bit
    for bit.
``swiglu_sqnorm_triton(h_N2F) -> (phi_NF, phi_sq_N)``
    phi as above for every row of h, and phi_sq_n = sum over f of phi_nf^2 in fp32 from the rounded phi: the
    layers' forward SwiGLU and the ||phi||^2 the "lrm" score needs, from one read of h (PyTorch would write a SiLU
    temporary and phi, and read phi again for the norms).

Why one kernel: the layer's backward needs phi (the down projection's weight-gradient operand) and dh (the gate/up
projection's output gradient) of the same retained rows, both from h. Compiled, Inductor produced them in two
kernels that each gathered h through two index loads per element (the retained row's pair, then that pair's row of
the saved h) over a flattened [R, 2F] range, 0.216 + 0.077 ms at the Qwen3 shape, retain 1, on the H200 (read
off Inductor's generated code and the profile). Here each program loads its rows' index once and
reads contiguous runs of the gate and up halves of those rows: h read once in place (the saved h with the row
index, no gathered copy), dphi once, dh and phi written once (0.148 ms at that shape, the same profile).
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from .launch import interpreting, known_empty, launch

__all__ = ["swiglu_backward_scaled_triton", "swiglu_backward_triton", "swiglu_dot_triton", "swiglu_sqnorm_triton"]



@triton.jit
def _phi(gate, up, h_dtype: tl.constexpr):
    """phi = silu(gate) * up from fp32 gate and up, rounded as eager PyTorch rounds in h's dtype: F.silu (fp32
    math, one rounding), then the product (one more)."""
    silu = (gate / (1.0 + tl.exp(-gate))).to(h_dtype)
    return (silu.to(tl.float32) * up).to(h_dtype)


@triton.jit
def _source_rows(rows_ptr, r_R, r_ok_R, N, HAS_ROWS: tl.constexpr):
    """(the row of h each output row reads, whether it reads one): rows[r] through the index, or r itself. An
    index outside h is not read: its outputs are zero."""
    if HAS_ROWS:
        src_R = tl.load(rows_ptr + r_R, mask=r_ok_R, other=0).to(tl.int64)
        read_R = r_ok_R & (src_R >= 0) & (src_R < N)
    else:
        src_R = r_R.to(tl.int64)
        read_R = r_ok_R
    return src_R, read_R


@triton.jit
def _swiglu_backward_kernel(
    h_ptr, rows_ptr, dphi_ptr, dh_ptr, phi_ptr,
    R, N, F,
    stride_hn, stride_hf, stride_dr, stride_df, stride_gr, stride_gf, stride_pr, stride_pf,
    HAS_ROWS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr,
):  # fmt: skip
    r_R = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    f_F = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    r_ok_R = r_R < R
    mask_RF = r_ok_R[:, None] & (f_F < F)[None, :]
    src_R, read_R = _source_rows(rows_ptr, r_R, r_ok_R, N, HAS_ROWS)
    read_RF = read_R[:, None] & (f_F < F)[None, :]
    gate_ptr = h_ptr + src_R[:, None] * stride_hn + f_F[None, :] * stride_hf
    h_dtype = h_ptr.dtype.element_ty
    gate_h = tl.load(gate_ptr, mask=read_RF, other=0.0)
    up_h = tl.load(gate_ptr + F * stride_hf, mask=read_RF, other=0.0)
    r64_R = r_R.to(tl.int64)[:, None]
    dphi = tl.load(dphi_ptr + r64_R * stride_dr + f_F[None, :] * stride_df, mask=mask_RF, other=0.0).to(tl.float32)

    gate = gate_h.to(tl.float32)
    up = up_h.to(tl.float32)
    sig = tl.sigmoid(gate)
    # Same operation order as lrmoe.ops.swiglu's reference (left to right), so the fp32 products round alike.
    dgate = dphi * up * sig * (1.0 + gate * (1.0 - sig))
    dup = dphi * gate * sig
    dh_ptrs = dh_ptr + r64_R * stride_gr + f_F[None, :] * stride_gf
    tl.store(dh_ptrs, dgate.to(h_dtype), mask=mask_RF)
    tl.store(dh_ptrs + F * stride_gf, dup.to(h_dtype), mask=mask_RF)
    tl.store(phi_ptr + r64_R * stride_pr + f_F[None, :] * stride_pf, _phi(gate, up, h_dtype), mask=mask_RF)


@triton.jit
def _swiglu_backward_scaled_kernel(
    h_ptr, rows_ptr, dphi_ptr, coef_ptr, dh_ptr, cphi_ptr, dot_ptr,
    R, N, F,
    stride_hn, stride_hf, stride_dr, stride_df, stride_gr, stride_gf, stride_pr, stride_pf,
    HAS_ROWS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr,
):  # fmt: skip
    r_R = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok_R = r_R < R
    src_R, read_R = _source_rows(rows_ptr, r_R, r_ok_R, N, HAS_ROWS)
    coef_R = tl.load(coef_ptr + r_R, mask=r_ok_R, other=0.0).to(tl.float32)[:, None]
    r64_R = r_R.to(tl.int64)[:, None]
    h_dtype = h_ptr.dtype.element_ty
    dot_RF = tl.zeros((BLOCK_R, BLOCK_F), dtype=tl.float32)
    for f0 in range(0, F, BLOCK_F):
        f_F = f0 + tl.arange(0, BLOCK_F)
        mask_RF = r_ok_R[:, None] & (f_F < F)[None, :]
        read_RF = read_R[:, None] & (f_F < F)[None, :]
        gate_ptr = h_ptr + src_R[:, None] * stride_hn + f_F[None, :] * stride_hf
        gate = tl.load(gate_ptr, mask=read_RF, other=0.0).to(tl.float32)
        up = tl.load(gate_ptr + F * stride_hf, mask=read_RF, other=0.0).to(tl.float32)
        dphi_raw = tl.load(dphi_ptr + r64_R * stride_dr + f_F[None, :] * stride_df, mask=mask_RF,
                           other=0.0).to(tl.float32)
        dphi = dphi_raw * coef_R
        sig = tl.sigmoid(gate)
        # Same operation order as lrmoe.ops.swiglu's reference (left to right), so the fp32 products round alike.
        dgate = dphi * up * sig * (1.0 + gate * (1.0 - sig))
        dup = dphi * gate * sig
        dh_ptrs = dh_ptr + r64_R * stride_gr + f_F[None, :] * stride_gf
        tl.store(dh_ptrs, dgate.to(h_dtype), mask=mask_RF)
        tl.store(dh_ptrs + F * stride_gf, dup.to(h_dtype), mask=mask_RF)
        phi = _phi(gate, up, h_dtype).to(tl.float32)  # masked lanes: zero
        tl.store(cphi_ptr + r64_R * stride_pr + f_F[None, :] * stride_pf, (phi * coef_R).to(h_dtype), mask=mask_RF)
        dot_RF += dphi_raw * phi
    tl.store(dot_ptr + r_R, tl.sum(dot_RF, axis=1), mask=r_ok_R)


@triton.jit
def _swiglu_dot_kernel(
    h_ptr, rows_ptr, dphi_ptr, dot_ptr,
    R, N, F,
    stride_hn, stride_hf, stride_dr, stride_df,
    HAS_ROWS: tl.constexpr, IS_PHI: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr,
):  # fmt: skip
    r_R = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok_R = r_R < R
    src_R, read_R = _source_rows(rows_ptr, r_R, r_ok_R, N, HAS_ROWS)
    r64_R = r_R.to(tl.int64)[:, None]
    h_dtype = h_ptr.dtype.element_ty
    dot_RF = tl.zeros((BLOCK_R, BLOCK_F), dtype=tl.float32)
    for f0 in range(0, F, BLOCK_F):
        f_F = f0 + tl.arange(0, BLOCK_F)
        mask_RF = r_ok_R[:, None] & (f_F < F)[None, :]
        read_RF = read_R[:, None] & (f_F < F)[None, :]
        gate_ptr = h_ptr + src_R[:, None] * stride_hn + f_F[None, :] * stride_hf
        if IS_PHI:
            phi = tl.load(gate_ptr, mask=read_RF, other=0.0).to(tl.float32)
        else:
            gate = tl.load(gate_ptr, mask=read_RF, other=0.0).to(tl.float32)
            up = tl.load(gate_ptr + F * stride_hf, mask=read_RF, other=0.0).to(tl.float32)
            phi = _phi(gate, up, h_dtype).to(tl.float32)
        dphi = tl.load(dphi_ptr + r64_R * stride_dr + f_F[None, :] * stride_df, mask=mask_RF,
                       other=0.0).to(tl.float32)
        dot_RF += dphi * phi
    tl.store(dot_ptr + r_R, tl.sum(dot_RF, axis=1), mask=r_ok_R)


@triton.jit
def _swiglu_sqnorm_kernel(
    h_ptr, phi_ptr, sq_ptr,
    N, F,
    stride_hn, stride_hf, stride_pn, stride_pf,
    BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr,
):  # fmt: skip
    # One program per BLOCK_R rows, over all F columns in BLOCK_F steps, so the row sums need no atomics:
    # elementwise fp32 accumulators, reduced once after the loop (as lrmoe_kernels.scoring's row norms).
    r_R = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok_R = r_R < N
    r64_R = r_R.to(tl.int64)[:, None]
    h_dtype = h_ptr.dtype.element_ty
    sq_RF = tl.zeros((BLOCK_R, BLOCK_F), dtype=tl.float32)
    for f0 in range(0, F, BLOCK_F):
        f_F = f0 + tl.arange(0, BLOCK_F)
        mask_RF = r_ok_R[:, None] & (f_F < F)[None, :]
        gate_ptr = h_ptr + r64_R * stride_hn + f_F[None, :] * stride_hf
        gate = tl.load(gate_ptr, mask=mask_RF, other=0.0).to(tl.float32)
        up = tl.load(gate_ptr + F * stride_hf, mask=mask_RF, other=0.0).to(tl.float32)
        phi = _phi(gate, up, h_dtype)
        tl.store(phi_ptr + r64_R * stride_pn + f_F[None, :] * stride_pf, phi, mask=mask_RF)
        phi32 = phi.to(tl.float32)  # masked lanes: phi of zeros is zero, adding nothing
        sq_RF += phi32 * phi32
    tl.store(sq_ptr + r_R, tl.sum(sq_RF, axis=1), mask=r_ok_R)


def _blocks(F: int) -> dict:
    """GPU: 8 rows x up to 256 columns, 4 warps: 16 elements of each of the five [R, F] tiles per thread. A first
    choice, not swept. Interpreter: small, so test shapes cross tiles and masked edges."""
    if interpreting():
        return {"BLOCK_R": 4, "BLOCK_F": 8, "num_warps": 1}
    return {"BLOCK_R": 8, "BLOCK_F": min(triton.next_power_of_2(max(F, 1)), 256), "num_warps": 4}


def _sqnorm_blocks(F: int) -> dict:
    """GPU: 4 rows x up to 256 columns a step, 4 warps (as _blocks, half the rows: each program loops over F).
    A first choice, not swept. Interpreter: small, so test shapes cross tiles, steps and masked edges."""
    if interpreting():
        return {"BLOCK_R": 4, "BLOCK_F": 8, "num_warps": 1}
    return {"BLOCK_R": 4, "BLOCK_F": min(triton.next_power_of_2(max(F, 1)), 256), "num_warps": 4}


def swiglu_sqnorm_triton(h_N2F: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(phi_NF in h's dtype, phi_sq_N fp32); see the module docstring. CUDA tensors (CPU ones under
    TRITON_INTERPRET=1); nothing is checked here (lrmoe.ops.swiglu does that). No host sync."""
    N, F2 = h_N2F.shape
    F = F2 // 2
    phi_NF = torch.empty((N, F), dtype=h_N2F.dtype, device=h_N2F.device)
    sq_N = torch.empty((N,), dtype=torch.float32, device=h_N2F.device)
    if known_empty(N):
        return phi_NF, sq_N
    cfg = _sqnorm_blocks(F)
    launch(_swiglu_sqnorm_kernel, (triton.cdiv(N, cfg["BLOCK_R"]),))(
        h_N2F, phi_NF, sq_N, N, F, *h_N2F.stride(), *phi_NF.stride(), **cfg,
    )  # fmt: skip
    return phi_NF, sq_N


def swiglu_backward_triton(
    h_N2F: torch.Tensor, rows_R: torch.Tensor | None, dphi_RF: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dh_R2F, phi_RF) in h's dtype; see the module docstring. CUDA tensors (CPU ones under TRITON_INTERPRET=1);
    neither devices nor shapes are checked here (lrmoe.ops.swiglu does that). No host sync."""
    N, F2 = h_N2F.shape
    F = F2 // 2
    R = dphi_RF.shape[0]
    rows_R = None if rows_R is None else rows_R.contiguous()  # read as a flat array
    dh_R2F = torch.empty((R, F2), dtype=h_N2F.dtype, device=h_N2F.device)
    phi_RF = torch.empty((R, F), dtype=h_N2F.dtype, device=h_N2F.device)
    if known_empty(R, F):
        return dh_R2F, phi_RF
    cfg = _blocks(F)
    grid = (triton.cdiv(R, cfg["BLOCK_R"]), triton.cdiv(F, cfg["BLOCK_F"]))
    launch(_swiglu_backward_kernel, grid)(
        h_N2F, h_N2F if rows_R is None else rows_R, dphi_RF, dh_R2F, phi_RF,
        R, N, F,
        *h_N2F.stride(), *dphi_RF.stride(), *dh_R2F.stride(), *phi_RF.stride(),
        HAS_ROWS=rows_R is not None, **cfg,
    )  # fmt: skip
    return dh_R2F, phi_RF


def swiglu_backward_scaled_triton(
    h_N2F: torch.Tensor, rows_R: torch.Tensor | None, dphi_RF: torch.Tensor, coef_R: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dh_R2F, cphi_RF in h's dtype, dot_R fp32); see the module docstring. CUDA tensors (CPU ones under
    TRITON_INTERPRET=1); nothing is checked here (lrmoe.ops.swiglu does that). No host sync."""
    N, F2 = h_N2F.shape
    F = F2 // 2
    R = dphi_RF.shape[0]
    rows_R = None if rows_R is None else rows_R.contiguous()  # read as a flat array
    dh_R2F = torch.empty((R, F2), dtype=h_N2F.dtype, device=h_N2F.device)
    cphi_RF = torch.empty((R, F), dtype=h_N2F.dtype, device=h_N2F.device)
    dot_R = torch.zeros((R,), dtype=torch.float32, device=h_N2F.device)
    if known_empty(R):
        return dh_R2F, cphi_RF, dot_R
    cfg = _sqnorm_blocks(F)  # rows of a program loop over F, as the forward's row norms
    launch(_swiglu_backward_scaled_kernel, (triton.cdiv(R, cfg["BLOCK_R"]),))(
        h_N2F, h_N2F if rows_R is None else rows_R, dphi_RF, coef_R.contiguous(), dh_R2F, cphi_RF, dot_R,
        R, N, F,
        *h_N2F.stride(), *dphi_RF.stride(), *dh_R2F.stride(), *cphi_RF.stride(),
        HAS_ROWS=rows_R is not None, **cfg,
    )  # fmt: skip
    return dh_R2F, cphi_RF, dot_R


def swiglu_dot_triton(h_N2F: torch.Tensor, rows_R: torch.Tensor | None, dphi_RF: torch.Tensor,
                      src_is_phi: bool = False) -> torch.Tensor:
    """dot_R fp32; see the module docstring (``h_N2F`` is phi [N, F] with ``src_is_phi``). CUDA tensors (CPU
    ones under TRITON_INTERPRET=1); nothing is checked here (lrmoe.ops.swiglu does that). No host sync."""
    N = h_N2F.shape[0]
    F = dphi_RF.shape[1]
    R = dphi_RF.shape[0]
    rows_R = None if rows_R is None else rows_R.contiguous()  # read as a flat array
    dot_R = torch.zeros((R,), dtype=torch.float32, device=h_N2F.device)
    if known_empty(R):
        return dot_R
    cfg = _sqnorm_blocks(F)
    launch(_swiglu_dot_kernel, (triton.cdiv(R, cfg["BLOCK_R"]),))(
        h_N2F, h_N2F if rows_R is None else rows_R, dphi_RF, dot_R,
        R, N, F,
        *h_N2F.stride(), *dphi_RF.stride(),
        HAS_ROWS=rows_R is not None, IS_PHI=src_is_phi, **cfg,
    )  # fmt: skip
    return dot_R
