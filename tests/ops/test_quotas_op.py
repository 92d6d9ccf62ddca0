"""lrmoe::waterfill: torch.library.opcheck, the quotas against a brute-force search for the level written from the
definition, argument errors, and non-differentiable integer output."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lrmoe.ops import waterfill


def _by_hand(loads, floors, budget):
    def kept(level):
        return sum(min(max(level, f), ld) for ld, f in zip(loads, floors))

    level = max([lv for lv in range(max(loads, default=0) + 1) if kept(lv) <= budget], default=0)
    quotas = [min(max(level, f), ld) for ld, f in zip(loads, floors)]
    short = budget - sum(quotas)
    for g, (ld, f) in enumerate(zip(loads, floors)):
        if short > 0 and f <= level < ld:
            quotas[g] += 1
            short -= 1
    return quotas


def _args(loads, floors, budget):
    return tuple(torch.tensor(v, dtype=torch.int64) for v in (loads, floors, budget))


@given(data=st.data())
def test_property_quotas_are_the_definition(data):
    loads = data.draw(st.lists(st.integers(0, 30), min_size=0, max_size=12))
    floors = [data.draw(st.integers(0, load)) for load in loads]
    budget = data.draw(st.integers(0, sum(loads) + 3))
    got = waterfill(*_args(loads, floors, budget))
    assert got.dtype == torch.int64 and got.tolist() == _by_hand(loads, floors, budget)


@pytest.mark.parametrize("case", [([5, 1, 8, 3], [0, 0, 0, 0], 11), ([4, 4], [1, 3], 2), ([7], [0], 0)])
def test_opcheck(case):
    torch.library.opcheck(waterfill, _args(*case))


@pytest.mark.parametrize("args,match", [
    (([1.0, 2.0], [0, 0], 2), "loads_G must be a 1-D int64 tensor"),
    (([[1, 2]], [0, 0], 2), "loads_G must be a 1-D int64 tensor"),
    (([1, 2], [0, 0, 0], 2), r"floors_G must have the shape of loads_G \(2,\)"),
    (([1, 2], [0, 0], [2, 3]), "budget must be one int64 value"),
])
def test_argument_errors_name_the_argument(args, match):
    loads, floors, budget = args
    tensors = [torch.tensor(loads), torch.tensor(floors, dtype=torch.int64), torch.tensor(budget, dtype=torch.int64)]
    with pytest.raises(ValueError, match=match):
        waterfill(*tensors)


def test_output_is_not_differentiable():
    quotas = waterfill(*_args([5, 1, 8, 3], [0, 0, 0, 0], 10))
    assert not quotas.requires_grad and quotas.tolist() == [3, 1, 3, 3]
