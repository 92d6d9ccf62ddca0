"""Triton kernels for lrmoe's grouped GEMMs, with the row gather fused into the operand load.

Shapes: N source rows, R buffer rows, E experts (groups), O output features, I input features. A group e holds
buffer rows [offsets[e-1], offsets[e]) (offsets are int32 cumulative ends, nondecreasing, clipped to R).

``gather_grouped_mm_triton(x_NI, weight_EOI, rows_R, offsets_E) -> y_RO``
    y[i] = weight[e(i)] @ x[rows[i]] for i < offsets[-1]; y[i] = 0 after (rows there may be -1).
``grouped_outer_triton(a_RO, b_NI, rows_R, offsets_E) -> w_EOI``
    w[e] = sum over i in group e of outer(a[i], b[rows[i]]) (the weight gradient); empty groups give zeros.
``zero_rows_past_last_offset_(y_RO, offsets_E) -> y_RO``
    y[i] = 0 for i >= offsets[-1], in place: what torch._grouped_mm leaves uninitialised, at the cost of the
    tail's bytes instead of a full masked pass over y.

Same contracts as the CPU reference in lrmoe/ops/grouped_gemm.py. fp32 accumulation (fp64 for fp64 inputs); the
output has the input's dtype. Any strides (a transposed weight view is read in place).

No host synchronisation: the launchers never read offsets on the host, and grid sizes come from static shapes
only. gather_grouped_mm launches cdiv(R, BLOCK_M) + E row tiles (an upper bound on the tiles the groups plus the
zero tail can need, whatever the group sizes) times cdiv(O, BLOCK_N) column tiles; each program finds its
(group, tile) from the offsets in the kernel and exits when it has none. grouped_outer launches one program per
(expert, output tile) and loops over its group's rows, a loop whose trip count is read on the device.

Under the Triton interpreter (TRITON_INTERPRET=1, CPU tensors: how the tests run without a GPU) the block sizes
are fixed and small, and loaded tiles are upcast to fp32 before tl.dot, because the interpreter's tl.dot on bf16
operands multiplies raw bit patterns and returns garbage without an error. On a GPU the tiles stay bf16 so Hopper
runs them on the tensor cores (wgmma), and a small autotune set keyed on (O, I, dtype) picks the blocks.

Operands: gathered rows come through pointer loads, software-pipelined by Triton with cp.async (Hopper's TMA
cannot gather rows; Blackwell's gather4 can). gather_grouped_mm reads a 16-bit weight through a 3-D TMA
descriptor (either layout: the forward's [E, O, I] and the input gradient's transposed view), which on one H200
took it from 0.84-0.95 to 0.90-1.01 of torch._grouped_mm on pre-gathered rows (docs/performance.md). Descriptors
only on a GPU with TMA (compute capability 9.0 on); elsewhere the pointer path. grouped_outer reads a 16-bit a_RO
(the weight gradient's contiguous operand) through a ragged TMA descriptor (triton.tools.ragged_tma: the group's
rows as a slice, zeros past its end) with its own config list: 0.79-0.85 of torch._grouped_mm on pre-gathered rows
where its pointer path ran at 0.71-0.76. Compiled for sm_90 (`python tests/kernels/sm90_compile.py --resources`),
every GPU config of both kernels fits without spilling (bf16: 108-234 registers, no stack).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .launch import interpreting, known_empty, launch, tracing

try:  # Triton >= 3.5: TMA over a slice of rows, zero past its end (the weight gradient's groups)
    from triton.tools.ragged_tma import create_ragged_descriptor, load_ragged
except ImportError:  # pragma: no cover - older Triton: grouped_outer reads a_RO by pointers
    create_ragged_descriptor = load_ragged = None

__all__ = [
    "gather_grouped_mm_triton",
    "grouped_outer_triton",
    "zero_rows_past_last_offset_",
]



# ----------------------------------------------------------------------------------------------- launch configs


def _interpreter_config() -> dict:
    """Fixed blocks for the interpreter: small enough that odd test shapes cross several tiles and masked edges,
    large enough that the (Python-speed) interpreter runs few programs."""
    return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32)


# Small or fp32 problems (see _prune_small); last in every GPU config list.
_SMALL_CONFIG = triton.Config(dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32), num_warps=4, num_stages=3)


def _gpu_configs() -> list[triton.Config]:
    """Candidate blocks for gather_grouped_mm on Hopper (BLOCK_M x BLOCK_N output tile, BLOCK_K deep): 128 rows x 256
    columns with 8 warps feeds wgmma; 3-4 stages keep the shared memory under the H200's 227 KiB per block
    ((BM + BN) * BK * 2 bytes a stage in bf16; 5 stages of 64 overflow). Measured (one H200, 65,536 rows, E = 128,
    bf16, the Qwen3 and GLM shapes balanced and skewed; benchmarks/gemm.py grouped --configs, docs/performance.md):
    128 x 256 x 64 was the best config or within 6 % of it in every case; 128 x 128 x 64 trailed by 8-34 %, 64-row
    and 128-deep tiles further still. 256 x 128 x 64 matched
    128 x 256 on balanced groups but fell to 0.55-0.70 of it on skewed ones (a 256-row tile spends most of its rows
    on padding past small groups), and the autotuner keys on (O, I) only, so a balanced first call would keep it
    for skewed steps (seen at the GLM down shape: 0.60 of torch._grouped_mm): it is not a candidate."""
    return [
        triton.Config(dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64), num_warps=8, num_stages=3),
        triton.Config(dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64), num_warps=8, num_stages=4),
        triton.Config(dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64), num_warps=8, num_stages=4),
        _SMALL_CONFIG,
    ]


def _outer_gpu_configs() -> list[triton.Config]:
    """Candidate blocks for grouped_outer, whose reduction runs over one group's rows (~R / E of them, 512 at the
    target shapes): with so short a K loop, each tile's pipeline fill and its L2 reads of the two operands weigh more
    than in gather_grouped_mm, and shallow K blocks with deep pipelines win. Measured (same problems; BLOCK_M here
    runs over the output's O, not over rows, so skew does not waste it): the best of these ran at 0.76-0.99 of
    torch._grouped_mm on pre-gathered rows, 11-20 % faster than 64-deep K blocks; 256 x 128 x 32 with 5 or 6
    stages led, 4 stages lost ~30 %; 128 x 128 x 32 with 4 warps was as good in some Qwen3 cases."""
    return [
        triton.Config(dict(BLOCK_M=256, BLOCK_N=128, BLOCK_K=32), num_warps=8, num_stages=6),
        triton.Config(dict(BLOCK_M=256, BLOCK_N=128, BLOCK_K=32), num_warps=8, num_stages=5),
        triton.Config(dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32), num_warps=4, num_stages=6),
        _SMALL_CONFIG,
    ]


def _outer_tma_gpu_configs() -> list[triton.Config]:
    """Candidate blocks for grouped_outer with a_RO read through a ragged TMA descriptor (_a_operand). Measured
    (one H200, 65,536 rows, E = 128, bf16, Qwen3 and GLM-4.5-Air up and down, balanced and
    router-like groups, 14 configs, docs/performance.md): 128 x 128 x 64 with 4 warps and 3 stages was
    the best at 6 of the 8 problems (0.80-0.85 of torch._grouped_mm on pre-gathered rows, where the pointer path's
    configs reached 0.71-0.76), 128 x 128 x 32 with 6 stages at the other two (0.80-0.82); 8 warps, 256-wide and
    128-deep tiles lost 5-50 %."""
    return [
        triton.Config(dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64), num_warps=4, num_stages=3),
        triton.Config(dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32), num_warps=4, num_stages=6),
        triton.Config(dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64), num_warps=4, num_stages=4),
        _SMALL_CONFIG,
    ]


def _prune_small(configs, named_args, **kwargs):
    """Problems narrower than 128 in O or I (tests, toy models) get the smallest config only: nothing to tune,
    and every extra config is a compile. fp32 and fp64 get it too: the bf16 configs' shared memory would overflow
    (fp32 runs on the CUDA cores anyway unless TF32 is on). The autotuner still times that one config once per
    key."""
    small = min(named_args["O"], named_args["I"]) < 128
    wide_dtype = named_args["dtype_bytes"] > 2
    if small or wide_dtype:
        return [min(configs, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] * c.kwargs["BLOCK_K"])]
    return configs


def _set_desc_blocks(nargs: dict) -> None:
    """A config's pre_hook (and the launchers' when they pass blocks themselves): the TMA descriptors' block
    shape for this launch's blocks: gather_grouped_mm's weight ``w`` (B_DESC 1: [E, O, I], blocks [1,
    BLOCK_N, BLOCK_K]; 2: its transpose, [1, BLOCK_K, BLOCK_N]); grouped_outer's ragged ``a_desc`` ([1, 1,
    BLOCK_K, BLOCK_M]). An operand passed as a tensor is left."""
    if isinstance(w := nargs.get("w"), TensorDescriptor):
        bn, bk = nargs["BLOCK_N"], nargs["BLOCK_K"]
        w.block_shape = [1, bn, bk] if nargs["B_DESC"] == 1 else [1, bk, bn]
    if isinstance(a := nargs.get("a_desc"), TensorDescriptor):
        a.block_shape = [1, 1, nargs["BLOCK_K"], nargs["BLOCK_M"]]


def _with_config(kernel, configs, key=("O", "I"), prune=_prune_small):
    """The interpreter runs the bare kernel with _interpreter_config(); a GPU autotunes over ``configs``, keyed on
    ``key`` (the problem's widths) plus the argument dtypes (Triton's autotuner appends those), never on R, which
    changes per step. Each config sets the TMA descriptor's blocks before its launch (_set_desc_blocks; a no-op for
    grouped_outer)."""
    if interpreting():
        return kernel
    configs = [triton.Config(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages, pre_hook=_set_desc_blocks)
               for c in configs]
    return triton.autotune(configs=configs, key=list(key), prune_configs_by=dict(early_config_prune=prune))(kernel)


def _kernel_and_blocks(tuned, bare, config: triton.Config | None) -> tuple:
    """(kernel, launch kwargs) for a launcher: ``config`` given, the bare kernel with its blocks (and, on a GPU, its
    warps and stages), for benchmarks that time one config; else the interpreter's fixed blocks or the autotuner."""
    if config is not None:
        extra = {} if interpreting() else dict(num_warps=config.num_warps, num_stages=config.num_stages)
        return bare, {**config.kwargs, **extra}
    return tuned, _interpreter_config() if interpreting() else {}


