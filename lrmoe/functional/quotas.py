"""Backward quotas: how many token-expert pairs of each expert (and each source rank) backward keeps.

Shapes: S source ranks (1 on a single device), E experts (or G expert instances), W ranks (with capacity).

All arithmetic is integer arithmetic on device tensors of static shape: the plan never leaves the device, so
planning costs no host synchronisation and traces into a compiled graph.
"""

from __future__ import annotations

import torch

from lrmoe.functional._checks import (
    check_at_least,
    check_choice,
    check_in_range,
    check_retain,
    check_same_size,
    check_tensor,
    checking,
    is_integer,
)
from lrmoe.ops.quotas import one_hot, per_rank, waterfill, waterfill_reference

__all__ = ["apportion", "plan_quotas"]

POLICIES = ("waterfill", "proportional")


def plan_quotas(
    loads_SE: torch.Tensor,
    retain: float,
    *,
    min_retain: float = 0.0,
    policy: str = "waterfill",
    capacity: torch.Tensor | None = None,
    placement: torch.Tensor | None = None,
    align: int = 1,
) -> torch.Tensor:
    """Plan per-(source, group) backward quotas from routed loads. A group is an expert or an expert instance.

    Args:
        loads_SE: [S, G] (or [G]) integer, pairs routed from each source rank to each group. A negative load
            counts as 0 (refusing it would need a sync; checking mode, ``lrmoe.checks``, refuses it).
        retain: fraction of all pairs backward keeps, a real number in (0, 1] (Python or NumPy; taken as a Python
            float). The budget is floor(retain * total load).
        min_retain: every group keeps at least ceil(min_retain * its load) pairs; in [0, retain].
        policy: "waterfill" trims only the groups above a common level lambda: a group keeps
            max(floor, min(load, lambda)) or one more, which flattens the backward load; "proportional" keeps
            the same fraction of every group (largest-remainder rounding); with floors, each group keeps its
            floor plus the same fraction of the load above it.
        capacity: [W] integer, the most rows each rank's expert backward may take; given together with
        placement: [G] integer in [0, W) (checked in checking mode only: a sync), the rank that runs each group's
            backward. Rank w's quotas then sum to at most capacity[w]. Without placement, capacity is [G], one
            per group (the same plan as placement = arange(G), with no per-rank sums: with "waterfill", one
            waterfill of min(load, capacity)). Capacity is a hard limit (it stands for
            memory): where a rank's floors alone exceed it, its floors shrink by waterfill to fit. Each rank
            first gets its own bound per group (its capacity spread over its groups by the policy, only where
            its load exceeds it), then the budget is spread over all groups by the policy under those bounds:
            "waterfill" keeps clamp(lambda, floor, bound); "proportional" keeps the floor plus one common
            fraction of the load above it on every rank that has room, and the rank's bound on the others.
        align: a positive int; > 1 rounds the quotas of the groups the policy trims (quota < load) to multiples of
            ``align`` with the same total: each goes down to a multiple (not below its floor), then the pairs this
            frees go back, each group up to its next multiple (never past its load), to the trimmed groups with
            the largest round-off first (ties to the lower group), the last remainder to one group. A grouped GEMM
            with ``align``-row tiles (128 for torch._grouped_mm on an H200) then runs no partial tile in those
            groups (benchmarks/gemm.py layouts: +-22 rows around 512 cost it 12-26 %). Quotas below
            ``align`` stay as they are: they fill one partial tile either way, and rounding them would move whole
            experts in or out of the backward. Each quota moves by less than ``align``; not with ``capacity``
            (the steps could pass a rank's capacity).

    Returns:
        quotas_SE: int64, same shape as ``loads_SE``. Invariants (``align`` keeps them all): 0 <= quota <= load;
        retain = 1 without a binding capacity gives quota == load; the total equals min(budget, what the
        capacities can hold) exactly (proportional under a binding capacity: up to rounding) unless the floors
        alone exceed the budget (then every group keeps its floor, capacity permitting); each group's quota is
        split over sources in proportion to their loads (largest remainder, ties to the lower source index).
        With capacity, sum of quotas of the groups placed on rank w <= max(capacity[w], 0). Deterministic.
    """
    check_tensor("loads_SE", loads_SE, ndim=(1, 2), kind="int")
    retain, min_retain = check_retain(retain, min_retain)
    check_choice("policy", policy, POLICIES)
    if not is_integer(align) or align < 1:
        raise ValueError(f"align must be a positive int (rows per GEMM tile), got {align!r}")
    align = int(align)
    if align > 1 and capacity is not None:
        raise ValueError("align > 1 cannot be combined with capacity: the aligned steps could pass a rank's "
                         "capacity; pass align=1 with capacity")
    n_groups = loads_SE.shape[-1]
    if placement is not None and capacity is None:
        raise ValueError("placement needs capacity: it names the rank whose capacity each group uses, and "
                         "capacity is missing")
    if capacity is not None:
        check_tensor("capacity", capacity, ndim=1, kind="int")
        if placement is None and capacity.shape[0] != n_groups:
            raise ValueError(f"capacity without placement holds one capacity per group, shape [{n_groups}], got "
                             f"{tuple(capacity.shape)}; pass placement to give per-rank capacities")
        if placement is not None:
            check_tensor("placement", placement, ndim=1, kind="int")
            if placement.shape[0] != n_groups:
                raise ValueError(f"placement must have one rank per group, shape [{n_groups}], got "
                                 f"{tuple(placement.shape)}")
    if checking():  # lrmoe.checks: the contracts the fast path cannot check without a sync
        check_at_least("loads_SE", loads_SE, 0, "pairs routed")
        check_at_least("capacity", capacity, 0, "rows a rank's backward may take")
        if placement is not None:
            check_in_range("placement", placement, 0, capacity.shape[0], "the rank of each group, W = capacity's "
                           "length")

    if retain >= 1.0 and capacity is None:
        # Every pair kept: quota == load whatever the policy and floors (the invariant above), with no planning.
        # A copy: the result never aliases the input (ops such as lrmoe::ep_plan return it).
        return loads_SE.to(torch.int64, copy=True).clamp_(min=0)
    one_source = loads_SE.dim() == 1
    # Negative loads (no router gives them; refusing them would need a sync) count as 0.
    loads_SE = loads_SE.long().reshape(1 if one_source else loads_SE.shape[0], n_groups).clamp(min=0)
    loads_E = loads_SE.sum(0)
    budget = (loads_E.sum().double() * retain).floor().long()
    # ceil(min_retain * load), less a slack of 1e-12 * max(product, 1) so that 0.3 * 10 = 3.0000000000000004
    # stays 3 (the product's rounding error is below 1e-15 relative); an absolute 1e-6 made ceil(0.1000001 * 10) 1,
    # not 2. Zeros, with no arithmetic, at min_retain 0.
    if min_retain > 0:
        want_E = loads_E.double() * min_retain
        floors_E = torch.minimum((want_E - 1e-12 * want_E.clamp(min=1)).ceil().clamp(min=0).long(), loads_E)
    else:
        floors_E = torch.zeros_like(loads_E)

    if capacity is not None:
        quotas_E = _plan_with_capacity(loads_E, floors_E, budget, capacity.long(),
                                       None if placement is None else placement.long(), policy,
                                       floors=min_retain > 0)
    elif policy == "waterfill":
        quotas_E = waterfill(loads_E, floors_E, budget)
    else:
        # Floors first, then what is left of the budget over the room above them, in proportion. (Raising the
        # proportional shares to the floors afterwards would overshoot the budget.)
        rest = (budget - floors_E.sum()).clamp(min=0).reshape(1)
        quotas_E = floors_E + apportion(rest, (loads_E - floors_E).unsqueeze(1)).squeeze(1)
    if align > 1:
        quotas_E = _align(quotas_E, loads_E, floors_E, align)

    if loads_SE.shape[0] == 1:  # one source keeps its expert's whole quota (apportion would give the same)
        return quotas_E if one_source else quotas_E.unsqueeze(0)
    return apportion(quotas_E, loads_SE)


