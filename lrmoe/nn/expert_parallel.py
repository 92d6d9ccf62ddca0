"""Expert parallelism for :class:`lrmoe.nn.LRMoE`: a ``ParallelStyle`` for ``parallelize_module`` (DESIGN.md §5).

Shapes: T local tokens, D model dim, F expert hidden dim, E experts, L = E / W local experts, K top-k,
P = T * K local pairs, W EP ranks, S source ranks (S == W: source s is rank s), N rows this rank's experts receive
in the forward dispatch, R retained rows this rank sends in backward, M retained rows its experts receive.

Rank w owns experts [w * L, (w + 1) * L): ``experts.gate_up_proj`` and ``experts.down_proj`` become DTensors
``Shard(0)`` over the EP mesh; the router (``gate.weight``) stays a plain tensor, identical on every rank, whose
gradient comes from the rank's own tokens only (a data-parallel wrapper over the same ranks reduces it).

Forward, on every rank:
1. route the local tokens (top-k) and count loads_E;
2. all-gather loads_E into loads_WE, the tiny [W, E] load matrix;
3. plan: quotas_WE = plan_quotas(loads_WE, retain), the same on every rank (same input, integer arithmetic);
   source s keeps exactly quotas_WE[s, e] of its own pairs of expert e in backward, so it knows its quotas
   without backward communication; plus this rank's sampling uniforms [E];
4. read the plan on the host once: the split sizes of all four all-to-alls of this step follow from loads_WE
   and quotas_WE (the only host synchronisation of the layer step);
5. dispatch all-to-all of x rows (one per pair, sorted by expert, so by owner);
6. grouped GEMMs on the local experts; 7. combine all-to-all of y rows with ||phi||^2 riding along;
8. out_t = sum_k alpha_u y_u on the source rank.

Backward: the source scores its pairs (everything is local: alpha, g_t, ||phi||^2) and selects quotas_WE[rank, e]
pairs of every expert; only those rows (alpha * g / p, plus a 4-byte row index) enter the backward all-to-all; the
owner runs the compact backward (grouped GEMMs over the retained rows only) and returns the input-gradient rows in
a second all-to-all. The router gradient <g_t, y_u> is exact and local.

Checkpoints: the sharded experts save and load with torch.distributed.checkpoint (get_state_dict/set_state_dict,
optimiser state included; tests/nn/test_expert_parallel_checkpoint.py).

torch.compile: the layer compiles with ``fullgraph=True``, forward and backward (tested with
``torch._dynamo.config.capture_scalar_outputs = True``; torch 2.13 also traces it without). The host read of the
split sizes becomes unbacked SymInts, so one graph serves every step's loads without recompiling
(tests/nn/test_expert_parallel_compile.py).

Not yet here (later increments): replicas and capacity-aware routing (``route_to_replicas``), a padded
static-capacity mode without host synchronisation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from lrmoe.functional.experts import _swiglu, _swiglu_backward
from lrmoe.functional.quotas import plan_quotas
from lrmoe.functional.routing import expert_loads, route_topk
from lrmoe.functional.scoring import score_pairs
from lrmoe.functional.selection import select_within_quota
from lrmoe.nn.lrmoe import LRMoE
from lrmoe.ops import gather_grouped_mm, grouped_outer

__all__ = ["ExpertParallel", "ExpertParallelPlan", "ExpertParallelStats", "plan_expert_parallel"]

# Backward statistics leave as the gradient of a float64 probe (float64: byte counts stay exact past 2**24):
# score-mass fraction kept, retained pairs sent, backward dispatch bytes, backward combine bytes, backward calls.
N_EP_BACKWARD_STATS = 5
_EXTRA_BYTES = 4  # per row: fp32 ||phi||^2 in the combine, int32 row index in the backward dispatch (retain < 1)


# ------------------------------------------------------------------------------------------------------ plan


@dataclass(frozen=True)
class ExpertParallelPlan:
    """One layer step's plan (tensors only, so a later compiled path can carry it as a pytree).

    loads:   [W, E] int64, pairs routed from each source rank to each expert (all-gathered, same on every rank).
    quotas:  [W, E] int64, pairs of each (source, expert) that backward keeps: plan_quotas(loads, retain),
             same on every rank; rank s keeps exactly quotas[s, e] of its own pairs of expert e.
    uniform: [E] fp32, this rank's systematic-sampling uniforms (one per expert), or None when not sampling.
    """

    loads: torch.Tensor
    quotas: torch.Tensor
    uniform: torch.Tensor | None


torch.utils._pytree.register_dataclass(ExpertParallelPlan)


@dataclass(frozen=True)
class _EPGroup:
    """The EP process group and this rank's place in it (Python values, fixed at parallelisation)."""

    group: dist.ProcessGroup
    rank: int
    size: int


