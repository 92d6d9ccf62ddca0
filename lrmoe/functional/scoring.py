"""Per-pair backward scores: how much each token-expert pair contributes to its expert's weight update.

Shapes: T tokens, K top-k, D model dim.

For pair u = (t, e) with gate alpha_u, output gradient g_t and SwiGLU activation phi_u, the pair's term in the
down projection's gradient is the rank-one matrix alpha_u g_t phi_u^T, whose squared Frobenius norm is the LRM
score alpha_u^2 ||g_t||^2 ||phi_u||^2 (docs/design.md, "The metric").
"""

from __future__ import annotations

import torch

from lrmoe.functional._checks import check_choice, check_same_device, check_tensor
from lrmoe.ops.scoring import non_finite_mask
from lrmoe.ops.scoring import score_pairs as score_pairs_op

__all__ = ["score_pairs", "METRICS"]

METRICS = ("lrm", "grad_l2", "grad_abs", "random")


def score_pairs(
    gates_TK: torch.Tensor,
    grad_out_TD: torch.Tensor,
    phi_sqnorm_TK: torch.Tensor,
    *,
    metric: str = "lrm",
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Score every pair, in fp32 whatever the input dtype.

    metric "lrm": alpha^2 * ||g_t||^2 * ||phi_u||^2; "grad_l2": alpha^2 * ||g_t||^2; "grad_abs": |alpha| *
    ||g_t||_1; "random": uniform in [0, 1) from ``generator`` (the global RNG when None).

    Any non-finite gate, gradient or ||phi||^2 (or an overflowing product) gives +inf, so a diverging pair is
    always kept and its NaN shows up in the weights instead of being silently dropped.

    Returns: scores_TK, fp32, same shape as gates_TK.
    """
    check_tensor("gates_TK", gates_TK, ndim=2, kind="float")
    check_tensor("grad_out_TD", grad_out_TD, ndim=2, kind="float")
    check_tensor("phi_sqnorm_TK", phi_sqnorm_TK, ndim=2, kind="float")
    check_same_device(gates_TK=gates_TK, grad_out_TD=grad_out_TD, phi_sqnorm_TK=phi_sqnorm_TK)
    check_choice("metric", metric, METRICS)
    if grad_out_TD.shape[0] != gates_TK.shape[0]:
        raise ValueError(
            f"grad_out_TD must have T={gates_TK.shape[0]} rows like gates_TK, got shape {tuple(grad_out_TD.shape)}"
        )
    if phi_sqnorm_TK.shape != gates_TK.shape:
        raise ValueError(
            f"phi_sqnorm_TK must have the shape of gates_TK {tuple(gates_TK.shape)}, got {tuple(phi_sqnorm_TK.shape)}"
        )

    if metric != "random":
        # One custom op (lrmoe::score_pairs): the reference on CPU, a Triton kernel on CUDA. Scores are not
        # differentiated, so the inputs are detached: callers may pass tensors that require grad.
        return score_pairs_op(gates_TK.detach(), grad_out_TD.detach(), phi_sqnorm_TK.detach(), metric)

    gates_TK = gates_TK.detach().float()
    phi_sqnorm_TK = phi_sqnorm_TK.detach().float()
    g_sqnorm_T1 = grad_out_TD.detach().float().square().sum(-1, keepdim=True)
    # No generator keyword when there is none: torch.rand's generator overload needs concrete sizes, so with it
    # a symbolic token count (torch.compile(dynamic=True)) fails to trace.
    rng = {} if generator is None else {"generator": generator}
    scores_TK = torch.rand(gates_TK.shape, device=gates_TK.device, **rng)
    return scores_TK.masked_fill(non_finite_mask(gates_TK, phi_sqnorm_TK, g_sqnorm_T1, scores_TK), float("inf"))
