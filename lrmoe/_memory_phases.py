"""The byte model's saved activations and transient phases, line by line in the code's order (lrmoe.memory's
module docstring describes them). Private to lrmoe.memory: ``layer_memory`` is the entry."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from lrmoe.memory import MemoryConfig, Rows

_FP32 = 4
_INT64 = 8
_INT32 = 4


def saved_activations(config: MemoryConfig, rows: Rows, retain: float, b: int, replicas: int, policy: str,
                      blocked: bool, save_outputs: bool) -> dict[str, int]:
    T, D, F, E, P, N = config.tokens, config.dim, config.hidden_dim, config.num_experts, rows.pairs, rows.recv
    saved = {
        "x": T * D * b,
        "router_scores": T * E * _FP32,
        "expert_ids": P * _INT64,
    }
    if config.norm_topk_prob:
        saved["raw_gates"] = P * _FP32
        saved["gate_sums"] = T * _FP32
    saved["gates"] = P * b
    saved["h"] = N * 2 * F * b
    from_rows = router_from_rows(config, retain, blocked, save_outputs)
    if not from_rows:  # otherwise the backward computes <g_t, y_u> without y
        saved["y"] = P * D * b
    elif retain < 1.0 and policy != "save":  # the dropped pairs' phi, where no h is on the device to make it
        saved["phi"] = N * F * b
    if retain < 1.0 or not from_rows:  # the scores' ||phi||^2
        saved["phi_sq"] = P * _FP32
    saved["order_and_inverse"] = 2 * P * _INT64
    if config.world_size == 1:
        saved["quotas"] = E * _INT64
        saved["offsets"] = E * _INT32
    else:
        saved["x_recv"] = N * D * b
        saved["recv_permutation"] = N * _INT64
        saved["loads_and_quotas"] = 2 * config.world_size * E * _INT64
        if replicas:
            # torch.cat of the owned shard and the fetched replicas: the [L + r] instance weights the expert
            # function saves hold a copy of the owned experts too (the replicas' part is replica_weights).
            saved["owned_weight_copy"] = config.local_experts * config.expert_numel * b
    if retain < 1.0 and config.selection == "sample":
        saved["uniforms"] = E * _FP32
    return saved


def router_from_rows(config: MemoryConfig, retain: float, blocked: bool, save_outputs: bool) -> bool:
    """Whether the portable backend computes the router gradient in the backward and the step saves no y
    (lrmoe.functional.expert_step): on one device, without the blocked backward, at retain 1 or without
    ``save_outputs``."""
    return config.world_size == 1 and not blocked and (retain >= 1.0 or not save_outputs)


class _Timeline:
    """Buffers live at each point of a pass, in the code's order: ``alloc`` what outlives its line (a local that
    stays referenced until the function returns), ``free`` what is released, ``mark`` a phase (a local maximum:
    the live buffers plus the temporaries of that line)."""

    def __init__(self):
        self.live: dict[str, int] = {}
        self.phases: dict[str, dict[str, int]] = {}

    def alloc(self, **buffers: int) -> None:
        self.live.update((k, v) for k, v in buffers.items() if v)

    def free(self, *names: str) -> None:
        for name in names:
            self.live.pop(name, None)

    def mark(self, phase: str, **temporaries: int) -> None:
        self.phases[phase] = {**self.live, **{k: v for k, v in temporaries.items() if v}}


def _gathers(config: MemoryConfig, *dims: int) -> bool:
    """Whether a grouped GEMM with these feature dimensions first gathers its rows into a contiguous buffer: the
    CUDA torch._grouped_mm path (bf16, each feature dimension a multiple of 8; row counts are free, as in
    lrmoe.ops.grouped_gemm._grouped_mm_ok, so the model stays monotone in the token count). The Triton kernels
    (other dtypes) fuse the gather, and the CPU reference gathers one expert's rows at a time."""
    return (config.device_type == "cuda" and config.param_dtype == torch.bfloat16
            and all(d % 8 == 0 for d in dims))