def _align(quotas_G: torch.Tensor, loads_G: torch.Tensor, floors_G: torch.Tensor, align: int) -> torch.Tensor:
    """Trimmed groups' quotas to multiples of ``align``, total unchanged (plan_quotas' ``align``).

    Down: q' = max(floor, align * (q // align)) for q < load. Every trimmed group has room up to the next
    multiple above q' or its load, which is more than it gave up (both pass q: q' >= align * (q // align), and
    q < load), so the freed pairs always fit: handed out in order of round-off (q - q') descending, each group
    takes min(its room, what is left). A group whose floor sat between two multiples ends on the next multiple.
    Quotas under one step are left out, giving and taking nothing.
    """
    trimmed_G = (quotas_G < loads_G) & (quotas_G >= align)
    down_G = torch.where(trimmed_G, torch.maximum(floors_G, quotas_G - quotas_G % align), quotas_G)
    cut_G = quotas_G - down_G
    room_G = torch.where(trimmed_G, torch.minimum(loads_G, down_G - down_G % align + align) - down_G, 0)
    order_G = torch.argsort(cut_G, descending=True, stable=True)
    room_in_order = room_G.index_select(0, order_G)
    before_in_order = torch.cumsum(room_in_order, 0) - room_in_order
    give_in_order = torch.minimum(room_in_order, (cut_G.sum() - before_in_order).clamp(min=0))
    return down_G + torch.empty_like(give_in_order).scatter_(0, order_G, give_in_order)


