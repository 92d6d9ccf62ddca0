"""Per-token reductions over K gathered rows, as custom ops.

Shapes: N source rows, C columns, T tokens, K rows per token.

``lrmoe::gather_sum_rows(src_NC, rows_TK, weights_TK=None) -> out_TC``
    out[t] = sum over k with rows[t, k] >= 0 of w[t, k] * src[rows[t, k]] (w = 1 without weights), accumulated in
    fp32 and returned in src's dtype. The MoE combine (src = expert outputs in expert order, rows = each pair's
    position there, w = gates) and the input gradient's sum over a token's kept pairs (rows = each pair's row in
    the retained buffer, -1 for a dropped pair). The tokens may have any leading shape: rows and weights
    [..., K] give out [..., C], written in that shape by the op itself, so the MoE layer returns its output in
    x's shape as a tensor of its own, not as a view of a [T, C] one (a view would lose the hooks FSDP2 puts on
    the layer's output to an in-place op on it).
``lrmoe::gather_dot_rows(src_NC, rows_TK, g_TC) -> out_TK``
    out[t, k] = <g[t], src[rows[t, k]]> in fp32, 0 where rows[t, k] < 0. The router gradient <g_t, y_tk>.
``lrmoe::gather_dot_scores(src_NC, rows_TK, g_TC, gates_TK, phi_sq_TK, metric) -> (out_TK, scores_TK)``
    gather_dot_rows' out and lrmoe::score_pairs(gates, g, phi_sq, metric) for a deterministic metric, from one pass
    over g on CUDA (one Triton kernel): the selective backward's router gradient and pair scores. Forward only.
fp64 inputs accumulate (and gather_dot_rows returns) in fp64, on the reference path on every device.

Rows must be < N (not checked: that would need a host sync). The CPU kernel is the reference (gathers into pair
order, fp32 arithmetic); the CUDA kernel is lrmoe_kernels.token_rows, which reads each token's K rows in place,
without the [T*K, C] pair-order copy. Both ops are differentiable in src, weights and g, each one's gradient being
the other op plus an index_add (they are transposes of each other).
"""

from __future__ import annotations

import torch
from torch.fx.experimental.symbolic_shapes import guard_or_false

from lrmoe.ops._define import define_op
from lrmoe.ops.rows import check_float_matrix
from lrmoe.ops.scoring import check_metric, score_pairs_reference

__all__ = ["gather_dot_rows", "gather_dot_scores", "gather_sum_rows"]


def _check(name: str, src_NC: torch.Tensor, rows_TK: torch.Tensor, other_TX: torch.Tensor | None, other: str,
           cols: int | None, any_lead: bool = False) -> None:
    """``any_lead``: rows may be [..., K] (at least 1-D), and ``other_TX`` must then have their shape."""
    check_float_matrix(name, "src_NC", src_NC)
    if (rows_TK.dim() < 1 if any_lead else rows_TK.dim() != 2) or rows_TK.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"lrmoe::{name}: rows_TK must be a {'[..., K]' if any_lead else '2-D'} int32 or int64 "
                         f"tensor, got shape {tuple(rows_TK.shape)} and dtype {rows_TK.dtype}")
    if other_TX is not None:
        want = tuple(rows_TK.shape) if cols is None else (rows_TK.shape[0], cols)
        if tuple(other_TX.shape) != want or not other_TX.is_floating_point():
            raise ValueError(f"lrmoe::{name}: {other} must be a float tensor of shape {want}, got "
                             f"{tuple(other_TX.shape)} and dtype {other_TX.dtype}")