def forward_phases(config: MemoryConfig, rows: Rows, b: int, policy: str,
                    saved: dict[str, int]) -> dict[str, dict[str, int]]:
    """The forward, line by line. ``peak`` counts every saved activation at every phase; on one device the phases
    before the down projection also carry ``saved_later``, minus the saved bytes made after them (y, ||phi||^2,
    the pairs' inverse order), so that a phase's sum plus the saved bytes is what is live there. (Expert
    parallelism: not split, every saved activation counted as live from the start, an upper bound.)"""
    T, D, F, P, N = config.tokens, config.dim, config.hidden_dim, rows.pairs, rows.recv
    one_device = config.world_size == 1
    after_gemm = -(saved.get("phi_sq", 0) + P * _INT64) if one_device else 0  # made after the down projection
    before_gemm = after_gemm - (saved.get("y", 0) if one_device else 0)
    t = _Timeline()
    # The router's fp32 gates stay referenced until the layer's forward returns when the experts take a cast copy
    # (16-bit weights), and so do the plan's loads.
    t.alloc(router_gates_fp32=P * _FP32 if b != _FP32 else 0, plan_loads=config.num_experts * _INT64)
    t.alloc(token_index=P * _INT64)
    if config.world_size > 1:
        t.mark("dispatch", dispatch_send=P * D * b)  # received rows are saved (x_recv)
        t.alloc(recv_permutation_tmp=N * _INT64)
    t.alloc(row_index=N * _INT64)
    phi_saved = saved.get("phi", 0)  # made by the SwiGLU, before the down projection
    # h: saved under "save"; otherwise a forward transient (offloaded: and, on a GPU, until its copy to the host is
    # done, which the copy overlaps with the rest of the forward).
    t.mark("gate_up_gemm", x_rows=N * D * b if _gathers(config, D, 2 * F) else 0,
           saved_later=before_gemm - phi_saved)
    t.alloc(h=N * 2 * F * b if policy != "save" else 0)
    # lrmoe::swiglu_sqnorm: phi and its rows' ||phi||^2, both locals until the forward returns; no SiLU temporary.
    t.mark("swiglu", phi=0 if phi_saved else N * F * b, phi_sq_rows=N * _FP32, saved_later=before_gemm)
    t.alloc(phi=0 if phi_saved else N * F * b, phi_sq_rows=N * _FP32)
    # phi read in place (rows_R=None). One device: y is the saved y (counted there), read in place by the combine;
    # when y is not saved, a local until the forward returns.
    y_rows = N * D * b if config.world_size > 1 or "y" not in saved else 0
    t.mark("down_gemm", y_rows=y_rows, saved_later=after_gemm)
    t.alloc(y_rows=y_rows)
    if config.world_size > 1:  # the y rows that come back are the saved y; their ||phi||^2 come in a second collective
        # The rows and ||phi||^2 sent (in the order they came) are temporaries of the all-to-all's line.
        t.mark("combine_all_to_all", combine_send=N * (D * b + _FP32), phi_sq_recv=P * _FP32)
        t.alloc(phi_sq_recv=P * _FP32, pair_index=P * _INT64)
    t.mark("combine", out=T * D * b)  # lrmoe::gather_sum_rows: each token's K rows of y read where they are
    return t.phases


