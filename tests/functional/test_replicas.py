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

from lrmoe.functional import (
    balanced_capacity,
    instance_experts,
    place_hot_replicas,
    route_to_replicas,
)


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
        (torch.ones(2, 2, dtype=torch.bool), torch.ones(2, 2, dtype=torch.int64), TypeError, "counts_SE"),
        # No source at all: S = W = 0 was an IndexError from the transport.
        (torch.ones(0, 2, dtype=torch.int64), torch.ones(2, 0, dtype=torch.int64), ValueError, "counts_SE"),
    ],
)
def test_route_to_replicas_errors_name_the_argument(counts, cap, exc, name):
    with pytest.raises(exc, match=name):
        route_to_replicas(counts, cap)


# ------------------------------------------------------------------------------------ placement of replicas


@st.composite
def placement_cases(draw):
    W = draw(st.integers(1, 4))
    L = draw(st.integers(1, 3))
    E = W * L
    R = draw(st.integers(0, 3))
    shape = draw(st.sampled_from(["random", "hot", "zeros"]))
    if shape == "random":
        loads = draw(st.lists(st.integers(0, 30), min_size=W * E, max_size=W * E))
    elif shape == "hot":
        hot = draw(st.integers(0, E - 1))
        loads = [draw(st.integers(20, 60)) if e == hot else draw(st.integers(0, 3)) for _ in range(W) for e in range(E)]
    else:
        loads = [0] * (W * E)
    return torch.tensor(loads, dtype=torch.int64).view(W, E), R


def _modeled_rank_loads(load_E: list[int], hosts: list[set[int]]) -> list[float]:
    n = [sum(e in h for h in hosts) for e in range(len(load_E))]
    return [sum(load_E[e] / n[e] for e in h) for h in hosts]


@given(placement_cases())
@example((torch.tensor([[50, 5, 5, 5], [50, 5, 5, 5]]), 1))
@example((torch.tensor([[0, 0, 0], [0, 0, 0], [0, 1, 1]]), 1))
def test_hot_replicas_contract(case):
    loads_WE, R = case
    W, E = loads_WE.shape
    L = E // W
    rep = place_hot_replicas(loads_WE, R)
    assert rep.shape == (W, R) and rep.dtype == torch.int64
    assert torch.equal(rep, place_hot_replicas(loads_WE.clone(), R))  # deterministic
    load_E = loads_WE.sum(0).tolist()
    hosts = [set(range(w * L, (w + 1) * L)) for w in range(W)]
    for w in range(W):
        placed = [e for e in rep[w].tolist() if e >= 0]
        assert all(0 <= e < E for e in placed)
        # A replica is never on its owner, and a rank holds at most one instance of an expert.
        assert not set(placed) & hosts[w] and len(set(placed)) == len(placed)
        # Filled slots come first.
        assert rep[w].tolist() == placed + [-1] * (R - len(placed))
        assert all(load_E[e] > 0 for e in placed)  # an idle expert never gets a replica
    # The modeled load of the busiest rank never rises. Each replica lowers every rank holding its expert and
    # raises one rank to below the old load of the busiest of those, so the rank loads sorted in descending order
    # fall lexicographically whenever a replica was placed; the maximum alone need not fall (two ranks tied at
    # the top, one replica: Hypothesis found loads [[0, 0, 0], [0, 0, 0], [0, 1, 1]] with R = 1).
    before = sorted(_modeled_rank_loads(load_E, hosts), reverse=True)
    for w in range(W):
        hosts[w] |= {e for e in rep[w].tolist() if e >= 0}
    after = sorted(_modeled_rank_loads(load_E, hosts), reverse=True)
    assert after[0] <= before[0] + 1e-9
    if (rep >= 0).any():
        first = next((i for i, (a, b) in enumerate(zip(after, before)) if abs(a - b) > 1e-9), None)
        assert first is not None and after[first] < before[first]


def test_hot_replicas_by_hand():
    # Expert 0 (rank 0) takes 100 of 130 pairs: its replica goes to rank 1, then rank 0's free slot takes one of
    # rank 1's experts (2, the lower of two equal ones), which evens the modeled loads at 65 and 65.
    loads = torch.tensor([[50, 5, 5, 5], [50, 5, 5, 5]])
    assert place_hot_replicas(loads, 1).tolist() == [[2], [0]]
    # A balanced load gets no replica: none would lower the busiest rank.
    assert place_hot_replicas(torch.full((2, 4), 5), 2).tolist() == [[-1, -1], [-1, -1]]
    assert place_hot_replicas(loads, 0).shape == (2, 0)


def test_instances_and_balanced_capacity():
    rep = torch.tensor([[3], [-1]])
    inst = instance_experts(rep, 4)
    assert inst.tolist() == [[0, 1, 3], [2, 3, -1]]
    # Expert 3 has two instances (rank 1 owns it, rank 0 holds a replica): ceil(7 / 2) = 4 each.
    cap = balanced_capacity(torch.tensor([2, 0, 5, 7]), inst)
    assert cap.tolist() == [[2, 0], [0, 0], [0, 5], [4, 4]]
    split = route_to_replicas(torch.tensor([[1, 0, 2, 3], [1, 0, 3, 4]]), cap)
    assert (split.sum(0) <= cap).all() and torch.equal(split.sum(-1), torch.tensor([[1, 0, 2, 3], [1, 0, 3, 4]]))


