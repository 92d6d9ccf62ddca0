"""The selective expert step: one autograd Function for one device and for expert parallelism
(docs/design.md, "One selective expert step" and "Expert parallelism").

Shapes: T tokens, D model dim, F expert hidden dim, I expert instances on this rank (E on one device), K top-k,
P = T * K pairs, N forward rows this rank's instances compute (N = P on one device), R retained rows this rank
selects in backward, M retained rows its instances receive (M = R on one device).

A step is planned before it runs: every pair's destination instance, the backward quotas of this rank's pair
groups and, across ranks, what each rank sends and receives (``ExpertPlan``; ``ExpertParallelPlan``). The
``_SelectiveStep`` Function then runs, on every rank,

    forward:  sort the pairs by destination -> transport.dispatch -> grouped GEMM (gate/up) -> SwiGLU and ||phi||^2
              -> grouped GEMM (down) -> transport.combine -> out_t = sum_k alpha_tk y_tk;
    backward: exact router gradient <g_t, y_u> -> score and select each group's quota of this rank's own pairs ->
              transport.exchange (the retained rows alpha * g / p to the instances that ran them) -> compact expert
              backward over those rows only -> transport.give_back (their input-gradient rows) -> sum per token.

On one device, where the backend computes the router gradient (``ExpertKernels.computes_router_gradient`` at
retain 1, ``computes_dropped_router_gradient`` below it, unless ``save_outputs``), the forward saves no y: the
expert backward, handed the rows as the tokens' own gradient rows with their coefficients (``TokenRows``), returns
<g_t, y_u> = <g_t W_down^T, phi_u> from its own operands, for the dropped pairs from one more GEMM over every
forward row (``TokenRows.all_tok_N``). The saved activations are then x, h (or, where h is not kept, phi below
retain 1) and the routing, as a dense MoE layer's; at retain 1 not even ||phi||^2, since nothing is scored.

Two seams, each an abstract class with frozen dataclasses for what crosses it: the transport
(lrmoe.functional.transport: :class:`IdentityTransport` on one device, lrmoe.nn._transport.AllToAllTransport under
expert parallelism) and the kernels that compute the experts (lrmoe.functional.expert_kernels: ``cfg.kernels``).
The step branches on neither.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lrmoe.functional._checks import checking, checks
from lrmoe.functional.expert_kernels import BACKENDS
from lrmoe.functional.retained_rows import take_rows
from lrmoe.functional.scoring import score_pairs
from lrmoe.functional.selection import select_within_quota
from lrmoe.functional.transport import BackwardRequest, ForwardRecord, Transport
from lrmoe.ops import argsort_ids, gather_dot_rows, gather_dot_scores, gather_sum_rows, offload_to_host, offload_wait
from lrmoe.ops.scoring import DETERMINISTIC_METRICS

__all__ = ["StepConfig", "selective_step"]


@dataclass(frozen=True)
class StepConfig:
    """The Python values one step runs with (the same on every rank).

    dense: keep every pair, in the forward's dispatch order (retain 1, and no capacity that could bind).
    max_rows: the selection's buffer rows: a static bound on one device, the planned exact count under expert
        parallelism.
    group_rows: C, rows per instance block of a blocked backward (torch.bmm over the instances), or None.
    out_shape: the output's shape, [..., D] with the T tokens as its leading dims (the layer's x's), or None for
        [T, D]. The combine writes the output in it: a tensor of its own, not a view of [T, D] rows, since an
        in-place op on a view would drop the hooks FSDP2 puts on the layer's output.
    kernels: the name of the backend that computes the experts (lrmoe.functional.expert_kernels.BACKENDS).
    save_outputs: keep y for the router gradient below retain 1 (BackwardOptions.save_outputs).
    """

    dense: bool
    metric: str
    selection: str
    generator: torch.Generator | None
    activations: str = "save"  # what forward keeps of h: "save", "recompute" or "offload" (see saved_h)
    max_rows: int = 0
    group_rows: int | None = None
    out_shape: tuple[int, ...] | None = None
    kernels: str = "portable"
    save_outputs: bool = False


class _SelectiveStep(torch.autograd.Function):
    """out_TD = sum_k gates[t, k] * SwiGLU_{instance of pair (t, k)}(x_t) with the selective backward; see the
    module docstring. Inputs: dest_P [P] the instance of every pair (its expert on one device); quotas_G and
    uniform_G of this rank's pair groups (the groups are dest_P, or groups_P when given: (source, expert) groups
    on one device); assign_SWI and quotas_SWI, the plan's rows per (source, rank, instance) in forward and
    backward (expert parallelism; None on one device)."""

    @staticmethod
    def forward(ctx, x_TD, gate_up_IFD, down_IDF, gates_TK, dest_P, quotas_G, uniform_G, groups_P, assign_SWI,
                quotas_SWI, probe, cfg: StepConfig, transport):
        n_tok, top_k = gates_TK.shape
        n_inst = gate_up_IFD.shape[0]
        # Pairs grouped by destination instance (stable: pair id within): under expert parallelism also by
        # destination rank, the dispatch's send order.
        order_P = argsort_ids(dest_P)
        tok_P = torch.div(order_P, top_k, rounding_mode="floor")
        dispatched = transport.dispatch(x_TD, tok_P, dest_P, n_inst, assign_SWI)
        x_ND, offsets_I = dispatched.rows_ND, dispatched.offsets_I
        ident_P = torch.arange(dest_P.shape[0], device=dest_P.device)

        kernels = BACKENDS[cfg.kernels]
        # On one device, with a backend that computes the router gradient in its backward, y is not saved:
        # <g_t, y_u> comes from the backward's operands, g W_down^T and phi. Every pair kept: the retained rows
        # are all the rows. Below retain 1 (unless save_outputs) the dropped rows' g W_down^T is their only extra
        # GEMM, and their phi comes from the saved h, or (h recomputed or offloaded) from phi itself, saved: half
        # of h's bytes.
        router_from_rows = cfg.group_rows is None and transport.selects_in_dispatch_order and (
            kernels.computes_router_gradient if cfg.dense
            else kernels.computes_dropped_router_gradient and not cfg.save_outputs)
        keep_phi = router_from_rows and not cfg.dense and cfg.activations != "save"
        h_NF2, phi_NF, phi_sq_N = kernels.gate_up(x_ND, dispatched.rows_N, offsets_I, gate_up_IFD)
        h_saved = saved_h(h_NF2, cfg.activations)
        y_ND = kernels.down(phi_NF, offsets_I, down_IDF)
        combined = transport.combine(y_ND, phi_sq_N, dispatched, assign_SWI)
        y_PD, phi_sq_P = combined.y_PD, combined.phi_sq_P
        # Pair (t, k) = pair id t*K + k sits at row inv_P[t*K + k] of the dispatch-ordered buffers.
        inv_P = torch.empty_like(order_P).scatter_(0, order_P, ident_P)
        phi_sq_TK = None if cfg.dense and router_from_rows else phi_sq_P.index_select(0, inv_P).view(n_tok, top_k)
        lead = (n_tok,) if cfg.out_shape is None else cfg.out_shape[:-1]  # out [*lead, D], written in that shape
        out = combine(y_PD, inv_P.view(*lead, top_k), gates_TK.reshape(*lead, top_k))

        ctx.cfg, ctx.transport = cfg, transport
        ctx.has_probe = probe is not None
        ctx.router_from_rows, ctx.y_dtype = router_from_rows, y_PD.dtype
        # Checking mode as this forward runs (a Python bool; False while compiled): the backward's checks follow it,
        # on whatever thread autograd runs the backward (lrmoe.checks).
        ctx.checking = checking()
        ctx.save_for_backward(x_ND, gate_up_IFD, down_IDF, gates_TK, dest_P, quotas_G, uniform_G, groups_P,
                              assign_SWI, quotas_SWI, h_saved, None if router_from_rows else y_PD, phi_sq_TK,
                              order_P, inv_P, offsets_I, combined.h_of_row_P, phi_NF if keep_phi else None)
        release_h(h_NF2, h_saved, out, cfg.activations)
        return out

    @staticmethod
    def backward(ctx, grad_out_TD):
        # A backward that builds a graph (create_graph=True: grad mode is on in it) would differentiate through
        # ops without gradients of their own, so the second order would be silently incomplete: refuse it.
        # (once_differentiable raises only when the incoming gradient itself requires grad.) Compiled graphs
        # never run double backward (AOTAutograd refuses it), so the check is eager only.
        if torch.is_grad_enabled() and not torch.compiler.is_compiling():
            raise RuntimeError(
                "lrmoe's selective expert step has no second-order gradient: a graph through it was "
                "differentiated with create_graph=True (torch.autograd.grad(..., create_graph=True), double "
                "backward, gradient penalties); differentiate without create_graph, or keep such a term off "
                "the MoE layer")
        if torch.compiler.is_compiling():  # traced: no check runs, and the context variable is never traced
            return _SelectiveStep._backward(ctx, grad_out_TD)
        with checks(ctx.checking):  # the forward's setting, not the backward thread's
            return _SelectiveStep._backward(ctx, grad_out_TD)

    @staticmethod
    def _backward(ctx, grad_out_TD):
        (x_ND, gate_up_IFD, down_IDF, gates_TK, dest_P, quotas_G, uniform_G, groups_P, assign_SWI, quotas_SWI,
         h_saved, y_PD, phi_sq_TK, order_P, inv_P, offsets_I, h_of_row_P, phi_saved) = ctx.saved_tensors
        cfg: StepConfig = ctx.cfg
        transport = ctx.transport
        n_tok, top_k = gates_TK.shape
        g_TD = grad_out_TD.reshape(n_tok, grad_out_TD.shape[-1])  # in cfg.out_shape

        # Exact router gradient dL/d alpha_u = <g_t, y_u>, local to the source: here from the saved y, or (y not
        # saved) from the expert backward below.
        from_rows = ctx.router_from_rows
        if not from_rows:
            grad_gates_TK, scores_P = router_gradient_and_scores(
                g_TD, y_PD, inv_P.view(n_tok, top_k), gates_TK, phi_sq_TK, metric=cfg.metric, selects=not cfg.dense
            )
            grad_gates_TK = grad_gates_TK.to(gates_TK.dtype)
        else:
            scores_P = None  # select_retained scores the pairs from g and ||phi||^2 (lrmoe::score_pairs)

        # Source side: score this rank's own pairs and keep each group's quota, before any communication.
        if cfg.dense:  # every pair, in the forward dispatch order: each instance finds its rows where they were
            pair_R, ends_G = order_P, None
            weight_R = torch.ones(order_P.shape[0], device=g_TD.device)
            mass_kept = torch.ones((), device=g_TD.device)
        else:
            # Groups are the destination instances (the dispatch order sorts them, and on one device its offsets
            # end them), or (source, expert) groups g = e * S + s, expert-major, so one expert's kept rows stay
            # contiguous and its GEMM offset is the end of its last source group.
            by_dest = groups_P is None
            sel, mass_kept = select_retained(
                gates_TK, g_TD, phi_sq_TK, dest_P if by_dest else groups_P, quotas_G, cfg.max_rows,
                metric=cfg.metric, selection=cfg.selection, generator=cfg.generator, uniform_G=uniform_G,
                group_order_P=order_P if by_dest else None,
                group_ends_G=offsets_I if by_dest and transport.selects_in_dispatch_order else None,
                scores_P=scores_P,
            )
            pair_R, weight_R, ends_G = sel.pair_ids, sel.weights, sel.offsets

        # The router gradient of dropped rows too: the token of every forward row (dispatch order).
        forward_tok_N = (torch.div(order_P, top_k, rounding_mode="floor") if from_rows and not cfg.dense
                         else None)
        forward = ForwardRecord(x_ND, ctx.y_dtype, dest_P, inv_P, offsets_I, gate_up_IFD.shape[0], assign_SWI,
                                quotas_SWI, h_of_row_P)
        # Every pair kept on one device with h saved: the rows are h's own, in its order, so the backward reads h
        # in place (no index, no gathered copy).
        h_in_place = (cfg.dense and cfg.group_rows is None and cfg.activations == "save"
                      and transport.selects_in_dispatch_order)
        # The retained rows' forward rows: to read the saved h, or the rows of every forward row's g W_down^T.
        need_h_index = (h_saved is not None and not h_in_place) or forward_tok_N is not None
        exchanged = transport.exchange(BackwardRequest(g_TD, gates_TK, pair_R, weight_R, ends_G, forward, cfg.dense,
                                                       cfg.group_rows, need_h_index, token_rows=from_rows,
                                                       forward_tok_N=forward_tok_N, forward_phi_N=phi_saved))
        del forward
        # The instance side: the compact expert backward over the retained rows only.
        need_x, need_gu, need_down = ctx.needs_input_grad[:3]
        grads = BACKENDS[cfg.kernels].backward(
            exchanged.dy, x_ND, exchanged.rows_R, exchanged.offsets_I, gate_up_IFD, down_IDF, h_saved=h_saved,
            h_index_R=exchanged.h_index_R, needs=(need_x or transport.always_needs_dx, need_gu, need_down),
            h_on_host=cfg.activations == "offload", group_rows=cfg.group_rows,
        )
        if from_rows:  # over the forward rows: row r holds pair order_P[r], so pair p's dot is at row inv_P[p]
            grad_gates_TK = grads.dot_R.index_select(0, inv_P).view(n_tok, top_k).to(gates_TK.dtype)
        dx_RD = None if grads.dx_RD is None else transport.give_back(grads.dx_RD, exchanged)
        grad_x = None if dx_RD is None else sum_rows_per_token(dx_RD, exchanged.pair_R, n_tok, top_k)

        grad_probe = transport.probe_grad(mass_kept, exchanged) if ctx.has_probe else None
        # Gradients of x, gate_up, down, gates; none of the plan's tensors; the probe's; none of cfg, transport.
        return (grad_x, grads.gate_up_IFD, grads.down_IDF, grad_gates_TK) + (None,) * 6 + (grad_probe, None, None)


def selective_step(x_TD, gate_up_IFD, down_IDF, gates_TK, dest_P, quotas_G, uniform_G, probe, cfg: StepConfig,
                   transport: Transport, *, groups_P=None, assign_SWI=None, quotas_SWI=None) -> torch.Tensor:
    """Run one selective expert step (``_SelectiveStep``): the one entry of both layers."""
    return _SelectiveStep.apply(x_TD, gate_up_IFD, down_IDF, gates_TK, dest_P, quotas_G, uniform_G, groups_P,
                                assign_SWI, quotas_SWI, probe, cfg, transport)


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
    first, as the product in that dtype would): the forward's combine, reading y where the experts wrote it.
    rows and gates [..., K] (the tokens with leading dims) give out [..., D]."""
    return gather_sum_rows(y_ND, rows_TK, gates_TK.to(y_ND.dtype))


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

