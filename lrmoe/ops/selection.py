"""Selection within quotas as a custom op.

Shapes: P pairs, G groups, R = max_rows.

``lrmoe::select_within_quota(scores, group_ids, quotas, max_rows, mode, uniform, group_order=None,
max_group_size=None, group_ends=None) -> (pair_ids, weights, counts, offsets)``
    pair_ids [R] int64, weights [R] fp32, counts [G] int32, offsets [G] int32: the contract of
    lrmoe.functional.select_within_quota (its docstring and the Selection dataclass describe the layout), which
    checks the arguments and draws ``uniform`` for mode "sample" when the caller gave none, so the op itself is
    deterministic: mode "sample" requires ``uniform`` [G] in [0, 1) (clamped to [U_MARGIN, 1 - U_MARGIN], see
    there); mode "top" ignores it. ``group_order`` [P] int64, when
    given, is the stable ascending argsort of ``group_ids`` (pairs by group, pair id within), which both modes
    select in; the op then does not sort the group ids itself. Not checked (that would need a sync).
    ``group_ends`` [G] int32/int64, when given, are the cumulative group sizes (group g's members end at
    group_ends[g] in the group order; the MoE layer has them from its forward dispatch as the grouped GEMMs'
    offsets): the CUDA plan reads each group's start and size from them instead of searching the group ids. The
    result does not depend on them when they are right; on CPU the reference checks them (no sync there), on CUDA
    they are not checked (a sync).

The CPU kernel is the reference below, pure PyTorch (it runs on any device): sorts, cumulative sums and scatters
into buffers of static size, no host synchronisation. The CUDA kernel is ``select_within_quota_triton`` (Triton
kernels in lrmoe_kernels.selection around torch.sort); without Triton it falls back to the reference. Both write
each group's kept pairs in pair-id order.

What runs where on CUDA, per mode (the group order: given, or one int32 sort of the group ids):
- "top": the per-group plan, then one Triton program per group that finds its take-th largest score by radix
  select over the bits of its key and writes the pairs above it, and the lowest-id ties, in pair-id order. No
  sort by score: one launch when the group order is given (two under torch.compile: lrmoe_kernels.selection).
- "sample": a sort by (group, score) keys and the per-group plan, the inclusion probabilities in Triton, one
  program per group over its members in score order, the reference's ``probabilities`` op for op in fp64, so
  bit-identical (the systematic sampling depends on the exact fp64 rounding); their running sum in the group
  order over all groups is torch.cumsum, as in the reference; one Triton pass takes each group's part of it (the
  reference's fp64 subtraction), samples and compacts.

No gradient formula: the selection only decides which pairs the backward keeps. The autograd registration marks
every output non-differentiable, as for lrmoe::score_pairs.
"""

from __future__ import annotations

import torch

from lrmoe.ops._define import define_op
from lrmoe.ops._kernels import kernel_module

__all__ = [
    "MODES",
    "U_MARGIN",
    "argsort_ids",
    "group_sizes",
    "inclusion_probabilities",
    "nan_as_inf",
    "probabilities",
    "sample_weights",
    "select_within_quota",
    "select_within_quota_reference",
    "select_within_quota_triton",
]

MODES = ("top", "sample")

U_MARGIN = 2.0**-30
"""Mode "sample" clamps each group's uniform into [U_MARGIN, 1 - U_MARGIN]. The points u + m then lie at least
U_MARGIN inside every unit interval, far above the fp64 rounding of the cumulative probabilities (about 1e-11 at
a running sum of 1e5), so a pair with p = 1, whose interval starts at an integer up to rounding, is always hit;
at u = 0 (torch.rand draws it once in 2^24) rounding could shift the point past the interval's start and lose the
pair. The clamp changes an inclusion probability by at most 2^-30."""


def _check_mode(mode: str, uniform_G: torch.Tensor | None) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(map(repr, MODES))} for lrmoe::select_within_quota; "
                         f"got {mode!r}")
    if mode == "sample" and uniform_G is None:
        raise ValueError("lrmoe::select_within_quota with mode 'sample' needs uniform [G] (the op draws nothing)")