def _acc_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """fp32, or fp64 when an input is fp64 (so gradcheck can differentiate the reference numerically)."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def _gathered(src_NC: torch.Tensor, rows_TK: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """[..., K, C] rows in pair order in the accumulation dtype, zero where rows < 0 (rows [..., K])."""
    shape = (*rows_TK.shape, src_NC.shape[1])
    if guard_or_false(src_NC.shape[0] == 0):  # no rows at all (an EP rank that kept none): every slot is padding
        return src_NC.new_zeros(shape, dtype=acc)
    vals_TKC = src_NC.index_select(0, rows_TK.clamp(min=0).reshape(-1).long()).view(shape).to(acc)
    return torch.where((rows_TK >= 0).unsqueeze(-1), vals_TKC, 0.0)


def gather_sum_rows_reference(src_NC, rows_TK, weights_TK=None):
    acc = _acc_dtype(src_NC, weights_TK)
    vals_TKC = _gathered(src_NC, rows_TK, acc)
    if weights_TK is not None:
        vals_TKC = vals_TKC * weights_TK.to(acc).unsqueeze(-1)
    return vals_TKC.sum(-2).to(src_NC.dtype)


def gather_dot_rows_reference(src_NC, rows_TK, g_TC):
    acc = _acc_dtype(src_NC, g_TC)
    return (_gathered(src_NC, rows_TK, acc) * g_TC.to(acc).unsqueeze(1)).sum(-1)


def _scatter_rows(rows_TK: torch.Tensor, coef_TK: torch.Tensor, vec_TC: torch.Tensor, n_src: int,
                  dtype: torch.dtype) -> torch.Tensor:
    """d_src[n] = sum over (t, k) with rows[t, k] = n of coef[t, k] * vec[t]: the transpose of both ops."""
    acc = _acc_dtype(coef_TK, vec_TC)
    contrib_TKC = torch.where((rows_TK >= 0).unsqueeze(-1), coef_TK.to(acc).unsqueeze(-1) * vec_TC.to(acc).unsqueeze(1),
                              0.0)
    out_NC = contrib_TKC.new_zeros(n_src, vec_TC.shape[1])
    out_NC.index_add_(0, rows_TK.clamp(min=0).reshape(-1).long(), contrib_TKC.reshape(-1, vec_TC.shape[1]))
    return out_NC.to(dtype)


def _fp64(kernels, src_NC, rows_TK, other_TX=None, *_) -> bool:
    """The kernels accumulate in fp32: fp64 takes the reference."""
    return _acc_dtype(src_NC, other_TX) == torch.float64


# ------------------------------------------------------------------------------------------------ gather_sum_rows


def _check_sum(src_NC, rows_TK, weights_TK=None) -> None:
    _check("gather_sum_rows", src_NC, rows_TK, weights_TK, "weights_TK", None, any_lead=True)


def _sum_setup(ctx, inputs, output):
    src_NC, rows_TK, weights_TK = inputs
    ctx.n_src, ctx.src_dtype = src_NC.shape[0], src_NC.dtype
    # Which inputs want a gradient, from the inputs themselves (needs_input_grad does not count an optional one).
    ctx.wants = (src_NC.requires_grad, weights_TK is not None and weights_TK.requires_grad)
    ctx.save_for_backward(src_NC, rows_TK, weights_TK)


def _token_rows(t: torch.Tensor) -> torch.Tensor:
    """[..., X] -> [T, X], T the product of the leading dims (a view where the strides allow)."""
    return t.unsqueeze(0) if t.dim() == 1 else t.flatten(0, -2)


def _sum_backward(ctx, grad_TC):
    src_NC, rows_TK, weights_TK = ctx.saved_tensors
    lead_shape = rows_TK.shape
    rows_TK, grad_TC = _token_rows(rows_TK), _token_rows(grad_TC)  # the ops below take 2-D tokens
    weights_TK = None if weights_TK is None else _token_rows(weights_TK)
    coef_TK = torch.ones_like(rows_TK, dtype=torch.float32) if weights_TK is None else weights_TK
    grad_src = _scatter_rows(rows_TK, coef_TK, grad_TC, ctx.n_src, ctx.src_dtype) if ctx.wants[0] else None
    grad_w = None
    if ctx.wants[1]:
        grad_w = gather_dot_rows(src_NC, rows_TK, grad_TC).to(weights_TK.dtype).view(lead_shape)
    return grad_src, None, grad_w


@define_op("lrmoe::gather_sum_rows", check=_check_sum,
           fake=lambda src_NC, rows_TK, weights_TK=None: src_NC.new_empty(*rows_TK.shape[:-1], src_NC.shape[1]),
           kernels="token_rows", cuda=lambda kernels, *args: kernels.gather_sum_rows_triton(*args),
           reference_if=_fp64, grad=(_sum_setup, _sum_backward), inline=True)
def gather_sum_rows(src_NC: torch.Tensor, rows_TK: torch.Tensor, weights_TK: torch.Tensor | None = None
                    ) -> torch.Tensor:
    return gather_sum_rows_reference(src_NC, rows_TK, weights_TK)


# ------------------------------------------------------------------------------------------------ gather_dot_rows


def _check_dot(src_NC, rows_TK, g_TC) -> None:
    _check("gather_dot_rows", src_NC, rows_TK, g_TC, "g_TC", src_NC.shape[1])


def _dot_setup(ctx, inputs, output):
    src_NC, rows_TK, g_TC = inputs
    ctx.n_src, ctx.src_dtype, ctx.g_dtype = src_NC.shape[0], src_NC.dtype, g_TC.dtype
    ctx.wants = (src_NC.requires_grad, g_TC.requires_grad)
    ctx.save_for_backward(src_NC, rows_TK, g_TC)


def _dot_backward(ctx, grad_TK):
    src_NC, rows_TK, g_TC = ctx.saved_tensors
    grad_src = _scatter_rows(rows_TK, grad_TK, g_TC, ctx.n_src, ctx.src_dtype) if ctx.wants[0] else None
    grad_g = None
    if ctx.wants[1]:
        grad_g = gather_sum_rows(src_NC, rows_TK, grad_TK).to(ctx.g_dtype)
    return grad_src, None, grad_g


@define_op("lrmoe::gather_dot_rows", check=_check_dot,
           fake=lambda src_NC, rows_TK, g_TC: src_NC.new_empty(rows_TK.shape, dtype=_acc_dtype(src_NC, g_TC)),
           kernels="token_rows", cuda=lambda kernels, *args: kernels.gather_dot_rows_triton(*args),
           reference_if=_fp64, grad=(_dot_setup, _dot_backward), inline=True)
def gather_dot_rows(src_NC: torch.Tensor, rows_TK: torch.Tensor, g_TC: torch.Tensor) -> torch.Tensor:
    return gather_dot_rows_reference(src_NC, rows_TK, g_TC)


# ---------------------------------------------------------------------------------------------- gather_dot_scores


def _check_scores(src_NC, rows_TK, g_TC, gates_TK, phi_sq_TK, metric) -> None:
    _check("gather_dot_scores", src_NC, rows_TK, g_TC, "g_TC", src_NC.shape[1])
    _check("gather_dot_scores", src_NC, rows_TK, gates_TK, "gates_TK", None)
    _check("gather_dot_scores", src_NC, rows_TK, phi_sq_TK, "phi_sq_TK", None)
    check_metric(metric, "lrmoe::gather_dot_scores")


def gather_dot_scores_reference(src_NC, rows_TK, g_TC, gates_TK, phi_sq_TK, metric):
    return gather_dot_rows_reference(src_NC, rows_TK, g_TC), score_pairs_reference(gates_TK, g_TC, phi_sq_TK, metric)


def _fake_scores(src_NC, rows_TK, g_TC, *_):
    return (src_NC.new_empty(rows_TK.shape, dtype=_acc_dtype(src_NC, g_TC)),
            src_NC.new_empty(rows_TK.shape, dtype=torch.float32))


# Forward only: the selective layers call it in their backward, where neither output is differentiated.
@define_op("lrmoe::gather_dot_scores", check=_check_scores, fake=_fake_scores, kernels="token_rows",
           cuda=lambda kernels, *args: kernels.gather_dot_scores_triton(*args), reference_if=_fp64, inline=True)
def gather_dot_scores(src_NC: torch.Tensor, rows_TK: torch.Tensor, g_TC: torch.Tensor, gates_TK: torch.Tensor,
                      phi_sq_TK: torch.Tensor, metric: str) -> tuple[torch.Tensor, torch.Tensor]:
    return gather_dot_scores_reference(src_NC, rows_TK, g_TC, gates_TK, phi_sq_TK, metric)
