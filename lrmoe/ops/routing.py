"""The router's choice of experts as a custom op.

Shapes: T tokens, E experts, K chosen per token.

``lrmoe::topk_ids(x_TE, k) -> ids_TK``
    int64 columns of the k largest entries of each row, largest first: the first k of a stable descending sort.
    So equal values go to the lower column (-0.0 and +0.0 are equal) and NaN ranks above +inf, NaNs in column order.
    torch.topk leaves the order of ties unspecified (on CPU it gave the higher column first); this op defines it,
    so the CPU reference and the CUDA kernel pick the same experts. On CUDA one Triton kernel
    (lrmoe_kernels.routing) with every row in registers, for E up to lrmoe_kernels.routing.MAX_COLUMNS; wider rows
    and fp64 take the reference there too.

Not differentiable (integer ids; the layers take gates from the scores at these ids). Under torch.compile
(lrmoe.ops._kernels.inline_when_compiled) a CUDA graph holds the Triton kernel itself.
"""

from __future__ import annotations

import torch

from lrmoe.ops._define import define_op

__all__ = ["topk_ids"]


def topk_ids_reference(x_TE: torch.Tensor, k: int) -> torch.Tensor:
    # A copy, not a view of the sort's [T, E] indices: the ids are saved for backward, and a view keeps all of them.
    return torch.sort(x_TE, dim=1, descending=True, stable=True).indices[:, :k].clone()


def _check(x_TE: torch.Tensor, k: int) -> None:
    if x_TE.dim() != 2 or not x_TE.is_floating_point():
        raise ValueError(f"lrmoe::topk_ids: x_TE must be a 2-D float tensor [T, E], got shape {tuple(x_TE.shape)} "
                         f"and dtype {x_TE.dtype}")
    if not 1 <= k <= x_TE.shape[1]:
        raise ValueError(f"lrmoe::topk_ids: k must be in [1, E={x_TE.shape[1]}], got {k}")


def _reference_on_cuda(kernels, x_TE, k) -> bool:
    return x_TE.dtype == torch.float64 or x_TE.shape[1] > kernels.MAX_COLUMNS


@define_op("lrmoe::topk_ids", check=_check, fake=lambda x_TE, k: x_TE.new_empty(x_TE.shape[0], k, dtype=torch.int64),
           kernels="routing", cuda=lambda kernels, *args: kernels.topk_ids_triton(*args),
           reference_if=_reference_on_cuda, inline=True)
def topk_ids(x_TE: torch.Tensor, k: int) -> torch.Tensor:
    return topk_ids_reference(x_TE, k)