@dataclass(frozen=True)
class _Splits:
    """Host-side row counts per peer of the four all-to-alls of one step, read from the plan in one sync.

    fwd_send[w]: this rank's pairs of rank w's experts (dispatch rows sent; combine rows received).
    fwd_recv[s]: source s's pairs of this rank's experts (dispatch rows received; combine rows sent).
    bwd_send[w], bwd_recv[s]: the same for the retained pairs (quotas instead of loads).
    """

    fwd_send: list[int]
    fwd_recv: list[int]
    bwd_send: list[int]
    bwd_recv: list[int]


def plan_expert_parallel(
    loads_WE: torch.Tensor,
    retain: float,
    *,
    min_retain: float = 0.0,
    policy: str = "waterfill",
) -> torch.Tensor:
    """quotas_WE from the all-gathered [W, E] load matrix: :func:`plan_quotas` on (source, expert) groups.

    A pure function of its inputs (integer arithmetic, no communication), so every rank that calls it with the
    same load matrix gets the same quotas: this is what lets a source rank select its own pairs in backward
    before any communication.
    """
    if loads_WE.dim() != 2:
        raise ValueError(f"loads_WE must be [W, E], got shape {tuple(loads_WE.shape)}")
    return plan_quotas(loads_WE, retain, min_retain=min_retain, policy=policy)