def _plan_with_capacity(loads_G, floors_G, budget, capacity_W, rank_G, policy, floors=True):
    """Quotas per group under per-rank capacities (plan_quotas' docstring): floors shrunk to fit, per-rank bounds,
    then the budget under those bounds. ``floors=False``: min_retain is 0, so the floors are all zero and stay
    zero (no waterfill of them: it would return zeros). ``rank_G`` None: one capacity per group."""
    n_ranks = capacity_W.shape[0]
    cap_W = capacity_W.clamp(min=0)
    if rank_G is None:
        if policy == "waterfill":
            # One group per rank: its floor shrinks to the capacity and its bound is min(load, capacity), what
            # the per-rank waterfills below give, without their [2G+1, W] sums (scatters on every rank).
            bound_G = torch.minimum(loads_G, cap_W)
            return waterfill(bound_G, torch.minimum(floors_G, cap_W), torch.minimum(budget, bound_G.sum()))
        rank_G = torch.arange(n_ranks, device=loads_G.device)
    if floors:
        # Capacity wins over min_retain: a rank whose floors exceed it keeps a waterfilled share of them.
        floors_G = waterfill_reference(floors_G, torch.zeros_like(floors_G), cap_W, rank_G)
    rest_G = loads_G - floors_G
    over_W = per_rank(loads_G, rank_G, n_ranks) > cap_W
    if policy == "waterfill":
        bound_G = waterfill_reference(loads_G, floors_G, cap_W, rank_G)
        return waterfill(bound_G, floors_G, torch.minimum(budget, bound_G.sum()))

    # Proportional. A rank over capacity spreads what its floors leave of it over its groups in proportion to
    # the load above the floors.
    room_W = (cap_W - per_rank(floors_G, rank_G, n_ranks)).clamp(min=0)
    onehot_GW = one_hot(rank_G, n_ranks) * over_W.long().unsqueeze(0)
    shares_G = (apportion(room_W * over_W, rest_G.unsqueeze(1) * onehot_GW) * onehot_GW).sum(1)
    bound_G = torch.where(over_W.index_select(0, rank_G), floors_G + shares_G, loads_G)
    # Then one common fraction of the rest on every rank with room. A rank whose share would exceed its capacity
    # is held at its bound and the others share what is left; that only raises their fraction, so ranks are held
    # in order and W rounds settle it.
    rest_budget = (budget - floors_G.sum()).clamp(min=0)
    held_G = torch.zeros_like(loads_G, dtype=torch.bool)
    for _ in range(n_ranks + 1):
        free_G = ~held_G
        left = (rest_budget - torch.where(held_G, bound_G - floors_G, 0).sum()).clamp(min=0)
        share_G = apportion(left.reshape(1), (rest_G * free_G).unsqueeze(1)).squeeze(1)
        trial_G = torch.where(free_G, floors_G + share_G, bound_G)
        burst_W = over_W & (per_rank(trial_G, rank_G, n_ranks) > cap_W)
        held_G = held_G | burst_W.index_select(0, rank_G)
    # Rounding (or a budget the capacities cannot hold) may leave a share above its bound: the bound wins.
    return torch.minimum(trial_G, bound_G)


def apportion(total_G: torch.Tensor, weights_SG: torch.Tensor) -> torch.Tensor:
    """Split each ``total_G[g]`` over the S rows of ``weights_SG[:, g]`` in proportion (largest remainder).

    Exact integer arithmetic: row s gets floor(total * w_s / sum w) plus one for the ``total - sum floor`` rows
    with the largest remainders (ties to the lower row). When total_G <= sum of weights, no row gets more than
    its weight. A column whose weights sum to zero gets zeros. Both integer tensors, total_G [G] and weights_SG
    [S, G]; weights >= 0 (checked in checking mode only: a sync).
    """
    check_tensor("total_G", total_G, ndim=1, kind="int")
    check_tensor("weights_SG", weights_SG, ndim=2, kind="int")
    check_same_size("total_G", total_G, 0, "weights_SG", weights_SG, 1)
    if checking():
        check_at_least("total_G", total_G, 0, "totals to split")
        check_at_least("weights_SG", weights_SG, 0, "weights")
    weights_SG = weights_SG.long()
    num_SG = total_G.long().unsqueeze(0) * weights_SG
    sum_G = weights_SG.sum(0)
    den_G = sum_G.clamp(min=1)
    base_SG = torch.div(num_SG, den_G, rounding_mode="floor")
    rem_SG = num_SG - base_SG * den_G
    short_G = torch.where(sum_G > 0, total_G - base_SG.sum(0), 0)
    order_SG = torch.argsort(rem_SG, dim=0, descending=True, stable=True)
    rows_SG = torch.arange(weights_SG.shape[0], device=weights_SG.device).unsqueeze(1).expand_as(order_SG)
    rank_SG = torch.empty_like(order_SG).scatter_(0, order_SG, rows_SG)
    return base_SG + (rank_SG < short_G.unsqueeze(0)).long()
