"""SwiGLU experts with an exact forward and a quota-bounded selective backward (DESIGN.md sections 3 and 5).

Shapes: T tokens, D model dim, F expert hidden dim, E experts, K top-k, P = T*K pairs, R = retained-row buffer.

Forward computes every routed pair: h_u = W_gu[e] x_t, phi_u = silu(h_u[:F]) * h_u[F:], y_u = W_d[e] phi_u,
out_t = sum_u alpha_u y_u, and saves h (per pair: on the device, in pinned host memory, or not at all, see
``activations``), y (for the router gradient, in the experts' row order) and ||phi_u||^2 (fp32).

Backward: the router gradient dL/d alpha_u = <g_t, y_u> is exact for every pair. Then every pair is scored
(score_pairs), each expert keeps its quota (select_within_quota), kept rows are scaled by their selection weight,
and the expert backward runs as grouped GEMMs over the compact buffer of at most R rows only: a dropped pair
contributes nothing to dW_gu, dW_d or, through the expert, to dx. At retain = 1 nothing is scored or dropped and
the backward equals plain autograd.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.autograd.function import once_differentiable
from torch.fx.experimental.symbolic_shapes import guard_or_false

from lrmoe.functional._checks import (
    check_backward_capacity,
    check_choice,
    check_generator,
    check_int,
    check_retain,
    check_same_device,
    check_tensor,
)
from lrmoe.functional.quotas import POLICIES, plan_quotas
from lrmoe.functional.routing import expert_loads
from lrmoe.functional.scoring import METRICS, score_pairs
from lrmoe.functional.selection import MODES, select_within_quota
from lrmoe.ops import (
    argsort_ids,
    gather_dot_rows,
    gather_dot_scores,
    gather_grouped_mm,
    gather_host_rows,
    gather_scale_rows,
    gather_sum_rows,
    grouped_outer,
    offload_to_host,
    offload_wait,
    swiglu_backward,
    swiglu_sqnorm,
)
from lrmoe.ops.scoring import DETERMINISTIC_METRICS

__all__ = ["ACTIVATION_POLICIES", "ExpertPlan", "backward_capacity_rows", "plan_experts", "retained_rows_bound",
           "selective_swiglu_experts"]

ACTIVATION_POLICIES = ("save", "recompute", "offload")  # what forward keeps for backward (selective_swiglu_experts)

N_BACKWARD_STATS = 3  # score-mass fraction kept, retained pairs, backward calls


@dataclass(frozen=True)
class ExpertPlan:
    """What the forward pass plans for backward (all tensors, no host sync).

    Pairs are grouped for selection either by expert (``group_ids`` None: loads, quotas, uniform are [E]) or by
    (source, expert) (loads, quotas, uniform are [S, E]; ``group_ids`` [T, K] holds g = expert * S + source for
    every pair, expert-major so the kept rows of one expert stay contiguous for the grouped GEMMs). The second
    form is what expert parallelism does: every source rank keeps exactly quotas[s, e] of its own pairs of
    expert e, so a single-device run with these groups reproduces the multi-rank computation.

    loads:     [E] or [S, E] int64, pairs routed to each expert (from each source).
    quotas:    same shape, pairs backward keeps.
    uniform:   same shape fp32 uniforms for systematic sampling (drawn in forward so backward is reproducible),
               or None.
    group_ids: [T, K] int64 group of every pair when grouping by (source, expert), else None.
    retain:    the retain the quotas were planned for (``plan_experts`` records it), or None for a plan built by
               hand. ``selective_swiglu_experts`` sizes its backward buffer from its own ``retain``, so it refuses a
               plan made for another one (a plan keeping more than the buffer holds lost gradients silently); for
               a plan built by hand it sizes the buffer for every pair (its quotas are not read on the host).
    """

    loads: torch.Tensor
    quotas: torch.Tensor
    uniform: torch.Tensor | None
    group_ids: torch.Tensor | None = None
    retain: float | None = None


torch.utils._pytree.register_dataclass(ExpertPlan)


def retained_rows_bound(n_pairs: int, n_experts: int, retain: float) -> int:
    """Static size of the backward row buffer: min(P, floor(retain * P) + E).

    Both quota policies keep exactly floor(retain * P) pairs unless the min_retain floors alone need more; each
    floor is ceil(min_retain * load) <= retain * load + 1, so the floors need at most retain * P + E and the
    bound always holds (plan_quotas' invariants).
    """
    # Comparisons only: under torch.compile(dynamic=True) n_pairs may be a SymInt and retain a SymFloat.
    if n_pairs < 0 or n_experts < 0 or not 0 < retain <= 1:
        raise ValueError(f"retained_rows_bound needs n_pairs >= 0, n_experts >= 0 and retain in (0, 1], got "
                         f"n_pairs={n_pairs}, n_experts={n_experts}, retain={retain}")
    if retain >= 1.0:
        return n_pairs
    return min(n_pairs, int(retain * n_pairs) + n_experts)


def backward_capacity_rows(n_tokens: int, top_k: int, n_experts: int, retain: float, factor: float) -> int:
    """Rows per expert of the padded backward buffer that ``backward_capacity=factor`` gives: C = ceil(factor *
    floor(retain * P) / E), the balanced quota times ``factor``, rounded up to a multiple of 8 (16-byte rows for the
    batched GEMMs), at least 1, and at most T (no expert is routed more than T pairs; 0 rows for 0 tokens). Every
    expert keeps at most C pairs."""
    if n_tokens < 0 or top_k < 1 or n_experts < 1 or not 0 < retain <= 1 or not 1 <= factor < math.inf:
        raise ValueError(f"backward_capacity_rows needs n_tokens >= 0, top_k >= 1, n_experts >= 1, retain in (0, 1] "
                         f"and a finite factor >= 1, got n_tokens={n_tokens}, top_k={top_k}, n_experts={n_experts}, "
                         f"retain={retain}, factor={factor}")
    budget = math.floor(retain * n_tokens * top_k)
    rows = -(-math.ceil(factor * budget / n_experts) // 8) * 8
    return min(n_tokens, max(1, rows))


def plan_experts(
    expert_ids_TK: torch.Tensor,
    num_experts: int,
    *,
    retain: float = 1.0,
    min_retain: float = 0.0,
    policy: str = "waterfill",
    selection: str = "sample",
    generator: torch.Generator | None = None,
    draw_uniform: bool = True,
    source_ids_T: torch.Tensor | None = None,
    num_sources: int = 1,
    quota_align: int = 1,
    backward_capacity: float | None = None,
) -> ExpertPlan:
    """Loads, quotas and sampling uniforms for one single-device MoE layer step.

    ``draw_uniform=False`` skips the sampling draw (no backward will run, e.g. evaluation), so a forward-only
    call leaves the RNG stream untouched.

    ``source_ids_T`` ([T] integer in [0, num_sources), not checked: that would need a sync) groups the pairs by
    (source, expert) instead of by expert: loads and quotas become [S, E] (``plan_quotas`` of the [S, E] loads,
    so each expert's quota is split over the sources in proportion to their loads), the uniforms [S, E] (drawn
    as one [S * E] draw in source-major order), and ``group_ids`` = expert * S + source. This is the plan
    expert parallelism uses when source s is EP rank s.

    ``quota_align``: plan_quotas' ``align`` (trimmed experts' quotas in multiples of it, same total).

    ``backward_capacity``: every expert keeps at most C = ``backward_capacity_rows(T, K, E, retain,
    backward_capacity)`` pairs: plan_quotas with capacity C per expert, so what a capped expert cannot keep goes
    to the experts below C, and the plan keeps min(floor(retain * P), sum of min(load, C)) pairs. Needs retain < 1,
    policy "waterfill", ``quota_align`` 1 and pairs grouped by expert.
    """
    check_tensor("expert_ids_TK", expert_ids_TK, ndim=2, kind="int")
    check_int("num_experts", num_experts)
    check_choice("selection", selection, MODES)
    check_generator(generator)
    check_backward_capacity(backward_capacity, retain, quota_align, source_ids_T is not None, policy)
    uniform = None
    if source_ids_T is None:
        loads = expert_loads(expert_ids_TK, num_experts)
        group_ids_TK = None
    else:
        check_tensor("source_ids_T", source_ids_T, ndim=1, kind="int")
        if source_ids_T.shape[0] != expert_ids_TK.shape[0]:
            raise ValueError(
                f"source_ids_T must have T={expert_ids_TK.shape[0]} entries like expert_ids_TK, got "
                f"{tuple(source_ids_T.shape)}"
            )
        if not isinstance(num_sources, int) or isinstance(num_sources, bool) or num_sources < 1:
            raise ValueError(f"num_sources must be a positive Python int, got {num_sources!r}")
        src_T1 = source_ids_T.long().unsqueeze(1)
        loads = expert_loads(src_T1 * num_experts + expert_ids_TK.long(), num_sources * num_experts)
        loads = loads.view(num_sources, num_experts)
        group_ids_TK = expert_ids_TK.long() * num_sources + src_T1
    if backward_capacity is None:
        quotas = plan_quotas(loads, retain, min_retain=min_retain, policy=policy, align=quota_align)
    else:  # plan_quotas with one capacity C per expert: what a capped expert cannot keep goes to the others
        n_tok, top_k = expert_ids_TK.shape
        cap = backward_capacity_rows(n_tok, top_k, num_experts, retain, backward_capacity)
        quotas = plan_quotas(loads, retain, min_retain=min_retain, policy=policy, capacity=torch.full_like(loads, cap))
    if draw_uniform and selection == "sample" and retain < 1.0:
        uniform = torch.rand(loads.shape, generator=generator, device=expert_ids_TK.device)
    return ExpertPlan(loads=loads, quotas=quotas, uniform=uniform, group_ids=group_ids_TK, retain=retain)


def selective_swiglu_experts(
    x_TD: torch.Tensor,
    gate_up_EFD: torch.Tensor,
    down_EDF: torch.Tensor,
    expert_ids_TK: torch.Tensor,
    gates_TK: torch.Tensor,
    *,
    retain: float = 1.0,
    metric: str = "lrm",
    selection: str = "sample",
    policy: str = "waterfill",
    min_retain: float = 0.0,
    plan: ExpertPlan | None = None,
    generator: torch.Generator | None = None,
    stats_probe: torch.Tensor | None = None,
    source_ids_T: torch.Tensor | None = None,
    num_sources: int = 1,
    activations: str = "save",
    quota_align: int = 1,
    backward_capacity: float | None = None,
) -> torch.Tensor:
    """out_TD = sum_k gates[t, k] * SwiGLU_{expert_ids[t, k]}(x_t), with the selective backward.

    Args:
        x_TD: [T, D] float tokens.
        gate_up_EFD: [E, 2F, D] gate half first (transformers' Qwen3-MoE ``experts.gate_up_proj``).
        down_EDF: [E, D, F] (``experts.down_proj``).
        expert_ids_TK: [T, K] integer expert of each pair; gates_TK: [T, K] float combine weights.
        retain, metric, selection, policy, min_retain: see plan_quotas, score_pairs, select_within_quota.
        quota_align: plan_quotas' ``align``, when planning here: trimmed experts keep multiples of it (128 lets
            torch._grouped_mm's 128-row tiles run full in backward), the same total.
        plan: loads/quotas/uniforms from :func:`plan_experts`; planned here when None. A plan grouped by
            (source, expert) (``plan.group_ids`` set) makes every (source, expert) group keep its own quota.
            Pass the ``retain`` the plan was made for: a plan recording another (``plan.retain``) is refused.
        source_ids_T, num_sources: when planning here, group the pairs by (source, expert) (see plan_experts).
        generator: RNG for sampling uniforms and the "random" metric (global RNG when None). Planning here with
            selection "sample" at retain < 1 draws the uniforms even when no backward will run (no_grad, as dropout
            draws); a plan from ``plan_experts(..., draw_uniform=False)`` leaves the RNG untouched.
        stats_probe: optional [3] fp32 leaf requiring grad; backward adds (fraction of score mass kept,
            retained pairs, 1) to its ``.grad``, which is how backward statistics leave without a sync.
        activations: what forward keeps for backward. "save": the gate/up projection h of every pair
            ([P, 2F]); backward gathers the retained rows. "recompute": not h; backward recomputes h for the
            retained rows only (one grouped GEMM over them, from x, which is saved either way), so the saved
            activations shrink by P*2F elements and the extra work scales with retain. "offload": h goes to
            pinned host memory, copied on a side stream while forward goes on (lrmoe.ops.offload_to_host), and
            backward reads back the retained rows only (lrmoe.ops.gather_host_rows): the device memory of
            "recompute" without its GEMM, for P*2F elements over PCIe in forward and M*2F in backward. The same
            gradients for all three; "offload" reads back the very values "save" keeps, so its gradients are
            bit-identical to those of "save".
        backward_capacity: None (default), or a factor >= 1: the backward's rows are laid out as E blocks of
            C = ``backward_capacity_rows(T, K, E, retain, backward_capacity)`` rows (each expert's kept pairs, then
            zero padding), and its four GEMMs run as batched GEMMs (torch.bmm) over E instead of grouped GEMMs. Each
            expert keeps at most C pairs (plan_experts plans so; a given plan's quotas are clamped to C). Pays where
            every expert's quota is near C (a balanced router): padding costs GEMM work and memory, a binding C
            costs kept pairs. Needs retain < 1, policy "waterfill", ``quota_align`` 1 and pairs grouped by expert.
            A padding row reads the output gradient of one real token times 0: an inf or NaN there makes the padded
            experts' weight gradients NaN (the gradients are not finite in that step anyway).

    Returns: out_TD, dtype of x.
    """
    check_tensor("x_TD", x_TD, ndim=2, kind="float")
    check_tensor("gate_up_EFD", gate_up_EFD, ndim=3, kind="float")
    check_tensor("down_EDF", down_EDF, ndim=3, kind="float")
    check_tensor("expert_ids_TK", expert_ids_TK, ndim=2, kind="int")
    check_tensor("gates_TK", gates_TK, ndim=2, kind="float")
    check_same_device(x_TD=x_TD, gate_up_EFD=gate_up_EFD, down_EDF=down_EDF, expert_ids_TK=expert_ids_TK,
                      gates_TK=gates_TK)
    if stats_probe is not None:
        check_tensor("stats_probe", stats_probe, ndim=1, kind="float")
        if stats_probe.shape[0] != N_BACKWARD_STATS:
            raise ValueError(f"stats_probe must have shape [{N_BACKWARD_STATS}] (one slot per backward statistic), "
                             f"got {tuple(stats_probe.shape)}")
        if not stats_probe.requires_grad:  # its .grad would stay None: no statistics, silently
            raise ValueError("stats_probe must require grad: the backward adds its statistics to stats_probe.grad")
    check_retain(retain, min_retain)
    check_choice("metric", metric, METRICS)
    check_choice("selection", selection, MODES)
    check_choice("policy", policy, POLICIES)
    check_choice("activations", activations, ACTIVATION_POLICIES)
    check_generator(generator)
    if plan is not None and not isinstance(plan, ExpertPlan):
        raise TypeError(f"plan must be an ExpertPlan (from plan_experts) or None, got {type(plan).__name__}")
    if plan is not None and plan.retain is not None and plan.retain != retain:
        raise ValueError(f"plan was made for retain={plan.retain}, the call has retain={retain}: pass the plan's "
                         f"retain (the backward buffer holds floor(retain * pairs) + E rows of the call's retain)")
    check_backward_capacity(backward_capacity, retain, quota_align,
                             source_ids_T is not None or (plan is not None and plan.group_ids is not None), policy)
    n_exp, two_f, dim = gate_up_EFD.shape
    if dim != x_TD.shape[1] or two_f % 2:
        raise ValueError(f"gate_up_EFD must be [E, 2F, D={x_TD.shape[1]}], got {tuple(gate_up_EFD.shape)}")
    if down_EDF.shape != (n_exp, dim, two_f // 2):
        raise ValueError(f"down_EDF must be [E={n_exp}, D={dim}, F={two_f // 2}], got {tuple(down_EDF.shape)}")
    if expert_ids_TK.shape != gates_TK.shape or expert_ids_TK.shape[0] != x_TD.shape[0]:
        raise ValueError(
            f"expert_ids_TK {tuple(expert_ids_TK.shape)} and gates_TK {tuple(gates_TK.shape)} must both be "
            f"[T={x_TD.shape[0]}, K]"
        )
    if not (x_TD.dtype == gate_up_EFD.dtype == down_EDF.dtype):
        raise TypeError(
            f"x_TD, gate_up_EFD and down_EDF must share a dtype, got {x_TD.dtype}, {gate_up_EFD.dtype}, "
            f"{down_EDF.dtype}"
        )
    if plan is None:
        plan = plan_experts(
            expert_ids_TK, n_exp, retain=retain, min_retain=min_retain, policy=policy, selection=selection,
            generator=generator, source_ids_T=source_ids_T, num_sources=num_sources, quota_align=quota_align,
        )
    quotas_G, uniform_G, group_ids_P = _flat_groups(plan, n_exp, expert_ids_TK)
    capacity = None
    if backward_capacity is not None:
        n_tok, top_k = expert_ids_TK.shape
        capacity = backward_capacity_rows(n_tok, top_k, n_exp, retain, backward_capacity)
        quotas_G = quotas_G.clamp(max=capacity)  # a given plan may keep more than a block holds
    differentiable = (x_TD, gate_up_EFD, down_EDF, gates_TK, stats_probe)
    if activations == "offload" and not (torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                                                         for t in differentiable)):
        activations = "recompute"  # no backward will run: nothing to keep, so no copy to the host either
    hand_built = plan is not None and plan.retain is None
    cfg = _Config(retain=retain, metric=metric, selection=selection, generator=generator, activations=activations,
                  capacity=capacity, buffer_retain=1.0 if hand_built else retain)
    return _SelectiveSwiGLU.apply(
        x_TD, gate_up_EFD, down_EDF, gates_TK, expert_ids_TK, quotas_G, uniform_G, stats_probe, cfg, group_ids_P
    )


def _flat_groups(plan: ExpertPlan, n_exp: int, expert_ids_TK: torch.Tensor):
    """Quotas and uniforms as [G] in group-id order (g = expert * S + source), and the [P] group ids or None.
    Checks the plan here, in forward, where the selection would only find a bad one in backward."""
    check_tensor("plan.quotas", plan.quotas, kind="int")
    if plan.uniform is not None:
        check_tensor("plan.uniform", plan.uniform, kind="float")
    if plan.group_ids is not None:
        check_tensor("plan.group_ids", plan.group_ids, kind="int")
    check_same_device(expert_ids_TK=expert_ids_TK, plan_quotas=plan.quotas, plan_uniform=plan.uniform,
                      plan_group_ids=plan.group_ids)
    pairs_shape = expert_ids_TK.shape
    if plan.group_ids is None:
        if plan.quotas.shape != (n_exp,):
            raise ValueError(f"plan.quotas must be [E={n_exp}] for a plan grouped by expert, got "
                             f"{tuple(plan.quotas.shape)}")
        if plan.uniform is not None and plan.uniform.shape != (n_exp,):
            raise ValueError(f"plan.uniform must be [E={n_exp}] like plan.quotas, got {tuple(plan.uniform.shape)}")
        return plan.quotas, plan.uniform, None
    if plan.quotas.dim() != 2 or plan.quotas.shape[1] != n_exp:
        raise ValueError(f"plan.quotas must be [S, E={n_exp}] for a plan grouped by (source, expert), got "
                         f"{tuple(plan.quotas.shape)}")
    if plan.group_ids.shape != pairs_shape:
        raise ValueError(f"plan.group_ids must have the shape of expert_ids_TK {tuple(pairs_shape)}, got "
                         f"{tuple(plan.group_ids.shape)}")
    if plan.uniform is not None and plan.uniform.shape != plan.quotas.shape:
        raise ValueError(f"plan.uniform must have the shape of plan.quotas {tuple(plan.quotas.shape)}, got "
                         f"{tuple(plan.uniform.shape)}")
    uniform_G = None if plan.uniform is None else plan.uniform.t().reshape(-1)
    return plan.quotas.t().reshape(-1), uniform_G, plan.group_ids.reshape(-1)


@dataclass(frozen=True)
class _Config:
    retain: float
    metric: str
    selection: str
    generator: torch.Generator | None
    activations: str = "save"
    capacity: int | None = None  # rows per expert of the padded backward layout (backward_capacity), or None
    # The retain the backward buffer is sized for: the call's, or 1 (every pair) for a plan built by hand, whose
    # quotas are unknown without a host read and may keep more than floor(retain * P) + E rows.
    buffer_retain: float = 1.0


def router_gradient(g_TD: torch.Tensor, y_ND: torch.Tensor, rows_TK: torch.Tensor) -> torch.Tensor:
    """Exact router gradient dL/d alpha_tk = <g_t, y_tk>, [T, K] fp32, where pair (t, k)'s expert output is
    ``y_ND[rows_TK[t, k]]`` (y in the order the experts wrote it): one pass over y, no pair-order copy
    (lrmoe::gather_dot_rows)."""
    return gather_dot_rows(y_ND, rows_TK, g_TD)


def router_gradient_and_scores(
    g_TD: torch.Tensor, y_ND: torch.Tensor, rows_TK: torch.Tensor, gates_TK: torch.Tensor, phi_sq_TK: torch.Tensor,
    *, metric: str, selects: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(router_gradient, the pairs' scores [P] or None), both layers. When the backward ``selects`` pairs by a
    deterministic metric, the scores come from the router gradient's own pass over g (lrmoe::gather_dot_scores:
    on CUDA one kernel, where score_pairs would read all of g a second time); otherwise None, and
    select_retained scores the pairs itself ("random" draws them)."""
    if not selects or metric not in DETERMINISTIC_METRICS:
        return router_gradient(g_TD, y_ND, rows_TK), None
    grad_TK, scores_TK = gather_dot_scores(y_ND, rows_TK, g_TD, gates_TK.detach(), phi_sq_TK, metric)
    return grad_TK, scores_TK.reshape(-1)


def combine(y_ND: torch.Tensor, rows_TK: torch.Tensor, gates_TK: torch.Tensor) -> torch.Tensor:
    """out_t = sum_k gates[t, k] * y[rows[t, k]] (fp32 accumulation, y's dtype; the gates rounded to y's dtype
    first, as the product in that dtype would): the forward's combine, reading y where the experts wrote it."""
    return gather_sum_rows(y_ND, rows_TK, gates_TK.to(y_ND.dtype))


def take_rows(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``src.index_select(0, index)``, or zero rows when ``src`` is known to have none (an expert-parallel rank
    with no tokens: every index it holds then points at padding). Inductor cannot lower a gather from a tensor
    of static size 0 by a data-dependent row count, and such a rank's compiled backward still gathers."""
    if guard_or_false(src.shape[0] == 0):
        return src.new_zeros(index.shape[0], *src.shape[1:])
    return src.index_select(0, index)


def select_retained(
    gates_TK: torch.Tensor,
    g_TD: torch.Tensor,
    phi_sq_TK: torch.Tensor,
    groups_P: torch.Tensor,
    quotas_G: torch.Tensor,
    max_rows: int,
    *,
    metric: str,
    selection: str,
    generator: torch.Generator | None,
    uniform_G: torch.Tensor | None,
    group_order_P: torch.Tensor | None = None,
    group_ends_G: torch.Tensor | None = None,
    scores_P: torch.Tensor | None = None,
):
    """Score the pairs and keep each group's quota (the source side of the selective backward, both layers).
    ``group_order_P`` and ``group_ends_G``: the stable argsort of ``groups_P`` and the cumulative group sizes, when
    the layer has them from its forward dispatch, so the selection need neither sort nor search for the groups
    again. ``scores_P``: the scores, when router_gradient_and_scores made them. Returns (Selection, fraction of the
    finite score mass the kept pairs carry)."""
    if scores_P is None:
        scores_P = score_pairs(gates_TK.detach(), g_TD, phi_sq_TK, metric=metric, generator=generator).reshape(-1)
    # Each token picks an expert at most once, so no group (expert, instance, or (source, expert)) holds more
    # than T pairs: the bound CUDA "sample" needs to sort per group.
    sel = select_within_quota(scores_P, groups_P, quotas_G, max_rows=max_rows, mode=selection, generator=generator,
                              uniform_G=uniform_G, group_order_P=group_order_P, max_group_size=gates_TK.shape[0],
                              group_ends_G=group_ends_G)
    finite_P = torch.where(torch.isfinite(scores_P), scores_P, 0.0)
    kept_mass = take_rows(finite_P, sel.pair_ids.clamp(min=0)).mul(sel.pair_ids >= 0).sum()
    return sel, kept_mass / finite_P.sum().clamp(min=torch.finfo(torch.float32).tiny)


def retained_dy(
    g_TD: torch.Tensor, gates_TK: torch.Tensor, pair_R: torch.Tensor, weight_R: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dy_RD = alpha * g / p per kept row, token of each row, pair id with padding -1 read as 0). Padding rows get
    weight 0, hence zero rows; the product is computed in fp32 and rounded once: lrmoe::gather_scale_rows, one pass
    and no fp32 copy of the rows, eager and compiled (its Triton kernel beat Inductor's gather there). g in another
    dtype than dy, or fp64 (whose gates keep fp64: plain autograd's values at retain 1): the PyTorch form."""
    safe_R = pair_R.clamp(min=0)
    tok_R = torch.div(safe_R, gates_TK.shape[1], rounding_mode="floor")
    coef_dtype = torch.promote_types(dtype, torch.float32)
    coef_R = take_rows(gates_TK.detach().reshape(-1).to(coef_dtype), safe_R) * weight_R.to(coef_dtype)
    if g_TD.dtype != dtype or coef_dtype != torch.float32:
        return (take_rows(g_TD, tok_R) * coef_R.unsqueeze(1)).to(dtype), tok_R, safe_R
    return gather_scale_rows(g_TD, tok_R, coef_R), tok_R, safe_R


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


def saved_h(h_NF2: torch.Tensor, activations: str) -> torch.Tensor | None:
    """What forward keeps of the gate/up projection (both layers): h itself ("save"), nothing ("recompute"), or
    its pinned host copy ("offload"). Called as soon as h exists, so the copy to the host overlaps the rest of the
    forward, compiled too: there the forward ends with ``release_h``, which keeps h's memory from being reused
    before the copy has read it (lrmoe.ops.offload, point 1)."""
    if activations == "save":
        return h_NF2
    if activations == "recompute":
        return None
    return offload_to_host(h_NF2)


def release_h(h_NF2: torch.Tensor, h_saved: torch.Tensor | None, out: torch.Tensor, activations: str) -> None:
    """The forward's last use of h (both layers, given their output). Compiled with "offload": lrmoe::offload_wait,
    so h's buffer stays live until the current stream waits (on the GPU) for the copy saved_h started, after the
    forward's work, and no later buffer in h's memory is written before the copy has read it (lrmoe.ops.offload,
    point 1). Eager: nothing, the caching allocator protects h (record_stream)."""
    if activations == "offload" and torch.compiler.is_compiling():
        offload_wait(h_NF2, h_saved, out)


def expert_rows_backward(
    dy: list[torch.Tensor],
    x_ND: torch.Tensor,
    src_rows_R: torch.Tensor | None,
    offsets_E: torch.Tensor,
    gate_up_EFD: torch.Tensor,
    down_EDF: torch.Tensor,
    h_saved: torch.Tensor | None,
    h_index_R: torch.Tensor | None,
    needs: tuple[bool, bool, bool] = (True, True, True),
    h_on_host: bool = False,
    group_rows: int | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The compact expert backward over retained rows, grouped by expert (``offsets_E``): shared by the
    single-device and the expert-parallel layer.

    ``dy`` = [dy_RD], the output gradient of the retained rows, is consumed (the caller drops its reference), so
    every row buffer is released right after its last use here: the lifetimes lrmoe.memory models. Row i's input
    is ``x_ND[src_rows_R[i]]``. Its gate/up pre-activation h is ``h_saved[h_index_R[i]]`` (activations "save",
    read in place by lrmoe::swiglu_backward; with ``h_on_host``, "offload": read from the pinned host copy, only
    these rows crossing the link), or recomputed from that input when ``h_saved`` is None ("recompute": one
    grouped GEMM over the kept rows). dphi comes first, so that phi and dh come out of one pass over h. ``needs`` = (dx,
    gate/up grad, down grad). Returns (dx_RD, grad_gate_up_EFD, grad_down_EDF), None where not needed.

    ``group_rows`` = C: the rows are E blocks of C (``pad_to_blocks``), and the GEMMs run as torch.bmm over E.
    """
    if group_rows is not None:
        return _blocked_rows_backward(dy, x_ND, src_rows_R, gate_up_EFD, down_EDF, h_saved, h_index_R, needs,
                                      h_on_host, group_rows)
    dy_RD = dy.pop()
    # Recomputed: rows past the last offset come back as zeros.
    h_src, h_rows_R = _rows_h(h_saved, h_index_R, h_on_host, gather_grouped_mm, x_ND, gate_up_EFD, src_rows_R,
                              offsets_E)
    need_x, need_gu, need_down = needs
    dphi_RF = gather_grouped_mm(dy_RD, down_EDF.transpose(1, 2), None, offsets_E)
    # phi (the down projection's weight-gradient operand) and dh from one read of h (lrmoe::swiglu_backward).
    dh_RF2, phi_RF = swiglu_backward(h_src, h_rows_R, dphi_RF)
    del h_src, dphi_RF
    grad_down = grouped_outer(dy_RD, phi_RF, None, offsets_E) if need_down else None
    del dy_RD, phi_RF
    grad_gu = grouped_outer(dh_RF2, x_ND, src_rows_R, offsets_E) if need_gu else None
    dx_RD = gather_grouped_mm(dh_RF2, gate_up_EFD.transpose(1, 2), None, offsets_E) if need_x else None
    return dx_RD, grad_gu, grad_down


def _rows_h(h_saved, h_index_R, h_on_host, recompute, *args):
    """(h, row index into it) for the retained rows: the saved h read in place through the index ("save"), or a
    buffer of just these rows, read back from the host copy ("offload") or ``recompute(*args)`` ("recompute")."""
    if h_saved is None:
        return recompute(*args), None
    if h_on_host:
        return gather_host_rows(h_saved, h_index_R), None
    return h_saved, h_index_R


def _block_mm(a_ECI: torch.Tensor, w_EIO: torch.Tensor) -> torch.Tensor:
    """One GEMM per block, as rows: [E, C, I] @ [E, I, O] -> [E * C, O]."""
    return torch.bmm(a_ECI, w_EIO).view(-1, w_EIO.shape[-1])


def _blocked_rows_backward(dy, x_ND, src_rows_R, gate_up_EFD, down_EDF, h_saved, h_index_R, needs, h_on_host,
                           n_rows):
    """expert_rows_backward over E blocks of ``n_rows`` rows: the same steps, each GEMM a torch.bmm on [E, C, .]
    views (the row buffers are contiguous), the inputs' rows gathered once for the weight gradient (and the
    recomputed h)."""
    n_exp, dim = gate_up_EFD.shape[0], x_ND.shape[1]
    dy_ECD = dy.pop().view(n_exp, n_rows, dim)
    need_x, need_gu, need_down = needs
    x_rows_ECD = None
    if h_saved is None or need_gu:  # lrmoe::gather_scale_rows times 1 (exact): its Triton row gather on CUDA
        ones_R = torch.ones(src_rows_R.shape[0], device=x_ND.device)
        x_rows_ECD = gather_scale_rows(x_ND, src_rows_R, ones_R).view(n_exp, n_rows, dim)
    h_src, h_rows_R = _rows_h(h_saved, h_index_R, h_on_host, _block_mm, x_rows_ECD, gate_up_EFD.transpose(1, 2))
    dphi_RF = _block_mm(dy_ECD, down_EDF)
    dh_RF2, phi_RF = swiglu_backward(h_src, h_rows_R, dphi_RF)
    del h_src, dphi_RF
    grad_down = torch.bmm(dy_ECD.transpose(1, 2), phi_RF.view(n_exp, n_rows, phi_RF.shape[1])) if need_down else None
    del dy_ECD, phi_RF
    dh_ECF2 = dh_RF2.view(n_exp, n_rows, dh_RF2.shape[1])  # sizes spelled out: C may be 0 (no tokens)
    grad_gu = torch.bmm(dh_ECF2.transpose(1, 2), x_rows_ECD) if need_gu else None
    del x_rows_ECD
    dx_RD = _block_mm(dh_ECF2, gate_up_EFD) if need_x else None
    return dx_RD, grad_gu, grad_down


def sum_rows_per_token(dx_RD: torch.Tensor, pair_R: torch.Tensor, n_tok: int, top_k: int) -> torch.Tensor:
    """grad_x[t] = sum of the rows of token t's kept pairs (both layers). Each pair learns the buffer row that holds
    it (-1: dropped; padding rows, pair id -1, go to a spare slot), then lrmoe::gather_sum_rows reads each
    token's rows in place and sums them with fp32 accumulation: deterministic (pair ids are unique, no atomics),
    and no [T*K, D] buffer of zeros and copied rows."""
    n_pairs = n_tok * top_k
    dest_R = torch.where(pair_R >= 0, pair_R, n_pairs)
    slot_P = torch.full((n_pairs + 1,), -1, dtype=torch.long, device=pair_R.device)
    slot_P.index_copy_(0, dest_R, torch.arange(pair_R.shape[0], device=pair_R.device))
    return gather_sum_rows(dx_RD, slot_P[:n_pairs].view(n_tok, top_k))


class _SelectiveSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, gate_up_EFD, down_EDF, gates_TK, expert_ids_TK, quotas_G, uniform_G, stats_probe, cfg,
                group_ids_P=None):
        n_tok, top_k = expert_ids_TK.shape
        n_exp = gate_up_EFD.shape[0]
        flat_P = expert_ids_TK.reshape(-1).long()
        order_P = argsort_ids(flat_P)  # pairs grouped by expert, pair id within
        tok_P = torch.div(order_P, top_k, rounding_mode="floor")
        offsets_E = torch.cumsum(expert_loads(flat_P, n_exp), 0).int()
        ident_P = torch.arange(flat_P.shape[0], device=flat_P.device)

        h_PF2 = gather_grouped_mm(x_TD, gate_up_EFD, tok_P, offsets_E)
        h_saved = saved_h(h_PF2, cfg.activations)
        phi_PF, phi_sq_P = swiglu_sqnorm(h_PF2)  # and ||phi||^2 per row in fp32, from one read of h
        y_PD = gather_grouped_mm(phi_PF, down_EDF, None, offsets_E)  # rows in place: no gather
        # Pair (t, k) = pair id t*K + k sits at row inv_P[t*K + k] of the expert-ordered buffers.
        inv_P = torch.empty_like(order_P).scatter_(0, order_P, ident_P)
        phi_sq_TK = phi_sq_P.index_select(0, inv_P).view(n_tok, top_k)
        out_TD = combine(y_PD, inv_P.view(n_tok, top_k), gates_TK)

        ctx.cfg = cfg
        ctx.has_probe = stats_probe is not None
        ctx.save_for_backward(x_TD, gate_up_EFD, down_EDF, gates_TK, expert_ids_TK, quotas_G, uniform_G,
                              h_saved, y_PD, phi_sq_TK, order_P, inv_P, offsets_E, group_ids_P)
        release_h(h_PF2, h_saved, out_TD, cfg.activations)
        return out_TD

    @staticmethod
    @once_differentiable  # its ops have no gradients: a second order would be silently incomplete
    def backward(ctx, grad_out_TD):
        (x_TD, gate_up_EFD, down_EDF, gates_TK, expert_ids_TK, quotas_G, uniform_G,
         h_saved, y_PD, phi_sq_TK, order_P, inv_P, offsets_E, group_ids_P) = ctx.saved_tensors
        cfg: _Config = ctx.cfg
        n_tok, top_k = expert_ids_TK.shape
        n_pairs = n_tok * top_k
        n_exp = gate_up_EFD.shape[0]
        g_TD = grad_out_TD

        grad_gates_TK, scores_P = router_gradient_and_scores(
            g_TD, y_PD, inv_P.view(n_tok, top_k), gates_TK, phi_sq_TK, metric=cfg.metric, selects=cfg.retain < 1.0
        )
        grad_gates_TK = grad_gates_TK.to(gates_TK.dtype)

        if cfg.retain >= 1.0:
            # Keep everything, in the forward's expert-sorted order: the dense backward.
            pair_R, off_E = order_P, offsets_E
            weight_R = torch.ones(n_pairs, device=g_TD.device)
            mass_kept = torch.ones((), device=g_TD.device)
        else:
            # Groups are experts, or (source, expert) pairs g = e * S + s: expert-major, so one expert's kept rows
            # stay contiguous and its grouped-GEMM offset is the end of its last source group.
            if group_ids_P is None:  # grouped by expert: the forward's dispatch order and offsets are the groups'
                groups_P, group_order_P, group_ends_G = expert_ids_TK.reshape(-1), order_P, offsets_E
            else:
                groups_P, group_order_P, group_ends_G = group_ids_P, None, None
            max_rows = retained_rows_bound(n_pairs, n_exp, cfg.buffer_retain)
            if cfg.capacity is not None:  # every quota is at most C, so the E blocks hold every kept pair
                max_rows = min(n_pairs, n_exp * cfg.capacity)
            sel, mass_kept = select_retained(
                gates_TK, g_TD, phi_sq_TK, groups_P, quotas_G, max_rows,
                metric=cfg.metric, selection=cfg.selection, generator=cfg.generator, uniform_G=uniform_G,
                group_order_P=group_order_P, group_ends_G=group_ends_G, scores_P=scores_P,
            )
            pair_R, weight_R = sel.pair_ids, sel.weights
            # Each expert's last group's end; contiguous: with (source, expert) groups this column is strided, and
            # the CUDA GEMMs read offsets as a flat array (they took every S-th group end, a wrong gradient).
            off_E = sel.offsets.view(n_exp, -1)[:, -1].contiguous()
        n_kept = off_E[-1]
        if cfg.capacity is not None:
            pair_R, weight_R, off_E = pad_to_blocks(pair_R, weight_R, off_E, cfg.capacity)

        dy_RD, tok_R, safe_R = retained_dy(g_TD, gates_TK, pair_R, weight_R, x_TD.dtype)
        dy = [dy_RD]
        del dy_RD  # expert_rows_backward releases it after its last use
        dx_RD, grad_gu, grad_down = expert_rows_backward(
            dy, x_TD, tok_R, off_E, gate_up_EFD, down_EDF, h_saved=h_saved,
            h_index_R=None if h_saved is None else inv_P.index_select(0, safe_R),
            needs=tuple(ctx.needs_input_grad[:3]), h_on_host=cfg.activations == "offload",
            group_rows=cfg.capacity,
        )
        grad_x = None if dx_RD is None else sum_rows_per_token(dx_RD, pair_R, n_tok, top_k)

        grad_probe = None
        if ctx.has_probe:
            grad_probe = torch.stack([mass_kept.float(), n_kept.float(), torch.ones_like(mass_kept)])
        return grad_x, grad_gu, grad_down, grad_gates_TK, None, None, None, grad_probe, None, None