def split_sizes(counts_WE: torch.Tensor, rank: int, n_ranks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows per peer of an all-to-all whose (source, expert) row counts are ``counts_WE``, experts sharded in
    contiguous blocks of L = E / W: send_W[w] = this rank's rows for rank w's experts, recv_W[s] = source s's
    rows for this rank's experts."""
    n_local = counts_WE.shape[1] // n_ranks
    send_W = counts_WE[rank].view(n_ranks, n_local).sum(1)
    recv_W = counts_WE[:, rank * n_local : (rank + 1) * n_local].sum(1)
    return send_W, recv_W


def expert_major_order(counts_SL: torch.Tensor, n_rows: int) -> torch.Tensor:
    """[n_rows] permutation taking rows laid out source-major (source, then local expert, as an all-to-all
    delivers them) to expert-major order (local expert, then source), stable within each (source, expert)
    block. ``n_rows`` must equal counts_SL.sum() (a host value the caller already has: passing it as
    ``output_size`` keeps repeat_interleave from synchronising)."""
    n_src, n_local = counts_SL.shape
    block_B = torch.arange(n_src * n_local, device=counts_SL.device)
    block_N = torch.repeat_interleave(block_B, counts_SL.reshape(-1), output_size=n_rows)
    key_N = (block_N % n_local) * n_src + torch.div(block_N, n_local, rounding_mode="floor")
    return torch.argsort(key_N, stable=True)


def _host_splits(plan: ExpertParallelPlan, ep: _EPGroup) -> _Splits:
    # HOST SYNC: the one host read of the EP layer step. The split sizes of all four all-to-alls (forward
    # dispatch and combine, backward dispatch and input-gradient return) follow from loads and quotas, so one
    # .tolist() here serves all of them; backward reads nothing from the device.
    fwd_send, fwd_recv = split_sizes(plan.loads, ep.rank, ep.size)
    bwd_send, bwd_recv = split_sizes(plan.quotas, ep.rank, ep.size)
    host = torch.stack([fwd_send, fwd_recv, bwd_send, bwd_recv]).tolist()
    # Under torch.compile this .tolist() gives unbacked SymInts (unknown at trace time): tell the compiler they are
    # row counts (>= 0), else checks such as select_within_quota's `max_rows < 0` cannot be decided while tracing
    # ("Could not guard on data-dependent expression"). In eager they are plain ints and the checks are no-ops.
    for counts in host:
        for n in counts:
            torch._check(n >= 0)
    return _Splits(*host)


def _peer_bytes(rows_W: list[int], row_bytes: int, rank: int) -> int:
    """Bytes an all-to-all moves between this rank and its peers (the chunk to itself is a local copy)."""
    return row_bytes * (sum(rows_W) - rows_W[rank])


# ---------------------------------------------------------------------------------------------- all-to-all


def _all_to_all(rows_N: torch.Tensor, recv: list[int], send: list[int], ep: _EPGroup) -> torch.Tensor:
    """Uneven all-to-all of rows (split sizes on the host, from :func:`_host_splits`)."""
    out = funcol.all_to_all_single(rows_N.contiguous(), recv, send, ep.group)
    return funcol.wait_tensor(out)


def _pack(rows_ND: torch.Tensor, extra_N: torch.Tensor) -> torch.Tensor:
    """One payload of rows plus a 4-byte scalar per row (fp32 ||phi||^2 or an int32 index), as raw bytes so
    that any row dtype works (bf16, fp32, fp64) and the scalar keeps its exact bits."""
    return torch.cat([rows_ND.contiguous().view(torch.uint8), extra_N.reshape(-1, 1).view(torch.uint8)], dim=1)


def _unpack(payload_NB: torch.Tensor, dtype: torch.dtype, extra_dtype: torch.dtype):
    n_row_bytes = payload_NB.shape[1] - _EXTRA_BYTES
    rows_ND = payload_NB[:, :n_row_bytes].contiguous().view(dtype)
    extra_N = payload_NB[:, n_row_bytes:].contiguous().view(extra_dtype).reshape(-1)
    return rows_ND, extra_N


# -------------------------------------------------------------------------------------------- autograd core


@dataclass(frozen=True)
class _Config:
    retain: float
    metric: str
    selection: str
    generator: torch.Generator | None


class _ExpertParallelSwiGLU(torch.autograd.Function):
    """Dispatch, local experts, combine; backward selects on the source before the backward all-to-all."""

    @staticmethod
    def forward(ctx, x_TD, gate_up_LFD, down_LDF, gates_TK, expert_ids_TK, quotas_WE, uniform_E, probe,
                loads_WE, cfg: _Config, splits: _Splits, ep: _EPGroup):
        n_tok, top_k = expert_ids_TK.shape
        n_local = gate_up_LFD.shape[0]
        flat_P = expert_ids_TK.reshape(-1).long()
        # Pairs sorted by expert (stable: pair id within an expert); experts are sharded in contiguous blocks,
        # so this is also sorted by owner rank: the dispatch send buffer.
        order_P = torch.argsort(flat_P, stable=True)
        tok_P = torch.div(order_P, top_k, rounding_mode="floor")
        x_recv_ND = _all_to_all(x_TD.index_select(0, tok_P), splits.fwd_recv, splits.fwd_send, ep)

        # Received rows are source-major; the grouped GEMMs want them expert-major. The gather is fused into the
        # first GEMM (rows = the permutation), so x_recv is never copied.
        n_rows = x_recv_ND.shape[0]
        counts_SL = loads_WE[:, ep.rank * n_local : (ep.rank + 1) * n_local]
        perm_N = expert_major_order(counts_SL, n_rows)
        offsets_L = torch.cumsum(counts_SL.sum(0), 0).int()
        ident_N = torch.arange(n_rows, device=x_TD.device)
        h_NF2 = gather_grouped_mm(x_recv_ND, gate_up_LFD, perm_N, offsets_L)
        phi_NF = _swiglu(h_NF2)
        y_ND = gather_grouped_mm(phi_NF, down_LDF, ident_N, offsets_L)
        inv_perm_N = torch.empty_like(perm_N).scatter_(0, perm_N, ident_N)
        phi_sq_N = phi_NF.float().square().sum(-1)

        # Combine: y rows and ||phi||^2 go back in the order they came (source-major), one payload.
        payload = _pack(y_ND.index_select(0, inv_perm_N), phi_sq_N.index_select(0, inv_perm_N))
        back = _all_to_all(payload, splits.fwd_send, splits.fwd_recv, ep)
        y_PD, phi_sq_P = _unpack(back, x_TD.dtype, torch.float32)
        ident_P = torch.arange(flat_P.shape[0], device=x_TD.device)
        inv_order_P = torch.empty_like(order_P).scatter_(0, order_P, ident_P)
        y_TKD = y_PD.index_select(0, inv_order_P).view(n_tok, top_k, x_TD.shape[1])
        phi_sq_TK = phi_sq_P.index_select(0, inv_order_P).view(n_tok, top_k)
        out_TD = (y_TKD * gates_TK.to(y_TKD.dtype).unsqueeze(-1)).sum(1)

        ctx.cfg, ctx.splits, ctx.ep = cfg, splits, ep
        ctx.has_probe = probe is not None
        ctx.x_shape = x_TD.shape
        ctx.save_for_backward(gate_up_LFD, down_LDF, gates_TK, expert_ids_TK, quotas_WE, uniform_E, loads_WE,
                              y_TKD, phi_sq_TK, order_P, inv_order_P, x_recv_ND, h_NF2, inv_perm_N)
        return out_TD

    @staticmethod
    def backward(ctx, grad_out_TD):
        (gate_up_LFD, down_LDF, gates_TK, expert_ids_TK, quotas_WE, uniform_E, loads_WE,
         y_TKD, phi_sq_TK, order_P, inv_order_P, x_recv_ND, h_NF2, inv_perm_N) = ctx.saved_tensors
        cfg: _Config = ctx.cfg
        splits: _Splits = ctx.splits
        ep: _EPGroup = ctx.ep
        n_tok, top_k = expert_ids_TK.shape
        n_local = gate_up_LFD.shape[0]
        dtype, device = y_TKD.dtype, y_TKD.device
        g_TD = grad_out_TD

        # Exact router gradient, local: dL/d alpha_u = <g_t, y_u>.
        grad_gates_TK = torch.einsum("td,tkd->tk", g_TD.float(), y_TKD.float()).to(gates_TK.dtype)

        # --- source side: score and select own pairs within quotas_WE[rank, e], before any communication.
        dense = cfg.retain >= 1.0
        if dense:
            # Keep every pair, in the forward dispatch order: the owner finds its rows where they were.
            pair_R = order_P
            weight_R = torch.ones(order_P.shape[0], device=device)
            mass_kept = torch.ones((), device=device)
        else:
            scores_P = score_pairs(gates_TK, g_TD, phi_sq_TK, metric=cfg.metric, generator=cfg.generator).reshape(-1)
            # Groups are this rank's (source, expert) pairs; the buffer holds exactly sum_e quotas[rank, e] rows
            # (every group keeps min(quota, load) = quota), grouped by expert ascending, so by owner rank: its
            # per-owner blocks are exactly splits.bwd_send.
            sel = select_within_quota(
                scores_P, expert_ids_TK.reshape(-1), quotas_WE[ep.rank], max_rows=sum(splits.bwd_send),
                mode=cfg.selection, generator=cfg.generator, uniform_G=uniform_E,
            )
            pair_R, weight_R = sel.pair_ids, sel.weights
            finite_P = torch.where(torch.isfinite(scores_P), scores_P, 0.0)
            kept_mass = finite_P.index_select(0, pair_R.clamp(min=0)).mul(pair_R >= 0).sum()
            mass_kept = kept_mass / finite_P.sum().clamp(min=torch.finfo(torch.float32).tiny)

        # Retained rows alpha_u * g_t * (1/p_u). A slot "sample" skipped (pair -1) sends a zero row: it keeps the
        # split sizes planned, and a zero dy contributes nothing to any gradient.
        safe_R = pair_R.clamp(min=0)
        tok_R = torch.div(safe_R, top_k, rounding_mode="floor")
        coef_R = gates_TK.detach().reshape(-1).float().index_select(0, safe_R) * weight_R
        dy_RD = (g_TD.float().index_select(0, tok_R) * coef_R.unsqueeze(1)).to(dtype)

        if dense:
            payload, row_bytes = dy_RD, dy_RD.shape[1] * dy_RD.element_size()
        else:
            # The owner must find each row's saved forward activations: send the pair's position in the forward
            # message to its owner (its position in the sorted dispatch buffer minus the owner's block start).
            fwd_send_W, fwd_recv_W = split_sizes(loads_WE, ep.rank, ep.size)  # on device: no host-to-device copy
            start_W = torch.cumsum(fwd_send_W, 0) - fwd_send_W
            owner_R = torch.div(expert_ids_TK.reshape(-1).long().index_select(0, safe_R), n_local,
                                rounding_mode="floor")
            index_R = inv_order_P.index_select(0, safe_R) - start_W.index_select(0, owner_R)
            index_R = torch.where(pair_R >= 0, index_R, 0).int()
            payload = _pack(dy_RD, index_R)
            row_bytes = payload.shape[1]
        recv = _all_to_all(payload, splits.bwd_recv, splits.bwd_send, ep)

        # --- owner side: compact backward over the M retained rows its experts received.
        n_kept = recv.shape[0]
        if dense:
            dy_MD = recv
            fwd_row_M = torch.arange(n_kept, device=device)  # the same layout as the forward dispatch
        else:
            dy_MD, index_M = _unpack(recv, dtype, torch.int32)
            bwd_recv_W = split_sizes(quotas_WE, ep.rank, ep.size)[1]
            src_M = torch.repeat_interleave(torch.arange(ep.size, device=device), bwd_recv_W, output_size=n_kept)
            fwd_row_M = (torch.cumsum(fwd_recv_W, 0) - fwd_recv_W).index_select(0, src_M) + index_M.long()
        quota_SL = quotas_WE[:, ep.rank * n_local : (ep.rank + 1) * n_local]
        perm_M = expert_major_order(quota_SL, n_kept)
        offsets_L = torch.cumsum(quota_SL.sum(0), 0).int()
        rows_M = fwd_row_M.index_select(0, perm_M)  # expert-major retained rows -> source-major forward rows
        ident_M = torch.arange(n_kept, device=device)

        dy_em_MD = dy_MD.index_select(0, perm_M)
        h_MF2 = h_NF2.index_select(0, inv_perm_N.index_select(0, rows_M))
        phi_MF = _swiglu(h_MF2)
        dphi_MF = gather_grouped_mm(dy_em_MD, down_LDF.transpose(1, 2), ident_M, offsets_L)
        grad_down = grouped_outer(dy_em_MD, phi_MF, ident_M, offsets_L)
        dh_MF2 = _swiglu_backward(h_MF2, dphi_MF)
        grad_gu = grouped_outer(dh_MF2, x_recv_ND, rows_M, offsets_L)
        dx_em_MD = gather_grouped_mm(dh_MF2, gate_up_LFD.transpose(1, 2), ident_M, offsets_L)
        # Return the input-gradient rows in the order they arrived (the reverse of the backward dispatch).
        dx_MD = torch.empty_like(dx_em_MD).index_copy_(0, perm_M, dx_em_MD)
        dx_RD = _all_to_all(dx_MD, splits.bwd_send, splits.bwd_recv, ep)

        # --- source side again: input gradient of the retained pairs.
        grad_x = torch.zeros(ctx.x_shape, dtype=dtype, device=device).index_add_(0, tok_R, dx_RD)

        grad_probe = None
        if ctx.has_probe:
            # Host values written by fills (kernel arguments), not copied from host memory.
            host = [
                float(sum(splits.bwd_send)),
                float(_peer_bytes(splits.bwd_send, row_bytes, ep.rank)),
                float(_peer_bytes(splits.bwd_recv, dx_MD.shape[1] * dx_MD.element_size(), ep.rank)),
                1.0,
            ]
            grad_probe = torch.stack(
                [mass_kept.double()] + [torch.full((), v, dtype=torch.float64, device=device) for v in host]
            )
        return grad_x, grad_gu, grad_down, grad_gates_TK, None, None, None, grad_probe, None, None, None, None


# ------------------------------------------------------------------------------------------------ the module


@dataclass(frozen=True)
class ExpertParallelStats:
    """Per-step statistics of an expert-parallel LRMoE layer, as tensors (no sync until read).

    loads [W, E], quotas [W, E] int64: the last forward's global plan (same on every rank).
    total_pairs, retained_pairs: 0-d int64, global (all ranks), last forward.
    dispatch_bytes, combine_bytes: 0-d int64, bytes this rank sent to its peers in the last forward's dispatch
        (x rows) and combine (y rows + fp32 ||phi||^2) all-to-alls; the chunk to itself is a local copy, not counted.
    backward_dispatch_bytes, backward_combine_bytes: 0-d fp64, bytes this rank sent to its peers in the backward
        dispatch (retained alpha*g rows, plus a 4-byte row index when retain < 1) and input-gradient return, summed
        over the backward passes since ``reset_stats()``.
    local_retained_pairs: 0-d fp64, retained rows this rank sent in backward, summed likewise.
    score_mass_fraction: 0-d fp64, mean over those backward passes of the kept share of this rank's score mass.
    backward_calls: 0-d fp64.
    """

    loads: torch.Tensor
    quotas: torch.Tensor
    total_pairs: torch.Tensor
    retained_pairs: torch.Tensor
    dispatch_bytes: torch.Tensor
    combine_bytes: torch.Tensor
    backward_dispatch_bytes: torch.Tensor
    backward_combine_bytes: torch.Tensor
    local_retained_pairs: torch.Tensor
    score_mass_fraction: torch.Tensor
    backward_calls: torch.Tensor

    @property
    def retained_fraction(self) -> torch.Tensor:
        return self.retained_pairs.float() / self.total_pairs.clamp(min=1).float()


class ExpertParallel(ParallelStyle):
    """Shard an :class:`LRMoE` layer's experts over an EP mesh: ``parallelize_module(layer, mesh, ExpertParallel())``.

    Args:
        mesh_dim_name: the EP dimension of a multi-dimensional mesh (e.g. ``"ep"``); None for a 1-D mesh.

    Expert parameters become DTensors ``Shard(0)`` (rank w holds experts [w*E/W, (w+1)*E/W)); the router stays a
    plain replicated tensor. Parameters are replaced, so build the optimiser afterwards. With
    ``src_data_rank=0`` (parallelize_module's default) rank 0's expert weights are scattered; with None every rank
    keeps its own slice. The layer's forward becomes the EP forward described in this module's docstring, and
    ``layer.stats()`` returns :class:`ExpertParallelStats`.

    Errors: a module that is not an LRMoE or is already expert-parallel, a mesh of more than one dimension without
    ``mesh_dim_name``, an unknown ``mesh_dim_name``, and ``num_experts % W != 0``.
    """

    def __init__(self, *, mesh_dim_name: str | None = None):
        super().__init__()
        self.mesh_dim_name = mesh_dim_name

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, LRMoE):
            raise TypeError(f"ExpertParallel applies to lrmoe.nn.LRMoE layers, got {type(module).__name__}")
        if isinstance(module, _ExpertParallelMixin):
            raise ValueError("this LRMoE layer is already expert-parallel")
        ep_mesh = self._ep_mesh(device_mesh)
        n_ranks = ep_mesh.size()
        if module.num_experts % n_ranks:
            raise ValueError(
                f"num_experts={module.num_experts} is not divisible by the EP mesh size W={n_ranks}; every rank "
                "must own the same number of experts (E % W == 0)"
            )
        for name in ("gate_up_proj", "down_proj"):
            param = getattr(module.experts, name)
            if isinstance(param, DTensor):
                raise ValueError(f"experts.{name} is already a DTensor; ExpertParallel shards plain parameters")
            sharded = distribute_tensor(param.detach(), ep_mesh, [Shard(0)], src_data_rank=self.src_data_rank)
            module.experts.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))

        module.__class__ = _ep_class(type(module))
        module.ep_mesh = ep_mesh
        module._ep = _EPGroup(group=ep_mesh.get_group(), rank=ep_mesh.get_local_rank(), size=n_ranks)
        device = module.last_loads.device
        n_exp = module.num_experts
        module.register_buffer("ep_loads", torch.zeros(n_ranks, n_exp, dtype=torch.int64, device=device),
                               persistent=False)
        module.register_buffer("ep_quotas", torch.zeros(n_ranks, n_exp, dtype=torch.int64, device=device),
                               persistent=False)
        module.register_buffer("ep_forward_bytes", torch.zeros(2, dtype=torch.int64, device=device),
                               persistent=False)
        module._stats_probe = torch.zeros(module._probe_size, dtype=module._probe_dtype, device=device,
                                          requires_grad=True)
        return module

    def _ep_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        if self.mesh_dim_name is None:
            if mesh.ndim != 1:
                raise ValueError(
                    f"ExpertParallel needs a 1-D EP mesh, got a {mesh.ndim}-D mesh "
                    f"(dims {mesh.mesh_dim_names}); pass ExpertParallel(mesh_dim_name=...) to pick the EP dimension"
                )
            return mesh
        names = mesh.mesh_dim_names or ()
        if self.mesh_dim_name not in names:
            raise ValueError(f"mesh_dim_name={self.mesh_dim_name!r} is not a dimension of the mesh (dims {names})")
        return mesh if mesh.ndim == 1 else mesh[self.mesh_dim_name]


