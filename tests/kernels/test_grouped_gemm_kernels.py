"""lrmoe_kernels.grouped_gemm: the Triton launchers equal the reference ops lrmoe::gather_grouped_mm and
lrmoe::grouped_outer (their CPU kernels) on tiny odd shapes: one or three experts, empty groups, padding rows
(-1) after the last group, offsets past the buffer, a transposed (non-contiguous) weight, fp32 and bf16.

Without a GPU the kernels run in Triton's interpreter (tests/conftest.py switches it on) on CPU tensors, at
Python speed: shapes stay tiny and Hypothesis draws few examples. On a GPU the same tests run on CUDA tensors.
"""

from __future__ import annotations

import pytest
import torch
from cuda_sync import no_host_sync
from hypothesis import given
from hypothesis import strategies as st
from lrmoe_kernels.grouped_gemm import (
    _a_operand,
    _gpu_configs,
    _outer_gpu_configs,
    _outer_tma_gpu_configs,
    _weight_operand,
    gather_grouped_mm_triton,
    grouped_outer_triton,
    zero_rows_past_last_offset_,
)

import lrmoe  # noqa: F401  (registers torch.ops.lrmoe.*)
from lrmoe_kernels.launch import interpreting

INTERPRET = interpreting()
DEVICE = "cpu" if INTERPRET else "cuda"
pytestmark = pytest.mark.skipif(
    not INTERPRET and not torch.cuda.is_available(), reason="needs a CUDA device or TRITON_INTERPRET=1"
)

# (N source rows, I, O, group sizes, padding rows, cut): the buffer holds sum(sizes) + pad - cut rows, so a cut
# makes offsets[-1] exceed R (the last groups are clipped to the buffer).
CASES = [
    (5, 8, 24, [9], 2, 0),  # one expert, padding rows
    (4, 40, 8, [0], 3, 0),  # one empty expert: every row is padding
    (6, 24, 40, [20], 0, 3),  # one expert clipped by the buffer, several row tiles
    (7, 40, 24, [3, 0, 18], 2, 0),  # an empty expert in the middle, I crosses two K blocks
    (9, 24, 40, [0, 17, 4], 0, 5),  # offsets past R: the last group is cut off entirely
    (3, 8, 8, [0, 0, 0], 4, 0),  # every expert empty
    (8, 40, 40, [5, 6, 0], 1, 0),  # an empty last expert
]


def make_case(N, I, O, sizes, pad, cut, dtype=torch.float32, transposed=True, seed=0):
    """CPU tensors: x_NI, weight_EOI (a transposed [E, I, O] view when `transposed`), a_RO, rows_R, offsets_E."""
    g = torch.Generator().manual_seed(seed)
    E, S = len(sizes), sum(sizes)
    R = S + pad - cut
    rows_R = torch.cat([torch.randint(0, N, (S,), generator=g), torch.full((pad,), -1)])[:R]
    offsets_E = torch.cumsum(torch.tensor(sizes), 0).int()
    x_NI = torch.randn(N, I, generator=g).to(dtype)
    if transposed:
        weight_EOI = torch.randn(E, I, O, generator=g).to(dtype).transpose(1, 2)
    else:
        weight_EOI = torch.randn(E, O, I, generator=g).to(dtype)
    a_RO = torch.randn(R, O, generator=g).to(dtype)
    return x_NI, weight_EOI, a_RO, rows_R, offsets_E


def on_device(*tensors):
    return [t.to(DEVICE) for t in tensors]


