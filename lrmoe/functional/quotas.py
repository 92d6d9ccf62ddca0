"""Backward quotas: how many token-expert pairs of each expert (and each source rank) backward keeps.

Shapes: S source ranks (1 on a single device), E experts (or expert instances).

All arithmetic is integer arithmetic on device tensors of static shape: the plan never leaves the device, so
planning costs no host synchronisation and traces into a compiled graph.
"""

from __future__ import annotations

import torch

from lrmoe.functional._checks import check_choice, check_retain, check_tensor

__all__ = ["plan_quotas", "apportion"]

POLICIES = ("waterfill", "proportional")


def plan_quotas(
    loads_SE: torch.Tensor,
    retain: float,
    *,
    min_retain: float = 0.0,
    policy: str = "waterfill",
    capacity: torch.Tensor | None = None,
    placement: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plan per-(source, expert) backward quotas from routed loads.

    Args:
        loads_SE: [S, E] (or [E]) integer, pairs routed from each source rank to each expert.
        retain: fraction of all pairs backward keeps, in (0, 1]. The budget is floor(retain * total load).
        min_retain: every expert keeps at least ceil(min_retain * its load) pairs; in [0, retain].
        policy: "waterfill" trims only the experts above a common level lambda: an expert keeps
            max(floor, min(load, lambda)) or one more, which flattens the backward load; "proportional" keeps
            the same fraction of every expert (largest-remainder rounding); with floors, each expert keeps its
            floor plus the same fraction of the load above it.
        capacity, placement: per-rank backward capacity and expert placement for expert parallelism; not
            implemented on this path yet (a later issue), so they must be None.

    Returns:
        quotas_SE: int64, same shape as ``loads_SE``. Invariants: 0 <= quota <= load; retain = 1 gives
        quota == load; the total equals the budget exactly unless the min_retain floors alone exceed it (then
        every expert keeps its floor); each expert's quota is split over sources in proportion to their loads
        (largest remainder, ties to the lower source index). Deterministic.
    """
    check_tensor("loads_SE", loads_SE, ndim=(1, 2), kind="int")
    check_retain(retain, min_retain)
    check_choice("policy", policy, POLICIES)
    if capacity is not None or placement is not None:
        raise NotImplementedError(
            "plan_quotas: capacity and placement belong to expert parallelism and are not implemented yet; "
            "pass capacity=None, placement=None"
        )

    one_source = loads_SE.dim() == 1
    loads_SE = loads_SE.long().reshape(-1, loads_SE.shape[-1])
    loads_E = loads_SE.sum(0)
    budget = (loads_E.sum().double() * retain).floor().long()
    # ceil(min_retain * load), with a small slack so that 0.3 * 10 = 3.0000000000000004 stays 3.
    floors_E = torch.minimum((loads_E.double() * min_retain - 1e-6).ceil().clamp(min=0).long(), loads_E)

    if policy == "waterfill":
        quotas_E = _waterfill(loads_E, floors_E, budget)
    else:
        # Floors first, then what is left of the budget over the room above them, in proportion. (Raising the
        # proportional shares to the floors afterwards would overshoot the budget.)
        rest = (budget - floors_E.sum()).clamp(min=0).reshape(1)
        quotas_E = floors_E + apportion(rest, (loads_E - floors_E).unsqueeze(1)).squeeze(1)

    quotas_SE = apportion(quotas_E, loads_SE)
    return quotas_SE.squeeze(0) if one_source else quotas_SE


def _waterfill(loads_E: torch.Tensor, floors_E: torch.Tensor, budget: torch.Tensor) -> torch.Tensor:
    """Largest integer level lambda with sum_e clamp(lambda, floor_e, load_e) <= budget, then +1 for the first
    few experts still growing at lambda until the budget is met exactly.

    kept(lambda) is piecewise linear with breakpoints at the floors and loads, so evaluate it at those 2E+1
    points ([2E+1, E] work, no sort), take the last breakpoint under budget and step along its segment.
    """
    cand_C = torch.cat([loads_E.new_zeros(1), floors_E, loads_E])
    kept_C = torch.clamp(cand_C.unsqueeze(1), floors_E.unsqueeze(0), loads_E.unsqueeze(0)).sum(1)
    # Last breakpoint whose kept count fits; -1 when even the floors overflow the budget.
    lo = torch.where(kept_C <= budget, cand_C, -1).max()
    kept_lo = torch.clamp(lo, floors_E, loads_E).sum()
    growing = (floors_E <= lo) & (lo < loads_E)
    slope = growing.sum().clamp(min=1)
    level = (lo + torch.div(budget - kept_lo, slope, rounding_mode="floor")).clamp(min=0)

    quotas_E = torch.clamp(level, floors_E, loads_E)
    short = budget - quotas_E.sum()  # < number of experts growing at `level`, by choice of level
    growing = (floors_E <= level) & (level < loads_E)
    rank_E = torch.cumsum(growing.long(), 0) - 1
    return quotas_E + (growing & (rank_E < short)).long()


def apportion(total_G: torch.Tensor, weights_SG: torch.Tensor) -> torch.Tensor:
    """Split each ``total_G[g]`` over the S rows of ``weights_SG[:, g]`` in proportion (largest remainder).

    Exact integer arithmetic: row s gets floor(total * w_s / sum w) plus one for the ``total - sum floor`` rows
    with the largest remainders (ties to the lower row). When total_G <= sum of weights, no row gets more than
    its weight. A column whose weights sum to zero gets zeros.
    """
    weights_SG = weights_SG.long()
    num_SG = total_G.long().unsqueeze(0) * weights_SG
    den_G = weights_SG.sum(0).clamp(min=1)
    base_SG = torch.div(num_SG, den_G, rounding_mode="floor")
    rem_SG = num_SG - base_SG * den_G
    short_G = total_G - base_SG.sum(0)
    order_SG = torch.argsort(rem_SG, dim=0, descending=True, stable=True)
    rows_SG = torch.arange(weights_SG.shape[0], device=weights_SG.device).unsqueeze(1).expand_as(order_SG)
    rank_SG = torch.empty_like(order_SG).scatter_(0, order_SG, rows_SG)
    return base_SG + (rank_SG < short_G.unsqueeze(0)).long()
