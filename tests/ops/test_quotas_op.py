"""lrmoe::waterfill: torch.library.opcheck, argument errors, and non-differentiable integer output. Its quotas
against the documented rule walked by hand: tests/functional/test_quotas.py (test_waterfill_op_is_the_rule)."""

from __future__ import annotations

import pytest
import torch

from lrmoe.ops import waterfill


def _args(loads, floors, budget):
    return tuple(torch.tensor(v, dtype=torch.int64) for v in (loads, floors, budget))


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
