"""Activations parked in pinned host memory, and the rows backward needs brought back, as custom ops (the
activation policy "offload", docs/design.md, 'Composition').

Shapes: N rows, C columns, R gathered rows.

``lrmoe::offload_to_host(x, join=False) -> host``
    A host (CPU) copy of x. CUDA: pinned memory, filled by an asynchronous copy on a side stream (one per device)
    that starts once the current stream has produced x, so the copy overlaps whatever the current stream runs
    next; no host synchronisation. ``join=True`` also makes the current stream wait for the copy (point 1 below).
    CPU: host and device memory are the same, so a contiguous clone (what the CPU tests run).
``lrmoe::gather_host_rows(host_NC, rows_R) -> out_RC``
    out[i] = host[rows[i]], on rows' device; rows must lie in [0, N). CUDA: the current stream first waits for the
    side stream (a wait on the GPU, not on the host), then a Triton kernel reads the rows straight from the pinned
    buffer through unified virtual addressing (lrmoe_kernels.offload), so only the gathered rows cross PCIe.
    Memory that is not pinned, or no Triton: the whole buffer is copied to the device and gathered there. A host
    tensor already on rows' device is gathered in place. CPU: index_select.
``lrmoe::offload_wait(x, host, after) -> ()``
    CUDA: the current stream waits for the side stream, so for every offload copy enqueued so far (a wait on the
    GPU, not on the host); what the current stream had enqueued before the wait still overlaps the copies. CPU:
    nothing. No output: x (an offloaded tensor), host (its copy) and after are arguments only to place the op in a
    compiled graph, after all three (point 1 below).
With mixed CPU and CUDA arguments (host on the CPU, rows on the GPU) the dispatcher picks the CUDA kernel.

offload_to_host and gather_host_rows are differentiable (a copy; a gather, whose gradient is an index_add onto the
host tensor's device), though the layer calls them only where autograd does not record (inside its
autograd.Function).

Under torch.compile: only backward reads the host copy, so AOTAutograd's partitioner would move offload_to_host
into the backward graph and save x on the device instead, undoing the policy; offload_to_host is registered as an
effectful op (EffectType.ORDERED, through lrmoe.ops._torch_internals), which keeps it in the forward and saves its
output. offload_wait, which has no
output, is effectful too, or it would be dropped. Where the copy runs is Inductor's choice: its peak-memory
reordering (config.reorder_for_peak_memory, on by default) counts the host buffer as memory and delays the op as far
as it can. Generated for the CPU, the single-device layer's copy then runs just before offload_wait, overlapping
nothing; the expert-parallel layer's before the combine all-to-all. Without that pass it runs where it was called,
right after the gate/up GEMM.

Memory safety: three places where a stream could read memory that something else reuses too early.
1. x while the side stream copies it. The caller may drop x as soon as the op returns (the layer does: x is the
   gate/up projection h, which "offload" does not keep). x.record_stream(side) keeps the caching allocator from
   handing x's block out before the copy has ended. A compiler that plans its own buffers does not go through the
   allocator: Inductor reuses a dead buffer's memory for a later buffer of the same size and dtype on the same
   stream, which record_stream cannot see. So, compiled, the layer ends its forward with offload_wait(h, host,
   out): h's buffer is live until that op (an argument, so Inductor frees or reuses it only after), and the op
   orders the current stream after the copy, so whatever reuses h's memory is enqueued behind the copy. host and
   the layer's output are arguments too, so the wait comes after the copy and after the forward's work, which
   overlaps the copy. (join=True, the current stream waiting at once, is for callers without such a point.)
2. The pinned block while gather_host_rows's kernel reads it. PyTorch's pinned-memory allocator learns of stream
   uses only through copies (Tensor.record_stream is CUDA-only), and hands a freed block to the next pin_memory
   user at once, e.g. a DataLoader's pinning thread, which writes it from the CPU. So after the kernel the op
   enqueues a one-element copy from the block on the same stream: the copy records the allocator's event, and
   the block is not reused before the kernel has finished.
3. A later offload into a pinned block that an earlier gather read: its copy runs on the side stream after
   side.wait_stream(current), so after every kernel the current stream had enqueued by then, that gather
   included (and point 2 holds the block back anyway).

Host memory: the pinned allocator rounds each block up to a power of two and caches freed blocks, so the host
holds up to twice the logical bytes lrmoe.memory reports as ``offloaded``.
"""

from __future__ import annotations

import functools

import torch

from lrmoe.ops._define import define_op
from lrmoe.ops._kernels import kernel_module

__all__ = ["gather_host_rows", "offload_to_host", "offload_wait"]


@functools.cache
def _side_stream(device_index: int) -> torch.cuda.Stream:
    """The stream the offload copies of one device run on, created at the first offload: one per device, so the
    copies of successive layers queue behind each other instead of competing for the link."""
    return torch.cuda.Stream(device=device_index)


