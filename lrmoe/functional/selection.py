"""Select, within each group's quota, the pairs that backward keeps, and compact them.

Shapes: P pairs, G groups (experts or expert instances), R = max_rows, the static size of the compact buffer.

Two rules (docs/design.md, "Selection rules"):
- "top": the quota highest scores of each group, ties to the lower pair id, weight 1 (the paper's rule).
- "sample": pair u is kept with probability p_u proportional to sqrt(score_u), capped at 1 and summing to the
  quota; systematic sampling keeps exactly the quota; a kept pair carries weight 1/p_u, so the expert gradient
  is unbiased. With the quota equal to the group size every p is 1 and the selection is exact.

The work is one custom op, lrmoe::select_within_quota (lrmoe/ops/selection.py): its CPU kernel is the pure-PyTorch
reference (sorts, cumulative sums and scatters into buffers of static size), its CUDA kernel runs Triton. Neither
synchronises with the host. This module checks the arguments, draws the uniforms of "sample" and wraps the result.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lrmoe.functional._checks import (
    check_choice,
    check_in_range,
    check_int,
    check_same_device,
    check_same_size,
    check_tensor,
    checking,
)
from lrmoe.ops._torch_internals import register_dataclass
from lrmoe.ops.selection import MODES
from lrmoe.ops.selection import inclusion_probabilities as inclusion_probabilities_op
from lrmoe.ops.selection import select_within_quota as select_within_quota_op

__all__ = ["Selection", "select_within_quota", "inclusion_probabilities", "MODES"]


@dataclass(frozen=True)
class Selection:
    """Compact index buffer of the kept pairs.

    pair_ids: [R] int64, kept pair ids grouped by group id ascending, by pair id within a group, -1 after the
              last kept entry (and in the rare slot a sample skipped).
    weights:  [R] fp32, gradient weight of each kept pair (1 for "top", 1/p for "sample"), 0 on padding.
    counts:   [G] int32, entries of each group in the buffer: min(quota, group size), truncated to fit R.
    offsets:  [G] int32, cumulative ends of the groups (offsets[g] = counts[: g + 1].sum()), as grouped GEMMs
              take them.
    """

    pair_ids: torch.Tensor
    weights: torch.Tensor
    counts: torch.Tensor
    offsets: torch.Tensor


register_dataclass(Selection)


def select_within_quota(
    scores_P: torch.Tensor,
    group_ids_P: torch.Tensor,
    quotas_G: torch.Tensor,
    *,
    max_rows: int,
    mode: str = "sample",
    generator: torch.Generator | None = None,
    uniform_G: torch.Tensor | None = None,
    group_order_P: torch.Tensor | None = None,
    max_group_size: int | None = None,
    group_ends_G: torch.Tensor | None = None,
) -> Selection:
    """Keep min(quota, size) pairs of every group and compact them into a buffer of ``max_rows`` entries.

    Args:
        scores_P: [P] float, pair scores (NaN counts as +inf: such pairs come first).
        group_ids_P: [P] integer in [0, G), the group of every pair (checked in checking mode only, a sync:
            ``lrmoe.checks``; so are the contracts of uniform_G, group_order_P, max_group_size, group_ends_G).
        quotas_G: [G] integer, pairs to keep per group (clamped to [0, group size]).
        max_rows: static buffer size R. Groups past the end are truncated (a group cut by it keeps its first kept
            pairs by pair id), never written out of bounds.
        mode: "sample" (default: unbiased, LRMoE's default ``selection`` too) or "top" (deterministic, weight 1;
            the paper's rule, a biased gradient estimate).
        generator: RNG for "sample" (the global one when None), one uniform draw per group.
        uniform_G: [G] pre-drawn float uniforms in [0, 1) for "sample", instead of drawing; lets a caller draw in
            the forward pass and select in backward reproducibly. Clamped to [2^-30, 1 - 2^-30]
            (lrmoe.ops.selection.U_MARGIN says why).
        group_order_P: [P] int64, the stable ascending argsort of ``group_ids_P`` (pairs by group, pair id
            within), when the caller already has it (an MoE layer sorts its pairs by expert for the forward
            dispatch). Both modes select in this order; given, the selection does not sort the group ids again
            (on CUDA, "top" is then one kernel launch). Checked in checking mode only (a sync): another
            permutation gives a wrong selection.
        max_group_size: a bound on every group's size when the caller knows one (in an MoE layer each token
            picks an expert at most once, so a group holds at most T pairs). With ``group_order_P`` and a bound
            up to 8,192, CUDA "sample" sorts each group in one program's registers instead of sorting all pairs.
            Checked in checking mode only (a sync): a group above it gives a wrong selection.
        group_ends_G: [G] integer, the cumulative group sizes (group g's members end at group_ends_G[g] in the
            group order), when the caller has them (an MoE layer's grouped-GEMM offsets of its forward dispatch).
            On CUDA the selection then reads each group's start and size instead of searching the group ids for
            them. The result does not depend on them when they are right; checked on CPU, not on CUDA (a sync):
            wrong ends give a wrong selection there.
    """
    check_tensor("scores_P", scores_P, ndim=1, kind="float")
    check_tensor("group_ids_P", group_ids_P, ndim=1, kind="int")
    check_tensor("quotas_G", quotas_G, ndim=1, kind="int")
    check_choice("mode", mode, MODES)
    if group_ids_P.shape != scores_P.shape:
        raise ValueError(
            f"group_ids_P must have the shape of scores_P {tuple(scores_P.shape)}, got {tuple(group_ids_P.shape)}"
        )
    max_rows = check_int("max_rows", max_rows, min_value=0)
    if uniform_G is not None:
        check_tensor("uniform_G", uniform_G, kind="float")
        if uniform_G.dim() != 1 or uniform_G.shape[0] != quotas_G.shape[0]:
            raise ValueError(f"uniform_G must have shape [{quotas_G.shape[0]}], got {tuple(uniform_G.shape)}")
    if max_group_size is not None:
        max_group_size = check_int("max_group_size", max_group_size, min_value=0)
    if group_order_P is not None:
        check_tensor("group_order_P", group_order_P, ndim=1, kind="int")
        if group_order_P.dtype != torch.int64:
            raise TypeError(f"group_order_P must be int64 (an argsort's indices), got dtype {group_order_P.dtype}")
        if group_order_P.shape != scores_P.shape:
            raise ValueError(f"group_order_P must have the shape of scores_P {tuple(scores_P.shape)}, got "
                             f"{tuple(group_order_P.shape)}")

    if group_ends_G is not None:
        check_tensor("group_ends_G", group_ends_G, ndim=1, kind="int")
        if group_ends_G.shape != quotas_G.shape:
            raise ValueError(f"group_ends_G must have the shape of quotas_G {tuple(quotas_G.shape)}, got "
                             f"{tuple(group_ends_G.shape)}")

    check_same_device(scores_P=scores_P, group_ids_P=group_ids_P, quotas_G=quotas_G, uniform_G=uniform_G,
                      group_order_P=group_order_P, group_ends_G=group_ends_G)
    if checking():
        _check_selection_inputs(group_ids_P, quotas_G.shape[0], uniform_G, group_order_P, max_group_size,
                                group_ends_G)
    if mode == "sample" and uniform_G is None:
        # Drawn here, not in the op, so that lrmoe::select_within_quota is deterministic given its inputs.
        uniform_G = torch.rand(quotas_G.shape[0], generator=generator, device=scores_P.device)
    # One custom op: the reference on CPU, Triton kernels on CUDA. The selection is not differentiated, so the
    # scores are detached: callers may pass tensors that require grad.
    # Compiled, too, the graph holds the op (one node; its Triton kernels on CUDA): the reference traced inline
    # was slower in the compiled layer on an H200 at retain 0.75 and 0.5 (docs/performance.md).
    pair_ids_R, weights_R, counts_G, offsets_G = select_within_quota_op(
        scores_P.detach(), group_ids_P, quotas_G, max_rows, mode, uniform_G if mode == "sample" else None,
        group_order_P, max_group_size, group_ends_G,
    )
    return Selection(pair_ids=pair_ids_R, weights=weights_R, counts=counts_G, offsets=offsets_G)


def _check_selection_inputs(group_ids_P, n_groups, uniform_G, group_order_P, max_group_size, group_ends_G):
    """Checking mode (lrmoe.checks): the contracts of select_within_quota's docstring that need the values. These
    reads (.item(), .tolist(), .all()) sync with the device by design: they run only under ``checking()``, which is
    off by default and never true while a compiler traces, so no compiled graph and no default step sees them."""
    check_in_range("group_ids_P", group_ids_P, 0, n_groups, "the group of each pair, G = len(quotas_G)")
    if uniform_G is not None and uniform_G.device.type != "meta" and not ((uniform_G >= 0) & (uniform_G < 1)).all():
        raise ValueError(f"uniform_G must be in [0, 1) (one uniform draw per group), got values from "
                         f"{uniform_G.min().item()} to {uniform_G.max().item()}")
    if group_ids_P.device.type == "meta":
        return
    if group_order_P is not None and not torch.equal(group_order_P, torch.argsort(group_ids_P, stable=True)):
        raise ValueError("group_order_P must be the stable ascending argsort of group_ids_P (pairs by group, pair id "
                         "within); it is not")
    sizes_G = torch.zeros(n_groups, dtype=torch.int64, device=group_ids_P.device).scatter_add_(
        0, group_ids_P.long(), torch.ones_like(group_ids_P, dtype=torch.int64))
    if max_group_size is not None and n_groups and sizes_G.max().item() > max_group_size:
        raise ValueError(f"max_group_size={max_group_size} is below the largest group, {sizes_G.max().item()} pairs")
    if group_ends_G is not None and not torch.equal(group_ends_G.long(), sizes_G.cumsum(0)):
        raise ValueError(f"group_ends_G must be the cumulative group sizes {sizes_G.cumsum(0).tolist()}, got "
                         f"{group_ends_G.tolist()}")


def inclusion_probabilities(scores_P: torch.Tensor, group_ids_P: torch.Tensor, quotas_G: torch.Tensor) -> torch.Tensor:
    """[P] fp64: the inclusion probability of every pair under ``mode="sample"``.

    Within a group: +inf scores first (probability 1, the first quota of them by pair id); then p = min(1, c *
    sqrt(score)) with c chosen so the group's probabilities sum to its quota; if the positive scores cannot fill
    the quota, the rest is spread uniformly over the zero-score pairs. Not differentiable (one op,
    ``lrmoe::inclusion_probabilities``: a compiled graph does not recompile as P grows).
    """
    check_tensor("scores_P", scores_P, ndim=1, kind="float")
    check_tensor("group_ids_P", group_ids_P, ndim=1, kind="int")
    check_tensor("quotas_G", quotas_G, ndim=1, kind="int")
    check_same_size("scores_P", scores_P, 0, "group_ids_P", group_ids_P, 0)
    if checking():
        check_in_range("group_ids_P", group_ids_P, 0, quotas_G.shape[0], "the group of each pair, G = len(quotas_G)")
    return inclusion_probabilities_op(scores_P.detach(), group_ids_P, quotas_G)