def backward_phases(config: MemoryConfig, rows: Rows, retain: float, b: int, policy: str,
                     replicas: int, blocked: bool = False, save_outputs: bool = False) -> dict[str, dict[str, int]]:
    """The backward of ``selective_swiglu_experts`` (W = 1) or of ``ExpertParallel``'s expert function (W > 1),
    line by line. Every local stays referenced until the function returns, so nothing it allocates is freed
    before the end; the weight-gradient outputs are live from their GEMM on (they become the gradients, or are
    added into preallocated ones after the function returns)."""
    T, D, F, E, P = config.tokens, config.dim, config.hidden_dim, config.num_experts, rows.pairs
    R, M = rows.sent_retained, rows.recv_retained
    n_inst = config.local_experts + replicas  # weight-gradient outputs cover every instance
    dense = retain >= 1.0
    from_rows = router_from_rows(config, retain, blocked, save_outputs)
    all_rows = from_rows and not dense  # the router gradient of every forward row, dropped ones too
    t = _Timeline()
    t.alloc(grad_out=T * D * b)
    if not from_rows:
        t.mark("router_gradient", grad_gates_fp32=P * _FP32)  # lrmoe::gather_dot_rows, fp32, then cast
        t.alloc(grad_gates=P * b)
    if dense:
        t.alloc(row_weights=R * _FP32)  # ones; the rows are the forward's order
    else:
        # The scores are the step's local when the router gradient's pass made them; otherwise (all_rows) the
        # selection's own, gone when it returns.
        if all_rows:
            t.mark("selection", scores=P * _FP32, finite_scores=P * _FP32)
            t.alloc(pair_ids=R * _INT64, row_weights=R * _FP32)
        else:
            t.alloc(scores=P * _FP32, pair_ids=R * _INT64, row_weights=R * _FP32, finite_scores=P * _FP32)
    if blocked:  # pad_to_blocks: its index temporaries on one line, then the padded pair ids and weights
        t.mark("pad_to_blocks", pad_index=5 * R * _INT64)  # rows, experts, clamped, destinations, a temporary
        t.alloc(padded_pair_ids=(R + 1) * _INT64, padded_row_weights=(R + 1) * _FP32)
    t.alloc(row_index=2 * R * _INT64, row_coef=R * _FP32)  # safe pair ids, token ids; alpha / p
    if all_rows:
        # The exchange: the rows' index into the saved h and the forward rows' tokens. The backend: g W_down^T at
        # every forward row (its g rows gathered where the GEMM gathers), their dots with phi, the retained rows'
        # rows of it; then the retained token rows.
        N = rows.recv
        t.alloc(h_row_index=M * _INT64, forward_tokens=P * _INT64)
        t.mark("router_dphi_gemm", g_rows=N * D * b if _gathers(config, D, F) else 0, router_dphi=N * F * b)
        t.alloc(router_dphi=N * F * b)
        t.mark("router_dots", router_dots=N * _FP32)
        t.alloc(router_dots=N * _FP32)
        t.mark("dphi_rows", dphi_rows=M * F * b)
        t.alloc(dphi_rows=M * F * b)
        t.free("router_dphi")
    # retained_dy: lrmoe::gather_scale_rows, one pass, no temporary (eager); from_rows: the tokens' rows, unscaled
    t.mark("dy", dy=R * D * b)
    t.alloc(dy=R * D * b)
    if config.world_size > 1:
        if dense:  # the payload is dy itself
            t.alloc(backward_recv=M * D * b, recv_row_index=M * _INT64)
        else:
            # dy rows and their int32 indices travel as they are (two collectives, no packed copy of either side).
            t.alloc(send_index=2 * R * _INT64 + R * _INT32, backward_recv=M * (D * b + _INT32),
                    recv_row_index=3 * M * _INT64)
        t.alloc(expert_major_index=2 * M * _INT64)  # perm_M, rows_M
        t.mark("dy_expert_major", dy_expert_major=M * D * b)
        t.alloc(dy_expert_major=M * D * b)
    if blocked:  # the rows of x (and the gather's unit coefficients), once for the recomputed h and the weight gradient
        t.alloc(x_rows=M * D * b, x_rows_coef=M * _FP32)
    if policy == "recompute":  # from x (one device: by token; W > 1: the received rows), gathered
        t.mark("h_rows", x_rows=M * D * b if _gathers(config, D, 2 * F) and not blocked else 0,
               h_rows=M * 2 * F * b)
        t.alloc(h_rows=M * 2 * F * b)
    # The rows' index into the saved h (or its host copy), an argument of expert_rows_backward; none where every
    # pair is kept on one device with h saved: the rows are h's own, which lrmoe::swiglu_backward reads in place.
    h_index = policy != "recompute" and not (dense and policy == "save" and config.world_size == 1 and not blocked)
    if h_index and not all_rows:
        t.alloc(h_row_index=M * _INT64)
    if policy == "offload":  # the retained rows read back from the host copy
        t.mark("h_rows", h_rows=M * 2 * F * b)
        t.alloc(h_rows=M * 2 * F * b)
    # The GEMMs below read their rows in place (rows_R=None): no gather copy.
    if not all_rows:
        t.mark("dphi_gemm", dphi_rows=M * F * b)
        t.alloc(dphi_rows=M * F * b)
    # lrmoe::swiglu_backward: its outputs. Its CPU reference's temporaries are inside one op (not modelled, see the
    # module docstring); the CUDA kernel has none.
    # from_rows: lrmoe::swiglu_backward_scaled, which also writes each row's router gradient, fp32 (all_rows: the
    # forward rows' are the ones kept).
    dots = M * _FP32 if from_rows else 0
    t.mark("swiglu_backward", dh_rows=M * 2 * F * b, phi_rows=M * F * b, retained_dots=dots)
    t.alloc(dh_rows=M * 2 * F * b, phi_rows=M * F * b, router_dots=0 if all_rows else dots)
    t.free(*(["h_rows"] if policy != "save" else []), "dphi_rows")
    t.mark("grad_down_gemm", grad_down=n_inst * D * F * b)
    t.alloc(grad_down=n_inst * D * F * b)
    # expert_rows_backward (both layers) releases each row buffer after its last use.
    t.free("dy" if config.world_size == 1 else "dy_expert_major", "phi_rows")
    t.mark("grad_gate_up_gemm", x_gathered=M * D * b if _gathers(config, 2 * F, D) and not blocked else 0,
           grad_gate_up=n_inst * 2 * F * D * b)
    t.alloc(grad_gate_up=n_inst * 2 * F * D * b)
    if blocked:
        t.free("x_rows")  # its coefficients stay until expert_rows_backward returns
    t.mark("dx_gemm", dx_rows=M * D * b)
    t.alloc(dx_rows=M * D * b)
    t.free("dh_rows", *(["h_row_index"] if h_index else []),  # gone when expert_rows_backward returns
           *(["x_rows_coef"] if blocked else []))
    if from_rows:  # the gates' gradient from the rows' dots: an fp32 gather, then the cast
        t.mark("router_gradient", grad_gates_fp32=P * _FP32 if b != _FP32 else 0, grad_gates=P * b)
        t.alloc(grad_gates=P * b)
    if config.world_size > 1:
        t.alloc(dx_source_major=M * D * b, dx_returned=R * D * b)
    # sum_rows_per_token: every pair learns its row (an index per pair), then each token's rows are summed in place.
    t.mark("input_grad", dx_dest_index=2 * R * _INT64, dx_pair_rows=(P + 1) * _INT64, grad_x=T * D * b)
    # The function returns: its locals and saved tensors go; autograd runs the router's backward (fp32 gate
    # gradients, softmax and gate backward) and sums the two input gradients.
    kept = {"grad_out", "grad_gates", "grad_down", "grad_gate_up"}
    t.free(*(name for name in list(t.live) if name not in kept))
    t.mark("router_backward", grad_gates_fp32=P * _FP32, router_grad=E * D * b, grad_x=T * D * b,
           grad_x_router=T * D * b)  # autograd sums the two into the first in place (a buffer it alone holds)
    return t.phases