def _dot_flags(dtype: torch.dtype) -> dict:
    """Constexprs for tl.dot: UPCAST (interpreter only, see the module docstring), the accumulator dtype, and the
    fp32 input precision, which follows torch's own switch so the kernel rounds like torch.matmul would."""
    fp32_tf32 = dtype == torch.float32 and not interpreting() and torch.backends.cuda.matmul.allow_tf32
    return dict(
        UPCAST=interpreting() and dtype in (torch.bfloat16, torch.float16),
        ACC_FP64=dtype == torch.float64,
        INPUT_PRECISION="tf32" if fp32_tf32 or dtype in (torch.bfloat16, torch.float16) else "ieee",
    )


def _check_device(*tensors: torch.Tensor) -> None:
    if not interpreting() and any(t.device.type != "cuda" for t in tensors):
        raise ValueError("the Triton grouped GEMMs need CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors)")


# ------------------------------------------------------------------------------------------- gather_grouped_mm


@triton.jit
def _tile(offsets_ptr, R, E, n_cols, G_POW2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(group, rows, row mask, columns) of this program's output tile in a grouped GEMM over R buffer rows.

    Column tiles vary fastest: the cdiv(n_cols, BLOCK_N) programs of one row tile run side by side and share its
    gathered x rows in L2, and one expert's weight (3-11 MiB at the target shapes) stays in the 60 MB L2 while all
    its row tiles pass.
    """
    pid = tl.program_id(0)
    num_n = tl.cdiv(n_cols, BLOCK_N)
    pid_m = pid // num_n
    offs_n = (pid % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    # Groups 0..E-1 are the experts; group E is the tail [offsets[-1], R), whose rows get zeros (so y needs no
    # memset); groups past E are empty padding up to the power of two. Clipping to R makes offsets past the
    # buffer harmless.
    g = tl.arange(0, G_POW2)
    end_g = tl.load(offsets_ptr + g, mask=g < E, other=0).to(tl.int32)
    end_g = tl.minimum(tl.where(g < E, end_g, R), R)
    start_g = tl.load(offsets_ptr + g - 1, mask=(g > 0) & (g <= E), other=0).to(tl.int32)
    start_g = tl.where(g > E, R, tl.minimum(start_g, R))
    tiles_g = tl.cdiv(tl.maximum(end_g - start_g, 0), BLOCK_M)
    tile_end_g = tl.cumsum(tiles_g, 0)
    # The first group whose tiles end past pid_m. The grid's cdiv(R, BLOCK_M) + E is an upper bound on the tiles:
    # programs past the last one find group = G_POW2 > E and do nothing (a branch, not an early return, which
    # would give the compiler unstructured control flow).
    group = tl.sum((tile_end_g <= pid_m).to(tl.int32), 0)
    mine = g == group
    row_end = tl.sum(tl.where(mine, end_g, 0), 0)
    tile = pid_m - tl.sum(tl.where(mine, tile_end_g - tiles_g, 0), 0)
    offs_m = tl.sum(tl.where(mine, start_g, 0), 0) + tile * BLOCK_M + tl.arange(0, BLOCK_M)
    return group, offs_m, offs_m < row_end, offs_n


@triton.jit
def _gather_a(x_ptr, rows_ptr, offs_m, m_mask, stride_xn, stride_xi, BLOCK_K: tl.constexpr):
    """(A pointers, offs_k) for the first K block of a gather GEMM tile. The gather, fused: each row of the A tile
    is read straight from x at rows[i]. Rows past the group's end read row 0 and are never stored."""
    src_m = tl.load(rows_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    return x_ptr + src_m[:, None] * stride_xn + offs_k[None, :] * stride_xi, offs_k


@triton.jit
def _gather_operands(x_ptr, w_ptr, rows_ptr, group, offs_m, m_mask, offs_n, n_cols,
                     stride_xn, stride_xi, stride_we, stride_wo, stride_wi, BLOCK_K: tl.constexpr):
    """(A pointers, B pointers, offs_k) for the first K block of a gather GEMM tile: A from _gather_a, B the
    group's weight through pointers. Columns past n_cols wrap around, so the K loop masks only K; those columns
    are never stored."""
    a_ptrs, offs_k = _gather_a(x_ptr, rows_ptr, offs_m, m_mask, stride_xn, stride_xi, BLOCK_K)
    b_ptrs = (w_ptr + group.to(tl.int64) * stride_we
              + (offs_n % n_cols)[None, :].to(tl.int64) * stride_wo + offs_k[:, None] * stride_wi)  # fmt: skip
    return a_ptrs, b_ptrs, offs_k


@triton.heuristics(dict(EVEN_K=lambda args: args["I"] % args["BLOCK_K"] == 0))
@triton.jit
def _gather_grouped_mm_kernel(
    x_ptr, w, rows_ptr, offsets_ptr, y_ptr,
    R, O, I, E, dtype_bytes,
    stride_xn, stride_xi, stride_we, stride_wo, stride_wi, stride_yr, stride_yo,
    G_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr, ACC_FP64: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    B_DESC: tl.constexpr = 0,
):  # fmt: skip
    """B_DESC 0: ``w`` is the weight's pointer (any strides); 1: a TMA descriptor over the weight [E, O, I]
    (I contiguous), blocks [1, BLOCK_N, BLOCK_K]; 2: one over its transpose [E, I, O] (O contiguous, the input
    gradient's weight.transpose(1, 2) view), blocks [1, BLOCK_K, BLOCK_N]. A descriptor's loads past I or O fill
    zeros, so no mask."""
    group, offs_m, m_mask, offs_n = _tile(offsets_ptr, R, E, O, G_POW2, BLOCK_M, BLOCK_N)
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_yr + offs_n[None, :] * stride_yo
    y_mask = m_mask[:, None] & (offs_n[None, :] < O)

    if group == E:
        tl.store(y_ptrs, tl.zeros((BLOCK_M, BLOCK_N), dtype=y_ptr.dtype.element_ty), mask=y_mask)
    elif group < E:
        if B_DESC == 0:
            a_ptrs, b_ptrs, offs_k = _gather_operands(x_ptr, w, rows_ptr, group, offs_m, m_mask, offs_n, O,
                                                      stride_xn, stride_xi, stride_we, stride_wo, stride_wi, BLOCK_K)
        else:
            a_ptrs, offs_k = _gather_a(x_ptr, rows_ptr, offs_m, m_mask, stride_xn, stride_xi, BLOCK_K)
            n0 = (tl.program_id(0) % tl.cdiv(O, BLOCK_N)) * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float64 if ACC_FP64 else tl.float32)
        for k in range(0, tl.cdiv(I, BLOCK_K)):
            if EVEN_K:
                a = tl.load(a_ptrs)
            else:
                a = tl.load(a_ptrs, mask=(offs_k < I - k * BLOCK_K)[None, :], other=0.0)
            if B_DESC == 1:
                b = tl.trans(w.load([group, n0, k * BLOCK_K]).reshape(BLOCK_N, BLOCK_K))
            elif B_DESC == 2:
                b = w.load([group, k * BLOCK_K, n0]).reshape(BLOCK_K, BLOCK_N)
            elif EVEN_K:
                b = tl.load(b_ptrs)
            else:
                b = tl.load(b_ptrs, mask=(offs_k < I - k * BLOCK_K)[:, None], other=0.0)
            if UPCAST:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION, out_dtype=acc.dtype)
            a_ptrs += BLOCK_K * stride_xi
            if B_DESC == 0:
                b_ptrs += BLOCK_K * stride_wi
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_mask)


