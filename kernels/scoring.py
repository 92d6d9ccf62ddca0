"""Per-pair backward scores in one pass over the output gradient (the kernel behind ``lrmoe::score_pairs``).

Shapes: T tokens, K top-k, D model dim.

For metric "lrm" the score of pair (t, k) is alpha_tk^2 * ||g_t||^2 * phi_sq_tk; "grad_l2" drops phi_sq;
"grad_abs" is |alpha_tk| * ||g_t||_1 (docs/design.md, 'The metric'). Any non-finite gate, phi_sq, token norm or
product gives +inf, exactly like the reference in lrmoe.ops.scoring, so a diverging pair is always kept.

The work is memory-bound: g [T, D] is T*D elements against T*K of everything else, so each program reads a block
of whole token rows of g exactly once (both norms from the same loads), then its pairs' gates and phi_sq, and
writes its pairs' fp32 scores. Everything is accumulated in fp32 whatever the input dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import known_empty, launch

__all__ = ["METRIC_IDS", "score_pairs_triton"]

# The deterministic metrics, as the kernel's constexpr METRIC ("random" never reaches a kernel).
METRIC_IDS = {"lrm": 0, "grad_l2": 1, "grad_abs": 2}


@triton.jit
def _is_finite(x):
    return tl.abs(x) < float("inf")  # false for +-inf and for NaN (every comparison with NaN is false)


@triton.jit
def _pair_scores(a, phi, g_sq, g_abs, METRIC: tl.constexpr):
    """Pair scores from gates ``a``, phi_sq ``phi`` and their tokens' ||g||^2, ||g||_1 (fp32 blocks that broadcast
    together), +inf where a gate, phi_sq, ||g||^2 or the product is not finite; the reference's operation order,
    so the products round alike given the same norms. Both kernels that score pairs use it."""
    if METRIC == 0:
        s = a * a * g_sq * phi
    elif METRIC == 1:
        s = a * a * g_sq
    else:
        s = tl.abs(a) * g_abs
    ok = _is_finite(s) & _is_finite(a) & _is_finite(phi) & _is_finite(g_sq)
    return tl.where(ok, s, float("inf"))


@triton.jit
def _row_norms(row_T, ok_T, D, stride_d, METRIC: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """(sum of squares, sum of absolute values for METRIC 2 ("grad_abs") or 0) over the D columns of BLOCK_T rows
    starting at the pointers row_T, in fp32, in one pass: elementwise fp32 accumulators, reduced once after the loop
    (fewer cross-lane reductions than reducing every chunk). Masked lanes load 0 and add nothing; NaN/inf in any
    entry of a row makes its sums non-finite. For other metrics the second sum is of zeros, and compiles away when
    unused."""
    d_D = tl.arange(0, BLOCK_D)
    sq_TD = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    abs_TD = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        dd_D = d0 + d_D
        mask_TD = ok_T[:, None] & (dd_D < D)[None, :]
        ptr_TD = row_T[:, None] + dd_D[None, :] * stride_d  # stride_d == 1 specialises to vector loads
        x_TD = tl.load(ptr_TD, mask=mask_TD, other=0.0).to(tl.float32)
        sq_TD += x_TD * x_TD
        if METRIC == 2:
            abs_TD += tl.abs(x_TD)
    return tl.sum(sq_TD, axis=1), tl.sum(abs_TD, axis=1)


@triton.jit
def _score_pairs_kernel(
    gates_ptr,
    g_ptr,
    phi_ptr,
    out_ptr,
    T,
    K,
    D,
    stride_gates_t,
    stride_gates_k,
    stride_g_t,
    stride_g_d,
    stride_phi_t,
    stride_phi_k,
    METRIC: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    t_T = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok_T = t_T < T
    t64_T = t_T.to(tl.int64)  # row offsets in int64: T * D can pass 2^31 elements
    g_row_T = g_ptr + t64_T * stride_g_t

    g_sq_T, g_abs_T = _row_norms(g_row_T, t_ok_T, D, stride_g_d, METRIC, BLOCK_T, BLOCK_D)

    k_K = tl.arange(0, BLOCK_K)
    mask_TK = t_ok_T[:, None] & (k_K < K)[None, :]
    a_TK = tl.load(
        gates_ptr + t64_T[:, None] * stride_gates_t + k_K[None, :] * stride_gates_k, mask=mask_TK, other=0.0
    ).to(tl.float32)
    phi_TK = tl.load(
        phi_ptr + t64_T[:, None] * stride_phi_t + k_K[None, :] * stride_phi_k, mask=mask_TK, other=0.0
    ).to(tl.float32)

    s_TK = _pair_scores(a_TK, phi_TK, g_sq_T[:, None], g_abs_T[:, None], METRIC)
    tl.store(out_ptr + t64_T[:, None] * K + k_K[None, :], s_TK, mask=mask_TK)


def _block_sizes(T: int, K: int, D: int) -> tuple[int, int, int, int]:
    """(BLOCK_T, BLOCK_D, BLOCK_K, num_warps) for a [T, D] gradient and K pairs per token.

    BLOCK_D: up to 128 columns a step, BLOCK_T: rows per program so that a step moves 512 elements (4 rows of 128
    from D = 128 on, more rows for narrower D, at most 32), 4 warps: 4 elements per thread a step, a few registers,
    so many programs fit on an SM. T = 8192 launches 2048 programs, ~15 per SM on an H200's 132 SMs.
    Measured on one H200 (benchmarks/single_kernels.py scoring --sweep --methods graph, bf16, K = 8, metric lrm, 38
    block shapes): (4, 128, 4 warps) read g at 75 % / 82 % of the device copy bandwidth at T = 8192
    (D = 2048 / 4096) and 99 % / 101 % at T = 131072; the best shape per case reached 76 / 83 / 101 / 103 %, and
    (4, 512, 4 warps) 59 / 71 / 88 / 96 %. (16, 512, 4 warps) did as well as (4, 128) but holds
    16x the registers (two accumulators for grad_abs), so it was not taken. Timed with the inputs rotated through
    copies larger than the L2 inside one CUDA graph; do_bench's L2 flush made the same kernel at T = 8192 read 19
    to 39 us in different runs where the graph method gave 13.4-13.7 us.
    BLOCK_K: K rounded up to a power of two (Triton tiles are powers of two); the pair part is T*K elements,
    noise next to g.
    """
    block_d = min(triton.next_power_of_2(max(D, 1)), 128)
    rows = T if isinstance(T, int) else 32  # a symbolic T (under torch.compile): the cap, no guard on it
    block_t = max(1, min(32, 512 // block_d, triton.next_power_of_2(max(rows, 1))))
    block_k = triton.next_power_of_2(max(K, 1))
    return block_t, block_d, block_k, 4


def score_pairs_triton(
    gates_TK: torch.Tensor,
    grad_out_TD: torch.Tensor,
    phi_sqnorm_TK: torch.Tensor,
    metric: str,
    *,
    block_t: int | None = None,
    block_d: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Launch the scoring kernel: fp32 scores_TK for metric "lrm", "grad_l2" or "grad_abs".

    Inputs may be any float dtype and any strides (all three on the same device); shapes are not checked here
    (lrmoe.functional.score_pairs does that). ``block_t``, ``block_d``, ``num_warps`` override the defaults of
    ``_block_sizes`` (powers of two), for tuning.
    """
    if metric not in METRIC_IDS:
        raise ValueError(f"metric must be one of {', '.join(map(repr, METRIC_IDS))}; got {metric!r}")
    T, K = gates_TK.shape
    D = grad_out_TD.shape[1]
    scores_TK = torch.empty((T, K), dtype=torch.float32, device=gates_TK.device)
    if known_empty(T, K):
        return scores_TK
    bt, bd, bk, nw = _block_sizes(T, K, D)
    bt, bd, nw = block_t or bt, block_d or bd, num_warps or nw
    launch(_score_pairs_kernel, (triton.cdiv(T, bt),))(
        gates_TK,
        grad_out_TD,
        phi_sqnorm_TK,
        scores_TK,
        T,
        K,
        D,
        gates_TK.stride(0),
        gates_TK.stride(1),
        grad_out_TD.stride(0),
        grad_out_TD.stride(1),
        phi_sqnorm_TK.stride(0),
        phi_sqnorm_TK.stride(1),
        METRIC=METRIC_IDS[metric],
        BLOCK_T=bt,
        BLOCK_D=bd,
        BLOCK_K=bk,
        num_warps=nw,
    )
    return scores_TK