# ------------------------------------------------------------------------------------------------ reference


def argsort_ids(ids: torch.Tensor) -> torch.Tensor:
    """Stable ascending argsort of integer ids in [0, 2^31) (groups, experts, instances, pair blocks). Sorted as
    int32: a stable sort of the same values gives the same permutation as int64 ids, and a CUDA radix sort then
    runs over 32 key bits instead of 64 (half the passes and launches)."""
    return torch.argsort(ids.int(), stable=True)


def nan_as_inf(scores_P: torch.Tensor) -> torch.Tensor:
    """fp32 scores with NaN as +inf. (Not nan_to_num: it would also turn +-inf into the largest finite floats.)"""
    scores_P = scores_P.float()
    return torch.where(torch.isnan(scores_P), float("inf"), scores_P)


def group_sizes(gid_P: torch.Tensor, quotas_G: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sizes_G, starts_G, take_G), int64: members, first sorted position and pairs kept of every group."""
    sizes_G = torch.zeros(quotas_G.shape[0], dtype=torch.int64, device=gid_P.device).scatter_add_(
        0, gid_P, torch.ones_like(gid_P)
    )
    starts_G = torch.cumsum(sizes_G, 0) - sizes_G
    take_G = torch.minimum(quotas_G.long().clamp(min=0), sizes_G)
    return sizes_G, starts_G, take_G


def select_within_quota_reference(
    scores_P: torch.Tensor,
    group_ids_P: torch.Tensor,
    quotas_G: torch.Tensor,
    max_rows: int,
    mode: str,
    uniform_G: torch.Tensor | None,
    group_order_P: torch.Tensor | None = None,
    max_group_size: int | None = None,
    group_ends_G: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The op's contract in plain PyTorch: (pair_ids_R, weights_R, counts_G, offsets_G). ``max_group_size`` and
    ``group_ends_G`` only select a CUDA strategy; the result does not depend on them (the ends are checked here
    when on the CPU)."""
    _check_mode(mode, uniform_G)
    device = scores_P.device
    gid_P = group_ids_P.long()
    scores_P = nan_as_inf(scores_P)
    sizes_G, starts_G, take_G = group_sizes(gid_P, quotas_G)
    # Checked on CPU only, where reading the values costs no device sync (the CPU kernel runs eagerly, also under
    # torch.compile, which keeps the op whole on CPU).
    if group_ends_G is not None and group_ends_G.device.type == "cpu":
        want_G = starts_G + sizes_G
        if group_ends_G.shape != want_G.shape or not torch.equal(group_ends_G.long(), want_G):
            raise ValueError(f"lrmoe::select_within_quota: group_ends (select_within_quota's group_ends_G) must be the "
                             f"cumulative group sizes {want_G.tolist()}, got {group_ends_G.tolist()}")  # CPU: no sync
    order_P = argsort_ids(gid_P) if group_order_P is None else group_order_P  # by group, then pair id
    g_P = gid_P[order_P]

    if mode == "top":
        # Kept: the take best of each group by score, ties to the lower pair id. Written in pair-id order.
        by_score_P = _group_sort(gid_P, scores_P, descending=True)
        rank_P = torch.arange(gid_P.shape[0], device=device) - starts_G[gid_P[by_score_P]]
        best_P = torch.zeros_like(gid_P, dtype=torch.bool).scatter_(
            0, by_score_P, rank_P < take_G[gid_P[by_score_P]])
        kept_P = best_P[order_P]
        before_P = torch.cumsum(kept_P.long(), 0) - kept_P.long()  # kept pairs before this one, all groups
        slot_P = before_P - before_P[starts_G[g_P]]  # minus those before the group's first member
        weights_P = torch.ones_like(scores_P)
    else:
        p_P = probabilities(scores_P, gid_P, take_G, sizes_G, starts_G)
        p_sorted = p_P[order_P]
        cum_hi = _segment_cumsum(p_sorted, g_P, starts_G)
        # Pin each group's last cumulative value to its quota so rounding can neither add nor lose a point.
        rank_P = torch.arange(gid_P.shape[0], device=device) - starts_G[g_P]
        is_last = rank_P == sizes_G[g_P] - 1
        take_P = take_G[g_P].double()
        cum_hi = torch.where(is_last, take_P, torch.minimum(cum_hi.clamp(min=0.0), take_P))
        # Each pair's interval starts where the previous member's ends, and the group's first at exactly 0, so
        # the intervals tile [0, take) whatever the rounding: every point u + m hits exactly one pair, u = 0
        # included (cum_hi - p could round to 1e-16 for the first member and miss the point 0).
        cum_lo = torch.where(rank_P == 0, 0.0, torch.cat([cum_hi.new_zeros(1), cum_hi[:-1]]))
        # Points u, u+1, ..., u+take-1; pair i is hit by point m iff cum_lo <= u + m < cum_hi. Its slot is m.
        u_P = uniform_G.double()[g_P].clamp(U_MARGIN, 1.0 - U_MARGIN)
        slot_P = torch.ceil(cum_lo - u_P).long()
        kept_P = (torch.ceil(cum_hi - u_P).long() > slot_P) & (slot_P < take_G[g_P])
        weights_P = (1.0 / p_sorted).float()

    return _compact(order_P, g_P, slot_P, kept_P, weights_P, take_G, max_rows)