@functools.cache
def _tma_capable(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def _has_tma(device: torch.device) -> bool:
    """Whether a CUDA device has the Tensor Memory Accelerator (compute capability 9.0 on: Hopper)."""
    return device.type == "cuda" and _tma_capable(device.index if device.index is not None
                                                  else torch.cuda.current_device())


def _weight_operand(weight_EOI: torch.Tensor, b_desc: bool | None) -> tuple:
    """(w argument, B_DESC) for _gather_grouped_mm_kernel: a TMA descriptor over
    the weight when ``b_desc`` is True, or None (the default) and it can be one: 16-bit dtype on a GPU with TMA
    (the interpreter: any), a nonempty weight with one of its last two dims contiguous, the other strides and the
    base 16-byte aligned (TMA's rules), and not traced (the launch then goes into a compiled graph through
    wrap_triton, which this descriptor path is not tested with). The block shape is a placeholder:
    _set_desc_blocks sets it from the launch's config. b_desc=False, or a weight that cannot be one, gives the
    pointer path."""
    E, O, I = weight_EOI.shape
    s_e, s_o, s_i = weight_EOI.stride()
    size = weight_EOI.element_size()
    mode = 1 if s_i == 1 else 2 if s_o == 1 else 0
    other = (s_e, s_o) if mode == 1 else (s_e, s_i)
    can = (
        mode > 0
        and min(E, O, I) > 0
        and (interpreting() or (size == 2 and _has_tma(weight_EOI.device)))
        and weight_EOI.data_ptr() % 16 == 0
        and all(s * size % 16 == 0 for s in other)
        and not tracing()
    )
    if b_desc and not can:
        raise ValueError("b_desc=True needs a weight TMA can read (see _weight_operand)")
    if not can or b_desc is False:
        return weight_EOI, 0
    if mode == 1:
        return TensorDescriptor(weight_EOI, [E, O, I], [s_e, s_o, 1], [1, 16, 16]), 1
    return TensorDescriptor(weight_EOI, [E, I, O], [s_e, s_i, 1], [1, 16, 16]), 2


_gather_grouped_mm = _with_config(_gather_grouped_mm_kernel, _gpu_configs())


def gather_grouped_mm_triton(
    x_NI: torch.Tensor, weight_EOI: torch.Tensor, rows_R: torch.Tensor, offsets_E: torch.Tensor,
    config: triton.Config | None = None, b_desc: bool | None = None,
) -> torch.Tensor:
    """y_RO[i] = weight_EOI[e(i)] @ x_NI[rows_R[i]] for i < offsets_E[-1], 0 after; dtype of x. No host sync.

    The output is allocated with torch.empty: the kernel writes every row, zeros included. ``config`` launches
    those blocks instead of autotuning (for benchmarks/gemm.py grouped --configs). ``b_desc``: read the weight
    through a TMA descriptor (True), through pointers (False), or the descriptor where it can be one (None).
    """
    _check_device(x_NI, weight_EOI, rows_R, offsets_E)
    rows_R, offsets_E = rows_R.contiguous(), offsets_E.contiguous()  # read as flat arrays
    R, (E, O, I) = rows_R.shape[0], weight_EOI.shape
    y_RO = torch.empty((R, O), dtype=x_NI.dtype, device=x_NI.device)
    if known_empty(R, O):
        return y_RO
    kernel, fixed = _kernel_and_blocks(_gather_grouped_mm, _gather_grouped_mm_kernel, config)
    w, mode = _weight_operand(weight_EOI, b_desc)
    if fixed:  # no autotuner to run the configs' pre_hook
        _set_desc_blocks({"w": w, "B_DESC": mode, **fixed})
    grid = lambda meta: ((triton.cdiv(R, meta["BLOCK_M"]) + E) * triton.cdiv(O, meta["BLOCK_N"]),)  # noqa: E731
    launch(kernel, grid)(
        x_NI, w, rows_R, offsets_E, y_RO,
        R, O, I, E, x_NI.element_size(),
        *x_NI.stride(), *weight_EOI.stride(), *y_RO.stride(),
        G_POW2=triton.next_power_of_2(E + 1), **_dot_flags(x_NI.dtype), **fixed, B_DESC=mode,
    )  # fmt: skip
    return y_RO


# ------------------------------------------------------------------------------------------------- zero tail


@triton.jit
def _zero_tail_kernel(y_ptr, offsets_ptr, R, O, E, stride_r, stride_o, BLOCK_R: tl.constexpr, BLOCK_O: tl.constexpr):
    end = tl.load(offsets_ptr + E - 1).to(tl.int64)
    r0 = tl.program_id(0).to(tl.int64) * BLOCK_R
    if r0 + BLOCK_R > end:  # programs wholly inside the groups only read the offset
        r_R = r0 + tl.arange(0, BLOCK_R)
        zeros = tl.zeros((BLOCK_R, BLOCK_O), dtype=y_ptr.dtype.element_ty)
        row_ok = (r_R >= end) & (r_R < R)
        for o0 in range(0, O, BLOCK_O):
            o_O = o0 + tl.arange(0, BLOCK_O)
            mask = row_ok[:, None] & (o_O < O)[None, :]
            tl.store(y_ptr + r_R[:, None] * stride_r + o_O[None, :] * stride_o, zeros, mask=mask)


def zero_rows_past_last_offset_(y_RO: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """Zero y_RO's rows from offsets_E[-1] on, in place, without reading the offset on the host. Returns y_RO."""
    R, O = y_RO.shape
    E = offsets_E.shape[0]
    offsets_E = offsets_E.contiguous()  # read as a flat array
    if known_empty(R, O):
        return y_RO
    if E == 0:
        return y_RO.zero_()
    block_r = 16 if interpreting() else 32
    block_o = min(triton.next_power_of_2(O), 32 if interpreting() else 256)
    launch(_zero_tail_kernel, (triton.cdiv(R, block_r),))(
        y_RO, offsets_E, R, O, E, *y_RO.stride(), BLOCK_R=block_r, BLOCK_O=block_o, num_warps=4,
    )
    return y_RO


# ----------------------------------------------------------------------------------------------- grouped_outer


@triton.jit
def _grouped_outer_kernel(
    a_ptr, a_desc, b_ptr, rows_ptr, offsets_ptr, w_ptr,
    R, O, I, E, dtype_bytes,
    stride_ar, stride_ao, stride_bn, stride_bi, stride_we, stride_wo, stride_wi,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, ACC_FP64: tl.constexpr, INPUT_PRECISION: tl.constexpr, A_TMA: tl.constexpr,
):  # fmt: skip
    # One program per (expert, BLOCK_M x BLOCK_N tile of w[e]), expert slowest: the programs of one expert run
    # together and read its rows of a and b through L2. The reduction runs over the group's rows, BLOCK_K at a
    # time; its length is read on the device, so an empty group stores zeros and no atomics or memset are needed.
    pid = tl.program_id(0)
    num_m = tl.cdiv(O, BLOCK_M)
    num_n = tl.cdiv(I, BLOCK_N)
    e = pid // (num_m * num_n)
    pid_m = (pid % (num_m * num_n)) // num_n
    pid_n = pid % num_n

    start = tl.minimum(tl.load(offsets_ptr + e - 1, mask=e > 0, other=0).to(tl.int32), R)
    end = tl.minimum(tl.load(offsets_ptr + e).to(tl.int32), R)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m_safe = offs_m % O  # wrapped columns are computed but never stored: no mask on O or I in the loop
    offs_n_safe = offs_n % I
    offs_k = tl.arange(0, BLOCK_K)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float64 if ACC_FP64 else tl.float32)
    for r0 in range(start, end, BLOCK_K):
        offs_r = r0 + offs_k
        r_mask = offs_r < end
        src_r = tl.load(rows_ptr + offs_r, mask=r_mask, other=0).to(tl.int64)
        # a^T tile [BLOCK_M, BLOCK_K] and gathered b tile [BLOCK_K, BLOCK_N]. Both are masked on the group's end:
        # zero in a alone would still turn an inf or NaN in a row of b outside the group into NaN. A_TMA: a's tile
        # through the ragged descriptor over the group's rows, which reads zeros past the group's end (and past O).
        if A_TMA:
            a = load_ragged(a_desc, start, end - start, [r0 - start, pid_m * BLOCK_M]).T
        else:
            a = tl.load(
                a_ptr + offs_m_safe[:, None] * stride_ao + offs_r[None, :].to(tl.int64) * stride_ar,
                mask=r_mask[None, :], other=0.0,
            )  # fmt: skip
        b = tl.load(
            b_ptr + src_r[:, None] * stride_bn + offs_n_safe[None, :] * stride_bi, mask=r_mask[:, None], other=0.0
        )
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION, out_dtype=acc.dtype)

    w_ptrs = (w_ptr + e.to(tl.int64) * stride_we
              + offs_m[:, None].to(tl.int64) * stride_wo + offs_n[None, :] * stride_wi)  # fmt: skip
    tl.store(w_ptrs, acc.to(w_ptr.dtype.element_ty), mask=(offs_m[:, None] < O) & (offs_n[None, :] < I))


