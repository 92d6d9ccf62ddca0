"""Row helpers of the selective backward, shared by the step and the transports: the retained rows' output gradient
(``retained_dy``, or its coefficients alone: ``retained_coefficients``), their layout in equal blocks
(``pad_to_blocks``, ``block_slots``) and a gather that tolerates a source with no rows (``take_rows``).

Shapes: T tokens, D model dim, K top-k, R retained rows, E groups (experts or instances), C rows per block.
"""

from __future__ import annotations

import torch
from torch.fx.experimental.symbolic_shapes import guard_or_false

from lrmoe.ops import gather_scale_rows


def take_rows(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``src.index_select(0, index)``, or zero rows when ``src`` is known to have none (an expert-parallel rank
    with no tokens: every index it holds then points at padding). Inductor cannot lower a gather from a tensor
    of static size 0 by a data-dependent row count, and such a rank's compiled backward still gathers."""
    if guard_or_false(src.shape[0] == 0):
        return src.new_zeros(index.shape[0], *src.shape[1:])
    return src.index_select(0, index)


def retained_dy(
    g_TD: torch.Tensor, gates_TK: torch.Tensor, pair_R: torch.Tensor, weight_R: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dy_RD = alpha * g / p per kept row, token of each row, pair id with padding -1 read as 0). Padding rows get
    weight 0, hence zero rows; the product is computed in fp32 and rounded once: lrmoe::gather_scale_rows, one pass
    and no fp32 copy of the rows, eager and compiled (its Triton kernel beat Inductor's gather there). g in another
    dtype than dy, or fp64 (whose gates keep fp64: plain autograd's values at retain 1): the PyTorch form."""
    coef_R, tok_R, safe_R = retained_coefficients(gates_TK, pair_R, weight_R, dtype)
    if g_TD.dtype != dtype or coef_R.dtype != torch.float32:
        return (take_rows(g_TD, tok_R) * coef_R.unsqueeze(1)).to(dtype), tok_R, safe_R
    return gather_scale_rows(g_TD, tok_R, coef_R), tok_R, safe_R


def retained_coefficients(gates_TK: torch.Tensor, pair_R: torch.Tensor, weight_R: torch.Tensor, dtype: torch.dtype
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(coef_R = alpha / p of each kept row, in fp32 (fp64 for fp64 rows), token of each row, pair id with
    padding -1 read as 0): row r's output gradient is coef_R[r] * g[tok_R[r]]. Padding rows get weight 0."""
    safe_R = pair_R.clamp(min=0)
    tok_R = torch.div(safe_R, gates_TK.shape[1], rounding_mode="floor")
    coef_dtype = torch.promote_types(dtype, torch.float32)
    coef_R = take_rows(gates_TK.detach().reshape(-1).to(coef_dtype), safe_R) * weight_R.to(coef_dtype)
    return coef_R, tok_R, safe_R


def pad_to_blocks(pair_R: torch.Tensor, weight_R: torch.Tensor, offsets_E: torch.Tensor, capacity: int,
                  dest_R: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The selection's compact rows (grouped by expert, group e ending at offsets_E[e]) laid out as E blocks of
    ``capacity`` rows: block e holds expert e's rows in their order, then padding (pair -1, weight 0). Returns
    (pair_ids [E * C], weights [E * C], offsets (e + 1) * C as int32). Every group must hold at most C rows (the
    caller clamps the quotas); rows past the last offset are padding already. Index arithmetic on the device,
    no sync. ``dest_R``: the rows' slots (``block_slots``), when the caller has them already."""
    n_exp = offsets_E.shape[0]
    n_pad = n_exp * capacity
    if dest_R is None:
        dest_R = block_slots(offsets_E, pair_R.shape[0], capacity)
    pair_pad = pair_R.new_full((n_pad + 1,), -1).index_copy_(0, dest_R, pair_R)
    weight_pad = weight_R.new_zeros(n_pad + 1).index_copy_(0, dest_R, weight_R)
    offsets_pad = torch.arange(1, n_exp + 1, device=pair_R.device, dtype=torch.int32) * capacity
    return pair_pad[:n_pad], weight_pad[:n_pad], offsets_pad


def block_slots(offsets_E: torch.Tensor, n_rows: int, capacity: int) -> torch.Tensor:
    """[n_rows] int64: where each row of a buffer grouped by expert (group e ending at offsets_E[e]) goes in E blocks
    of ``capacity`` rows: e * capacity + its place in its group; E * capacity (a spare slot past the blocks) for
    rows past the last offset. Every group must hold at most ``capacity`` rows."""
    n_exp = offsets_E.shape[0]
    ends_E = offsets_E.long()
    starts_E = torch.cat([ends_E.new_zeros(1), ends_E[:-1]])
    row_R = torch.arange(n_rows, device=offsets_E.device)
    expert_R = torch.searchsorted(ends_E, row_R, right=True)  # E for rows past the last offset
    safe_R = expert_R.clamp(max=n_exp - 1)
    return torch.where(expert_R < n_exp, safe_R * capacity + row_R - starts_E.index_select(0, safe_R),
                       n_exp * capacity)