_EP_CLASSES: dict[type, type] = {}


def _ep_class(cls: type) -> type:
    """The expert-parallel subclass of an LRMoE class (FSDP2's fully_shard swaps classes the same way), so the
    layer stays an instance of its own class, with the EP forward."""
    if cls not in _EP_CLASSES:
        _EP_CLASSES[cls] = type(f"ExpertParallel{cls.__name__}", (_ExpertParallelMixin, cls), {})
    return _EP_CLASSES[cls]


class _ExpertParallelMixin:
    """Forward and statistics of an expert-parallel LRMoE (see the module docstring)."""

    ep_mesh: DeviceMesh
    _ep: _EPGroup
    _probe_size = N_EP_BACKWARD_STATS
    _probe_dtype = torch.float64  # byte counts stay exact past 2**24

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up, down = self.experts.gate_up_proj, self.experts.down_proj
        self._check_input(x)
        ep = self._ep
        x_TD = x.reshape(-1, self.dim)
        routing = route_topk(
            self.gate(x_TD), self.top_k, score_func=self.score_func, norm_topk_prob=self.norm_topk_prob
        )
        probe = self._probe_for(x)

        # The tiny [W, E] load matrix, all-gathered (no host sync), then the same plan on every rank.
        loads_E = expert_loads(routing.expert_ids, self.num_experts)
        loads_WE = funcol.wait_tensor(funcol.all_gather_single(loads_E, 0, ep.group)).view(ep.size, -1)
        quotas_WE = plan_expert_parallel(loads_WE, self.retain, min_retain=self.min_retain, policy=self.policy)
        uniform_E = None
        if probe is not None and self.selection == "sample" and self.retain < 1.0:
            # This rank's uniforms, one draw of [E] from the layer's generator (the global RNG when None).
            uniform_E = torch.rand(self.num_experts, generator=self.generator, device=x.device)
        plan = ExpertParallelPlan(loads=loads_WE, quotas=quotas_WE, uniform=uniform_E)
        splits = _host_splits(plan, ep)  # the one host synchronisation of this layer step

        row_bytes = self.dim * x.element_size()
        with torch.no_grad():
            self.ep_loads.copy_(loads_WE)
            self.ep_quotas.copy_(quotas_WE)
            self.last_loads.copy_(loads_WE.sum(0))
            self.last_quotas.copy_(quotas_WE.sum(0))
            self.ep_forward_bytes[0].fill_(_peer_bytes(splits.fwd_send, row_bytes, ep.rank))
            self.ep_forward_bytes[1].fill_(_peer_bytes(splits.fwd_recv, row_bytes + _EXTRA_BYTES, ep.rank))

        cfg = _Config(retain=self.retain, metric=self.metric, selection=self.selection, generator=self.generator)
        out_TD = _ExpertParallelSwiGLU.apply(
            x_TD, gate_up.to_local(), down.to_local(), routing.gates.to(x.dtype), routing.expert_ids, quotas_WE,
            uniform_E, probe, loads_WE, cfg, splits, ep,
        )
        return out_TD.view(x.shape)

    def stats(self) -> ExpertParallelStats:
        """This step's statistics as tensors (see :class:`ExpertParallelStats`)."""
        acc = self._stats_probe.grad
        if acc is None:
            acc = torch.zeros(N_EP_BACKWARD_STATS, dtype=torch.float64, device=self.ep_loads.device)
        calls = acc[4]
        return ExpertParallelStats(
            loads=self.ep_loads.clone(),
            quotas=self.ep_quotas.clone(),
            total_pairs=self.ep_loads.sum(),
            retained_pairs=self.ep_quotas.sum(),
            dispatch_bytes=self.ep_forward_bytes[0].clone(),
            combine_bytes=self.ep_forward_bytes[1].clone(),
            backward_dispatch_bytes=acc[2].clone(),
            backward_combine_bytes=acc[3].clone(),
            local_retained_pairs=acc[1].clone(),
            score_mass_fraction=acc[0] / calls,
            backward_calls=calls.clone(),
        )