def _group_sort(gid_P: torch.Tensor, key_P: torch.Tensor, *, descending: bool) -> torch.Tensor:
    """Permutation sorting by group ascending, then key, ties to the lower pair id (two stable sorts)."""
    by_key = torch.argsort(key_P, descending=descending, stable=True)
    return by_key[argsort_ids(gid_P[by_key])]


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


def sample_weights(scores_P: torch.Tensor) -> torch.Tensor:
    """[P] fp64 sampling weights sqrt(max(score, 0)) of scores with NaN already +inf: one function for the
    reference and the Triton path, whose probabilities must agree bit for bit."""
    return scores_P.double().clamp(min=0).sqrt()


def probabilities(scores_P, gid_P, take_G, sizes_G, starts_G) -> torch.Tensor:
    """[P] fp64 inclusion probabilities of mode "sample" (see lrmoe.functional.inclusion_probabilities), from
    scores with NaN already +inf and the int64 group sizes, starts and takes of ``group_sizes``."""
    w_P = sample_weights(scores_P)
    # +inf first, then by weight. Sorted by the fp32 key max(score, 0), not by the fp64 weight sqrt(max(score, 0)):
    # the same order (sqrt is strictly increasing and fp64 separates the roots of distinct fp32 values; both keep
    # the sign of a zero), at half the key bits of a CUDA radix sort.
    order_P = _group_sort(gid_P, scores_P.clamp(min=0), descending=True)
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


def _compact(order_P, g_P, slot_P, kept_P, weights_P, take_G, max_rows: int):
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
    return pair_ids_R[:max_rows], weights_R[:max_rows], counts_G.int(), offsets_G.int()


# ------------------------------------------------------------------------------------------------ Triton path


