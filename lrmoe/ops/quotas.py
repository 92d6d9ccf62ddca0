"""Quota planning's water-filling as a custom op, and its PyTorch reference (lrmoe.functional.quotas plans with them).

Shapes: G groups (experts or expert instances), B bins (ranks under a capacity).

``lrmoe::waterfill(loads_G, floors_G, budget) -> quotas_G``
    int64 quotas: the largest integer level lambda with sum_g clamp(lambda, floor_g, load_g) <= budget, each group
    clamp(lambda, floor_g, load_g), then +1 for the first groups (in group order) still growing at lambda until the
    total meets the budget exactly; the floors alone when they exceed it. Needs 0 <= floor <= load (not checked:
    that would need a host sync). ``waterfill_reference`` is its CPU kernel (and the per-bin form the capacity
    planner uses). On CUDA one Triton program (lrmoe_kernels.quotas) for G up to lrmoe_kernels.quotas.MAX_GROUPS:
    the reference is ~50 small PyTorch ops, which a compiled graph fuses but an eager step launches one by one
    (docs/performance.md: the eager layer's step at retain < 1 is host-bound).

Not differentiable (integers). Under torch.compile (lrmoe.ops._kernels.inline_when_compiled) a CUDA graph holds the
Triton kernel itself.
"""

from __future__ import annotations

import torch

from lrmoe.ops._define import define_op

__all__ = ["one_hot", "per_rank", "waterfill", "waterfill_reference"]


def one_hot(ids_G: torch.Tensor, n: int) -> torch.Tensor:
    """[G, n] int64 one-hot of ids in [0, n), by comparison: F.one_hot also checks its indices on the device (two
    reductions and two asserts in a compiled graph)."""
    return (ids_G.unsqueeze(1) == torch.arange(n, device=ids_G.device)).long()


def per_rank(values_G: torch.Tensor, rank_G: torch.Tensor, n_ranks: int) -> torch.Tensor:
    if n_ranks == 1:  # one bin (no capacities): a plain sum, which a compiled graph fuses; no scatter
        return values_G.sum(0, keepdim=True)
    return torch.zeros(n_ranks, dtype=values_G.dtype, device=values_G.device).index_add_(0, rank_G, values_G)


def waterfill_reference(
    loads_G: torch.Tensor, floors_G: torch.Tensor, budget: torch.Tensor, bin_G: torch.Tensor | None = None
) -> torch.Tensor:
    """Largest integer level lambda with sum_g clamp(lambda, floor_g, load_g) <= budget, then +1 for the first
    few groups still growing at lambda until the budget is met exactly.

    kept(lambda) is piecewise linear with breakpoints at the floors and loads, so evaluate it at those 2G+1
    points ([2G+1, G] work, no sort), take the last breakpoint under budget and step along its segment.

    With ``bin_G`` ([G] in [0, B)) and ``budget`` [B], one independent waterfill per bin (a rank's groups under
    its capacity), all evaluated at the same candidate levels (other bins' breakpoints are points on the line).
    """
    if bin_G is None:
        bin_G = torch.zeros_like(loads_G)
    budget_B = budget.reshape(-1)
    n_bins = budget_B.shape[0]
    cand_C = torch.cat([loads_G.new_zeros(1), floors_G, loads_G])
    kept_CG = torch.clamp(cand_C.unsqueeze(1), floors_G.unsqueeze(0), loads_G.unsqueeze(0))
    if n_bins == 1:
        kept_CB = kept_CG.sum(1, keepdim=True)
    else:
        kept_CB = torch.zeros(cand_C.shape[0], n_bins, dtype=torch.int64, device=loads_G.device).index_add_(
            1, bin_G, kept_CG
        )
    # Last breakpoint whose kept count fits; -1 when even the floors overflow the budget.
    lo_B = torch.where(kept_CB <= budget_B.unsqueeze(0), cand_C.unsqueeze(1), -1).max(0).values
    lo_G = lo_B.index_select(0, bin_G)
    kept_lo_B = per_rank(torch.clamp(lo_G, floors_G, loads_G), bin_G, n_bins)
    growing_G = (floors_G <= lo_G) & (lo_G < loads_G)
    slope_B = per_rank(growing_G.long(), bin_G, n_bins).clamp(min=1)
    level_B = (lo_B + torch.div(budget_B - kept_lo_B, slope_B, rounding_mode="floor")).clamp(min=0)

    level_G = level_B.index_select(0, bin_G)
    quotas_G = torch.clamp(level_G, floors_G, loads_G)
    short_B = budget_B - per_rank(quotas_G, bin_G, n_bins)  # < groups growing at `level`, by choice of level
    growing_G = (floors_G <= level_G) & (level_G < loads_G)
    # Rank of each growing group among its bin's growing groups, in group order: the first `short` get +1.
    onehot_GB = one_hot(bin_G, n_bins) * growing_G.long().unsqueeze(1)
    rank_G = torch.cumsum(onehot_GB, 0).gather(1, bin_G.unsqueeze(1)).squeeze(1) - 1
    return quotas_G + (growing_G & (rank_G < short_B.index_select(0, bin_G))).long()


def _check(loads_G: torch.Tensor, floors_G: torch.Tensor, budget: torch.Tensor) -> None:
    for name, t in (("loads_G", loads_G), ("floors_G", floors_G)):
        if t.dim() != 1 or t.dtype != torch.int64:
            raise ValueError(f"lrmoe::waterfill: {name} must be a 1-D int64 tensor, got shape {tuple(t.shape)} and "
                             f"dtype {t.dtype}")
    if floors_G.shape != loads_G.shape:
        raise ValueError(f"lrmoe::waterfill: floors_G must have the shape of loads_G {tuple(loads_G.shape)}, got "
                         f"{tuple(floors_G.shape)}")
    if budget.numel() != 1 or budget.dtype != torch.int64:
        raise ValueError(f"lrmoe::waterfill: budget must be one int64 value, got shape {tuple(budget.shape)} and "
                         f"dtype {budget.dtype}")


@define_op("lrmoe::waterfill", check=_check, fake=lambda loads_G, floors_G, budget: torch.empty_like(loads_G),
           kernels="quotas", cuda=lambda kernels, *args: kernels.waterfill_triton(*args),
           reference_if=lambda kernels, loads_G, *_: loads_G.shape[0] > kernels.MAX_GROUPS, inline=True)
def waterfill(loads_G: torch.Tensor, floors_G: torch.Tensor, budget: torch.Tensor) -> torch.Tensor:
    return waterfill_reference(loads_G, floors_G, budget)