@pytest.mark.parametrize("R, loads, exc, name", [
    (-1, torch.ones(2, 4, dtype=torch.int64), ValueError, "max_replicas"),
    (1.5, torch.ones(2, 4, dtype=torch.int64), ValueError, "max_replicas"),
    (True, torch.ones(2, 4, dtype=torch.int64), ValueError, "max_replicas"),  # a bool is not a count
    (1, torch.ones(3, 4, dtype=torch.int64), ValueError, "loads_WE"),
    (1, torch.ones(2, 4), TypeError, "loads_WE"),
    (1, torch.ones(0, 4, dtype=torch.int64), ValueError, "loads_WE"),  # W = 0: was a ZeroDivisionError
    (1, torch.ones(2, 0, dtype=torch.int64), ValueError, "loads_WE"),  # E = 0: was an IndexError from argmax
])
def test_place_hot_replicas_errors_name_the_argument(R, loads, exc, name):
    with pytest.raises(exc, match=name):
        place_hot_replicas(loads, R)


def test_instance_experts_keeps_int64_for_any_integer_placement():
    inst = instance_experts(torch.tensor([[3], [-1]], dtype=torch.int32), 4)
    assert inst.dtype == torch.int64 and inst.tolist() == [[0, 1, 3], [2, 3, -1]]


@pytest.mark.parametrize("replicas, num_experts, exc, name", [
    (torch.tensor([[3], [-1]]), 4.0, TypeError, "num_experts"),  # was a float32 result
    (torch.tensor([[-1]]), True, TypeError, "num_experts"),  # was taken as 1
    (torch.tensor([[3], [-1]]), 3, ValueError, "num_experts"),  # E % W != 0: was an opaque reshape error
    (torch.tensor([[3], [-1]]), 0, ValueError, "num_experts"),
    (torch.empty(0, 1, dtype=torch.int64), 4, ValueError, "replicas_WR"),  # W = 0
    (torch.tensor([[3.0], [-1.0]]), 4, TypeError, "replicas_WR"),
    (torch.tensor([3, -1]), 4, ValueError, "replicas_WR"),
])
def test_instance_experts_errors_name_the_argument(replicas, num_experts, exc, name):
    with pytest.raises(exc, match=name):
        instance_experts(replicas, num_experts)


_INST = torch.tensor([[0, 1, 3], [2, 3, -1]])  # E = 4 over W = 2, one replica slot


@pytest.mark.parametrize("loads, experts, exc, name", [
    (torch.tensor([2.0, 0.0, 5.0, 7.0]), _INST, TypeError, "loads_E"),  # floats were truncated
    (torch.tensor([[2, 0, 5, 7]]), _INST, ValueError, "loads_E"),
    (torch.tensor([2, 0, 5, 7]), _INST.float(), TypeError, "experts_WI"),
    (torch.tensor([2, 0, 5, 7]), _INST[0], ValueError, "experts_WI"),
    (torch.tensor([2, 0, 5]), _INST, ValueError, "loads_E"),  # E % W != 0
    (torch.tensor([2, 0, 5, 7, 1, 1, 1, 1]), _INST[:, :1], ValueError, "experts_WI"),  # I < E / W: E differs
    (torch.tensor([2, 0, 5, 7]), torch.empty(0, 3, dtype=torch.int64), ValueError, "experts_WI"),  # W = 0
])
def test_balanced_capacity_errors_name_the_argument(loads, experts, exc, name):
    with pytest.raises(exc, match=name):
        balanced_capacity(loads, experts)


def test_plan_makes_no_tensor_from_host_data_on_a_device(monkeypatch):
    """torch.tensor / torch.as_tensor with a device copy host memory to it, which on CUDA waits for the stream (a
    hidden synchronisation the sync-debug mode does not flag). The whole expert-parallel plan, replicas and
    capacity included, runs here on the meta device with both constructors refusing any device but the CPU."""
    from lrmoe.nn.expert_parallel import plan_expert_parallel

    for name in ("tensor", "as_tensor"):
        original = getattr(torch, name)

        def refuse(*args, _original=original, _name=name, **kwargs):
            device = kwargs.get("device")
            if device is not None and torch.device(device).type != "cpu":
                raise AssertionError(f"torch.{_name}(..., device={device}) in the plan: a copy from host memory")
            return _original(*args, **kwargs)

        monkeypatch.setattr(torch, name, refuse)
    loads_WE = torch.empty(4, 16, dtype=torch.int64, device="meta")
    plan = plan_expert_parallel(loads_WE, 0.5, max_replicas=2, capacity_factor=1.25)
    assert plan.instances.device.type == "meta" and plan.quotas.device.type == "meta"
    with pytest.raises(AssertionError, match="copy from host memory"):  # the guard itself works
        torch.tensor(1.0, device="meta")