def assert_close(got, want, dtype, k):
    """bf16: the interpreter truncates fp32 -> bf16 and the reference rounds, so allow a couple of ulps
    (2^-8 relative each) of values that grow like sqrt(k)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    got = got.cpu()
    if dtype == torch.bfloat16:
        torch.testing.assert_close(got.double(), want.double(), rtol=2e-2, atol=2e-2 * k**0.5)
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * k**0.5)


def check_gather(x_NI, weight_EOI, rows_R, offsets_E, b_desc=None):
    want = torch.ops.lrmoe.gather_grouped_mm(x_NI, weight_EOI, rows_R, offsets_E)
    got = gather_grouped_mm_triton(*on_device(x_NI, weight_EOI, rows_R, offsets_E), b_desc=b_desc)
    assert_close(got, want, x_NI.dtype, x_NI.shape[1])
    end = min(int(offsets_E[-1]), rows_R.shape[0]) if offsets_E.numel() else 0
    assert (got[end:] == 0).all(), "rows past offsets[-1] must be zero"


def check_outer(a_RO, b_NI, rows_R, offsets_E, a_tma=None):
    want = torch.ops.lrmoe.grouped_outer(a_RO, b_NI, rows_R, offsets_E)
    got = grouped_outer_triton(*on_device(a_RO, b_NI, rows_R, offsets_E), a_tma=a_tma)
    assert_close(got, want, a_RO.dtype, max(1, rows_R.shape[0]))
    starts = [0] + offsets_E.tolist()[:-1]
    for e, (s, t) in enumerate(zip(starts, offsets_E.tolist())):
        if min(t, rows_R.shape[0]) <= s:
            assert (got[e] == 0).all(), f"empty group {e} must give zeros"


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b_desc", [None, False], ids=["weight-desc-if-possible", "weight-pointers"])
def test_gather_grouped_mm_equals_reference(case, dtype, b_desc):
    x_NI, weight_EOI, _, rows_R, offsets_E = make_case(*case, dtype=dtype)
    assert not weight_EOI.is_contiguous()
    check_gather(x_NI, weight_EOI, rows_R, offsets_E, b_desc)


@pytest.mark.parametrize("transposed", [False, True])
def test_weight_descriptor_both_layouts(transposed):
    """The TMA descriptor path on both weight layouts (the forward's [E, O, I] and the input gradient's transposed
    view), O and I not multiples of the blocks (the descriptor's zero fill past the edges replaces the masks)."""
    x_NI, weight_EOI, _, rows_R, offsets_E = make_case(7, 40, 24, [3, 0, 18], 2, 0, torch.bfloat16, transposed)
    w, mode = _weight_operand(weight_EOI.to(DEVICE), None)
    assert mode == (2 if transposed else 1)
    check_gather(x_NI, weight_EOI, rows_R, offsets_E, b_desc=True)


def test_weight_descriptor_refused_where_tma_cannot_read():
    """A weight whose rows are not 16-byte aligned (I = 7 in bf16: 14 bytes) takes the pointer path by default;
    asking for the descriptor says why it cannot."""
    x_NI, weight_EOI, _, rows_R, offsets_E = make_case(5, 7, 24, [4, 5], 1, 0, torch.bfloat16, transposed=False)
    assert _weight_operand(weight_EOI.to(DEVICE), None)[1] == 0
    check_gather(x_NI, weight_EOI, rows_R, offsets_E)
    with pytest.raises(ValueError, match="b_desc=True"):
        gather_grouped_mm_triton(*on_device(x_NI, weight_EOI, rows_R, offsets_E), b_desc=True)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("a_tma", [None, False], ids=["a-desc-if-possible", "a-pointers"])
def test_grouped_outer_equals_reference(case, dtype, a_tma):
    x_NI, _, a_RO, rows_R, offsets_E = make_case(*case, dtype=dtype)
    check_outer(a_RO, x_NI, rows_R, offsets_E, a_tma)


def test_a_descriptor_refused_where_tma_cannot_read():
    """a_RO rows that are not 16-byte aligned (O = 7 in bf16: 14 bytes) take the pointer path by default; asking for
    the ragged descriptor says why it cannot. Aligned rows take the descriptor."""
    x_NI, _, a_RO, rows_R, offsets_E = make_case(5, 24, 7, [4, 5], 1, 0, torch.bfloat16)
    assert _a_operand(a_RO.to(DEVICE), None)[1] is False
    check_outer(a_RO, x_NI, rows_R, offsets_E)
    with pytest.raises(ValueError, match="a_tma=True"):
        grouped_outer_triton(*on_device(a_RO, x_NI, rows_R, offsets_E), a_tma=True)
    x_NI, _, a_RO, rows_R, offsets_E = make_case(5, 24, 8, [4, 5], 1, 0, torch.bfloat16)
    assert _a_operand(a_RO.to(DEVICE), None)[1] is True


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_contiguous_weight_and_other_dtypes(dtype):
    x_NI, weight_EOI, a_RO, rows_R, offsets_E = make_case(7, 40, 24, [3, 0, 18], 2, 0, dtype, transposed=False)
    check_gather(x_NI, weight_EOI, rows_R, offsets_E)
    check_outer(a_RO, x_NI, rows_R, offsets_E)


# Groups longer than the weight gradient's K blocks (32 rows in the interpreter and in the GPU configs): whole
# blocks, then a partial one (70 = 2 x 32 + 6, 45, 33), and one of exactly two blocks (64).
LONG_GROUPS = (11, 24, 40, [70, 0, 45, 64, 33], 3, 0)


@pytest.mark.parametrize("a_tma", [True, False])
def test_grouped_outer_whole_and_partial_blocks(a_tma):
    x_NI, _, a_RO, rows_R, offsets_E = make_case(*LONG_GROUPS, dtype=torch.bfloat16)
    check_outer(a_RO, x_NI, rows_R, offsets_E, a_tma)


@pytest.mark.parametrize("a_tma", [True, False])
def test_grouped_outer_keeps_a_nonfinite_row_in_its_group(a_tma):
    """An inf in the first row of a group (the row a block read past the previous group's end would take in)
    must leave the other groups' gradients finite and equal to the reference; its own gets inf or NaN."""
    x_NI, _, a_RO, rows_R, offsets_E = make_case(*LONG_GROUPS, dtype=torch.bfloat16)
    a_RO[70] = float("inf")  # the first row of group 2 (group 1 is empty)
    want = torch.ops.lrmoe.grouped_outer(a_RO, x_NI, rows_R, offsets_E)
    got = grouped_outer_triton(*on_device(a_RO, x_NI, rows_R, offsets_E), a_tma=a_tma).cpu()
    assert not want[2].isfinite().all() and not got[2].isfinite().all()
    others = [0, 1, 3, 4]
    assert got[others].isfinite().all()
    assert_close(got[others], want[others], torch.bfloat16, rows_R.shape[0])


def _config_id(config) -> str:
    k = config.kwargs
    return f"{k['BLOCK_M']}x{k['BLOCK_N']}x{k['BLOCK_K']}-w{config.num_warps}-s{config.num_stages}"


@pytest.mark.parametrize("config", _gpu_configs(), ids=_config_id)
def test_every_gather_config_equals_reference(config):
    """Each block shape the autotuner may pick (on a GPU with its warps and stages; the interpreter takes the blocks)
    gives the reference result, on groups that cross its tiles: an autotuner times its candidates and would happily
    keep a fast wrong one."""
    x_NI, weight_EOI, _, rows_R, offsets_E = make_case(40, 136, 264, [70, 0, 150, 9], 5, 0, torch.bfloat16)
    want = torch.ops.lrmoe.gather_grouped_mm(x_NI, weight_EOI, rows_R, offsets_E)
    got = gather_grouped_mm_triton(*on_device(x_NI, weight_EOI, rows_R, offsets_E), config=config)
    assert_close(got, want, torch.bfloat16, x_NI.shape[1])
    assert (got[229:] == 0).all()


@pytest.mark.parametrize(("config", "a_tma"), [(c, False) for c in _outer_gpu_configs()]
                         + [(c, True) for c in _outer_tma_gpu_configs()],
                         ids=[_config_id(c) for c in _outer_gpu_configs()]
                         + [f"tma-{_config_id(c)}" for c in _outer_tma_gpu_configs()])
def test_every_outer_config_equals_reference(config, a_tma):
    x_NI, _, a_RO, rows_R, offsets_E = make_case(40, 264, 136, [70, 0, 150, 9], 5, 0, torch.bfloat16)
    want = torch.ops.lrmoe.grouped_outer(a_RO, x_NI, rows_R, offsets_E)
    got = grouped_outer_triton(*on_device(a_RO, x_NI, rows_R, offsets_E), config=config, a_tma=a_tma)
    assert_close(got, want, torch.bfloat16, rows_R.shape[0])
    assert (got[1] == 0).all(), "the empty group gives zeros"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("a_tma", [None, False], ids=["a-desc-if-possible", "a-pointers"])
def test_values_outside_the_groups_never_leak(dtype, a_tma):
    """inf/NaN in source rows that no grouped row gathers, and in a rows past offsets[-1], stay out of the output
    (masking, not multiplying by zero; a_RO's descriptor, taken for bf16 on a GPU and always in the interpreter,
    reads zeros past a group's end)."""
    x_NI, weight_EOI, a_RO, rows_R, offsets_E = make_case(8, 24, 40, [5, 0, 6], 3, 0, dtype)
    x_NI = torch.cat([x_NI, torch.full((2, 24), float("nan"), dtype=dtype)])  # rows 8, 9: never gathered
    x_NI[9, 0] = float("inf")
    a_RO[11:] = float("nan")  # the padding rows
    y_RO = gather_grouped_mm_triton(*on_device(x_NI, weight_EOI, rows_R, offsets_E))
    w_EOI = grouped_outer_triton(*on_device(a_RO, x_NI, rows_R, offsets_E), a_tma=a_tma)
    assert y_RO.isfinite().all() and w_EOI.isfinite().all()
    check_outer(a_RO, x_NI, rows_R, offsets_E, a_tma)
    check_gather(x_NI, weight_EOI, rows_R, offsets_E)


@given(
    sizes=st.sampled_from([1, 3]).flatmap(lambda E: st.lists(st.integers(0, 20), min_size=E, max_size=E)),
    pad=st.integers(0, 3),
    cut=st.integers(0, 4),
    I=st.sampled_from([8, 24, 40]),
    O=st.sampled_from([8, 24, 40]),
    N=st.integers(1, 9),
    transposed=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_property_both_kernels_equal_reference(sizes, pad, cut, I, O, N, transposed, seed):
    cut = min(cut, sum(sizes) + pad)
    x_NI, weight_EOI, a_RO, rows_R, offsets_E = make_case(N, I, O, sizes, pad, cut, transposed=transposed, seed=seed)
    check_gather(x_NI, weight_EOI, rows_R, offsets_E)
    check_outer(a_RO, x_NI, rows_R, offsets_E)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("R, O, offsets", [(37, 40, [5, 5, 20]), (37, 40, [0, 0]), (37, 40, [10, 37]),
                                           (37, 40, [50]), (16, 8, [7]), (5, 3, [])])
def test_zero_rows_past_last_offset(R, O, offsets, dtype):
    y = torch.randn(R, O).to(dtype)
    y[3] = float("nan")  # values before the end stay as they are, NaN included
    want = y.clone()
    end = min(offsets[-1], R) if offsets else 0
    want[end:] = 0
    (got,) = on_device(y)
    out = zero_rows_past_last_offset_(got, torch.tensor(offsets, dtype=torch.int32, device=DEVICE))
    assert out is got  # in place
    assert torch.equal(got.cpu()[end:], want[end:]) and torch.equal(got.cpu()[:end].isnan(), want[:end].isnan())
    torch.testing.assert_close(got.cpu(), want, equal_nan=True, rtol=0, atol=0)


def _strided(t):
    """The same values as a non-contiguous view (every other element of a twice-as-long tensor)."""
    out = t.new_zeros(2 * t.shape[0]) - 7
    out[::2] = t
    return out[::2]


def test_strided_rows_and_offsets_are_read_as_their_values():
    # A strided offsets column (each expert's last (source, expert) group end) used to be read as a flat array:
    # every S-th group end instead of each expert's, a wrong grouping with no error (found on two GPUs).
    x_NI, weight_EOI, a_RO, rows_R, offsets_E = make_case(8, 40, 40, [5, 6, 0], 1, 0)
    rows_s, offs_s = _strided(rows_R), _strided(offsets_E)
    assert not rows_s.is_contiguous() and not offs_s.is_contiguous()
    check_gather(x_NI, weight_EOI, rows_s, offs_s)
    check_outer(a_RO, x_NI, rows_s, offs_s)
    y = torch.ones(12, 5, device=DEVICE)
    zero_rows_past_last_offset_(y, _strided(torch.tensor([2, 7], dtype=torch.int32)).to(DEVICE))
    assert y.cpu()[:7].eq(1).all() and y.cpu()[7:].eq(0).all()


@pytest.mark.skipif(INTERPRET, reason="host syncs exist only on a GPU")
def test_no_host_sync():
    x_NI, weight_EOI, a_RO, rows_R, offsets_E = on_device(*make_case(7, 40, 24, [3, 0, 18], 2, 0, torch.bfloat16))
    gather_grouped_mm_triton(x_NI, weight_EOI, rows_R, offsets_E)  # first calls autotune, which synchronises
    grouped_outer_triton(a_RO, x_NI, rows_R, offsets_E)
    with no_host_sync():
        gather_grouped_mm_triton(x_NI, weight_EOI, rows_R, offsets_E)
        grouped_outer_triton(a_RO, x_NI, rows_R, offsets_E)
