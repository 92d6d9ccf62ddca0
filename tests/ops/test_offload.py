"""lrmoe::offload_to_host, lrmoe::gather_host_rows and lrmoe::offload_wait: torch.library.opcheck (schema, fake,
autograd registration, AOT dispatch) on odd shapes and dtypes, values, gradients, argument errors, and the GPU
contract where there is one (pinned host copy, rows gathered onto the device, no host synchronisation)."""

from __future__ import annotations

import pytest
import torch
from cuda_sync import no_host_sync

from lrmoe.ops import gather_host_rows, offload_to_host, offload_wait

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# (N rows, C columns, rows to gather): repeats, the first and last row, nothing gathered, an empty source.
CASES = [
    (7, 5, [0, 6, 3, 3, 0]),
    (1, 1, [0, 0, 0]),
    (9, 42, [8, 1, 5]),
    (4, 3, []),
    (0, 6, []),
]


def _case(N, C, rows, dtype=torch.float32, index_dtype=torch.int64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, C, generator=g).to(dtype)
    return x, torch.tensor(rows, dtype=index_dtype)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("join", [False, True])
def test_opcheck_offload_to_host(case, requires_grad, join):
    x, _ = _case(*case)
    torch.library.opcheck(offload_to_host, (x.requires_grad_(requires_grad), join))


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_opcheck_gather_host_rows(case, requires_grad, index_dtype):
    host, rows = _case(*case, index_dtype=index_dtype)
    torch.library.opcheck(gather_host_rows, (host.requires_grad_(requires_grad), rows))


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("requires_grad", [False, True])
def test_opcheck_offload_wait(case, requires_grad):
    # No output: the arguments only place the op in a compiled graph (after the copy and the layer's output).
    x, _ = _case(*case)
    host, after = offload_to_host(x), torch.randn(3, 2)
    torch.library.opcheck(offload_wait, (x.requires_grad_(requires_grad), host, after.requires_grad_(requires_grad)))
    assert offload_wait(x, host, after) is None


def test_offload_ops_are_ordered_effects():
    # An effectful op stays in the forward graph (offload_to_host) and is kept though nothing reads it (offload_wait).
    from torch._higher_order_ops.effects import _get_effect

    for op in (torch.ops.lrmoe.offload_to_host.default, torch.ops.lrmoe.offload_wait.default):
        assert str(_get_effect(op)).endswith("ORDERED"), op


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_values(case, dtype):
    x, rows = _case(*case, dtype=dtype)
    host = offload_to_host(x)
    assert host.device.type == "cpu" and host.dtype == dtype and torch.equal(host, x)
    assert host.data_ptr() != x.data_ptr() or x.numel() == 0  # a copy, never x itself
    got = gather_host_rows(host, rows)
    assert torch.equal(got, torch.stack([x[r] for r in rows.tolist()]) if len(rows) else x[:0])


def test_offload_of_a_non_contiguous_tensor_is_contiguous():
    x = torch.randn(6, 10)[:, ::2]
    host = offload_to_host(x)
    assert host.is_contiguous() and torch.equal(host, x)


def test_gradients_are_a_copy_and_an_index_add():
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    rows = torch.tensor([4, 0, 4, 2])
    assert torch.autograd.gradcheck(lambda x_: gather_host_rows(offload_to_host(x_), rows), (x,))
    gather_host_rows(offload_to_host(x), rows).sum().backward()
    assert x.grad[:, 0].tolist() == [1.0, 0.0, 1.0, 0.0, 2.0]  # row 4 gathered twice, rows 1 and 3 never


@pytest.mark.parametrize(
    "host, rows, match",
    [
        (torch.zeros(4), torch.tensor([0]), "host_NC must be 2-D"),
        (torch.zeros(2, 3, 4), torch.tensor([0]), "host_NC must be 2-D"),
        (torch.zeros(4, 3), torch.tensor([[0]]), "rows_R must be a 1-D int32 or int64"),
        (torch.zeros(4, 3), torch.tensor([0.0]), "rows_R must be a 1-D int32 or int64"),
        (torch.zeros(4, 3), torch.tensor([True]), "rows_R must be a 1-D int32 or int64"),
    ],
)
def test_bad_arguments_name_the_argument(host, rows, match):
    with pytest.raises(ValueError, match=match):
        gather_host_rows(host, rows)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode, pytest.raises(ValueError, match=match):
        gather_host_rows(mode.from_tensor(host), mode.from_tensor(rows))  # the fake checks too (compile time)


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("N, C", [(1000, 1536), (37, 45)])
def test_cuda_pinned_round_trip_without_host_sync(dtype, N, C):
    x = torch.randn(N, C, device="cuda").to(dtype)
    rows = torch.randint(0, N, (N // 2 + 3,), device="cuda")
    gather_host_rows(offload_to_host(x), rows)  # first call: side stream, kernel compilation
    with no_host_sync():
        host = offload_to_host(x)
        del x  # the caller may drop x at once: record_stream keeps its memory until the copy has run
        got = gather_host_rows(host, rows)  # mixed devices: the CUDA kernel
    assert host.device.type == "cpu" and host.is_pinned()
    assert got.device == rows.device and got.dtype == dtype
    assert torch.equal(got.cpu(), host.index_select(0, rows.cpu()))  # .cpu() synchronises: the copy is done


@cuda
def test_cuda_offload_wait_orders_the_stream_after_the_copy_without_host_sync():
    x = torch.randn(4096, 1024, device="cuda")
    want = x.cpu()
    offload_to_host(x)  # first call: side stream
    with no_host_sync():
        host = offload_to_host(x)
        offload_wait(x, host, x)
        x.zero_()  # enqueued after the wait: runs after the copy has read x
    torch.cuda.synchronize()
    assert torch.equal(host, want)


@cuda
def test_cuda_fallback_for_host_memory_that_is_not_pinned():
    host = torch.randn(11, 7)
    rows = torch.tensor([10, 0, 3, 3], device="cuda")
    assert torch.equal(gather_host_rows(host, rows).cpu(), host[rows.cpu()])
    on_device = host.cuda()  # a host tensor already on the rows' device is gathered there
    assert torch.equal(gather_host_rows(on_device, rows), on_device[rows])
