"""A row gather that reads its source straight from pinned host memory (the kernel behind
``lrmoe::gather_host_rows``).

Shapes: N source rows, C columns, R gathered rows.

``gather_host_rows_triton(src_NC, rows_R, coef_R=None) -> out_RC``
    out[i] = src[rows[i]] (times coef[i], in fp32, rounded once to src's dtype, when coef is given), on rows'
    device. ``src`` may be a pinned CPU tensor: memory that cudaHostAlloc pinned
    (PyTorch's pin_memory) is mapped into the device's address space at the same address on systems with unified
    virtual addressing (every 64-bit Linux system), and Triton's launcher translates such a pointer to its device
    address (cuPointerGetAttribute), so the kernel's loads cross PCIe for the gathered rows only, never for the
    whole buffer. A CUDA ``src`` works the same way.

The same kernel gathers from device memory: lrmoe::gather_scale_rows (the expert backward's output-gradient rows,
each scaled by its gate and selection weight, in one pass instead of a gather, an fp32 product and a cast) and the
rows lrmoe::gather_grouped_mm and lrmoe::grouped_outer hand to torch._grouped_mm (faster than index_select and
than Inductor's gather, see ``_blocks``).

Rows outside [0, N) are not read (the kernel cannot report them without a host synchronisation): their output
rows are zero. Offsets are int64: the source is the [P, 2F] activations, and P * 2F reaches 2^31 elements at
131,072 tokens with K = 8 and 2F = 2048.

From host memory the work is a copy, bound by the PCIe read bandwidth (~55 GB/s on a Gen5 x16 link, against
~4 TB/s from HBM). Each program copies a BLOCK_R x BLOCK_C tile: whole contiguous runs of a row per load, so the
reads over the link are full 128-byte transactions, and many programs in flight to cover the ~1-2 us latency of a
read across PCIe. The host blocks are a first guess; benchmarks on the GPU should tune them (and compare against a
cudaMemcpy of the whole buffer, which wins when nearly every row is gathered).

Under the Triton interpreter (TRITON_INTERPRET=1, CPU tensors: how the tests run without a GPU) the blocks are
small, so the odd test shapes cross several tiles and masked edges.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from .launch import interpreting, known_empty, launch, tracing

__all__ = ["gather_host_rows_triton"]



@triton.jit
def _gather_rows_kernel(
    src_ptr, rows_ptr, coef_ptr, out_ptr,
    R, N, C,
    stride_sn, stride_sc, stride_or, stride_oc,
    HAS_COEF: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    r_R = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    c_C = (pid_c * BLOCK_C + tl.arange(0, BLOCK_C)).to(tl.int64)
    r_ok_R = r_R < R
    c_ok_C = c_C < C
    row_R = tl.load(rows_ptr + r_R, mask=r_ok_R, other=0).to(tl.int64)
    # An index outside the source is not read: a stray host address would fault or read another buffer.
    read_R = r_ok_R & (row_R >= 0) & (row_R < N)
    tile_RC = tl.load(
        src_ptr + row_R[:, None] * stride_sn + c_C[None, :] * stride_sc,
        mask=read_R[:, None] & c_ok_C[None, :],
        other=0,
    )
    if HAS_COEF:
        coef_R = tl.load(coef_ptr + r_R, mask=r_ok_R, other=0.0).to(tl.float32)
        tile_RC = (tile_RC.to(tl.float32) * coef_R[:, None]).to(out_ptr.dtype.element_ty)
    out_RC = out_ptr + r_R.to(tl.int64)[:, None] * stride_or + c_C[None, :] * stride_oc
    tl.store(out_RC, tile_RC, mask=r_ok_R[:, None] & c_ok_C[None, :])


def _blocks(n_cols: int, elem_bytes: int, on_host: bool = False) -> dict:
    """Tile sizes: 8 rows a program, 4 warps; BLOCK_C up to 512 bytes of a row from device memory, 1 KiB from host
    memory (a first guess for the link, untuned); narrow rows get a narrower BLOCK_C instead of masked lanes.
    Device rows measured on one H200 (benchmarks/single_kernels.py row-gather --sweep, bf16, T = 8192, 65,536 and 32,768
    rows out of 2,048 / 4,096 columns, 32 shapes): 8 x 256 elements was within 1 % of the best shape in all six
    cases, and 3-5 % faster than 8 x 512: 5.4-6.3 TB/s counting each output row read and written once, 1.33-1.51x
    a clone of the output's size (the source rows come from the L2), and 0.65-0.80 of Inductor's time for the same
    gathers (the layers' row gathers use it, compiled too: lrmoe.ops.grouped_gemm)."""
    if interpreting():
        return {"BLOCK_R": 4, "BLOCK_C": 16, "num_warps": 1}
    block_c = min(triton.next_power_of_2(max(n_cols, 1)), max((1024 if on_host else 512) // elem_bytes, 16))
    return {"BLOCK_R": 8, "BLOCK_C": block_c, "num_warps": 4}


def gather_host_rows_triton(src_NC: torch.Tensor, rows_R: torch.Tensor, coef_R: torch.Tensor | None = None, *,
                            blocks: dict | None = None) -> torch.Tensor:
    """out_RC[i] = src_NC[rows_R[i]] (* coef_R[i] in fp32, rounded to src's dtype) on rows_R's device (zero where
    rows_R[i] is outside [0, N)). ``src_NC`` is a pinned CPU tensor or a tensor on rows_R's device; the caller
    orders the stream after whatever writes it. ``coef_R``: [R] float on rows_R's device, or None. ``blocks``
    overrides the launch config of ``_blocks`` (keys BLOCK_R, BLOCK_C, num_warps), for tuning."""
    if src_NC.dim() != 2 or rows_R.dim() != 1:
        raise ValueError(f"src_NC must be 2-D and rows_R 1-D, got shapes {tuple(src_NC.shape)} and "
                         f"{tuple(rows_R.shape)}")
    if not interpreting() and not tracing() and rows_R.device.type != "cuda":  # traced: recorded, not launched here
        raise ValueError("gather_host_rows_triton needs rows_R on CUDA (or TRITON_INTERPRET=1 for CPU tensors)")
    n_rows, n_cols = src_NC.shape
    rows_R = rows_R.contiguous()  # rows_R and coef_R are read as flat arrays
    coef_R = None if coef_R is None else coef_R.contiguous()
    out_RC = torch.empty(rows_R.shape[0], n_cols, dtype=src_NC.dtype, device=rows_R.device)
    if known_empty(rows_R.shape[0], n_cols):  # nothing to read (an empty source may not even be pinned)
        return out_RC
    if not interpreting() and not tracing() and src_NC.device != rows_R.device and not src_NC.is_pinned():
        raise ValueError(f"src_NC must be pinned host memory or on {rows_R.device}, got {src_NC.device} memory "
                         "that is not pinned (not mapped into the device's address space)")
    cfg = blocks or _blocks(n_cols, src_NC.element_size(), on_host=src_NC.device != rows_R.device)
    grid = (triton.cdiv(rows_R.shape[0], cfg["BLOCK_R"]), triton.cdiv(n_cols, cfg["BLOCK_C"]))
    launch(_gather_rows_kernel, grid)(
        src_NC, rows_R, rows_R if coef_R is None else coef_R, out_RC,
        rows_R.shape[0], n_rows, n_cols,
        src_NC.stride(0), src_NC.stride(1), out_RC.stride(0), out_RC.stride(1),
        HAS_COEF=coef_R is not None, **cfg,
    )  # fmt: skip
    return out_RC
