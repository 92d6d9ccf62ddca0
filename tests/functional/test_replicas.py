"""Properties of lrmoe.functional.replicas.route_to_replicas, and a Python-loop reference of its documented rule:
local instance first, then the rest in source order over the remaining capacities in rank order, any excess to
the instance with the largest capacity (lowest rank among equals).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from lrmoe.functional import route_to_replicas


def ref_route(counts_SE: list[list[int]], cap_EW: list[list[int]]) -> np.ndarray:
    S, E = len(counts_SE), len(cap_EW)
    W = S
    split = np.zeros((S, E, W), dtype=np.int64)
    for e in range(E):
        left = list(cap_EW[e])
        rest = []
        for s in range(S):
            local = min(counts_SE[s][e], cap_EW[e][s])
            split[s, e, s] += local
            left[s] -= local
            rest.append(counts_SE[s][e] - local)
        biggest = max(range(W), key=lambda w: (cap_EW[e][w], -w))
        w = 0
        for s in range(S):
            r = rest[s]
            while r > 0 and w < W:
                if left[w] == 0:
                    w += 1
                    continue
                moved = min(r, left[w])
                split[s, e, w] += moved
                left[w] -= moved
                r -= moved
            split[s, e, biggest] += r
    return split


@st.composite
def replica_cases(draw, *, every_expert_placed: bool = True, fits: bool | None = None):
    W = draw(st.integers(1, 4))
    E = draw(st.integers(1, 4))
    counts = draw(st.lists(st.lists(st.integers(0, 12), min_size=E, max_size=E), min_size=W, max_size=W))
    cap = []
    for e in range(E):
        row = draw(st.lists(st.integers(0, 15), min_size=W, max_size=W))
        if every_expert_placed and not any(row):
            row[draw(st.integers(0, W - 1))] = draw(st.integers(1, 15))
        demand = sum(counts[s][e] for s in range(W))
        if fits is True and sum(row) < demand:  # top up one instance so the demand fits
            w = next(i for i, c in enumerate(row) if c > 0) if any(row) else 0
            row[w] += demand - sum(row)
        cap.append(row)
    dtype = draw(st.sampled_from([torch.int64, torch.int32]))
    return counts, cap, dtype


def _run(counts, cap, dtype=torch.int64):
    split = route_to_replicas(torch.tensor(counts, dtype=dtype), torch.tensor(cap, dtype=dtype))
    assert split.dtype == torch.int64
    assert split.shape == (len(counts), len(cap), len(counts))
    return split.numpy()


@given(replica_cases())
@example(([[5, 0], [7, 3]], [[2, 2], [0, 1]], torch.int64))  # both experts overflow
@example(([[0]], [[0]], torch.int64))
def test_route_to_replicas_contract(case):
    counts, cap, dtype = case
    split = _run(counts, cap, dtype)
    C, K = np.array(counts), np.array(cap)
    S, E = C.shape
    assert (split >= 0).all()
    # Every pair is assigned, exactly once.
    np.testing.assert_array_equal(split.sum(-1), C)
    # Only ranks with an instance of the expert receive pairs.
    assert (split[:, K == 0] == 0).all()
    demand, supply = C.sum(0), K.sum(1)
    per_rank = split.sum(0)  # [E, W]
    for e in range(E):
        for s in range(S):
            local = min(C[s, e], K[e, s])
            if demand[e] <= supply[e]:
                # Local first: the source's own instance takes what fits.
                assert split[s, e, s] == local
            else:
                assert split[s, e, s] >= local
        if demand[e] <= supply[e]:
            assert (per_rank[e] <= K[e]).all()
        else:
            # Overflow: every instance full, exactly one instance over capacity: the biggest.
            over = np.nonzero(per_rank[e] > K[e])[0].tolist()
            assert over == [int(np.argmax(K[e]))]
            assert (per_rank[e][K[e] > 0] >= K[e][K[e] > 0]).all()
    np.testing.assert_array_equal(split, ref_route(counts, cap))


@given(replica_cases(fits=True))
def test_fitting_demand_never_exceeds_capacity(case):
    counts, cap, dtype = case
    split = _run(counts, cap, dtype)
    assert (split.sum(0) <= np.array(cap)).all()
    np.testing.assert_array_equal(split.sum(-1), np.array(counts))


@given(replica_cases(every_expert_placed=False))
def test_deterministic(case):
    counts, cap, dtype = case
    a = _run(counts, cap, dtype)
    b = _run([row[:] for row in counts], [row[:] for row in cap], dtype)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a.sum(-1), np.array(counts))


def test_by_hand():
    # One expert on ranks 0 and 1 (capacity 3 each), 2 ranks: source 0 sends 5, source 1 sends 0.
    split = _run([[5], [0]], [[3, 3]])
    assert split[0, 0].tolist() == [3, 2] and split[1, 0].tolist() == [0, 0]
    # Demand 9 > capacity 6: rank 1 (the bigger instance) takes the excess.
    split = _run([[5], [4]], [[2, 4]])
    assert split[0, 0].tolist() == [2, 3] and split[1, 0].tolist() == [0, 4]
    assert split.sum(0)[0].tolist() == [2, 7]


@pytest.mark.parametrize(
    "counts, cap, exc, name",
    [
        (torch.ones(2, 3, dtype=torch.int64), torch.ones(3, 4, dtype=torch.int64), ValueError, "counts_SE"),
        (torch.ones(2, 3, dtype=torch.int64), torch.ones(4, 2, dtype=torch.int64), ValueError, "capacity_EW"),
        (torch.ones(2, 3), torch.ones(3, 2, dtype=torch.int64), TypeError, "counts_SE"),
        (torch.ones(2, 3, dtype=torch.int64), torch.ones(3, 2), TypeError, "capacity_EW"),
        (torch.ones(3, dtype=torch.int64), torch.ones(3, 2, dtype=torch.int64), ValueError, "counts_SE"),
    ],
)
def test_route_to_replicas_errors_name_the_argument(counts, cap, exc, name):
    with pytest.raises(exc, match=name):
        route_to_replicas(counts, cap)