def select_within_quota_triton(
    scores_P: torch.Tensor,
    group_ids_P: torch.Tensor,
    quotas_G: torch.Tensor,
    max_rows: int,
    mode: str,
    uniform_G: torch.Tensor | None,
    group_order_P: torch.Tensor | None = None,
    max_group_size: int | None = None,
    group_ends_G: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The CUDA kernel of the op (runs on CPU tensors too, in Triton's interpreter): same outputs, bit for bit.

    No host synchronisation: every size below is a shape; counts and offsets stay on the device.
    """
    _check_mode(mode, uniform_G)
    kernels = kernel_module("selection")
    scores_P = scores_P.contiguous()
    gids_P = group_ids_P.contiguous()
    quotas_G = quotas_G.contiguous()
    ends_G = None if group_ends_G is None else group_ends_G.contiguous()
    order_P = argsort_ids(gids_P) if group_order_P is None else group_order_P.contiguous()
    if mode == "top":
        # Per group its take-th largest score as a threshold, in the group order: no sort by score, one launch.
        return kernels.select_top(scores_P, gids_P, order_P, quotas_G, max_rows, ends_G)
    # Inclusion probabilities: one Triton program per group over its members in score order, the reference's
    # arithmetic op for op (bit-identical); then their running sum in the group order in PyTorch, as in the
    # reference, and the sampling and compaction in Triton.
    if group_order_P is not None and max_group_size is not None and max_group_size <= kernels.SORT_MAX:
        # Every group fits one program's registers: each sorted within the group order, no global sort.
        plan = kernels.plan_groups(gids_P, order_P, quotas_G, max_rows, ends_G)
        by_score_P, pair_ids_R, weights_R = kernels.group_score_order(scores_P, order_P, plan, max_rows,
                                                                      max_group_size)
    else:
        by_score_P, pair_ids_R, weights_R = kernels.score_order(scores_P, gids_P, max_rows)
        plan = kernels.plan_groups(gids_P, by_score_P, quotas_G, max_rows, ends_G)  # by group first: same ends
    p_P = kernels.sample_probabilities(sample_weights(nan_as_inf(scores_P)), by_score_P, plan)
    # The running sum of p in the group order over all groups, as the reference's _segment_cumsum takes it
    # (torch.cumsum's fp64 rounding); the compaction subtracts each group's start from it.
    cum_P = torch.cumsum(p_P[order_P], 0)
    kernels.compact(order_P, gids_P, plan, pair_ids_R, weights_R, p_P=p_P, cum_P=cum_P,
                    uniform_G=uniform_G.contiguous(), u_margin=U_MARGIN)
    return pair_ids_R, weights_R, plan["counts"], plan["offsets"]


# ------------------------------------------------------------------------------------------------ the op


def _check(scores, group_ids, quotas, max_rows, mode, uniform, *_) -> None:
    _check_mode(mode, uniform)


def _fake(scores, group_ids, quotas, max_rows, mode, uniform, *_):
    G = quotas.shape[0]
    return (
        scores.new_empty((max_rows,), dtype=torch.int64),
        scores.new_empty((max_rows,), dtype=torch.float32),
        scores.new_empty((G,), dtype=torch.int32),
        scores.new_empty((G,), dtype=torch.int32),
    )


@define_op("lrmoe::select_within_quota", check=_check, fake=_fake, kernels="selection",
           cuda=lambda kernels, *args: select_within_quota_triton(*args), inline=True)
def select_within_quota(
    scores: torch.Tensor,
    group_ids: torch.Tensor,
    quotas: torch.Tensor,
    max_rows: int,
    mode: str,
    uniform: torch.Tensor | None,
    group_order: torch.Tensor | None = None,
    max_group_size: int | None = None,
    group_ends: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return select_within_quota_reference(scores, group_ids, quotas, max_rows, mode, uniform, group_order,
                                         group_ends_G=group_ends)


@define_op("lrmoe::inclusion_probabilities",
           fake=lambda scores, group_ids, quotas: scores.new_empty(scores.shape, dtype=torch.float64))
def inclusion_probabilities(scores: torch.Tensor, group_ids: torch.Tensor, quotas: torch.Tensor) -> torch.Tensor:
    """[P] fp64, mode "sample"'s inclusion probabilities (``probabilities``), on every device. An op so that a
    compiled graph holds it whole: traced, the reference's scan loops ceil(log2 P) times, so every new power of
    two of P would recompile. Probabilities of a selection: no gradient flows through them."""
    gid_P = group_ids.long()
    sizes_G, starts_G, take_G = group_sizes(gid_P, quotas)
    return probabilities(nan_as_inf(scores), gid_P, take_G, sizes_G, starts_G)
