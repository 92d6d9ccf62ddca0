"""Select, within each group's quota, the pairs that backward keeps, and compact them.

Shapes: P pairs, G groups (experts or expert instances), R = max_rows, the static size of the compact buffer.

Two rules (DESIGN.md section 3):
- "top": the quota highest scores of each group, ties to the lower pair id, weight 1 (the paper's rule).
- "sample": pair u is kept with probability p_u proportional to sqrt(score_u), capped at 1 and summing to the
  quota; systematic sampling keeps exactly the quota; a kept pair carries weight 1/p_u, so the expert gradient
  is unbiased. With the quota equal to the group size every p is 1 and the selection is exact.

Everything is sorts, cumulative sums and scatters into buffers of static size: no host synchronisation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lrmoe.functional._checks import check_choice, check_tensor

__all__ = ["Selection", "select_within_quota", "inclusion_probabilities", "MODES"]

MODES = ("top", "sample")


@dataclass(frozen=True)
class Selection:
    """Compact index buffer of the kept pairs.

    pair_ids: [R] int64, kept pair ids grouped by group id ascending ("top": by score descending within a group,
              "sample": by pair id), -1 after the last kept entry (and in the rare slot a sample skipped).
    weights:  [R] fp32, gradient weight of each kept pair (1 for "top", 1/p for "sample"), 0 on padding.
    counts:   [G] int32, entries of each group in the buffer: min(quota, group size), truncated to fit R.
    offsets:  [G] int32, cumulative ends of the groups (offsets[g] = counts[: g + 1].sum()), as grouped GEMMs
              take them.
    """

    pair_ids: torch.Tensor
    weights: torch.Tensor
    counts: torch.Tensor
    offsets: torch.Tensor


torch.utils._pytree.register_dataclass(Selection)


def select_within_quota(
    scores_P: torch.Tensor,
    group_ids_P: torch.Tensor,
    quotas_G: torch.Tensor,
    *,
    max_rows: int,
    mode: str = "top",
    generator: torch.Generator | None = None,
    uniform_G: torch.Tensor | None = None,
) -> Selection:
    """Keep min(quota, size) pairs of every group and compact them into a buffer of ``max_rows`` entries.

    Args:
        scores_P: [P] float, pair scores (NaN counts as +inf: such pairs come first).
        group_ids_P: [P] integer in [0, G), the group of every pair (not checked: that would need a sync).
        quotas_G: [G] integer, pairs to keep per group (clamped to [0, group size]).
        max_rows: static buffer size R. Groups past the end are truncated, never written out of bounds.
        mode: "top" or "sample".
        generator: RNG for "sample" (the global one when None), one uniform draw per group.
        uniform_G: [G] pre-drawn uniforms in [0, 1) for "sample", instead of drawing; lets a caller draw in the
            forward pass and select in backward reproducibly.
    """
    check_tensor("scores_P", scores_P, ndim=1, kind="float")
    check_tensor("group_ids_P", group_ids_P, ndim=1, kind="int")
    check_tensor("quotas_G", quotas_G, ndim=1, kind="int")
    check_choice("mode", mode, MODES)
    if group_ids_P.shape != scores_P.shape:
        raise ValueError(
            f"group_ids_P must have the shape of scores_P {tuple(scores_P.shape)}, got {tuple(group_ids_P.shape)}"
        )
    if not isinstance(max_rows, int) or isinstance(max_rows, bool) or max_rows < 0:
        raise ValueError(f"max_rows must be a non-negative Python int, got {max_rows!r}")
    if uniform_G is not None and (uniform_G.dim() != 1 or uniform_G.shape[0] != quotas_G.shape[0]):
        raise ValueError(f"uniform_G must have shape [{quotas_G.shape[0]}], got {tuple(uniform_G.shape)}")

    device = scores_P.device
    n_groups = quotas_G.shape[0]
    gid_P = group_ids_P.long()
    scores_P = _nan_as_inf(scores_P)
    sizes_G = torch.zeros(n_groups, dtype=torch.int64, device=device).scatter_add_(0, gid_P, torch.ones_like(gid_P))
    starts_G = torch.cumsum(sizes_G, 0) - sizes_G
    take_G = torch.minimum(quotas_G.long().clamp(min=0), sizes_G)

    if mode == "top":
        order_P = _group_sort(gid_P, scores_P, descending=True)
        g_P = gid_P[order_P]
        slot_P = torch.arange(gid_P.shape[0], device=device) - starts_G[g_P]
        kept_P = slot_P < take_G[g_P]
        weights_P = torch.ones_like(scores_P)
    else:
        p_P = _probabilities(scores_P, gid_P, take_G, sizes_G, starts_G)
        if uniform_G is None:
            uniform_G = torch.rand(n_groups, generator=generator, device=device)
        order_P = torch.argsort(gid_P, stable=True)  # by group, then pair id
        g_P = gid_P[order_P]
        p_sorted = p_P[order_P]
        cum_hi = _segment_cumsum(p_sorted, g_P, starts_G)
        cum_lo = cum_hi - p_sorted
        # Pin each group's last cumulative value to its quota so rounding can neither add nor lose a point.
        rank_P = torch.arange(gid_P.shape[0], device=device) - starts_G[g_P]
        is_last = rank_P == sizes_G[g_P] - 1
        cum_hi = torch.where(is_last, take_G[g_P].double(), cum_hi.clamp(max=take_G[g_P].double()))
        cum_lo = cum_lo.clamp(max=take_G[g_P].double())
        # Points u, u+1, ..., u+take-1; pair i is hit by point m iff cum_lo <= u + m < cum_hi. Its slot is m.
        u_P = uniform_G.double()[g_P]
        slot_P = torch.ceil(cum_lo - u_P).long()
        kept_P = (torch.ceil(cum_hi - u_P).long() > slot_P) & (slot_P < take_G[g_P])
        weights_P = (1.0 / p_sorted).float()

    return _compact(order_P, g_P, slot_P, kept_P, weights_P, take_G, max_rows)


def inclusion_probabilities(scores_P: torch.Tensor, group_ids_P: torch.Tensor, quotas_G: torch.Tensor) -> torch.Tensor:
    """[P] fp64: the inclusion probability of every pair under ``mode="sample"``.

    Within a group: +inf scores first (probability 1, the first quota of them by pair id); then p = min(1, c *
    sqrt(score)) with c chosen so the group's probabilities sum to its quota; if the positive scores cannot fill
    the quota, the rest is spread uniformly over the zero-score pairs.
    """
    check_tensor("scores_P", scores_P, ndim=1, kind="float")
    check_tensor("group_ids_P", group_ids_P, ndim=1, kind="int")
    check_tensor("quotas_G", quotas_G, ndim=1, kind="int")
    gid_P = group_ids_P.long()
    sizes_G = torch.zeros(quotas_G.shape[0], dtype=torch.int64, device=gid_P.device).scatter_add_(
        0, gid_P, torch.ones_like(gid_P)
    )
    take_G = torch.minimum(quotas_G.long().clamp(min=0), sizes_G)
    starts_G = torch.cumsum(sizes_G, 0) - sizes_G
    return _probabilities(_nan_as_inf(scores_P), gid_P, take_G, sizes_G, starts_G)


def _nan_as_inf(scores_P: torch.Tensor) -> torch.Tensor:
    """fp32 scores with NaN as +inf. (Not nan_to_num: it would also turn +-inf into the largest finite floats.)"""
    scores_P = scores_P.float()
    return torch.where(torch.isnan(scores_P), float("inf"), scores_P)


def _group_sort(gid_P: torch.Tensor, key_P: torch.Tensor, *, descending: bool) -> torch.Tensor:
    """Permutation sorting by group ascending, then key, ties to the lower pair id (two stable sorts)."""
    by_key = torch.argsort(key_P, descending=descending, stable=True)
    return by_key[torch.argsort(gid_P[by_key], stable=True)]


def _segment_cumsum(v_P: torch.Tensor, g_P: torch.Tensor, starts_G: torch.Tensor) -> torch.Tensor:
    """Inclusive cumulative sum restarting at every group, for values already sorted by group (fp64)."""
    cum_P = torch.cumsum(v_P.double(), 0)
    excl_P = cum_P - v_P.double()
    base_G = excl_P.new_zeros(starts_G.shape[0] + 1)
    if v_P.shape[0] > 0:
        base_G = excl_P[starts_G.clamp(max=v_P.shape[0] - 1)]
    return cum_P - base_G[g_P]


def _segment_suffix_sum(v_S: torch.Tensor, g_S: torch.Tensor) -> torch.Tensor:
    """Sum from every position to the end of its group, for values sorted by group (fp64).

    A segmented Hillis-Steele scan: ceil(log2 P) shifted adds, each taking the partial sum d places ahead when
    it lies in the same group. Unlike a group total minus a prefix sum it never subtracts, so a tail of tiny
    weights after huge ones (or after another group) keeps its precision and a tail of zeros is exactly zero.
    """
    out_S = v_S.double()
    n, d = v_S.shape[0], 1
    while d < n:  # static: depends on the shape only
        same_S = torch.cat([g_S[d:] == g_S[:-d], g_S.new_zeros(d, dtype=torch.bool)])
        out_S = out_S + torch.where(same_S, torch.cat([out_S[d:], out_S.new_zeros(d)]), 0.0)
        d *= 2
    return out_S


def _probabilities(scores_P, gid_P, take_G, sizes_G, starts_G) -> torch.Tensor:
    w_P = scores_P.double().clamp(min=0).sqrt()
    order_P = _group_sort(gid_P, w_P, descending=True)  # +inf first, then by weight
    g_S = gid_P[order_P]
    w_S = w_P[order_P]
    rank_S = torch.arange(gid_P.shape[0], device=gid_P.device) - starts_G[g_S]
    inf_S = torch.isinf(w_S)
    n_inf_G = torch.zeros_like(take_G).scatter_add_(0, g_S, inf_S.long())

    # Finite part: quota q after the infinite pairs, ranks rf among finite pairs, tails t(r) = sum_{j >= r} w_j.
    q_G = (take_G - n_inf_G).clamp(min=0)
    wf_S = torch.where(inf_S, 0.0, w_S)
    rf_S = rank_S - n_inf_G[g_S]
    tail_S = _segment_suffix_sum(wf_S, g_S)
    # The largest m pairs are capped at 1, m the first rank with (q - r) w_r <= t(r) (monotone in r). A quota
    # covering every finite pair caps them all, so p is exactly 1 there (retain = 1 must give weights of 1).
    room_G = q_G < sizes_G - n_inf_G
    fits_S = room_G[g_S] & ((q_G[g_S] - rf_S).double() * wf_S <= tail_S)
    in_quota_S = (~inf_S) & (rf_S < q_G[g_S])
    m_G = torch.zeros_like(q_G).scatter_add_(0, g_S, (in_quota_S & ~fits_S).long())
    at_m_S = (~inf_S) & (rf_S == m_G[g_S])
    tail_m_G = wf_S.new_zeros(take_G.shape[0]).scatter_add_(0, g_S, torch.where(at_m_S, tail_S, 0.0))
    left_G = (q_G - m_G).double()
    scale_G = left_G / tail_m_G.clamp(min=torch.finfo(torch.float64).tiny)
    uniform_G = left_G / (sizes_G - n_inf_G - m_G).clamp(min=1).double()
    free_S = torch.where(tail_m_G[g_S] > 0, (scale_G[g_S] * wf_S).clamp(max=1.0), uniform_G[g_S])

    p_S = torch.where(
        inf_S,
        (rank_S < take_G[g_S]).double(),
        torch.where(rf_S < m_G[g_S], 1.0, free_S),
    )
    return torch.empty_like(p_S).scatter_(0, order_P, p_S)


def _compact(order_P, g_P, slot_P, kept_P, weights_P, take_G, max_rows: int) -> Selection:
    """Write kept pair ids at group start + slot; everything else goes to a trash slot at index max_rows."""
    ends_G = torch.cumsum(take_G, 0)
    dest_P = ends_G[g_P] - take_G[g_P] + slot_P
    kept_P = kept_P & (dest_P < max_rows)
    dest_P = torch.where(kept_P, dest_P, max_rows)
    pair_ids_R = torch.full((max_rows + 1,), -1, dtype=torch.int64, device=order_P.device)
    pair_ids_R = pair_ids_R.scatter(0, dest_P, torch.where(kept_P, order_P, -1))
    weights_R = torch.zeros(max_rows + 1, dtype=torch.float32, device=order_P.device)
    weights_R = weights_R.scatter(0, dest_P, torch.where(kept_P, weights_P, 0.0))
    offsets_G = ends_G.clamp(max=max_rows)
    counts_G = offsets_G - torch.cat([offsets_G.new_zeros(1), offsets_G[:-1]])
    return Selection(
        pair_ids=pair_ids_R[:max_rows],
        weights=weights_R[:max_rows],
        counts=counts_G.int(),
        offsets=offsets_G.int(),
    )
