"""Top-k routing: router logits -> chosen experts and their combine weights (gates).

Shapes: T tokens, E experts, K top-k.

The choice of experts may use a selection bias (aux-loss-free balancing, as in DeepSeek-V3 and GLM-4.5) and
group-limited routing; the gates never see the bias. Output shapes depend only on T, E and K. ``router_logits``
computes the logits, in fp32 from bf16 tokens without fp32 GEMMs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lrmoe.functional._autocast import autocast_enabled, autocast_off
from lrmoe.functional._checks import (
    check_choice,
    check_float_dtype,
    check_group_routing,
    check_in_range,
    check_int,
    check_scaling,
    check_tensor,
    check_top_k,
    checking,
)
from lrmoe.ops._torch_internals import register_dataclass
from lrmoe.ops.routing import topk_ids

__all__ = ["Routing", "route_topk", "expert_loads", "router_logits"]


def _probe_mm_out_dtype() -> bool:
    """Whether torch.mm takes out_dtype (a bf16 GEMM that writes its fp32 accumulator; CUDA kernels only)."""
    a = torch.empty(1, 1, dtype=torch.bfloat16, device="meta")
    try:
        return torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (TypeError, RuntimeError):
        return False


_MM_OUT_DTYPE = _probe_mm_out_dtype()


def _mm_acc32(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """a @ b for bf16 a, b with fp32 accumulation, written in out_dtype. CUDA: one bf16 GEMM on the tensor cores
    (torch.mm's out_dtype for an fp32 result); elsewhere (or without out_dtype): the fp32 GEMM of fp32 copies."""
    if a.is_cuda and _MM_OUT_DTYPE:
        return torch.mm(a, b) if out_dtype == a.dtype else torch.mm(a, b, out_dtype=out_dtype)
    out = a.float() @ b.float()
    # No .to() when it would return its input: under torch.compile in torch 2.11 (CPU), the forward's output as
    # such a no-op made the backward of _Bf16LogitsInFp32 wrong (every element; seen in a torch 2.11 venv).
    return out if out_dtype == torch.float32 else out.to(out_dtype)


def _bf16_bits(t_fp32: torch.Tensor) -> torch.Tensor:
    """fp32 values cut to bf16's 8 significant bits (the low 16 bits cleared, rounding toward zero): exact in bf16."""
    return (t_fp32.view(torch.int32) & -65536).view(torch.float32)


class _Bf16LogitsInFp32(torch.autograd.Function):
    """logits = x @ weight^T in fp32 for bf16 x and weight; see router_logits."""

    @staticmethod
    def forward(x_TD: torch.Tensor, weight_ED: torch.Tensor) -> torch.Tensor:
        return _mm_acc32(x_TD, weight_ED.t(), torch.float32)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, grad_TE: torch.Tensor):
        x_TD, weight_ED = ctx.saved_tensors
        # The fp32 gradient as the sum of three bf16 parts, 8 significant bits each: exactly (fp32 has 24), unless a
        # part falls below bf16's smallest normal numbers. Each GEMM below multiplies all three, so against an fp32
        # backward only the order of the sums and the final rounding to the inputs' dtype differ. The parts are cut
        # by clearing bits, not by rounding to bf16 and subtracting the rounded value: compiled, Inductor may keep
        # such a round trip in fp32 (with it, the compiled gradients differed from eager's by up to 2^-7).
        head_TE = _bf16_bits(grad_TE.float())
        rest_TE = grad_TE - head_TE  # exact: the 16 bits cleared above
        mid_TE = _bf16_bits(rest_TE)
        parts = [t.to(x_TD.dtype) for t in (head_TE, mid_TE, rest_TE - mid_TE)]  # each exact in bf16
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:  # [g1 g2 g3] @ [w; w; w]: one GEMM, the parts summed in its fp32 accumulator
            grad_x = _mm_acc32(torch.cat(parts, 1), torch.cat([weight_ED] * 3, 0), x_TD.dtype)
        if ctx.needs_input_grad[1]:  # [E, D], small: three GEMMs to fp32 and a sum
            grad_w = sum(_mm_acc32(part.t(), x_TD, torch.float32) for part in parts).to(weight_ED.dtype)
        return grad_x, grad_w