_grouped_outer = _with_config(_grouped_outer_kernel, _outer_gpu_configs())
_grouped_outer_tma = _with_config(_grouped_outer_kernel, _outer_tma_gpu_configs())


def _a_operand(a_RO: torch.Tensor, a_tma: bool | None) -> tuple:
    """(a_desc argument, A_TMA) for _grouped_outer_kernel: a ragged TMA descriptor over a_RO's rows when ``a_tma``
    is True, or None (the default) and it can be one: Triton's ragged_tma present, 16-bit dtype on a GPU with TMA
    (the interpreter: any), nonempty, rows contiguous, the row stride and the base 16-byte aligned, at most 2^30
    rows (the descriptor's limit), and not traced (as for _weight_operand). Block shape: a placeholder,
    _set_desc_blocks sets it. a_tma=False, or a_RO that cannot be one, gives the pointer path."""
    R, O = a_RO.shape
    size = a_RO.element_size()
    can = (
        create_ragged_descriptor is not None
        and not tracing()  # first: R may be an unbacked size while traced, which the tests below would guard on
        and min(R, O) > 0
        and R <= 2**30
        and (interpreting() or (size == 2 and _has_tma(a_RO.device)))
        and a_RO.stride(1) == 1
        and a_RO.data_ptr() % 16 == 0
        and a_RO.stride(0) * size % 16 == 0
    )
    if a_tma and not can:
        raise ValueError("a_tma=True needs an a_RO TMA can read (see _a_operand)")
    if not can or a_tma is False:
        return a_RO, False
    return create_ragged_descriptor(a_RO, [16, 16]), True


