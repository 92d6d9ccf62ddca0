"""Per-token reductions over K gathered rows (the kernels behind ``lrmoe::gather_sum_rows`` and
``lrmoe::gather_dot_rows``).

Shapes: N source rows, C columns, T tokens, K rows per token (top-k).

``gather_sum_rows_triton(src_NC, rows_TK, weights_TK | None) -> out_TC``
    out[t] = sum_k w[t, k] * src[rows[t, k]], accumulated in fp32, written in src's dtype; rows < 0 add nothing.
    Rows and weights may be [..., K]: out is then [..., C], allocated in that shape and written in place.
``gather_dot_rows_triton(src_NC, rows_TK, g_TC) -> out_TK``
    out[t, k] = <g[t], src[rows[t, k]]> in fp32; 0 where rows[t, k] < 0.
``gather_dot_scores_triton(src_NC, rows_TK, g_TC, gates_TK, phi_sq_TK, metric) -> (out_TK, scores_TK)``
    the same, plus each pair's backward score (lrmoe_kernels.scoring) from the norms of g[t] taken in the same
    pass: the router gradient and the pair scores read g once between them.

These are the three places where the MoE layer meets its token order: the forward's combine (src = the expert
outputs y in expert order, rows = where each (t, k) pair sits there, w = the gates), the router gradient (the same
rows against g) and the input gradient (src = the retained rows' dx, rows = each pair's slot, -1 if dropped). As
PyTorch they need the rows gathered into pair order first (an extra write and read of [T*K, C]) or an index_add
with atomics; here each program reads the K rows of one token straight from their source, once.

The work is bandwidth-bound: [T*K, C] elements read against [T, C] written. A gather_sum program owns one token
and BLOCK_C columns and loads its K rows as one [KP, BLOCK_C] tile (KP = K padded to a power of two); a
gather_dot program owns one token and sweeps the columns, so g[t] is read once. Offsets are int64: T*K*C passes
2^31 elements at large token counts.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from .launch import interpreting, known_empty, launch
from .scoring import METRIC_IDS, _pair_scores

__all__ = ["gather_dot_rows_triton", "gather_dot_scores_triton", "gather_sum_rows_triton"]



@triton.jit
def _gather_sum_rows_kernel(
    src_ptr, rows_ptr, w_ptr, out_ptr,
    C, K,
    stride_sn, stride_ot,
    HAS_W: tl.constexpr, KP: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    c_C = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok_C = c_C < C
    k_K = tl.arange(0, KP)
    k_ok_K = k_K < K
    row_K = tl.load(rows_ptr + t * K + k_K, mask=k_ok_K, other=-1).to(tl.int64)
    valid_K = row_K >= 0
    tile_KC = tl.load(src_ptr + row_K[:, None] * stride_sn + c_C[None, :], mask=valid_K[:, None] & c_ok_C[None, :],
                      other=0.0).to(tl.float32)
    if HAS_W:
        w_K = tl.load(w_ptr + t * K + k_K, mask=k_ok_K, other=0.0).to(tl.float32)
        tile_KC = tile_KC * w_K[:, None]
    out_C = tl.sum(tile_KC, axis=0)
    tl.store(out_ptr + t * stride_ot + c_C, out_C.to(out_ptr.dtype.element_ty), mask=c_ok_C)


@triton.jit
def _dots_and_norms(src_ptr, rows_ptr, g_ptr, t, C, K, stride_sn, stride_gt,
                    NORMS: tl.constexpr, KP: tl.constexpr, BLOCK_C: tl.constexpr):
    """One token's sweep over the columns: (<g[t], src[rows[t, k]]> for k < KP, ||g[t]||^2, ||g[t]||_1), fp32;
    the norms only for NORMS 1 (squares) or 2 (both), else zeros that compile away. Values only: no store address
    is built from what this returns (tests/ops/kernel_writes.py says why that matters)."""
    k_K = tl.arange(0, KP)
    row_K = tl.load(rows_ptr + t * K + k_K, mask=k_K < K, other=-1).to(tl.int64)
    valid_K = row_K >= 0
    acc_KC = tl.zeros((KP, BLOCK_C), dtype=tl.float32)
    sq_C = tl.zeros((BLOCK_C,), dtype=tl.float32)
    abs_C = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for c0 in range(0, C, BLOCK_C):
        c_C = c0 + tl.arange(0, BLOCK_C)
        c_ok_C = c_C < C
        g_C = tl.load(g_ptr + t * stride_gt + c_C, mask=c_ok_C, other=0.0).to(tl.float32)
        tile_KC = tl.load(src_ptr + row_K[:, None] * stride_sn + c_C[None, :],
                          mask=valid_K[:, None] & c_ok_C[None, :], other=0.0).to(tl.float32)
        acc_KC += tile_KC * g_C[None, :]
        if NORMS >= 1:
            sq_C += g_C * g_C
        if NORMS == 2:
            abs_C += tl.abs(g_C)
    return tl.sum(acc_KC, axis=1), tl.sum(sq_C, axis=0), tl.sum(abs_C, axis=0)


@triton.jit
def _gather_dot_rows_kernel(
    src_ptr, rows_ptr, g_ptr, out_ptr,
    C, K,
    stride_sn, stride_gt,
    KP: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    k_K = tl.arange(0, KP)
    dots_K, _, _ = _dots_and_norms(src_ptr, rows_ptr, g_ptr, t, C, K, stride_sn, stride_gt, 0, KP, BLOCK_C)
    tl.store(out_ptr + t * K + k_K, dots_K, mask=k_K < K)


@triton.jit
def _gather_dot_scores_kernel(
    src_ptr, rows_ptr, g_ptr, gates_ptr, phi_ptr, out_ptr, score_ptr,
    C, K,
    stride_sn, stride_gt,
    METRIC: tl.constexpr, NORMS: tl.constexpr, KP: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """_gather_dot_rows_kernel plus each pair's score from the same pass over g (lrmoe_kernels.scoring's rules:
    METRIC 0 "lrm", 1 "grad_l2", 2 "grad_abs", NORMS 2 for "grad_abs" else 1; a non-finite gate, phi_sq, norm or
    product gives +inf). gates and phi_sq are [T, K] and contiguous."""
    t = tl.program_id(0).to(tl.int64)
    k_K = tl.arange(0, KP)
    k_ok_K = k_K < K
    # Loaded before the sweep over g, so their latency hides behind it rather than adding to every program's tail.
    a_K = tl.load(gates_ptr + t * K + k_K, mask=k_ok_K, other=0.0).to(tl.float32)
    phi_K = tl.load(phi_ptr + t * K + k_K, mask=k_ok_K, other=0.0).to(tl.float32)
    dots_K, g_sq, g_abs = _dots_and_norms(src_ptr, rows_ptr, g_ptr, t, C, K, stride_sn, stride_gt, NORMS, KP,
                                          BLOCK_C)
    tl.store(out_ptr + t * K + k_K, dots_K, mask=k_ok_K)
    zeros_K = tl.zeros((KP,), dtype=tl.float32)  # the token's norms as blocks, one per pair
    s_K = _pair_scores(a_K, phi_K, zeros_K + g_sq, zeros_K + g_abs, METRIC)
    tl.store(score_ptr + t * K + k_K, s_K, mask=k_ok_K)


def _check(src_NC: torch.Tensor, rows_TK: torch.Tensor) -> None:
    if src_NC.dim() != 2 or rows_TK.dim() != 2:
        raise ValueError(f"src_NC must be 2-D and rows_TK 2-D, got shapes {tuple(src_NC.shape)} and "
                         f"{tuple(rows_TK.shape)}")


def _block_c(n_cols: int, elem_bytes: int, kp: int, tile_bytes: int) -> int:
    """Columns per program (or per step): a [KP, BLOCK_C] tile of about ``tile_bytes`` on a GPU; small under the
    interpreter, so the tests' odd shapes cross several blocks and masked edges."""
    if interpreting():
        return 8
    return max(16, min(triton.next_power_of_2(max(n_cols, 1)), tile_bytes // (kp * elem_bytes)))


def gather_sum_rows_triton(src_NC: torch.Tensor, rows_TK: torch.Tensor, weights_TK: torch.Tensor | None, *,
                           block_c: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """out_TC[t] = sum_k weights[t, k] * src[rows[t, k]] (fp32 accumulation, src's dtype); rows < 0 skipped.
    Rows (and weights) [..., K] give out [..., C]: the tokens are the leading dims, in row-major order, and out is
    allocated in that shape, so the caller gets a tensor of its own, not a view (the kernel writes it as [T, C]:
    it is contiguous). ``block_c``, ``num_warps`` override the defaults, for tuning (benchmarks/single_kernels.py
    token-rows)."""
    if src_NC.dim() != 2 or rows_TK.dim() < 1:
        raise ValueError(f"src_NC must be 2-D and rows_TK [..., K], got shapes {tuple(src_NC.shape)} and "
                         f"{tuple(rows_TK.shape)}")
    *lead, top_k = rows_TK.shape
    n_tok = 1
    for size in lead:  # not numel() // K: K may be 0
        n_tok = n_tok * size
    n_cols = src_NC.shape[1]
    out = torch.empty(*lead, n_cols, dtype=src_NC.dtype, device=src_NC.device)
    if known_empty(n_tok, n_cols):
        return out
    src_NC = src_NC if src_NC.stride(1) == 1 else src_NC.contiguous()
    rows_TK = rows_TK.contiguous()
    w_TK = rows_TK if weights_TK is None else weights_TK.contiguous()  # rows: an unused stand-in pointer
    kp = triton.next_power_of_2(max(top_k, 1))
    # GPU: 16 KiB tiles, 4 warps: within 3 % of the best of 12 shapes at D = 2,048 and 4,096 (benchmarks/
    # single_kernels.py token-rows --sweep; 0.85 / 0.90 of a clone of y's bandwidth).
    block_c = block_c or _block_c(n_cols, src_NC.element_size(), kp, 16384)
    grid = (n_tok, triton.cdiv(n_cols, block_c))
    launch(_gather_sum_rows_kernel, grid)(
        src_NC, rows_TK, w_TK, out,  # rows, w, out contiguous: token t's at t * K, t * C
        n_cols, top_k,
        src_NC.stride(0), n_cols,
        HAS_W=weights_TK is not None, KP=kp, BLOCK_C=block_c, num_warps=num_warps or (1 if interpreting() else 4),
    )  # fmt: skip
    return out


def gather_dot_rows_triton(src_NC: torch.Tensor, rows_TK: torch.Tensor, g_TC: torch.Tensor, *,
                           block_c: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """out_TK[t, k] = <g[t], src[rows[t, k]]> in fp32; 0 where rows < 0. ``block_c``, ``num_warps`` override the
    defaults, for tuning (benchmarks/single_kernels.py token-rows)."""
    _check(src_NC, rows_TK)
    n_tok, top_k = rows_TK.shape
    out_TK = torch.empty(n_tok, top_k, dtype=torch.float32, device=src_NC.device)
    if known_empty(n_tok, top_k):
        return out_TK
    src_NC = src_NC if src_NC.stride(1) == 1 else src_NC.contiguous()
    g_TC = g_TC if g_TC.stride(1) == 1 else g_TC.contiguous()
    rows_TK = rows_TK.contiguous()
    kp = triton.next_power_of_2(max(top_k, 1))
    # GPU: 16 KiB tiles over 2 warps (at K = 8, bf16: 1,024 columns, 128 fp32 accumulators a thread). Measured on
    # one H200 (benchmarks/single_kernels.py token-rows --sweep, T = 8192, K = 8): the best of 12 shapes at D = 2,048 and
    # 4,096, 85.7 / 151.9 us against 102.3 / 184.4 for 8 KiB, 4-warp tiles (0.85 / 0.95 of a clone of y's
    # bandwidth).
    block_c = block_c or _block_c(src_NC.shape[1], src_NC.element_size(), kp, 16384)
    launch(_gather_dot_rows_kernel, (n_tok,))(
        src_NC, rows_TK, g_TC, out_TK,
        src_NC.shape[1], top_k,
        src_NC.stride(0), g_TC.stride(0),
        KP=kp, BLOCK_C=block_c, num_warps=num_warps or (1 if interpreting() else 2),
    )  # fmt: skip
    return out_TK


def gather_dot_scores_triton(src_NC: torch.Tensor, rows_TK: torch.Tensor, g_TC: torch.Tensor, gates_TK: torch.Tensor,
                             phi_sq_TK: torch.Tensor, metric: str, *, block_c: int | None = None,
                             num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(gather_dot_rows_triton's out_TK, the pairs' fp32 scores as lrmoe_kernels.scoring computes them for a
    deterministic ``metric``) from one pass over g: the router gradient and the scores of the selective backward,
    which both read all of g. ``block_c``, ``num_warps`` as in gather_dot_rows_triton (other defaults, below)."""
    if metric not in METRIC_IDS:
        raise ValueError(f"metric must be one of {', '.join(map(repr, METRIC_IDS))}; got {metric!r}")
    _check(src_NC, rows_TK)
    n_tok, top_k = rows_TK.shape
    out_TK = torch.empty(n_tok, top_k, dtype=torch.float32, device=src_NC.device)
    scores_TK = torch.empty(n_tok, top_k, dtype=torch.float32, device=src_NC.device)
    if known_empty(n_tok, top_k):
        return out_TK, scores_TK
    src_NC = src_NC if src_NC.stride(1) == 1 else src_NC.contiguous()
    g_TC = g_TC if g_TC.stride(1) == 1 else g_TC.contiguous()
    rows_TK, gates_TK, phi_sq_TK = rows_TK.contiguous(), gates_TK.contiguous(), phi_sq_TK.contiguous()
    kp = triton.next_power_of_2(max(top_k, 1))
    # GPU: 8 KiB tiles (512 columns at K 8 in bf16), 2 warps, half of gather_dot_rows' tile. Measured (one H200,
    # benchmarks/single_kernels.py token-rows --sweep, 12 shapes): 0.90 / 0.99 of a clone's bandwidth at D = 2,048 /
    # 4,096 against 0.83 / 0.95 with 16 KiB; the next best, 16 KiB with 4 warps, 0.88 / 0.98 (gather_dot_rows
    # itself is best at 16 KiB, 2 warps). sm_90 registers at the Qwen3 shape: 120 a thread here, 234 with 16 KiB.
    block_c = block_c or _block_c(src_NC.shape[1], src_NC.element_size(), kp, 8192)
    launch(_gather_dot_scores_kernel, (n_tok,))(
        src_NC, rows_TK, g_TC, gates_TK, phi_sq_TK, out_TK, scores_TK,
        src_NC.shape[1], top_k,
        src_NC.stride(0), g_TC.stride(0),
        METRIC=METRIC_IDS[metric], NORMS=2 if metric == "grad_abs" else 1, KP=kp, BLOCK_C=block_c,
        num_warps=num_warps or (1 if interpreting() else 2),
    )  # fmt: skip
    return out_TK, scores_TK
