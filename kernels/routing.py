"""The router's choice of experts: the K largest entries of each row, as ids (the kernel behind ``lrmoe::topk_ids``).

Shapes: T tokens (rows), E experts (columns), K chosen per row.

Each program holds BLOCK_T whole rows in registers. An entry becomes one int64 key that orders like a stable
descending sort: the high 32 bits an order-preserving integer form of the value (-0.0 read as +0.0, every NaN above
+inf), the low 32 bits BLOCK_E - 1 - column, so that of equal values the lower column is larger. K rounds then take
each row's largest key, store its column and knock it out. Keys are distinct within a row, so a round removes
exactly one entry.

Rows per program: 1024 entries a program (8 rows at E = 128). Measured on one H200 (K = 8, fp32,
graph method of benchmarks/single_kernels.py topk): T = 8192, E = 128: 9.5 us against 11.0 with 32 rows a program and 58.1
for torch.topk; E = 256: 17.8 (4 rows) against 104.7; T = 32768, E = 128: 29.7 against 207.5. In the compiled
Qwen3 layer (retain 0.75, 32 rows a program) the step's GPU time went from 3.848 to 3.794 ms.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import known_empty, launch

__all__ = ["MAX_COLUMNS", "topk_ids_triton"]

# Rows wider than this go to the reference (a sort): a program holds BLOCK_T x BLOCK_E int64 keys in registers.
MAX_COLUMNS = 4096


@triton.jit
def _topk_ids_kernel(x_ptr, ids_ptr, T, E, stride_t, stride_e,
                     K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):  # fmt: skip
    t_T = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    e_E = tl.arange(0, BLOCK_E)
    ok_T = t_T < T
    ok_TE = ok_T[:, None] & (e_E < E)[None, :]
    t64_T = t_T.to(tl.int64)
    x_TE = tl.load(x_ptr + t64_T[:, None] * stride_t + e_E[None, :] * stride_e, mask=ok_TE, other=0.0)
    x_TE = x_TE.to(tl.float32)
    x_TE = tl.where(x_TE == 0.0, 0.0, x_TE)  # -0.0 == +0.0: equal values, one key
    bits_TE = x_TE.to(tl.int32, bitcast=True)
    # Signed int32 order = float order: non-negative floats already are; negative ones flip their magnitude bits.
    key_TE = tl.where(bits_TE < 0, bits_TE ^ 0x7FFFFFFF, bits_TE)
    key_TE = tl.where(x_TE != x_TE, 0x7FFFFFFF, key_TE)  # NaN: above +inf (0x7F800000), as torch.sort puts it
    low_TE = (BLOCK_E - 1 - e_E).to(tl.int64)[None, :]
    comb_TE = (key_TE.to(tl.int64) << 32) | low_TE
    lowest: tl.constexpr = -(2**63)
    comb_TE = tl.where(ok_TE, comb_TE, lowest)  # padding columns: below every real key
    for k in tl.static_range(K):
        best_T = tl.max(comb_TE, axis=1)
        col_T = (BLOCK_E - 1) - (best_T & 0xFFFFFFFF)
        tl.store(ids_ptr + t64_T * K + k, col_T, mask=ok_T)
        comb_TE = tl.where(comb_TE == best_T[:, None], lowest, comb_TE)


def topk_ids_triton(x_TE: torch.Tensor, k: int, *, block_t: int | None = None) -> torch.Tensor:
    """int64 [T, k]: the columns of each row's k largest entries, largest first, ties to the lower column, -0.0 equal
    to +0.0, NaN largest (a stable descending sort's first k). x: fp32/fp16/bf16, any strides, E <= MAX_COLUMNS,
    1 <= k <= E (checked by the caller). ``block_t`` (a power of two) overrides the rows per program, for tuning.
    No host sync."""
    T, E = x_TE.shape
    ids_TK = torch.empty((T, k), dtype=torch.int64, device=x_TE.device)
    if known_empty(T, k):
        return ids_TK
    block_e = triton.next_power_of_2(E)
    rows = T if isinstance(T, int) else 32  # a symbolic T (under torch.compile): no guard on it
    block_t = block_t or max(1, min(1024 // block_e, triton.next_power_of_2(max(rows, 1))))
    launch(_topk_ids_kernel, (triton.cdiv(T, block_t),))(
        x_TE, ids_TK, T, E, x_TE.stride(0), x_TE.stride(1), K=k, BLOCK_T=block_t, BLOCK_E=block_e, num_warps=4
    )
    return ids_TK
