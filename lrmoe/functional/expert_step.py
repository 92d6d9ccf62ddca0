"""The selective expert step: one autograd Function for one device and for expert parallelism
(docs/design.md, "The selective backward" and "Expert parallelism").

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

The transport is the only part that differs: :class:`IdentityTransport` (one device: the rows stay where they
are, and every step that exists only for communication is skipped) or the all-to-all transport of
``lrmoe.nn._transport`` (expert parallelism over a process group). A transport is a frozen object of Python
values with four methods, ``dispatch``, ``combine``, ``exchange`` and ``give_back``, plus ``probe_grad`` (the
backward statistics it reports).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx.experimental.symbolic_shapes import guard_or_false

from lrmoe.functional.routing import expert_loads
from lrmoe.functional.scoring import score_pairs
from lrmoe.functional.selection import select_within_quota
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

N_BACKWARD_STATS = 3  # one device: score-mass fraction kept, retained pairs, backward calls


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
    """

    dense: bool
    metric: str
    selection: str
    generator: torch.Generator | None
    activations: str = "save"  # what forward keeps of h: "save", "recompute" or "offload" (see saved_h)
    max_rows: int = 0
    group_rows: int | None = None
    out_shape: tuple[int, ...] | None = None


@dataclass(frozen=True)
class IdentityTransport:
    """One device: the pairs' rows are already where their instances run. Dispatch reads x by token inside the
    first GEMM, combine reads y where the GEMM wrote it, and backward's retained rows are the selection's own
    buffer (padded to blocks of ``cfg.group_rows`` first, when set): no copy and no kernel beyond the step's own."""

    identity = True

    def dispatch(self, x_TD, tok_P, dest_P, n_inst, assign_SWI):
        """(the rows' source, each GEMM row's index into it, the instances' row offsets)."""
        return x_TD, tok_P, torch.cumsum(expert_loads(dest_P, n_inst), 0).int()

    def combine(self, y_ND, phi_sq_N, rows_N, assign_SWI):
        """(y rows in dispatch order, their ||phi||^2, the map from a row of that order to its row of h (None:
        the same row))."""
        return y_ND, phi_sq_N, None

    def exchange(self, g_TD, gates_TK, pair_R, weight_R, ends_G, saved, cfg, need_h_index):
        """The retained rows as the expert backward takes them: ([dy_RD], each row's source row, offsets, each
        row's h row, the pair of every row for the per-token sum, state for give_back and probe_grad)."""
        offsets_I, inv_P, n_inst = saved["offsets_I"], saved["inv_P"], saved["n_inst"]
        # Each expert's last group's end; contiguous: with (source, expert) groups this column is strided, and the
        # CUDA GEMMs read offsets as a flat array (they would take every S-th group end, a wrong gradient).
        off_I = offsets_I if cfg.dense else ends_G.view(n_inst, -1)[:, -1].contiguous()
        n_kept = off_I[-1]
        if cfg.group_rows is not None:
            pair_R, weight_R, off_I = pad_to_blocks(pair_R, weight_R, off_I, cfg.group_rows)
        dy_RD, tok_R, safe_R = retained_dy(g_TD, gates_TK, pair_R, weight_R, saved["dtype"])
        dy = [dy_RD]
        del dy_RD  # expert_rows_backward releases it after its last use
        h_index_R = inv_P.index_select(0, safe_R) if need_h_index else None
        return dy, tok_R, off_I, h_index_R, pair_R, n_kept

    def give_back(self, dx_RD, state):
        return dx_RD

    def probe_grad(self, mass_kept, state):
        n_kept = state
        return torch.stack([mass_kept.float(), n_kept.float(), torch.ones_like(mass_kept)])


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
        x_ND, rows_N, offsets_I = transport.dispatch(x_TD, tok_P, dest_P, n_inst, assign_SWI)
        ident_P = torch.arange(dest_P.shape[0], device=dest_P.device)

        h_NF2 = gather_grouped_mm(x_ND, gate_up_IFD, rows_N, offsets_I)  # the row gather fused into the GEMM
        h_saved = saved_h(h_NF2, cfg.activations)
        phi_NF, phi_sq_N = swiglu_sqnorm(h_NF2)  # and ||phi||^2 per row in fp32, from one read of h
        y_ND = gather_grouped_mm(phi_NF, down_IDF, None, offsets_I)  # rows in place: no gather
        y_PD, phi_sq_P, h_of_row_N = transport.combine(y_ND, phi_sq_N, rows_N, assign_SWI)
        # Pair (t, k) = pair id t*K + k sits at row inv_P[t*K + k] of the dispatch-ordered buffers.
        inv_P = torch.empty_like(order_P).scatter_(0, order_P, ident_P)
        phi_sq_TK = phi_sq_P.index_select(0, inv_P).view(n_tok, top_k)
        lead = (n_tok,) if cfg.out_shape is None else cfg.out_shape[:-1]  # out [*lead, D], written in that shape
        out = combine(y_PD, inv_P.view(*lead, top_k), gates_TK.reshape(*lead, top_k))

        ctx.cfg, ctx.transport = cfg, transport
        ctx.has_probe = probe is not None
        ctx.save_for_backward(x_ND, gate_up_IFD, down_IDF, gates_TK, dest_P, quotas_G, uniform_G, groups_P,
                              assign_SWI, quotas_SWI, h_saved, y_PD, phi_sq_TK, order_P, inv_P, offsets_I,
                              h_of_row_N)
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
        return _SelectiveStep._backward(ctx, grad_out_TD)

    @staticmethod
    def _backward(ctx, grad_out_TD):
        (x_ND, gate_up_IFD, down_IDF, gates_TK, dest_P, quotas_G, uniform_G, groups_P, assign_SWI, quotas_SWI,
         h_saved, y_PD, phi_sq_TK, order_P, inv_P, offsets_I, h_of_row_N) = ctx.saved_tensors
        cfg: StepConfig = ctx.cfg
        transport = ctx.transport
        n_tok, top_k = gates_TK.shape
        g_TD = grad_out_TD.reshape(n_tok, grad_out_TD.shape[-1])  # in cfg.out_shape

        # Exact router gradient dL/d alpha_u = <g_t, y_u>, local to the source.
        grad_gates_TK, scores_P = router_gradient_and_scores(
            g_TD, y_PD, inv_P.view(n_tok, top_k), gates_TK, phi_sq_TK, metric=cfg.metric, selects=not cfg.dense
        )
        grad_gates_TK = grad_gates_TK.to(gates_TK.dtype)

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
                group_ends_G=offsets_I if by_dest and transport.identity else None, scores_P=scores_P,
            )
            pair_R, weight_R, ends_G = sel.pair_ids, sel.weights, sel.offsets

        saved = {"x_ND": x_ND, "dtype": y_PD.dtype, "dest_P": dest_P, "inv_P": inv_P, "offsets_I": offsets_I,
                 "n_inst": gate_up_IFD.shape[0], "assign_SWI": assign_SWI, "quotas_SWI": quotas_SWI,
                 "h_of_row_N": h_of_row_N}
        dy, rows_R, off_I, h_index_R, pair_R, state = transport.exchange(
            g_TD, gates_TK, pair_R, weight_R, ends_G, saved, cfg, h_saved is not None)
        del saved
        # The instance side: the compact expert backward over the retained rows only. Under expert parallelism
        # every rank computes x's rows (the return is a collective).
        need_x, need_gu, need_down = ctx.needs_input_grad[:3]
        dx_RD, grad_gu, grad_down = expert_rows_backward(
            dy, x_ND, rows_R, off_I, gate_up_IFD, down_IDF, h_saved=h_saved, h_index_R=h_index_R,
            needs=(need_x or not transport.identity, need_gu, need_down), h_on_host=cfg.activations == "offload",
            group_rows=cfg.group_rows,
        )
        dx_RD = transport.give_back(dx_RD, state)
        grad_x = None if dx_RD is None else sum_rows_per_token(dx_RD, pair_R, n_tok, top_k)

        grad_probe = transport.probe_grad(mass_kept, state) if ctx.has_probe else None
        # Gradients of x, gate_up, down, gates; none of the plan's tensors; the probe's; none of cfg, transport.
        return (grad_x, grad_gu, grad_down, grad_gates_TK) + (None,) * 6 + (grad_probe, None, None)


def selective_step(x_TD, gate_up_IFD, down_IDF, gates_TK, dest_P, quotas_G, uniform_G, probe, cfg: StepConfig,
                   transport, *, groups_P=None, assign_SWI=None, quotas_SWI=None) -> torch.Tensor:
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

