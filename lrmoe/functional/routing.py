"""Top-k routing: router logits -> chosen experts and their combine weights (gates).

Shapes: T tokens, E experts, K top-k.

The choice of experts may use a selection bias (aux-loss-free balancing, as in DeepSeek-V3 and GLM-4.5) and
group-limited routing; the gates never see the bias. Output shapes depend only on T, E and K.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lrmoe.functional._checks import check_choice, check_group_routing, check_scaling, check_tensor
from lrmoe.ops.routing import topk_ids

__all__ = ["Routing", "route_topk", "expert_loads"]


@dataclass(frozen=True)
class Routing:
    """Result of :func:`route_topk`.

    expert_ids: [T, K] int64, the chosen experts of each token (descending by biased score; of equal scores the
                lower expert id first, lrmoe::topk_ids).
    gates:      [T, K] fp32, combine weight of each chosen pair (after renormalisation and scaling).
    scores:     [T, E] fp32, router probabilities (softmax or sigmoid of the logits, no bias).
    """

    expert_ids: torch.Tensor
    gates: torch.Tensor
    scores: torch.Tensor


torch.utils._pytree.register_dataclass(Routing)


def route_topk(
    logits_TE: torch.Tensor,
    top_k: int,
    *,
    score_func: str = "softmax",
    bias_E: torch.Tensor | None = None,
    norm_topk_prob: bool = True,
    scaling: float = 1.0,
    n_group: int | None = None,
    topk_group: int | None = None,
) -> Routing:
    """Choose ``top_k`` experts per token.

    scores = softmax(logits) or sigmoid(logits), in fp32. Experts are chosen by ``scores + bias_E`` (the bias
    only steers the choice); with ``n_group``/``topk_group`` the experts are split into ``n_group`` equal groups,
    each group is rated by the sum of its two best biased scores (its best one if a group has a single expert),
    and only experts of the ``topk_group`` best groups can be chosen. Gates are the unbiased scores of the chosen
    experts, divided by their sum when ``norm_topk_prob``, times ``scaling``. Gates are differentiable in the
    logits; the choice is not.
    """
    check_tensor("logits_TE", logits_TE, ndim=2, kind="float")
    check_choice("score_func", score_func, ("softmax", "sigmoid"))
    n_experts = logits_TE.shape[1]
    if not isinstance(top_k, int) or not 1 <= top_k <= n_experts:
        raise ValueError(f"top_k must be an int in [1, num_experts={n_experts}], got {top_k!r}")
    if bias_E is not None:
        check_tensor("bias_E", bias_E, ndim=1, kind="float")
        if bias_E.shape[0] != n_experts:
            raise ValueError(f"bias_E must have shape [{n_experts}], got {tuple(bias_E.shape)}")
    check_group_routing(n_experts, top_k, n_group, topk_group)
    check_scaling(scaling)

    scores_TE = logits_TE.float().softmax(-1) if score_func == "softmax" else logits_TE.float().sigmoid()
    choice_TE = scores_TE.detach()
    if bias_E is not None:
        choice_TE = choice_TE + bias_E.detach().float()

    if n_group is not None:
        group_size = n_experts // n_group
        choice_TGS = choice_TE.unflatten(-1, (n_group, group_size))
        group_score_TG = choice_TGS.topk(min(2, group_size), dim=-1).values.sum(-1)
        top_groups_TG = group_score_TG.topk(topk_group, dim=-1).indices
        keep_TG = torch.zeros_like(group_score_TG, dtype=torch.bool).scatter_(1, top_groups_TG, True)
        choice_TE = choice_TGS.masked_fill(~keep_TG.unsqueeze(-1), float("-inf")).flatten(1)

    expert_ids_TK = topk_ids(choice_TE, top_k)  # ties to the lower expert id, on every device
    gates_TK = scores_TE.gather(1, expert_ids_TK)
    if norm_topk_prob:
        gates_TK = gates_TK / gates_TK.sum(-1, keepdim=True)
    if scaling != 1.0:
        gates_TK = gates_TK * scaling
    return Routing(expert_ids=expert_ids_TK, gates=gates_TK, scores=scores_TE)


def expert_loads(expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Pairs routed to each expert: [E] int64. scatter_add, not bincount (bincount syncs on CUDA)."""
    flat = expert_ids.reshape(-1)
    return torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int64)
    )
