"""SwiGLU experts with an exact forward and a quota-bounded selective backward (docs/design.md, "One
selective expert step").

Shapes: T tokens, D model dim, F expert hidden dim, E experts, K top-k, P = T*K pairs, R = retained-row buffer.

Forward computes every routed pair: h_u = W_gu[e] x_t, phi_u = silu(h_u[:F]) * h_u[F:], y_u = W_d[e] phi_u,
out_t = sum_u alpha_u y_u, and saves h (per pair: on the device, in pinned host memory, or not at all, see
``activations``), y (for the router gradient, in the experts' row order) and ||phi_u||^2 (fp32).

Backward: the router gradient dL/d alpha_u = <g_t, y_u> is exact for every pair. Then every pair is scored
(score_pairs), each expert keeps its quota (select_within_quota), kept rows are scaled by their selection weight,
and the expert backward runs as grouped GEMMs over the compact buffer of at most R rows only: a dropped pair
contributes nothing to dW_gu, dW_d or, through the expert, to dx. At retain = 1 nothing is scored or dropped and
the backward equals plain autograd.

This module plans one device's step (``plan_experts``) and runs it (``selective_swiglu_experts``): the one-rank
case of the selective expert step of lrmoe.functional.expert_step, with the identity transport.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lrmoe.functional._checks import (
    check_backward_capacity,
    check_generator_not_traced,
    check_int,
    check_keeps_pairs,
    check_same_device,
    check_tensor,
)
from lrmoe.functional.expert_kernels import choose_kernels
from lrmoe.functional.expert_step import StepConfig, selective_step
from lrmoe.functional.options import BackwardOptions, resolve_options
from lrmoe.functional.quotas import plan_quotas
from lrmoe.functional.rng import sampling_uniforms
from lrmoe.functional.routing import expert_loads
from lrmoe.functional.transport import N_BACKWARD_STATS, IdentityTransport
from lrmoe.ops._torch_internals import register_dataclass

__all__ = ["ExpertPlan", "backward_capacity_rows", "plan_experts", "retained_rows_bound", "selective_swiglu_experts"]


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


register_dataclass(ExpertPlan)


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
    backward: BackwardOptions | None = None,
    draw_uniform: bool = True,
    source_ids_T: torch.Tensor | None = None,
    num_sources: int = 1,
    **options,
) -> ExpertPlan:
    """Loads, quotas and sampling uniforms for one single-device MoE layer step.

    ``backward``: the selective backward's options (:class:`~lrmoe.functional.BackwardOptions`, which documents
    each); or its fields as keywords (``**options``: retain, min_retain, policy, selection, ...), not both. The plan
    reads retain, min_retain, policy, selection, generator, quota_align and backward_capacity.

    The sampling uniforms (selection "sample", retain < 1): from ``generator`` when one is given, else a hash of
    the step's routing (``lrmoe.functional.rng``: the same draws for the same model and batch, so a resumed run, a
    recompute and a compiled graph draw what the plain run draws). ``draw_uniform=False`` skips the draw (no
    backward will run, e.g. evaluation).

    ``source_ids_T`` ([T] integer in [0, num_sources), not checked: that would need a sync) groups the pairs by
    (source, expert) instead of by expert: loads and quotas become [S, E] (``plan_quotas`` of the [S, E] loads,
    so each expert's quota is split over the sources in proportion to their loads), the uniforms [S, E] (drawn
    as one [S * E] draw in source-major order), and ``group_ids`` = expert * S + source. This is the plan
    expert parallelism uses when source s is EP rank s.

    With ``backward_capacity`` every expert keeps at most C = ``backward_capacity_rows(T, K, E, retain,
    backward_capacity)`` pairs: plan_quotas with capacity C per expert, so what a capped expert cannot keep goes
    to the experts below C, and the plan keeps min(floor(retain * P), sum of min(load, C)) pairs (pairs grouped by
    expert only).
    """
    opts = resolve_options(BackwardOptions, backward, "plan_experts", **options)
    check_tensor("expert_ids_TK", expert_ids_TK, ndim=2, kind="int")
    num_experts = check_int("num_experts", num_experts)
    retain = opts.retain
    check_generator_not_traced(opts.generator)
    if source_ids_T is not None:  # the one check that depends on the call, not on the options
        check_backward_capacity(opts.backward_capacity, retain, opts.quota_align, True, opts.policy)
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
    if opts.backward_capacity is None:
        quotas = plan_quotas(loads, retain, min_retain=opts.min_retain, policy=opts.policy, align=opts.quota_align)
    else:  # plan_quotas with one capacity C per expert: what a capped expert cannot keep goes to the others
        n_tok, top_k = expert_ids_TK.shape
        cap = backward_capacity_rows(n_tok, top_k, num_experts, retain, opts.backward_capacity)
        quotas = plan_quotas(loads, retain, min_retain=opts.min_retain, policy=opts.policy,
                             capacity=torch.full_like(loads, cap))
    if draw_uniform and opts.selection == "sample" and retain < 1.0:
        uniform = sampling_uniforms(expert_ids_TK, loads.numel(), generator=opts.generator).view(loads.shape)
    return ExpertPlan(loads=loads, quotas=quotas, uniform=uniform, group_ids=group_ids_TK, retain=retain)


def selective_swiglu_experts(
    x_TD: torch.Tensor,
    gate_up_EFD: torch.Tensor,
    down_EDF: torch.Tensor,
    expert_ids_TK: torch.Tensor,
    gates_TK: torch.Tensor,
    *,
    backward: BackwardOptions | None = None,
    plan: ExpertPlan | None = None,
    stats_probe: torch.Tensor | None = None,
    source_ids_T: torch.Tensor | None = None,
    num_sources: int = 1,
    out_shape: tuple[int, ...] | torch.Size | None = None,
    part_of_step: bool = False,
    **options,
) -> torch.Tensor:
    """out_TD = sum_k gates[t, k] * SwiGLU_{expert_ids[t, k]}(x_t), with the selective backward.

    Args:
        x_TD: [T, D] float tokens.
        gate_up_EFD: [E, 2F, D] gate half first (transformers' Qwen3-MoE ``experts.gate_up_proj``).
        down_EDF: [E, D, F] (``experts.down_proj``).
        expert_ids_TK: [T, K] integer expert of each pair; gates_TK: [T, K] float combine weights.
        backward: the selective backward's options as one :class:`~lrmoe.functional.BackwardOptions` (validated
            when it was built; it documents each); or its fields as keywords (``**options``: retain, metric,
            selection, activations, backward_capacity, kernels, ...), not both. A function has no mode:
            ``selective_in_eval`` plays no part here.
        plan: loads/quotas/uniforms from :func:`plan_experts`; planned here when None. A plan grouped by
            (source, expert) (``plan.group_ids`` set) makes every (source, expert) group keep its own quota.
            Pass the ``retain`` the plan was made for: a plan recording another (``plan.retain``) is refused.
            With ``backward_capacity`` a given plan's quotas are clamped to C.
        stats_probe: optional [3] fp32 leaf requiring grad; backward adds (fraction of score mass kept,
            retained pairs, 1) to its ``.grad``, which is how backward statistics leave without a sync.
        source_ids_T, num_sources: when planning here, group the pairs by (source, expert) (see plan_experts).
        out_shape: the output's shape, [..., D] with T tokens in its leading dims (a layer passes its input's
            shape, of which x_TD is the reshape), or None for [T, D]. The output is written in that shape, a tensor
            of its own: reshaping a [T, D] one would make it a view, and an in-place op on a view drops the hooks
            on it (FSDP2's pre-backward hook on a sharded layer's output).
        part_of_step: False (default): these pairs are the whole step, and a retain that keeps none of them where
            a backward can run is refused (every expert gradient would be zero, silently). True: they are one
            rank's part of a step whose ranks plan their quotas apart (torchtitan's expert parallelism), where a
            rank that keeps none of its few pairs is valid, and a refusal on that rank alone would leave the
            others waiting in the step's next collective.

    Returns: out_TD (in ``out_shape``, when given), dtype of x. This is the one-device case of the selective
    expert step (lrmoe.functional.expert_step): one rank, the identity transport.
    """
    opts = resolve_options(BackwardOptions, backward, "selective_swiglu_experts", **options)
    retain = opts.retain
    check_generator_not_traced(opts.generator)
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
    if plan is not None and not isinstance(plan, ExpertPlan):
        raise TypeError(f"plan must be an ExpertPlan (from plan_experts) or None, got {type(plan).__name__}")
    if plan is not None and plan.retain is not None and plan.retain != retain:
        raise ValueError(f"plan was made for retain={plan.retain}, the call has retain={retain}: pass the plan's "
                         f"retain (the backward buffer holds floor(retain * pairs) + E rows of the call's retain)")
    if source_ids_T is not None or (plan is not None and plan.group_ids is not None):
        check_backward_capacity(opts.backward_capacity, retain, opts.quota_align, True, opts.policy)
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
    hand_built = plan is not None and plan.retain is None
    n_tok, top_k = expert_ids_TK.shape
    n_pairs = n_tok * top_k
    differentiable = (x_TD, gate_up_EFD, down_EDF, gates_TK, stats_probe)
    runs_backward = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in differentiable)
    if runs_backward and not hand_built and not part_of_step:  # a forward alone is exact at any retain; a
        # hand-built plan's budget is the caller's, as is a rank's part of a step
        check_keeps_pairs(retain, opts.min_retain, n_pairs, "selective_swiglu_experts")
    if plan is None:
        plan = plan_experts(expert_ids_TK, n_exp, source_ids_T=source_ids_T, num_sources=num_sources, backward=opts)
    quotas_G, uniform_G, group_ids_P = _flat_groups(plan, n_exp, expert_ids_TK)
    capacity = None
    # The selection's buffer: retained_rows_bound of the call's retain, or of 1 (every pair) for a plan built by
    # hand, whose quotas are unknown without a host read and may keep more than floor(retain * P) + E rows.
    max_rows = retained_rows_bound(n_pairs, n_exp, 1.0 if hand_built else retain)
    if opts.backward_capacity is not None:
        capacity = backward_capacity_rows(n_tok, top_k, n_exp, retain, opts.backward_capacity)
        quotas_G = quotas_G.clamp(max=capacity)  # a given plan may keep more than a block holds
        max_rows = min(n_pairs, n_exp * capacity)  # every quota is at most C, so the E blocks hold every kept pair
    activations = opts.activations
    if activations == "offload" and not runs_backward:
        activations = "recompute"  # no backward will run: nothing to keep, so no copy to the host either
    kernels = choose_kernels(opts.kernels, x_TD, dim, down_EDF.shape[2], blocked=capacity is not None)
    cfg = StepConfig(dense=retain >= 1.0, metric=opts.metric, selection=opts.selection, generator=opts.generator,
                     activations=activations, max_rows=max_rows, group_rows=capacity,
                     out_shape=None if out_shape is None else _check_out_shape(out_shape, n_tok, dim), kernels=kernels,
                     save_outputs=opts.save_outputs)
    return selective_step(x_TD, gate_up_EFD, down_EDF, gates_TK, expert_ids_TK.reshape(-1).long(), quotas_G,
                          uniform_G, stats_probe, cfg, IdentityTransport(), groups_P=group_ids_P)


def _check_out_shape(out_shape, n_tok, dim) -> tuple[int, ...]:
    """``out_shape`` as a tuple, checked to be [..., dim] with n_tok tokens in its leading dims."""
    if not isinstance(out_shape, (tuple, list)) or not all(isinstance(n, (int, torch.SymInt)) for n in out_shape):
        raise TypeError(f"out_shape must be a tuple of ints (e.g. x.shape), got {out_shape!r}")
    n_lead = 1
    for size in out_shape[:-1]:  # not math.prod: the sizes may be SymInts under torch.compile
        n_lead = n_lead * size
    if len(out_shape) == 0 or out_shape[-1] != dim or n_lead != n_tok:
        raise ValueError(f"out_shape must be [..., D={dim}] holding the T={n_tok} tokens of x_TD in its leading "
                         f"dims, got {tuple(out_shape)}")
    return tuple(out_shape)


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
