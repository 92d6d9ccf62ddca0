"""Per-pair backward scores as a custom op.

Shapes: T tokens, K top-k, D model dim.

``lrmoe::score_pairs(gates_TK, grad_out_TD, phi_sqnorm_TK, metric) -> scores_TK``
    fp32 scores for metric "lrm" (alpha^2 ||g_t||^2 phi_sq), "grad_l2" (alpha^2 ||g_t||^2) or "grad_abs"
    (|alpha| ||g_t||_1); any non-finite gate, phi_sq, token norm or product gives +inf. Inputs: any float dtype,
    on one device. Shapes are checked by lrmoe.functional.score_pairs, the public entry point.

The CPU kernel is the reference below, pure PyTorch (it runs on any device). The CUDA kernel is one Triton pass
over g (lrmoe_kernels.scoring); without Triton it falls back to the reference.

No gradient formula: scores only decide which pairs the backward keeps, they are not differentiated. The autograd
registration marks the output non-differentiable, so the op accepts inputs that require grad and returns a
tensor that does not (lrmoe.functional.score_pairs also detaches its inputs, which keeps autograd out of the
traced graph altogether).
"""

from __future__ import annotations

import torch

from lrmoe.ops._define import define_op

__all__ = ["DETERMINISTIC_METRICS", "check_metric", "non_finite_mask", "score_pairs", "score_pairs_reference"]

DETERMINISTIC_METRICS = ("lrm", "grad_l2", "grad_abs")


def check_metric(metric: str, op: str = "lrmoe::score_pairs") -> None:
    if metric not in DETERMINISTIC_METRICS:
        raise ValueError(
            f"metric must be one of {', '.join(map(repr, DETERMINISTIC_METRICS))} for {op}; got {metric!r}"
        )


def non_finite_mask(
    gates_TK: torch.Tensor, phi_sqnorm_TK: torch.Tensor, g_sqnorm_T1: torch.Tensor, scores_TK: torch.Tensor
) -> torch.Tensor:
    """[T, K] bool: pairs whose score must be +inf (a non-finite gate, phi_sq, ||g_t||^2 or score)."""
    return (
        ~torch.isfinite(scores_TK)
        | ~torch.isfinite(gates_TK)
        | ~torch.isfinite(phi_sqnorm_TK)
        | ~torch.isfinite(g_sqnorm_T1)
    )


def score_pairs_reference(
    gates_TK: torch.Tensor, grad_out_TD: torch.Tensor, phi_sqnorm_TK: torch.Tensor, metric: str
) -> torch.Tensor:
    """The op's contract in plain PyTorch, in fp32 whatever the input dtype."""
    check_metric(metric)
    gates_TK = gates_TK.float()
    phi_sqnorm_TK = phi_sqnorm_TK.float()
    g_TD = grad_out_TD.float()
    g_sqnorm_T1 = g_TD.square().sum(-1, keepdim=True)
    if metric == "lrm":
        scores_TK = gates_TK.square() * g_sqnorm_T1 * phi_sqnorm_TK
    elif metric == "grad_l2":
        scores_TK = gates_TK.square() * g_sqnorm_T1
    else:
        scores_TK = gates_TK.abs() * g_TD.abs().sum(-1, keepdim=True)
    bad_TK = non_finite_mask(gates_TK, phi_sqnorm_TK, g_sqnorm_T1, scores_TK)
    return scores_TK.masked_fill(bad_TK, float("inf"))


def _cuda(kernels, gates_TK, grad_out_TD, phi_sqnorm_TK, metric):
    # The kernel reads phi_sqnorm with its own strides: a broadcastable [T, 1] (which the CPU reference
    # broadcasts) would be read past its rows; expanded, it is read as the reference reads it.
    return kernels.score_pairs_triton(gates_TK, grad_out_TD, phi_sqnorm_TK.expand_as(gates_TK), metric)


@define_op("lrmoe::score_pairs", check=lambda gates_TK, grad_out_TD, phi_sqnorm_TK, metric: check_metric(metric),
           fake=lambda gates_TK, *_: gates_TK.new_empty(gates_TK.shape, dtype=torch.float32),
           kernels="scoring", cuda=_cuda, inline=True)
def score_pairs(
    gates_TK: torch.Tensor, grad_out_TD: torch.Tensor, phi_sqnorm_TK: torch.Tensor, metric: str
) -> torch.Tensor:
    return score_pairs_reference(gates_TK, grad_out_TD, phi_sqnorm_TK, metric)