def router_logits(x_TD: torch.Tensor, weight_ED: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """[T, D] tokens and an [E, D] router weight -> [T, E] logits, in ``dtype`` (None: x's dtype, a plain linear).

    ``dtype=torch.float32`` gives the logits of fp32 copies of x and the weight, as transformers' GLM-4.5 and
    DeepSeek-V3 routers compute them (in bf16 they can choose other experts for a few tokens in a thousand). With
    bf16 x and weight no copy is made: products of bf16 numbers are exact in fp32, so one bf16 GEMM that accumulates
    in fp32 and writes fp32 (torch.mm's out_dtype, on CUDA) gives the fp32 GEMM's result up to the order of its
    sums, on the tensor cores. Its backward writes the fp32 gradient of the logits exactly as the sum of three bf16
    parts and multiplies them in bf16 GEMMs, so the gradients match an fp32 backward's up to the order of the sums
    and their final rounding. Other dtypes: the linear of copies in ``dtype``. Under torch.autocast the plain
    linear (``dtype`` None) autocasts like any; a ``dtype`` given is kept (autocast is off for it).
    """
    check_tensor("x_TD", x_TD, ndim=2, kind="float")
    check_tensor("weight_ED", weight_ED, ndim=2, kind="float")
    if weight_ED.shape[1] != x_TD.shape[1]:
        raise ValueError(f"weight_ED must be [E, {x_TD.shape[1]}] (x_TD's D), got shape {tuple(weight_ED.shape)}")
    check_float_dtype("dtype", dtype)
    if dtype is None and x_TD.dtype != weight_ED.dtype and not autocast_enabled(x_TD.device.type):
        raise TypeError(f"x_TD ({x_TD.dtype}) and weight_ED ({weight_ED.dtype}) must have the same dtype when dtype is "
                        "None (a plain linear); pass dtype to compute in one")
    if dtype is None:
        return torch.nn.functional.linear(x_TD, weight_ED)  # as any linear, under autocast too
    # A dtype asked for is kept under torch.autocast as well (autocast would run the linear in its own dtype).
    with autocast_off(x_TD.device.type):
        if dtype == x_TD.dtype and dtype == weight_ED.dtype:
            return torch.nn.functional.linear(x_TD, weight_ED)
        if dtype == torch.float32 and x_TD.dtype == weight_ED.dtype == torch.bfloat16:
            return _Bf16LogitsInFp32.apply(x_TD, weight_ED)
        return torch.nn.functional.linear(x_TD.to(dtype), weight_ED.to(dtype))


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


register_dataclass(Routing)


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
    top_k = check_top_k(top_k, n_experts)
    if bias_E is not None:
        check_tensor("bias_E", bias_E, ndim=1, kind="float")
        if bias_E.shape[0] != n_experts:
            raise ValueError(f"bias_E must have shape [{n_experts}], got {tuple(bias_E.shape)}")
        if checking() and bias_E.device.type != "meta" and not bias_E.isfinite().all():
            raise ValueError("bias_E must be finite: a NaN or infinite selection bias decides the choice of "
                             "experts for every token")
    n_group, topk_group = check_group_routing(n_experts, top_k, n_group, topk_group)
    scaling = check_scaling(scaling)

    scores_TE = logits_TE.float().softmax(-1) if score_func == "softmax" else logits_TE.float().sigmoid()
    choice_TE = scores_TE.detach()
    if bias_E is not None:
        choice_TE = choice_TE + bias_E.detach().float()

    if n_group is not None:
        group_size = n_experts // n_group
        choice_TGS = choice_TE.unflatten(-1, (n_group, group_size))
        group_score_TG = choice_TGS.topk(min(2, group_size), dim=-1).values.sum(-1)
        top_groups_TG = topk_ids(group_score_TG, topk_group)  # ties to the lower group id, as experts below
        keep_TG = torch.zeros_like(group_score_TG, dtype=torch.bool).scatter_(1, top_groups_TG, True)
        choice_TE = choice_TGS.masked_fill(~keep_TG.unsqueeze(-1), float("-inf")).flatten(1)

    expert_ids_TK = topk_ids(choice_TE, top_k)  # ties to the lower expert id, on every device
    gates_TK = scores_TE.gather(1, expert_ids_TK)
    if norm_topk_prob:
        denom_T1 = gates_TK.sum(-1, keepdim=True)
        if score_func == "sigmoid":
            # As transformers' sigmoid routers (DeepSeek-V3, GLM-4.5): + 1e-20, so k scores that all underflow to
            # 0 give gates 0, not NaN; it vanishes in the rounding of any sum above ~1e-13. Softmax needs none: its
            # best score is at least 1/E.
            denom_T1 = denom_T1 + 1e-20
        gates_TK = gates_TK / denom_T1
    if scaling != 1.0:
        gates_TK = gates_TK * scaling
    return Routing(expert_ids=expert_ids_TK, gates=gates_TK, scores=scores_TE)


def expert_loads(expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Pairs routed to each expert: [E] int64. scatter_add, not bincount (bincount syncs on CUDA).

    ``expert_ids``: integer tensor of any shape, ids in [0, num_experts): checked on the CPU outside compiled code
    (a ValueError naming the range); on a GPU only in checking mode (``lrmoe.checks``), as that needs a sync
    (scatter_add_'s device-side assert stops an out-of-range id there).
    """
    check_tensor("expert_ids", expert_ids, kind="int")
    num_experts = check_int("num_experts", num_experts)
    flat = expert_ids.reshape(-1).long()  # scatter_add_ takes int64 indices (int16 / uint8 ids raised)
    if flat.device.type == "cpu" and flat.numel() and not torch.compiler.is_compiling():
        lo, hi = int(flat.min()), int(flat.max())  # CPU tensors: no device to wait for
        if lo < 0 or hi >= num_experts:
            raise ValueError(f"expert_ids must be in [0, num_experts={num_experts}), got ids from {lo} to {hi}")
    elif checking():  # lrmoe.checks: on any device
        check_in_range("expert_ids", flat, 0, num_experts, f"expert ids, num_experts={num_experts}")
    return torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int64)
    )