# ------------------------------------------------------------------------------------------------ offload_to_host


def _offload_cuda(x, join=False):
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    if x.numel() == 0:
        return host
    current = torch.cuda.current_stream(x.device)
    side = _side_stream(x.device.index)
    side.wait_stream(current)  # x is complete on the current stream
    with torch.cuda.stream(side):
        host.copy_(x, non_blocking=True)  # records the pinned block's use on the side stream
    x.record_stream(side)  # point 1 of the module docstring
    if join:
        current.wait_stream(side)
    return host


def _offload_setup(ctx, inputs, output):
    ctx.device = inputs[0].device


def _offload_backward(ctx, grad_host):
    return grad_host.to(ctx.device), None


# The forward's outputs do not depend on the host copy, only backward reads it, so AOTAutograd's partitioner would
# move the op into the backward graph and save h on the device instead, undoing the policy. An effectful op stays in
# the forward, where it was called, and its output is saved (torch.compile threads effect tokens through the graph).
@define_op("lrmoe::offload_to_host", cuda=_offload_cuda, fake=lambda x, join=False: x.new_empty(x.shape, device="cpu"),
           grad=(_offload_setup, _offload_backward), effect=True)
def offload_to_host(x: torch.Tensor, join: bool = False) -> torch.Tensor:
    return x.clone(memory_format=torch.contiguous_format)  # CPU: the host copy is a copy


# --------------------------------------------------------------------------------------------------- offload_wait


def _wait_cuda(x, host, after):
    torch.cuda.current_stream(x.device).wait_stream(_side_stream(x.device.index))  # on the GPU: no host sync


# Nothing reads an op without outputs, so the compiler would drop it (AOTAutograd does): the effect keeps it. Its
# arguments, not the effect token, place it: Inductor 2.13 drops the token's ordering edge between effectful ops
# (pytorch/pytorch#189209) and its peak-memory reordering hoists h's last use, which put the wait before the copy.
@define_op("lrmoe::offload_wait", cuda=_wait_cuda, fake=lambda x, host, after: None, grad=None, effect=True)
def offload_wait(x: torch.Tensor, host: torch.Tensor, after: torch.Tensor) -> None:
    pass  # CPU: the copy was done when offload_to_host returned


# ----------------------------------------------------------------------------------------------- gather_host_rows


def _check_gather(host_NC: torch.Tensor, rows_R: torch.Tensor) -> None:
    if host_NC.dim() != 2:
        raise ValueError(f"lrmoe::gather_host_rows: host_NC must be 2-D [N, C], got shape {tuple(host_NC.shape)}")
    if rows_R.dim() != 1 or rows_R.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"lrmoe::gather_host_rows: rows_R must be a 1-D int32 or int64 tensor, got shape "
                         f"{tuple(rows_R.shape)} and dtype {rows_R.dtype}")


def _gather_cuda(host_NC, rows_R):
    device = rows_R.device
    if host_NC.device == device:  # nothing was offloaded
        return host_NC.index_select(0, rows_R)
    # The offload copies were enqueued on the side stream; order this stream after them, on the GPU.
    torch.cuda.current_stream(device).wait_stream(_side_stream(device.index))
    kernels = kernel_module("offload")
    if kernels is None or not host_NC.is_pinned():
        # The whole buffer crosses the link (and, from memory that is not pinned, the copy blocks the host).
        return host_NC.to(device, non_blocking=True).index_select(0, rows_R)
    out_RC = kernels.gather_host_rows_triton(host_NC, rows_R)
    if host_NC.numel():  # point 2 of the module docstring: tell the pinned allocator this stream read the block
        torch.empty(1, 1, dtype=host_NC.dtype, device=device).copy_(host_NC[:1, :1], non_blocking=True)
    return out_RC


def _gather_setup(ctx, inputs, output):
    host_NC, rows_R = inputs
    ctx.save_for_backward(rows_R)
    ctx.host_shape, ctx.host_device = host_NC.shape, host_NC.device


def _gather_backward(ctx, grad_out_RC):
    (rows_R,) = ctx.saved_tensors
    grad_host = None
    if ctx.needs_input_grad[0]:
        grad_host = grad_out_RC.new_zeros(ctx.host_shape, device=ctx.host_device).index_add_(
            0, rows_R.to(ctx.host_device), grad_out_RC.to(ctx.host_device)
        )
    return grad_host, None


@define_op("lrmoe::gather_host_rows", check=_check_gather, cuda=_gather_cuda,
           fake=lambda host_NC, rows_R: host_NC.new_empty(rows_R.shape[0], host_NC.shape[1], device=rows_R.device),
           grad=(_gather_setup, _gather_backward))
def gather_host_rows(host_NC: torch.Tensor, rows_R: torch.Tensor) -> torch.Tensor:
    return host_NC.index_select(0, rows_R)
