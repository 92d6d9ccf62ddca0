"""Spread each source's pairs of each expert over the ranks that hold an instance of that expert.

Shapes: S source ranks, E experts, W EP ranks (S == W: source s is rank s).
"""

from __future__ import annotations

import torch

from lrmoe.functional._checks import check_tensor

__all__ = ["route_to_replicas"]


def route_to_replicas(counts_SE: torch.Tensor, capacity_EW: torch.Tensor) -> torch.Tensor:
    """Assign pairs (counts per source x expert) to expert instances with capacities.

    Rank w holds an instance of expert e iff capacity_EW[e, w] > 0. For every expert, independently:
    1. each source first keeps what fits on its own rank's instance: min(count, capacity of (e, s));
    2. the rest is laid out in source order against the remaining capacities in rank order, and source s
       sends to rank w the overlap of its interval with w's (a deterministic transport with no sort);
    3. if the expert's demand exceeds its total capacity, the excess goes to the instance with the largest
       capacity (the lowest rank among equals), which is then the only one over capacity. Every pair is
       always assigned. An expert with no instance at all (a capacity row of zeros) sends its excess to
       rank 0: giving every expert an instance is the caller's job (checking it here would need a sync).

    Returns: split_SEW, int64, with split.sum(-1) == counts; split[s, e, w] > 0 only where capacity[e, w] > 0
    (given an instance per expert); split.sum(0) <= capacity whenever counts.sum(0) <= capacity.sum(1).
    """
    check_tensor("counts_SE", counts_SE, ndim=2, kind="int")
    check_tensor("capacity_EW", capacity_EW, ndim=2, kind="int")
    n_src, n_exp = counts_SE.shape
    if capacity_EW.shape[0] != n_exp:
        raise ValueError(
            f"capacity_EW must have E={n_exp} rows like counts_SE has columns, got shape {tuple(capacity_EW.shape)}"
        )
    n_ranks = capacity_EW.shape[1]
    if n_src != n_ranks:
        raise ValueError(
            f"counts_SE has {n_src} sources but capacity_EW has {n_ranks} ranks; source s is rank s, so they "
            "must be equal"
        )

    counts_SE = counts_SE.long().clamp(min=0)
    cap_EW = capacity_EW.long().clamp(min=0)
    local_SE = torch.minimum(counts_SE, cap_EW.t())
    rest_SE = counts_SE - local_SE
    left_EW = cap_EW - local_SE.t()

    d_hi_SE = torch.cumsum(rest_SE, 0)
    d_lo_SE = d_hi_SE - rest_SE
    c_hi_EW = torch.cumsum(left_EW, 1)
    c_lo_EW = c_hi_EW - left_EW
    overlap_SEW = (
        torch.minimum(d_hi_SE.unsqueeze(-1), c_hi_EW.unsqueeze(0))
        - torch.maximum(d_lo_SE.unsqueeze(-1), c_lo_EW.unsqueeze(0))
    ).clamp(min=0)

    excess_SE = (d_hi_SE - torch.maximum(d_lo_SE, c_hi_EW[:, -1].unsqueeze(0))).clamp(min=0)
    biggest_EW = torch.nn.functional.one_hot(cap_EW.argmax(1), n_ranks)
    eye_SW = torch.eye(n_src, n_ranks, dtype=torch.int64, device=counts_SE.device)
    return overlap_SEW + local_SE.unsqueeze(-1) * eye_SW.unsqueeze(1) + excess_SE.unsqueeze(-1) * biggest_EW.unsqueeze(0)
