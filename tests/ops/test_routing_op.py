"""lrmoe::topk_ids: torch.library.opcheck, the ids against a sort written by hand from the definition (ties to the
lower column, -0.0 equal to +0.0, NaN largest), argument errors, non-differentiable output, and route_topk's
choice under ties."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lrmoe.functional import route_topk
from lrmoe.ops import topk_ids

VALUES = [0.0, -0.0, 1.0, -1.0, 0.25, 2.0, float("inf"), -float("inf"), float("nan")]


def _by_hand(x, k):
    def rank(e, v):
        return (0, 0.0, e) if math.isnan(v) else (1, -v, e)  # NaN first, then descending, then column

    return [[e for e, v in sorted(enumerate(row), key=lambda ev: rank(*ev))][:k] for row in x.tolist()]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [1, 3, 6])
def test_opcheck(dtype, k):
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(k)).to(dtype)
    torch.library.opcheck(topk_ids, (x, k))
    torch.library.opcheck(topk_ids, (x.requires_grad_(dtype != torch.bfloat16), k))


@given(t=st.integers(1, 6), e=st.integers(1, 12), data=st.data())
def test_property_ids_are_the_definition(t, e, data):
    k = data.draw(st.integers(1, e))
    x = torch.tensor(data.draw(st.lists(st.sampled_from(VALUES), min_size=t * e, max_size=t * e))).reshape(t, e)
    got = topk_ids(x, k)
    assert got.dtype == torch.int64 and got.tolist() == _by_hand(x, k)


@pytest.mark.parametrize("x,k,match", [
    (torch.randn(4), 1, "x_TE must be a 2-D float tensor"),
    (torch.ones(2, 3, dtype=torch.int64), 1, "x_TE must be a 2-D float tensor"),
    (torch.randn(2, 3), 4, r"k must be in \[1, E=3\], got 4"),
    (torch.randn(2, 3), 0, r"k must be in \[1, E=3\], got 0"),
])
def test_argument_errors_name_the_argument(x, k, match):
    with pytest.raises(ValueError, match=match):
        topk_ids(x, k)


def test_output_does_not_require_grad():
    assert not topk_ids(torch.randn(3, 4, requires_grad=True), 2).requires_grad


def test_route_topk_gives_ties_to_the_lower_expert():
    logits = torch.tensor([[0.0, 1.0, 1.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0, 2.0]])
    routing = route_topk(logits, 2, norm_topk_prob=False)
    assert routing.expert_ids.tolist() == [[1, 2], [0, 1]]
    torch.testing.assert_close(routing.gates, routing.scores.gather(1, routing.expert_ids))


@pytest.mark.parametrize("T,E,k", [(1, 3, 1), (4, 6, 2), (2, 5, 5)])
def test_ids_own_exactly_their_storage(T, E, k):
    # A view of a sort's [T, E] indices would keep all of them alive wherever the ids are saved (autograd saves
    # them for the gates' gather).
    ids = topk_ids(torch.randn(T, E), k)
    assert ids.is_contiguous() and ids.untyped_storage().nbytes() == T * k * 8
