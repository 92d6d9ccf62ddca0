"""Gather rows by index and multiply each group by its expert's weight.

Shapes: N source rows, R buffer rows, E experts, O output features, I input features.
"""

from __future__ import annotations

import torch

from lrmoe.functional._checks import (
    check_at_least,
    check_in_range,
    check_nondecreasing,
    check_same_device,
    check_tensor,
    checking,
)
from lrmoe.ops import gather_grouped_mm

__all__ = ["compact_and_gemm"]


def compact_and_gemm(
    x_NI: torch.Tensor, weight_EOI: torch.Tensor, rows_R: torch.Tensor, offsets_E: torch.Tensor
) -> torch.Tensor:
    """y[i] = weight[e(i)] @ x[rows[i]] for i < offsets[-1]; y[i] = 0 after.

    Args:
        x_NI: [N, I] float, the rows to gather from.
        weight_EOI: [E, O, I], same dtype as x (one matrix per expert, as nn.Linear stores it).
        rows_R: [R] integer, the source row of every buffer row; entries past offsets[-1] are ignored (may be -1),
            entries before must lie in [0, N).
        offsets_E: [E] integer, cumulative group ends (nondecreasing); group e holds rows
            [offsets[e-1], offsets[e]). Ends past R are clipped. Checking mode (``lrmoe.checks``) refuses negative
            or decreasing offsets and rows out of range; the fast path does not read them (a sync).

    Returns: y_RO, dtype of x. Differentiable in x (gradient scattered back to the gathered rows) and weight.
    One custom op (``lrmoe::gather_grouped_mm``), so compiled graphs see a single node.
    """
    check_tensor("x_NI", x_NI, ndim=2, kind="float")
    check_tensor("weight_EOI", weight_EOI, ndim=3, kind="float")
    check_tensor("rows_R", rows_R, ndim=1, kind="int")
    check_tensor("offsets_E", offsets_E, ndim=1, kind="int")
    check_same_device(x_NI=x_NI, weight_EOI=weight_EOI, rows_R=rows_R, offsets_E=offsets_E)
    if weight_EOI.shape[2] != x_NI.shape[1]:
        raise ValueError(
            f"weight_EOI must be [E, O, I={x_NI.shape[1]}] to multiply x_NI {tuple(x_NI.shape)}, "
            f"got {tuple(weight_EOI.shape)}"
        )
    if offsets_E.shape[0] != weight_EOI.shape[0]:
        raise ValueError(
            f"offsets_E must have one entry per expert (E={weight_EOI.shape[0]}), got {tuple(offsets_E.shape)}"
        )
    if weight_EOI.dtype != x_NI.dtype:
        raise TypeError(f"weight_EOI dtype {weight_EOI.dtype} must equal x_NI dtype {x_NI.dtype}")
    if checking() and offsets_E.device.type != "meta":  # lrmoe.checks: the contracts above that need the values
        check_at_least("offsets_E", offsets_E, 0, "cumulative group ends")
        check_nondecreasing("offsets_E", offsets_E, "cumulative group ends")
        used = min(int(offsets_E[-1]), rows_R.shape[0]) if offsets_E.numel() else 0
        check_in_range("rows_R", rows_R[:used], 0, x_NI.shape[0], f"source rows of x_NI, before offsets_E[-1]={used}")
    return gather_grouped_mm(x_NI, weight_EOI, rows_R.long(), offsets_E.int())
