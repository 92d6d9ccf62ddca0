"""lrmoe_kernels.offload: the row gather equals index_select exactly (a copy, so bit for bit), on odd shapes that
cross the block edges of rows and columns, repeated rows, int32 and int64 indices, bf16, fp32 and fp64, strided
sources; rows outside the source come back as zeros instead of being read. With coefficients (lrmoe::gather_scale_rows,
a source in device memory): each row times its coefficient, rounded once.

Without a GPU the kernel runs in Triton's interpreter (tests/conftest.py switches it on) on CPU tensors. On a GPU the
source is pinned host memory and the rows and output are on the device: the path lrmoe::gather_host_rows takes.
"""

from __future__ import annotations

import pytest
import torch
from cuda_sync import no_host_sync
from hypothesis import given
from hypothesis import strategies as st
from lrmoe_kernels.launch import interpreting

INTERPRET = interpreting()
DEVICE = "cpu" if INTERPRET else "cuda"
pytestmark = pytest.mark.skipif(
    not INTERPRET and not torch.cuda.is_available(), reason="needs a CUDA device or TRITON_INTERPRET=1"
)
pytest.importorskip("triton")

from lrmoe_kernels.offload import gather_host_rows_triton


def host_copy(src: torch.Tensor) -> torch.Tensor:
    """Where the op keeps its source: pinned host memory on a GPU machine, plain CPU memory in the interpreter."""
    return src if INTERPRET else src.pin_memory()


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits, so NaN compares equal to itself (and -0.0 unequal to 0.0)."""
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def check(src_NC: torch.Tensor, rows: list[int], index_dtype=torch.int64):
    rows_R = torch.tensor(rows, dtype=index_dtype)
    got = gather_host_rows_triton(host_copy(src_NC), rows_R.to(DEVICE))
    assert got.device.type == DEVICE and got.dtype == src_NC.dtype and got.is_contiguous()
    assert torch.equal(bits(got.cpu()), bits(src_NC.index_select(0, rows_R)))


# (N, C, rows): the interpreter's blocks are 4 rows x 16 columns.
CASES = [
    (7, 5, [0, 6, 3, 3, 0, 6]),  # repeats, fewer columns than a block
    (9, 17, [8, 1, 5, 2, 2, 2, 7, 0, 4]),  # one column past a block, rows past a block
    (3, 40, [1]),  # one row, columns ending mid-block
    (12, 32, list(range(11, -1, -1))),  # every row, reversed, columns a multiple of the block
    (1, 1, [0, 0, 0, 0, 0]),
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_gather_equals_index_select(case, dtype, index_dtype):
    N, C, rows = case
    check(torch.randn(N, C, generator=torch.Generator().manual_seed(N * C)).to(dtype), rows, index_dtype)


def test_bits_are_copied_not_converted():
    # NaN payloads, infinities, -0.0 and bf16 subnormals survive: the kernel moves bits.
    src = torch.tensor([[float("nan"), float("inf"), -0.0, 1e-40], [-float("inf"), 0.0, 3.0, -1e-39]])
    check(src.to(torch.bfloat16), [1, 0, 1])
    check(src, [1, 0, 1])


def test_strided_source():
    base = torch.randn(6, 40)
    check(base[:, ::3], [5, 0, 2, 2])  # column stride 3
    check(base.t()[:9], [8, 0, 3])  # a transposed view: row stride 1, column stride 40


def test_empty_gather_and_empty_source_rows():
    src = torch.randn(4, 19)
    got = gather_host_rows_triton(host_copy(src), torch.empty(0, dtype=torch.int64, device=DEVICE))
    assert got.shape == (0, 19)
    got = gather_host_rows_triton(host_copy(torch.empty(5, 0)), torch.tensor([4, 1], device=DEVICE))
    assert got.shape == (2, 0)


def test_rows_outside_the_source_are_zeros_not_reads():
    src = torch.randn(5, 21)
    got = gather_host_rows_triton(host_copy(src), torch.tensor([-1, 2, 5, 1 << 40, 4], device=DEVICE)).cpu()
    assert torch.equal(got[[1, 4]], src[[2, 4]])
    assert (got[[0, 2, 3]] == 0).all()


def test_bad_shapes():
    with pytest.raises(ValueError, match="2-D"):
        gather_host_rows_triton(torch.randn(4), torch.tensor([0], device=DEVICE))
    with pytest.raises(ValueError, match="1-D"):
        gather_host_rows_triton(torch.randn(4, 2), torch.tensor([[0]], device=DEVICE))


@given(
    N=st.integers(1, 13),
    C=st.integers(1, 37),
    rows=st.lists(st.integers(0, 12), min_size=0, max_size=14),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_property_gather_equals_index_select(N, C, rows, dtype):
    check(torch.randn(N, C).to(dtype), [r % N for r in rows])


@pytest.mark.skipif(INTERPRET, reason="a pinned source exists only on a GPU machine")
def test_pinned_source_is_read_in_place_without_host_sync():
    src = torch.randn(1000, 1536).to(torch.bfloat16).pin_memory()
    rows = torch.randint(0, 1000, (700,), device="cuda")
    gather_host_rows_triton(src, rows)  # first call compiles
    with no_host_sync():
        got = gather_host_rows_triton(src, rows)
    assert torch.equal(got.cpu(), src.index_select(0, rows.cpu()))
    with pytest.raises(ValueError, match="pinned"):
        gather_host_rows_triton(torch.randn(4, 3), rows[:2] % 4)  # pageable memory is not mapped to the device


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scaled_gather_from_device_memory(case, dtype):
    # lrmoe::gather_scale_rows: the source on the rows' device, each row times its coefficient in fp32, rounded
    # once to the source's dtype (the interpreter truncates where PyTorch rounds: one bf16 ulp).
    N, C, rows = case
    g = torch.Generator().manual_seed(N + C)
    src = torch.randn(N, C, generator=g).to(dtype)
    rows_R = torch.tensor(rows)
    coef_R = torch.randn(len(rows), generator=g)
    coef_R[0] = 0.0  # a padding row's weight
    got = gather_host_rows_triton(src.to(DEVICE), rows_R.to(DEVICE), coef_R.to(DEVICE)).cpu()
    want = (src.index_select(0, rows_R).float() * coef_R.unsqueeze(1)).to(dtype)
    assert got.dtype == dtype and torch.equal(got[0], torch.zeros(C, dtype=dtype))
    tol = dict(rtol=8e-3, atol=1e-6) if dtype == torch.bfloat16 else dict(rtol=0, atol=0)
    torch.testing.assert_close(got, want, **tol)


def test_strided_rows_and_coefficients_are_read_as_their_values():
    src = torch.randn(6, 4)
    rows_2R, coef_2R = torch.tensor([4, 9, 0, 9, 5, 9]), torch.tensor([2.0, 7.0, -1.0, 7.0, 0.5, 7.0])
    got = gather_host_rows_triton(src.to(DEVICE), rows_2R.to(DEVICE)[::2], coef_2R.to(DEVICE)[::2]).cpu()
    torch.testing.assert_close(got, src[[4, 0, 5]] * torch.tensor([[2.0], [-1.0], [0.5]]), rtol=0, atol=0)


def test_scaled_gather_of_rows_outside_gives_zeros():
    src = torch.full((3, 4), float("nan"))
    got = gather_host_rows_triton(src.to(DEVICE), torch.tensor([-1, 3, 7], device=DEVICE),
                                  torch.ones(3, device=DEVICE))
    assert torch.equal(got.cpu(), torch.zeros(3, 4))