def grouped_outer_triton(
    a_RO: torch.Tensor, b_NI: torch.Tensor, rows_R: torch.Tensor, offsets_E: torch.Tensor,
    config: triton.Config | None = None, a_tma: bool | None = None,
) -> torch.Tensor:
    """w_EOI[e] = sum over i in group e of outer(a_RO[i], b_NI[rows_R[i]]); dtype of a. No host sync.

    The output is allocated with torch.empty: every program stores its whole tile, zeros for empty groups.
    ``config``: as in gather_grouped_mm_triton. ``a_tma``: read a_RO through a ragged TMA descriptor (True), through
    pointers (False), or the descriptor where it can be one (None); each way has its own autotuned config list.
    """
    _check_device(a_RO, b_NI, rows_R, offsets_E)
    rows_R, offsets_E = rows_R.contiguous(), offsets_E.contiguous()  # read as flat arrays
    R, O, I, E = rows_R.shape[0], a_RO.shape[1], b_NI.shape[1], offsets_E.shape[0]
    w_EOI = torch.empty((E, O, I), dtype=a_RO.dtype, device=a_RO.device)
    if known_empty(E, O, I):
        return w_EOI
    a_desc, a_mode = _a_operand(a_RO, a_tma)
    kernel, fixed = _kernel_and_blocks(_grouped_outer_tma if a_mode else _grouped_outer, _grouped_outer_kernel,
                                       config)
    if fixed:  # no autotuner to run the configs' pre_hook
        _set_desc_blocks({"a_desc": a_desc, **fixed})
    grid = lambda meta: (E * triton.cdiv(O, meta["BLOCK_M"]) * triton.cdiv(I, meta["BLOCK_N"]),)  # noqa: E731
    launch(kernel, grid)(
        a_RO, a_desc, b_NI, rows_R, offsets_E, w_EOI,
        R, O, I, E, a_RO.element_size(),
        *a_RO.stride(), *b_NI.stride(), *w_EOI.stride(),
        **_dot_flags(a_RO.dtype), **fixed, A_TMA=a_mode,
    )  # fmt: skip
    return w_EOI
