"""lrmoe_kernels.quotas.waterfill_triton (lrmoe::waterfill's CUDA kernel) gives exactly the reference's quotas:
random loads and floors (zeros, equal loads, floors at the load), budgets from nothing to more than every load,
floors that alone exceed the budget, one group, groups that do not fill a power of two, no groups.

Without a GPU the kernel runs in Triton's interpreter (tests/conftest.py switches it on) on CPU tensors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from lrmoe_kernels.quotas import waterfill_triton

from lrmoe.ops.quotas import waterfill_reference
from lrmoe_kernels.launch import interpreting

INTERPRET = interpreting()
DEVICE = "cpu" if INTERPRET else "cuda"
pytestmark = pytest.mark.skipif(
    not INTERPRET and not torch.cuda.is_available(), reason="needs a CUDA device or TRITON_INTERPRET=1"
)


def _check(loads, floors, budget):
    loads, floors, budget = (torch.tensor(v, dtype=torch.int64) for v in (loads, floors, budget))
    got = waterfill_triton(loads.to(DEVICE), floors.to(DEVICE), budget.to(DEVICE)).cpu()
    want = waterfill_reference(loads, floors, budget)
    assert got.dtype == torch.int64 and torch.equal(got, want), (loads, floors, budget, got, want)
    return got


def test_by_hand():
    # loads 5, 1, 8, 3; budget 10: level 3 keeps 3 + 1 + 3 + 3 = 10
    assert _check([5, 1, 8, 3], [0, 0, 0, 0], 10).tolist() == [3, 1, 3, 3]
    # budget 11: level 3 and one more for the first group still growing (group 0)
    assert _check([5, 1, 8, 3], [0, 0, 0, 0], 11).tolist() == [4, 1, 3, 3]
    # floors 2, 0, 6, 0 over budget 7: the floors alone (8) exceed it and stay
    assert _check([5, 1, 8, 3], [2, 0, 6, 0], 7).tolist() == [2, 0, 6, 0]
    # more budget than load: every load
    assert _check([5, 1, 8, 3], [0, 0, 0, 0], 100).tolist() == [5, 1, 8, 3]


def test_strided_loads_and_floors_are_read_as_their_values():
    # [S, E] loads planned per column (one column of a 2-D plan) are a strided view.
    loads_SE, floors_SE = torch.tensor([[5, 9], [1, 9], [8, 9], [3, 9]]), torch.zeros(4, 2, dtype=torch.int64)
    got = waterfill_triton(loads_SE[:, 0].to(DEVICE), floors_SE[:, 0].to(DEVICE), torch.tensor(10, device=DEVICE))
    assert got.cpu().tolist() == [3, 1, 3, 3]  # test_by_hand's first case


@pytest.mark.parametrize("G", [0, 1, 3, 128, 130])
def test_sizes(G):
    g = torch.Generator().manual_seed(G)
    loads = torch.randint(0, 700, (G,), generator=g)
    floors = (loads * torch.rand(G, generator=g) * 0.3).long()
    for budget in (0, int(loads.sum()) // 3, int(loads.sum()) * 3 // 4, int(loads.sum())):
        _check(loads.tolist(), floors.tolist(), budget)


@given(data=st.data())
def test_property_equal_to_reference(data):
    loads = data.draw(st.lists(st.integers(0, 60), min_size=1, max_size=40))
    floors = [data.draw(st.integers(0, load)) for load in loads]
    budget = data.draw(st.integers(-3, sum(loads) + 5))
    _check(loads, floors, budget)
