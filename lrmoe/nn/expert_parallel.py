"""Expert parallelism for :class:`lrmoe.nn.LRMoE` and for a model's own :class:`lrmoe.nn.SwiGLUExperts` module: a
``ParallelStyle`` for ``parallelize_module`` (DESIGN.md §5).

Shapes: T local tokens, D model dim, F expert hidden dim, E experts, L = E / W owned experts per rank, R replica
slots per rank (``max_replicas``), I = L + R instance slots per rank, G = W * I instances, K top-k, P = T * K local
pairs, W EP ranks, S source ranks (S == W: source s is rank s), N rows this rank's instances receive in the forward
dispatch, R retained rows this rank sends in backward, M retained rows its instances receive.

Rank w owns experts [w * L, (w + 1) * L): ``experts.gate_up_proj`` and ``experts.down_proj`` become DTensors
``Shard(0)`` over the EP mesh; the router (``gate.weight``) stays a plain tensor, identical on every rank, whose
gradient comes from the rank's own tokens only (a data-parallel wrapper over the same ranks reduces it). With
``max_replicas`` R > 0, rank w also holds up to R replicas of hot experts it does not own, chosen every step.

Forward, on every rank:
1. route the local tokens (top-k) and count loads_E;
2. all-gather loads_E into loads_WE, the tiny [W, E] load matrix;
3. plan (``plan_expert_parallel``), the same on every rank (same input, deterministic arithmetic):
   placement replicas_WR = policy(loads_WE, R) (default ``place_hot_replicas``); the forward assignment of each
   (source, expert) pair block to the expert's instances, ``route_to_replicas`` with capacity ceil(load /
   instances) per instance (own rank first); backward quotas per (source, instance), ``plan_quotas`` under the
   per-rank backward capacity ceil(capacity_factor * budget / W) when ``capacity_factor`` is set. Source s keeps
   exactly quotas[s, w, i] of its own pairs that ran on instance (w, i), so it knows its quotas without backward
   communication; plus this rank's sampling uniforms [G];
4. read the plan on the host once: the split sizes of the all-to-alls of this step (dispatch, combine, backward
   dispatch and return, replica weights) follow from it (the only host synchronisation of the layer step). With
   ``ExpertParallel(plan_on="host")`` (the default) steps 3-4 swap: the load matrix is read on the host (the one
   host synchronisation), the plan runs on CPU tensors and goes to the device in one copy;
5. replica weights (R > 0): owners send the weights of the experts others replicate through one
   differentiable all-to-all (``funcol.all_to_all_single``, autograd-aware), so in backward the replicas'
   weight gradients travel back to the owners and are summed into their shards by autograd;
6. dispatch all-to-all of x rows (one per pair, sorted by destination instance);
7. grouped GEMMs on the local instances; 8. combine all-to-all of y rows, with ||phi||^2 in a second one;
9. out_t = sum_k alpha_u y_u on the source rank.
Steps 5-9 run in ``layer.experts(...)`` (the experts' class is swapped for an expert-parallel subclass, as the
layer's is), so hooks on that module see the weights used: FSDP2's ``fully_shard(layer.experts, mesh["dp"])``
gathers them there. Applied to a ``SwiGLUExperts`` of its own (a transformers model's experts after
``swap_experts``, whose block routes and calls ``experts(x_TD, expert_ids_TK, gates_TK)``), steps 2-9 run in that
call with the module's options, and its ``stats()`` are the layer's.

Backward: the source scores its pairs (everything is local: alpha, g_t, ||phi||^2) and selects quotas[rank, w, i]
pairs of every instance; only those rows (alpha * g / p, plus a 4-byte row index) enter the backward all-to-all;
each instance runs the compact backward (grouped GEMMs over the retained rows only) and returns the input-gradient
rows in a second all-to-all. A retained pair goes back to the instance that ran its forward (no rebalancing): that
instance holds its saved activations, so only the alpha * g row travels; moving it would make its x row (and h, or
a recompute) travel too. The router gradient <g_t, y_u> is exact and local. The activation policies are those of
the single-device layer: the instance keeps h of its received rows ("save"), recomputes the retained ones from the
received x rows ("recompute"), or parks h in pinned host memory and reads back the retained rows ("offload").

Checkpoints: the sharded experts save and load with torch.distributed.checkpoint (get_state_dict/set_state_dict,
optimiser state included; tests/nn/test_expert_parallel_checkpoint.py). Replicas are per-step copies, never saved.

torch.compile: the layer compiles with ``fullgraph=True``, forward and backward, with and without replicas (tested
with ``torch._dynamo.config.capture_scalar_outputs = True``; torch 2.13 also traces it without). The host read of
the split sizes becomes unbacked SymInts, so one graph serves every step's loads without recompiling
(tests/nn/test_expert_parallel_compile.py). The plan (step 3) is one opaque op, ``lrmoe::ep_plan``, so every rank
computes it with the same eager kernels, compiled or not (see ``_ep_plan`` for why).

Not yet here (later increments): a memory-aware placement policy, a padded static-capacity mode without host
synchronisation.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.autograd.function import once_differentiable
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle
from torch.fx.experimental.symbolic_shapes import guard_or_false

from lrmoe.functional._checks import check_replica_slots, check_same_device, check_same_size, check_tensor
from lrmoe.functional.experts import (
    block_slots,
    combine,
    expert_rows_backward,
    pad_to_blocks,
    release_h,
    retained_dy,
    router_gradient_and_scores,
    saved_h,
    select_retained,
    selective_swiglu_experts,
    sum_rows_per_token,
    take_rows,
)
from lrmoe.functional.quotas import plan_quotas
from lrmoe.functional.replicas import (
    balanced_capacity,
    instance_experts,
    place_hot_replicas,
    route_to_replicas,
)
from lrmoe.functional.routing import expert_loads
from lrmoe.nn.lrmoe import EXPERT_OPTIONS, UNGATHERED_EXPERTS, LRMoE, SwiGLUExperts, compute_dtype, recomputing
from lrmoe.ops import argsort_ids, gather_grouped_mm, gather_scale_rows, swiglu_sqnorm

__all__ = ["ExpertParallel", "ExpertParallelPlan", "ExpertParallelStats", "backward_capacity", "plan_expert_parallel"]

# Backward statistics leave as the gradient of a float64 probe (float64: byte counts stay exact past 2**24):
# score-mass fraction kept, retained pairs sent, backward dispatch bytes, backward combine bytes, backward calls.
N_EP_BACKWARD_STATS = 5
# torch 2.13 renamed funcol.all_gather_tensor (deprecated there, a FutureWarning every step); 2.11 has only it.
_all_gather = getattr(funcol, "all_gather_single", funcol.all_gather_tensor)
_EXTRA_BYTES = 4  # per row: fp32 ||phi||^2 in the combine, int32 row index in the backward dispatch (retain < 1)


# ------------------------------------------------------------------------------------------------------ plan


@dataclass(frozen=True)
class ExpertParallelPlan:
    """One layer step's plan (tensors only, a pytree), the same on every rank.

    loads:     [W, E] int64, pairs routed from each source rank to each expert (all-gathered).
    instances: [W, I] int64, the expert of every instance slot: rank w's L owned experts, then its R replica slots
               (-1 where empty).
    routes:    [S, E, W] int64, pairs of (source s, expert e) that run on rank w's instance of e
               (``route_to_replicas``); source s sends its pairs of e in pair order, the first routes[s, e, 0] to
               rank 0, the next routes[s, e, 1] to rank 1, and so on.
    assignment: [S, W, I] int64, the same per instance slot: routes[s, instances[w, i], w].
    instance_quotas: [S, W, I] int64, pairs of each (source, instance) that backward keeps (``plan_quotas``).
    quotas:    [S, E] int64, instance_quotas summed over each expert's instances.
    capacity:  [W] int64 backward capacity per rank (rows its instances' backward may take), or None.
    uniform:   [G] fp32, this rank's systematic-sampling uniforms (one per instance, g = w * I + i), or None.
    """

    loads: torch.Tensor
    instances: torch.Tensor
    routes: torch.Tensor
    assignment: torch.Tensor
    instance_quotas: torch.Tensor
    quotas: torch.Tensor
    capacity: torch.Tensor | None = None
    uniform: torch.Tensor | None = None


torch.utils._pytree.register_dataclass(ExpertParallelPlan)

PlacementPolicy = Callable[[torch.Tensor, int], torch.Tensor]


@dataclass(frozen=True)
class _EPGroup:
    """The EP process group and this rank's place in it (Python values, fixed at parallelisation)."""

    group: dist.ProcessGroup
    rank: int
    size: int


@dataclass(frozen=True)
class _Splits:
    """Host-side row counts per peer of the all-to-alls of one step, read from the plan in one sync.

    fwd_send[w]: this rank's pairs that run on rank w (dispatch rows sent; combine rows received).
    fwd_recv[s]: source s's pairs that run on this rank (dispatch rows received; combine rows sent).
    bwd_send[w], bwd_recv[s]: the same for the retained pairs (instance quotas instead of the assignment).
    rep_send[w]: replica weights this rank sends to rank w (w's replicas of experts this rank owns);
    rep_recv[v]: replica weights this rank receives from owner v. Empty lists without replicas.
    block_rows: with ExpertParallel(backward_blocks=True), the rows of every local instance's block in the
    blocked backward: the most retained rows any instance of this rank receives, rounded up to 8; else 0.
    """

    fwd_send: list[int]
    fwd_recv: list[int]
    bwd_send: list[int]
    bwd_recv: list[int]
    rep_send: list[int]
    rep_recv: list[int]
    block_rows: int = 0


def _check_replication(max_replicas: int, capacity_factor: float | None, placement_policy: PlacementPolicy) -> None:
    """``ExpertParallel``'s and ``plan_expert_parallel``'s replication arguments (Python values only)."""
    if isinstance(max_replicas, bool) or not isinstance(max_replicas, int) or max_replicas < 0:
        raise ValueError(f"max_replicas must be a non-negative int, got {max_replicas!r}")
    if capacity_factor is not None:
        if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float)):
            raise TypeError(f"capacity_factor must be a float >= 1 or None, got {type(capacity_factor).__name__}")
        if not capacity_factor >= 1.0 or math.isinf(capacity_factor):  # nan fails the first comparison
            raise ValueError(
                f"capacity_factor must be a finite float >= 1, got {capacity_factor}: W ranks of capacity "
                "capacity_factor * budget / W must together hold the budget"
            )
    if not callable(placement_policy):
        raise TypeError(f"placement_policy must be callable (loads_WE, max_replicas) -> replicas_WR, got "
                        f"{type(placement_policy).__name__}")


def backward_capacity(loads_WE: torch.Tensor, retain: float, capacity_factor: float) -> torch.Tensor:
    """[W] int64, the backward capacity of every rank: ceil(capacity_factor * budget / W), budget =
    floor(retain * total pairs) (plan_quotas' budget), the same on every rank."""
    n_ranks = loads_WE.shape[0]
    budget = (loads_WE.sum().double() * retain).floor()
    cap = (budget * capacity_factor / n_ranks).ceil().long()
    return cap.expand(n_ranks).clone()


def _check_placement(replicas_WR, loads_WE: torch.Tensor, max_replicas: int) -> torch.Tensor:
    """A placement policy's output: an integer [W, R] tensor on the loads' device; on the host (``plan_on="host"``,
    where reading it costs no sync) also its values: expert ids in [-1, E), none a rank's own expert, no expert
    twice on one rank. A policy breaking these used to surface as split sizes that disagree between ranks."""
    n_ranks, n_exp = loads_WE.shape
    if not isinstance(replicas_WR, torch.Tensor) or tuple(replicas_WR.shape) != (n_ranks, max_replicas):
        got = tuple(replicas_WR.shape) if isinstance(replicas_WR, torch.Tensor) else type(replicas_WR).__name__
        raise ValueError(f"placement_policy must return a [W={n_ranks}, max_replicas={max_replicas}] tensor of "
                         f"expert ids, got {got}")
    if replicas_WR.dtype.is_floating_point or replicas_WR.dtype.is_complex or replicas_WR.dtype == torch.bool:
        raise TypeError(f"placement_policy must return integer expert ids, got {replicas_WR.dtype}")
    if replicas_WR.device != loads_WE.device:
        raise ValueError(f"placement_policy must return its tensor on the loads' device ({loads_WE.device}), got "
                         f"{replicas_WR.device}")
    if replicas_WR.device.type != "cpu":
        return replicas_WR  # its values would need a host sync (plan_on="device"): the policy is trusted
    reps = replicas_WR.long()  # a CPU tensor from here on: the reads below (any, tolist, nonzero) cost no sync
    n_local = n_exp // n_ranks
    bad = (reps < -1) | (reps >= n_exp)
    if bad.any():
        raise ValueError(f"placement_policy returned expert ids outside [-1, E={n_exp}): {reps[bad].tolist()}")
    owner_WR = torch.div(reps, n_local, rounding_mode="floor")
    own = (reps >= 0) & (owner_WR == torch.arange(n_ranks).unsqueeze(1))
    if own.any():
        w = int(own.any(1).nonzero()[0])
        raise ValueError(f"placement_policy put a replica of an expert on the rank that owns it (rank {w}: "
                         f"{reps[w][own[w]].tolist()}); a replica goes to a rank that does not own its expert")
    for w in range(n_ranks):
        placed = reps[w][reps[w] >= 0]
        if placed.unique().numel() != placed.numel():
            raise ValueError(f"placement_policy put one expert in two replica slots of rank {w} ({reps[w].tolist()});"
                             f" a rank holds at most one instance of an expert")
    return replicas_WR


def plan_expert_parallel(
    loads_WE: torch.Tensor,
    retain: float,
    *,
    min_retain: float = 0.0,
    policy: str = "waterfill",
    max_replicas: int = 0,
    capacity_factor: float | None = None,
    placement_policy: PlacementPolicy = place_hot_replicas,
    quota_align: int = 1,
) -> ExpertParallelPlan:
    """The plan of one EP layer step from the all-gathered [W, E] load matrix (``ExpertParallelPlan``, uniform
    None): placement, forward assignment, backward quotas.

    A pure function of its inputs (deterministic arithmetic, no communication), so every rank that calls it with
    the same load matrix gets the same plan: this is what lets a source rank select its own pairs in backward
    before any communication. Without replicas and capacity, instance (w, i) is expert w * L + i and the quotas
    are plan_quotas(loads_WE, retain) exactly. ``quota_align``: plan_quotas' ``align`` over the instances' totals
    (each instance's rows form one group of the receiving rank's grouped GEMMs); not with ``capacity_factor``.

    Errors (on Python values, shapes and dtypes, no sync), those of ``ExpertParallel`` for the same arguments:
    ``loads_WE`` not an integer [W, E] tensor with E a positive multiple of W, ``max_replicas`` not an int in
    [0, E - E/W], ``capacity_factor`` neither None nor a finite float >= 1, ``placement_policy`` not callable or
    returning other than an integer [W, max_replicas] tensor on the loads' device (on CPU also: ids outside [-1,
    E), a rank's own expert, an expert twice on one rank); and plan_quotas' errors for ``retain``, ``min_retain``,
    ``policy`` and ``quota_align``.
    """
    check_tensor("loads_WE", loads_WE, ndim=2, kind="int")  # as plan_quotas: float loads would be truncated
    _check_replication(max_replicas, capacity_factor, placement_policy)
    n_ranks, n_exp = loads_WE.shape
    if n_ranks < 1 or n_exp < 1 or n_exp % n_ranks:
        raise ValueError(f"loads_WE must be [W, E] with W >= 1 ranks and E experts a positive multiple of W (every "
                         f"rank owns E/W experts), got shape {tuple(loads_WE.shape)}")
    check_replica_slots("max_replicas", max_replicas, n_exp, n_ranks)
    loads_WE = loads_WE.long()
    device = loads_WE.device
    if max_replicas > 0:
        replicas_WR = _check_placement(placement_policy(loads_WE, max_replicas), loads_WE, max_replicas)
    else:
        replicas_WR = torch.empty(n_ranks, 0, dtype=torch.int64, device=device)
    inst_WI = instance_experts(replicas_WR, n_exp)
    n_inst = inst_WI.shape[1]

    if max_replicas == 0:
        # Owners only: every pair runs on its expert's owner, which is what route_to_replicas gives with one
        # instance per expert of capacity = its load (tests/nn/test_expert_parallel.py checks the two agree), and
        # instance (w, i) is expert w * L + i. A few ops instead of the transport's ~60, every step.
        owner_E = torch.arange(n_exp, device=device) // n_inst
        routes_SEW = loads_WE.unsqueeze(2) * (owner_E.unsqueeze(1) == torch.arange(n_ranks, device=device))
        assign_SWI = loads_WE.view(n_ranks, n_ranks, n_inst).clone()
    else:
        valid_WI = inst_WI >= 0
        safe_WI = inst_WI.clamp(min=0)
        rank_WI = torch.arange(n_ranks, device=device).unsqueeze(1).expand_as(safe_WI)
        routes_SEW = route_to_replicas(loads_WE, balanced_capacity(loads_WE.sum(0), inst_WI))
        assign_SWI = routes_SEW[:, safe_WI, rank_WI] * valid_WI
    loads_SG = assign_SWI.reshape(n_ranks, -1)
    if capacity_factor is None:
        capacity_W = None
        quotas_SG = plan_quotas(loads_SG, retain, min_retain=min_retain, policy=policy, align=quota_align)
    else:
        capacity_W = backward_capacity(loads_WE, retain, capacity_factor)
        placement_G = torch.arange(n_ranks, device=device).repeat_interleave(n_inst)
        quotas_SG = plan_quotas(loads_SG, retain, min_retain=min_retain, policy=policy, capacity=capacity_W,
                                placement=placement_G, align=quota_align)
    quotas_SWI = quotas_SG.view(n_ranks, n_ranks, n_inst)
    if max_replicas == 0:  # instances are the experts, in order
        quotas_SE = quotas_SG.clone()
    else:
        quotas_SE = torch.zeros_like(loads_WE).index_add_(1, safe_WI.reshape(-1), (quotas_SWI * valid_WI).reshape(
            n_ranks, -1))
    return ExpertParallelPlan(loads=loads_WE, instances=inst_WI, routes=routes_SEW, assignment=assign_SWI,
                              instance_quotas=quotas_SWI, quotas=quotas_SE, capacity=capacity_W)


# The plan as one opaque op. Every rank must compute the same plan, or the split sizes of the all-to-alls
# disagree and gloo aborts ("Received data size doesn't match expected size"). Compiled, each rank traces its own
# graph (its rank is a constant in it), so inductor fuses and orders the plan's kernels differently on every rank.
# On 2 gloo ranks with replicas (torch 2.13), rank 1's kernels read balanced_capacity's index_add_ result (an
# IndexPutFallback into a zeros buffer) before the index_add_ ran: the ordering edge in the pre-fusion IR was lost
# in scheduling (reorder_for_peak_memory=False or no horizontal fusion avoids it). Rank 1 planned with zero
# instances per expert, rank 0 planned right. Behind this op the plan runs the same eager kernels on every rank,
# compiled or not: the same plan everywhere by construction, not by trusting every rank's compiled code (float64
# sums in the placement policy included). It is [W, E]-sized integer work: nothing worth fusing is lost.

# Placement policies by key, so that the op (whose arguments are tensors and scalars) can reach the callable.
# Filled by ExpertParallel.__init__, never emptied: a key always names the same function.
_PLACEMENT_POLICIES: dict[str, PlacementPolicy] = {}


def _placement_key(policy: PlacementPolicy) -> str:
    name = getattr(policy, "__qualname__", type(policy).__name__)
    key = f"{getattr(policy, '__module__', '')}.{name}@{id(policy):x}"
    _PLACEMENT_POLICIES.setdefault(key, policy)
    return key


@torch.library.custom_op("lrmoe::ep_plan", mutates_args=())
def _ep_plan(
    loads_WE: torch.Tensor, retain: float, min_retain: float, policy: str, max_replicas: int,
    capacity_factor: float | None, placement_key: str, quota_align: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(instances, routes, assignment, instance_quotas, quotas, capacity) of ``plan_expert_parallel``; capacity
    is a [W] tensor of -1 without ``capacity_factor``."""
    plan = plan_expert_parallel(
        loads_WE, retain, min_retain=min_retain, policy=policy, max_replicas=max_replicas,
        capacity_factor=capacity_factor, placement_policy=_PLACEMENT_POLICIES[placement_key],
        quota_align=quota_align,
    )
    capacity_W = plan.capacity if plan.capacity is not None else torch.full_like(plan.loads[:, 0], -1)
    return plan.instances, plan.routes, plan.assignment, plan.instance_quotas, plan.quotas, capacity_W


@_ep_plan.register_fake
def _(loads_WE, retain, min_retain, policy, max_replicas, capacity_factor, placement_key, quota_align):
    n_ranks, n_exp = loads_WE.shape
    n_inst = n_exp // n_ranks + max_replicas

    def new(*shape):
        return loads_WE.new_empty(shape, dtype=torch.int64)

    return (new(n_ranks, n_inst), new(n_ranks, n_exp, n_ranks), new(n_ranks, n_ranks, n_inst),
            new(n_ranks, n_ranks, n_inst), new(n_ranks, n_exp), new(n_ranks))


def _plan_step(loads_WE: torch.Tensor, layer: LRMoE, rep: _Replication) -> ExpertParallelPlan:
    """``plan_expert_parallel`` for one layer step, through the opaque op (uniform None)."""
    inst, routes, assign, inst_quotas, quotas, capacity = _ep_plan(
        loads_WE.long(), layer.retain, layer.min_retain, layer.policy, rep.max_replicas, rep.capacity_factor,
        rep.placement_key, layer.quota_align,
    )
    return ExpertParallelPlan(loads=loads_WE.long(), instances=inst, routes=routes, assignment=assign,
                              instance_quotas=inst_quotas, quotas=quotas,
                              capacity=None if rep.capacity_factor is None else capacity)


def _plan_to(plan: ExpertParallelPlan, loads_WE: torch.Tensor) -> ExpertParallelPlan:
    """A plan computed on CPU tensors, on the device of ``loads_WE`` (which it carries as its loads): one copy of
    the packed integer tensors, then views."""
    parts = [plan.instances, plan.routes, plan.assignment, plan.instance_quotas, plan.quotas]
    if plan.capacity is not None:
        parts.append(plan.capacity)
    # non_blocking: CUDA stages pageable host memory at once and the stream does not wait; a blocking copy would
    # synchronise the stream a second time in the step.
    packed = torch.cat([t.reshape(-1) for t in parts]).to(loads_WE.device, non_blocking=True)
    views = [v.view(t.shape) for v, t in zip(packed.split([t.numel() for t in parts]), parts, strict=True)]
    inst, routes, assign, inst_quotas, quotas = views[:5]
    return ExpertParallelPlan(loads=loads_WE.long(), instances=inst, routes=routes, assignment=assign,
                              instance_quotas=inst_quotas, quotas=quotas,
                              capacity=views[5] if plan.capacity is not None else None)


def instance_slots(instances_WI: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[E, W] int64: the slot of expert e on rank w, -1 where rank w holds no instance of e."""
    n_ranks, n_inst = instances_WI.shape
    valid_WI = instances_WI >= 0
    flat_WI = torch.where(valid_WI, instances_WI * n_ranks + torch.arange(n_ranks, device=instances_WI.device)
                          .unsqueeze(1), num_experts * n_ranks)  # empty slots land in a dump entry
    slots = torch.full((num_experts * n_ranks + 1,), -1, dtype=torch.int64, device=instances_WI.device)
    slot_WI = torch.arange(n_inst, device=instances_WI.device).expand(n_ranks, n_inst)
    return slots.scatter(0, flat_WI.reshape(-1), slot_WI.reshape(-1))[:-1].view(num_experts, n_ranks)


def pair_destinations(
    expert_ids_TK: torch.Tensor, routes_EW: torch.Tensor, slots_EW: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """([P] rank, [P] slot) of the instance that runs each of this source's pairs (pair p = t * K + k).

    The source's pairs of expert e, in pair order: the first routes_EW[e, 0] run on rank 0, the next
    routes_EW[e, 1] on rank 1, and so on (routes_EW = plan.routes[source]); the slot is slots_EW[e, rank].
    """
    flat_P = expert_ids_TK.reshape(-1).long()
    n_exp, n_ranks = routes_EW.shape
    order_P = argsort_ids(flat_P)
    ident_P = torch.arange(flat_P.shape[0], device=flat_P.device)
    pos_P = torch.empty_like(order_P).scatter_(0, order_P, ident_P)
    count_E = torch.zeros(n_exp, dtype=torch.int64, device=flat_P.device).index_add_(
        0, flat_P, torch.ones_like(flat_P)
    )
    within_P = pos_P - (torch.cumsum(count_E, 0) - count_E).index_select(0, flat_P)
    ends_PW = torch.cumsum(routes_EW, 1).index_select(0, flat_P)
    rank_P = (within_P.unsqueeze(1) >= ends_PW).sum(1).clamp(max=n_ranks - 1)
    return rank_P, slots_EW[flat_P, rank_P]


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
    return argsort_ids(key_N)


def _host_splits(plan: ExpertParallelPlan, ep: _EPGroup, n_local: int, blocked: bool = False) -> _Splits:
    # HOST SYNC (plan on the device; with plan_on="host" the plan is already on the host): the one host read of the
    # EP layer step. The split sizes of every all-to-all of the step (forward dispatch and combine, backward
    # dispatch and input-gradient return, replica weights and their gradients) follow from the plan, so one
    # .tolist() here serves all of them; backward reads nothing from the device.
    rows = [
        plan.assignment[ep.rank].sum(-1), plan.assignment[:, ep.rank].sum(-1),
        plan.instance_quotas[ep.rank].sum(-1), plan.instance_quotas[:, ep.rank].sum(-1),
    ]
    replicas_WR = plan.instances[:, n_local:]
    n_rep = replicas_WR.shape[1]
    if n_rep:
        owner_WR = torch.where(replicas_WR >= 0, torch.div(replicas_WR, n_local, rounding_mode="floor"), -1)
        rows.append((owner_WR == ep.rank).sum(1))  # rank w's replicas of experts this rank owns
        rows.append(torch.nn.functional.one_hot(owner_WR[ep.rank] + 1, ep.size + 1)[:, 1:].sum(0))
    if blocked:  # the rows of this rank's blocks, repeated to a row's length: the same one read
        rows.append(_block_rows(plan.instance_quotas[:, ep.rank].sum(0)).expand(ep.size))
    host = torch.stack(rows).tolist()
    # Under torch.compile this .tolist() gives unbacked SymInts (unknown at trace time): tell the compiler they are
    # row counts (>= 0), else checks such as select_within_quota's `max_rows < 0` cannot be decided while tracing
    # ("Could not guard on data-dependent expression"). In eager they are plain ints and the checks are no-ops.
    for counts in host:
        for n in counts:
            torch._check(n >= 0)
    n_block = host.pop()[0] if blocked else 0
    if not n_rep:
        host += [[], []]
    return _Splits(*host, block_rows=n_block)


def _block_rows(rows_I: torch.Tensor) -> torch.Tensor:
    """Rows per block of a rank's blocked backward (``ExpertParallel(backward_blocks=True)``), from its instances'
    retained rows [..., I]: the most any of them keeps, rounded up to whole 8-row steps (as the single-device
    blocks of ``backward_capacity``)."""
    return (rows_I.max(-1).values + 7) // 8 * 8


def _peer_bytes(rows_W: list[int], row_bytes: int, rank: int) -> int:
    """Bytes an all-to-all moves between this rank and its peers (the chunk to itself is a local copy)."""
    return row_bytes * (sum(rows_W) - rows_W[rank])


# ---------------------------------------------------------------------------------------------- all-to-all


def _all_to_all(rows_N: torch.Tensor, recv: list[int], send: list[int], ep: _EPGroup) -> torch.Tensor:
    """Uneven all-to-all of rows (split sizes on the host, from :func:`_host_splits`)."""
    out = funcol.all_to_all_single(rows_N.contiguous(), recv, send, ep.group)
    return funcol.wait_tensor(out)


def _all_to_all_with_scalars(rows_ND: torch.Tensor, extra_N: torch.Tensor, recv: list[int], send: list[int],
                             ep: _EPGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows and a 4-byte scalar per row (fp32 ||phi||^2 or an int32 index) with the same split sizes: two
    all-to-alls, both issued before either is waited on. One byte payload (each row with its scalar appended) saves
    a collective but needs a byte-wise copy of every row to pack it and another to unpack it: on two H200s the
    packing's cat alone took 1.3 ms of a 16 ms step (docs/performance.md, seventh GPU session)."""
    rows = funcol.all_to_all_single(rows_ND.contiguous(), recv, send, ep.group)
    extra = funcol.all_to_all_single(extra_N.contiguous(), recv, send, ep.group)
    return funcol.wait_tensor(rows), funcol.wait_tensor(extra)


def _fetch_replicas(flat_LX: torch.Tensor, plan: ExpertParallelPlan, splits: _Splits, ep: _EPGroup) -> torch.Tensor:
    """[R, X] weights of this rank's replica slots (zeros in empty slots), fetched from their owners.

    ``flat_LX`` is this rank's owned experts, both weights flattened into one row each, so one all-to-all moves
    them. The all-to-all is funcol's autograd-aware one: its backward sends each replica's weight gradient back to
    the owner, and the backward of the owner's index_select sums every replica's gradient into the owned row, so
    the shard's gradient is the sum over all instances of its experts.
    """
    n_local = flat_LX.shape[0]
    replicas_WR = plan.instances[:, n_local:]
    n_ranks, n_rep = replicas_WR.shape
    device = flat_LX.device
    owner_WR = torch.where(replicas_WR >= 0, torch.div(replicas_WR, n_local, rounding_mode="floor"), n_ranks)
    # Owner side: the experts others replicate, in (rank, slot) order: the order each receiver expects.
    slot_WR = torch.arange(n_ranks * n_rep, device=device).view(n_ranks, n_rep)
    key_WR = torch.where(owner_WR == ep.rank, slot_WR, n_ranks * n_rep)
    send_slots = torch.argsort(key_WR.reshape(-1), stable=True)[: sum(splits.rep_send)]
    local_ids = replicas_WR.reshape(-1).index_select(0, send_slots) - ep.rank * n_local
    send = flat_LX.index_select(0, local_ids)
    recv = funcol.all_to_all_single(send, splits.rep_recv, splits.rep_send, ep.group)
    # Receiver side: rows come owner-major, then by slot; put them in their slots.
    mine_R = owner_WR[ep.rank]
    key_R = mine_R * n_rep + torch.arange(n_rep, device=device)
    recv_slots = torch.argsort(key_R, stable=True)[: sum(splits.rep_recv)]
    return torch.zeros(n_rep, flat_LX.shape[1], dtype=flat_LX.dtype, device=device).index_copy(0, recv_slots, recv)


# -------------------------------------------------------------------------------------------- autograd core


@dataclass(frozen=True)
class _Config:
    retain: float
    dense: bool  # retain 1 and no capacity: every pair is kept, in forward order
    metric: str
    selection: str
    generator: torch.Generator | None
    activations: str = "save"  # what forward keeps of h: "save", "recompute" or "offload" (see saved_h)
    blocked: bool = False  # the instance-side backward on equal blocks of splits.block_rows rows (torch.bmm)


class _ExpertParallelSwiGLU(torch.autograd.Function):
    """Dispatch, local instances, combine; backward selects on the source before the backward all-to-all."""

    @staticmethod
    def forward(ctx, x_TD, gate_up_IFD, down_IDF, gates_TK, group_P, assign_SWI, quotas_SWI, uniform_G, probe,
                cfg: _Config, splits: _Splits, ep: _EPGroup):
        n_tok, top_k = gates_TK.shape
        # Pairs sorted by instance g = w * I + i (stable: pair id within an instance), so by destination rank: the
        # dispatch send buffer.
        order_P = argsort_ids(group_P)
        tok_P = torch.div(order_P, top_k, rounding_mode="floor")
        x_recv_ND = _all_to_all(x_TD.index_select(0, tok_P), splits.fwd_recv, splits.fwd_send, ep)

        # Received rows are source-major; the grouped GEMMs want them instance-major. The gather is fused into the
        # first GEMM (rows = the permutation), so x_recv is never copied.
        n_rows = x_recv_ND.shape[0]
        counts_SI = assign_SWI[:, ep.rank]
        perm_N = expert_major_order(counts_SI, n_rows)
        offsets_I = torch.cumsum(counts_SI.sum(0), 0).int()
        ident_N = torch.arange(n_rows, device=x_TD.device)
        h_NF2 = gather_grouped_mm(x_recv_ND, gate_up_IFD, perm_N, offsets_I)
        h_saved = saved_h(h_NF2, cfg.activations)
        phi_NF, phi_sq_N = swiglu_sqnorm(h_NF2)  # and ||phi||^2 per row in fp32, from one read of h
        y_ND = gather_grouped_mm(phi_NF, down_IDF, None, offsets_I)  # rows in place
        inv_perm_N = torch.empty_like(perm_N).scatter_(0, perm_N, ident_N)

        # Combine: y rows and ||phi||^2 go back in the order they came (source-major).
        y_PD, phi_sq_P = _all_to_all_with_scalars(
            y_ND.index_select(0, inv_perm_N), phi_sq_N.index_select(0, inv_perm_N), splits.fwd_send, splits.fwd_recv, ep
        )
        ident_P = torch.arange(group_P.shape[0], device=x_TD.device)
        inv_order_P = torch.empty_like(order_P).scatter_(0, order_P, ident_P)
        phi_sq_TK = phi_sq_P.index_select(0, inv_order_P).view(n_tok, top_k)
        out_TD = combine(y_PD, inv_order_P.view(n_tok, top_k), gates_TK)  # y stays in dispatch order

        ctx.cfg, ctx.splits, ctx.ep = cfg, splits, ep
        ctx.has_probe = probe is not None
        ctx.x_shape = x_TD.shape
        ctx.save_for_backward(gate_up_IFD, down_IDF, gates_TK, group_P, assign_SWI, quotas_SWI, uniform_G,
                              y_PD, phi_sq_TK, order_P, inv_order_P, x_recv_ND, h_saved, inv_perm_N)
        release_h(h_NF2, h_saved, out_TD, cfg.activations)
        return out_TD

    @staticmethod
    @once_differentiable  # its ops have no gradients: a second order would be silently incomplete
    def backward(ctx, grad_out_TD):
        (gate_up_IFD, down_IDF, gates_TK, group_P, assign_SWI, quotas_SWI, uniform_G,
         y_PD, phi_sq_TK, order_P, inv_order_P, x_recv_ND, h_saved, inv_perm_N) = ctx.saved_tensors
        cfg: _Config = ctx.cfg
        splits: _Splits = ctx.splits
        ep: _EPGroup = ctx.ep
        n_inst = gate_up_IFD.shape[0]
        dtype, device = y_PD.dtype, y_PD.device
        g_TD = grad_out_TD

        # Exact router gradient, local: dL/d alpha_u = <g_t, y_u>.
        grad_gates_TK, scores_P = router_gradient_and_scores(
            g_TD, y_PD, inv_order_P.view(gates_TK.shape), gates_TK, phi_sq_TK, metric=cfg.metric,
            selects=not cfg.dense,
        )
        grad_gates_TK = grad_gates_TK.to(gates_TK.dtype)

        # --- source side: score and select own pairs within quotas[rank, w, i], before any communication.
        if cfg.dense:
            # Keep every pair, in the forward dispatch order: each instance finds its rows where they were.
            pair_R = order_P
            weight_R = torch.ones(order_P.shape[0], device=device)
            mass_kept = torch.ones((), device=device)
        else:
            # Groups are this rank's (source, instance) pairs; the buffer holds exactly sum quotas[rank] rows
            # (every group keeps min(quota, load) = quota), grouped by instance ascending, so by destination rank:
            # its per-rank blocks are exactly splits.bwd_send.
            sel, mass_kept = select_retained(
                gates_TK, g_TD, phi_sq_TK, group_P, quotas_SWI[ep.rank].reshape(-1), sum(splits.bwd_send),
                metric=cfg.metric, selection=cfg.selection, generator=cfg.generator, uniform_G=uniform_G,
                group_order_P=order_P,  # the dispatch order: instances ascending, pair id within
                scores_P=scores_P,
            )
            pair_R, weight_R = sel.pair_ids, sel.weights

        # Retained rows alpha_u * g_t * (1/p_u). A slot "sample" skipped (pair -1) sends a zero row: it keeps the
        # split sizes planned, and a zero dy contributes nothing to any gradient.
        dy_RD, _, safe_R = retained_dy(g_TD, gates_TK, pair_R, weight_R, dtype)
        tie = None
        if guard_or_false(g_TD.shape[0] == 0):
            # A rank without tokens (T = 0, a static size under torch.compile): the CUDA ops, inlined, return its
            # empty results without reading g, so nothing this backward sends depended on the incoming gradient and
            # AOTAutograd's partitioner moved the backward all-to-alls into this rank's forward graph, out of step
            # with the other ranks' collectives (two GPUs: garbage row indices, a device-side assert). The sum of
            # the empty g, added to what is sent, ties the sends to it.
            tie = g_TD.sum()
            dy_RD = dy_RD + tie.to(dy_RD.dtype)

        fwd_recv_W = assign_SWI[:, ep.rank].sum(-1)  # on device: no host-to-device copy
        row_bytes = dy_RD.shape[1] * dy_RD.element_size()
        if cfg.dense:
            dy_MD = _all_to_all(dy_RD, splits.bwd_recv, splits.bwd_send, ep)
        else:
            # The instance must find each row's saved forward activations: send the pair's position in the forward
            # message to its rank (its position in the sorted dispatch buffer minus that rank's block start).
            fwd_send_W = assign_SWI[ep.rank].sum(-1)
            start_W = torch.cumsum(fwd_send_W, 0) - fwd_send_W
            dest_R = torch.div(take_rows(group_P, safe_R), n_inst, rounding_mode="floor")
            index_R = take_rows(inv_order_P, safe_R) - start_W.index_select(0, dest_R)
            index_R = torch.where(pair_R >= 0, index_R, 0).int()
            if tie is not None:
                index_R = index_R + tie.int()
            dy_MD, index_M = _all_to_all_with_scalars(dy_RD, index_R, splits.bwd_recv, splits.bwd_send, ep)
            row_bytes += _EXTRA_BYTES

        # --- instance side: compact backward over the M retained rows this rank's instances received.
        n_kept = dy_MD.shape[0]
        if cfg.dense:
            fwd_row_M = torch.arange(n_kept, device=device)  # the same layout as the forward dispatch
        else:
            bwd_recv_W = quotas_SWI[:, ep.rank].sum(-1)
            src_M = torch.repeat_interleave(torch.arange(ep.size, device=device), bwd_recv_W, output_size=n_kept)
            fwd_row_M = (torch.cumsum(fwd_recv_W, 0) - fwd_recv_W).index_select(0, src_M) + index_M.long()
        quota_SI = quotas_SWI[:, ep.rank]
        perm_M = expert_major_order(quota_SI, n_kept)  # instance-major position j -> arrived row perm_M[j]
        offsets_I = torch.cumsum(quota_SI.sum(0), 0).int()
        # The expert backward's rows R, instance-major: the M retained rows, or I blocks of C (padding included).
        group_rows = None
        if cfg.blocked:
            # Each instance's rows first in a block of splits.block_rows (the largest instance's count, from the
            # plan already on the host: no pair dropped, no sync), zero rows after them; the GEMMs as torch.bmm.
            group_rows = splits.block_rows
            slot_M = block_slots(offsets_I, n_kept, group_rows)  # also maps the input-gradient rows back below
            # The arrived row in each slot (-1 for padding), weight 1 (0 for padding), the blocks' offsets.
            arrived_B, keep_B, offsets_I = pad_to_blocks(perm_M, torch.ones(n_kept, device=device), offsets_I,
                                                         group_rows, slot_M)
            safe_B = arrived_B.clamp(min=0)
            dy = [gather_scale_rows(dy_MD, safe_B, keep_B)]  # padding: zero rows
            rows_R = fwd_row_M.index_select(0, safe_B)
        else:
            dy = [dy_MD.index_select(0, perm_M)]
            rows_R = fwd_row_M.index_select(0, perm_M)  # instance-major retained rows -> source-major forward rows

        # "recompute" (h_saved None): h from the received x rows, which this rank keeps for the weight gradient
        # anyway; "offload": the retained rows of the host copy.
        dx_em_RD, grad_gu, grad_down = expert_rows_backward(
            dy, x_recv_ND, rows_R, offsets_I, gate_up_IFD, down_IDF, h_saved=h_saved,
            h_index_R=None if h_saved is None else inv_perm_N.index_select(0, rows_R),
            h_on_host=cfg.activations == "offload", group_rows=group_rows,
        )
        # Return the input-gradient rows in the order they arrived (the reverse of the backward dispatch).
        if cfg.blocked:
            dx_MD = dx_em_RD.index_select(0, torch.empty_like(slot_M).index_copy_(0, perm_M, slot_M))
        else:
            dx_MD = torch.empty_like(dx_em_RD).index_copy_(0, perm_M, dx_em_RD)
        dx_RD = _all_to_all(dx_MD, splits.bwd_send, splits.bwd_recv, ep)

        # --- source side again: input gradient of the retained pairs.
        grad_x = sum_rows_per_token(dx_RD, pair_R, *gates_TK.shape).view(ctx.x_shape)

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
        return grad_x, grad_gu, grad_down, grad_gates_TK, None, None, None, None, grad_probe, None, None, None


# ------------------------------------------------------------------------------------------------ the module


@dataclass(frozen=True)
class ExpertParallelStats:
    """Per-step statistics of an expert-parallel LRMoE layer, as tensors (no sync until read).

    loads [W, E], quotas [W, E] int64: the last forward's global plan (same on every rank); quotas summed over
        each expert's instances.
    instances [W, I], assignment [W, W, I], instance_quotas [W, W, I] int64: placement, forward rows and backward
        quotas per (source, rank, slot) (ExpertParallelPlan); capacity [W] int64: the backward capacity per rank,
        -1 without ``capacity_factor``.
    rank_loads [W], rank_backward_loads [W] int64: rows each rank's instances take in forward, and in backward
        after calibration (the per-rank load before and after).
    total_pairs, retained_pairs: 0-d int64, global (all ranks), last forward.
    dispatch_bytes, combine_bytes: 0-d int64, bytes this rank sent to its peers in the last forward's dispatch
        (x rows) and combine (y rows + fp32 ||phi||^2) all-to-alls; the chunk to itself is a local copy, not counted.
    replica_bytes, replica_grad_bytes: 0-d int64, bytes of expert weights this rank sent to replicas in the last
        forward, and of replica weight gradients it sends back to owners in its backward.
    backward_dispatch_bytes, backward_combine_bytes: 0-d fp64, bytes this rank sent to its peers in the backward
        dispatch (retained alpha*g rows, plus a 4-byte row index when retain < 1) and input-gradient return, summed
        over the backward passes since ``reset_stats()``.
    local_retained_pairs: 0-d fp64, retained rows this rank sent in backward, summed likewise.
    score_mass_fraction: 0-d fp64, mean over those backward passes of the kept share of this rank's score mass.
    backward_calls: 0-d fp64.
    """

    loads: torch.Tensor
    quotas: torch.Tensor
    instances: torch.Tensor
    assignment: torch.Tensor
    instance_quotas: torch.Tensor
    capacity: torch.Tensor
    rank_loads: torch.Tensor
    rank_backward_loads: torch.Tensor
    total_pairs: torch.Tensor
    retained_pairs: torch.Tensor
    dispatch_bytes: torch.Tensor
    combine_bytes: torch.Tensor
    replica_bytes: torch.Tensor
    replica_grad_bytes: torch.Tensor
    backward_dispatch_bytes: torch.Tensor
    backward_combine_bytes: torch.Tensor
    local_retained_pairs: torch.Tensor
    score_mass_fraction: torch.Tensor
    backward_calls: torch.Tensor

    @property
    def retained_fraction(self) -> torch.Tensor:
        return self.retained_pairs.float() / self.total_pairs.clamp(min=1).float()

    @property
    def block_padding(self) -> torch.Tensor:
        """[W] fp64: per rank, the share of its blocked backward's rows that are padding under the last forward's
        plan, 1 - M / (I * C): M retained rows over I instances, blocks of C rows, the most any of them keeps
        rounded up to 8; 0 for a rank with no rows. What ``backward_blocks=True`` pays, or would pay, for this
        plan: watch it under a skewed router."""
        rows_WI = self.instance_quotas.sum(0)
        slots_W = (_block_rows(rows_WI) * rows_WI.shape[1]).double()
        return torch.where(slots_W > 0, 1 - rows_WI.sum(1).double() / slots_W.clamp(min=1), 0.0)


@dataclass(frozen=True)
class _Replication:
    """Replica and capacity settings of an expert-parallel layer (Python values, fixed at parallelisation)."""

    max_replicas: int
    capacity_factor: float | None
    placement_policy: PlacementPolicy
    placement_key: str  # the policy's key in _PLACEMENT_POLICIES, for the plan op
    plan_on: str = "host"  # "host" or "device": where plan_expert_parallel runs (see ExpertParallel)
    backward_blocks: bool = False  # the instance-side backward as batched GEMMs on equal blocks (see ExpertParallel)


class ExpertParallel(ParallelStyle):
    """Shard an :class:`LRMoE` layer's experts over an EP mesh: ``parallelize_module(layer, mesh, ExpertParallel())``;
    or a model's own :class:`SwiGLUExperts` module, called by the model's block as ``experts(x_TD, expert_ids_TK,
    gates_TK)`` (a transformers model after ``swap_experts``: ``parallelize_module(model, mesh,
    {"model.layers.*.mlp.experts": ExpertParallel()})``), which then plans, dispatches and combines in that call
    with the module's options (retain, selection, ...; per-call options are refused) and has ``stats()``.

    Args:
        mesh_dim_name: the EP dimension of a multi-dimensional mesh (e.g. ``"ep"``); None for a 1-D mesh.
        max_replicas: replica slots per rank (R): every step, the placement policy may put up to R replicas of hot
            experts on each rank; 0 (default) = owners only. At most E - E/W (the experts a rank does not own).
        capacity_factor: backward capacity per rank, as a multiple of the balanced share: each rank's instances
            take at most ceil(capacity_factor * floor(retain * pairs) / W) rows in backward; None = no limit.
            Must be >= 1: with less, the ranks together could not hold the budget. Capacity is a hard limit: a
            rank whose min_retain floors exceed it keeps a waterfilled share of them (``plan_quotas``).
        placement_policy: ``(loads_WE, max_replicas) -> replicas_WR`` (see lrmoe.functional.replicas); must be
            deterministic. Default :func:`~lrmoe.functional.place_hot_replicas`. Its output is checked at every
            plan (values only on the host: see ``plan_expert_parallel``).
        plan_on: where the per-step plan (``plan_expert_parallel`` on the [W, E] load matrix: ~20 tiny integer
            ops for the dense backward without replicas, ~170-480 with a capacity or replicas at W = 2) runs.
            "host" (default): one device-to-host copy of the load matrix (the step's one host synchronisation),
            the plan on CPU tensors, one host-to-device copy of the plan. "device": on the layer's device, then
            one host read of the split sizes. On a GPU "host" trades each op's kernel launch for a CPU op: on two
            H200s (docs/performance.md, seventh GPU session) every LRMoE configuration's step was 1.0-6.0 ms
            faster with it (the plan's host time 1.6-4.1 vs 3.2-9.2 ms), the dense backward without replicas 2.1
            ms slower (its plan is ~20 ops). The same plan either way on every rank (all ranks plan on the same
            kind of device); on a CPU mesh the two are the same.
        backward_blocks: False (default) or True: each rank's expert backward lays every local instance's
            retained rows out as a block of C rows, C = the most any instance of the rank received this step
            (rounded up to 8; read with the split sizes, so no further sync), zero rows after them, and runs its
            four GEMMs as torch.bmm over the blocks instead of grouped GEMMs. Exact (the same kept pairs and
            gradients); the cost is the padding, which an uneven plan makes large. On two H200s
            (docs/performance.md, sixteenth session) it took 0.20-0.25 ms off the expert GEMMs per step with
            balanced loads (no padding), and under a skewed router padded 54-90 % of the rows and tripled a dense
            backward's peak memory: for routers that keep loads near even.

    Expert parameters become DTensors ``Shard(0)`` (rank w holds experts [w*E/W, (w+1)*E/W)); the router stays a
    plain replicated tensor. Parameters are replaced, so build the optimiser afterwards. With
    ``src_data_rank=0`` (parallelize_module's default) rank 0's expert weights are scattered; with None every rank
    keeps its own slice. The layer's forward becomes the EP forward described in this module's docstring, and
    ``layer.stats()`` returns :class:`ExpertParallelStats`.

    Errors: a module that is not an LRMoE or a SwiGLUExperts, or is already expert-parallel, a mesh of more than
    one dimension without ``mesh_dim_name``, an unknown ``mesh_dim_name``, ``num_experts % W != 0``, and bad
    ``max_replicas``, ``capacity_factor``, ``placement_policy``, ``plan_on`` or ``backward_blocks``.
    """

    def __init__(
        self,
        *,
        mesh_dim_name: str | None = None,
        max_replicas: int = 0,
        capacity_factor: float | None = None,
        placement_policy: PlacementPolicy = place_hot_replicas,
        plan_on: str = "host",
        backward_blocks: bool = False,
    ):
        super().__init__()
        if plan_on not in ("device", "host"):
            raise ValueError(f'plan_on must be "device" or "host", got {plan_on!r}')
        if not isinstance(backward_blocks, bool):
            raise TypeError(f"backward_blocks must be a bool, got {type(backward_blocks).__name__}")
        _check_replication(max_replicas, capacity_factor, placement_policy)
        self.mesh_dim_name = mesh_dim_name
        self.replication = _Replication(max_replicas, capacity_factor, placement_policy,
                                        _placement_key(placement_policy), plan_on, backward_blocks)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if isinstance(module, (_ExpertParallelMixin, _ExpertParallelExpertsMixin)):
            raise ValueError(f"this {type(module).__name__} is already expert-parallel")
        standalone = isinstance(module, SwiGLUExperts)  # experts called as experts(x, ids, gates) by their model
        if not standalone and not isinstance(module, LRMoE):
            raise TypeError("ExpertParallel applies to lrmoe.nn.LRMoE layers and to lrmoe.nn.SwiGLUExperts modules "
                            f"(swap_experts puts them into transformers models), got {type(module).__name__}")
        experts = module if standalone else module.experts
        capacity = experts.options.get("backward_capacity") if standalone else module.backward_capacity
        quota_align = experts.options.get("quota_align", 1) if standalone else module.quota_align
        _refuse_backward_capacity(capacity)
        if quota_align != 1 and self.replication.capacity_factor is not None:
            raise ValueError(
                f"quota_align={quota_align} with capacity_factor={self.replication.capacity_factor}: aligned "
                "quota steps could pass a rank's backward capacity; use quota_align=1 or capacity_factor=None"
            )
        ep_mesh = self._ep_mesh(device_mesh)
        n_ranks = ep_mesh.size()
        if experts.num_experts % n_ranks:
            raise ValueError(
                f"num_experts={experts.num_experts} is not divisible by the EP mesh size W={n_ranks}; every rank "
                "must own the same number of experts (E % W == 0)"
            )
        rep = self.replication
        check_replica_slots("max_replicas", rep.max_replicas, experts.num_experts, n_ranks)
        n_local = experts.num_experts // n_ranks
        device = experts.gate_up_proj.device if standalone else module.last_loads.device
        for name in ("gate_up_proj", "down_proj"):
            param = getattr(experts, name)
            if isinstance(param, DTensor):
                raise ValueError(f"experts.{name} is already a DTensor; ExpertParallel shards plain parameters")
            sharded = distribute_tensor(param.detach(), ep_mesh, [Shard(0)], src_data_rank=self.src_data_rank)
            experts.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))

        if standalone:
            module.__class__ = _ep_class(type(module), _ExpertParallelStandaloneMixin)
        else:
            module.__class__ = _ep_class(type(module), _ExpertParallelMixin)
            module.experts.__class__ = _ep_class(type(module.experts), _ExpertParallelExpertsMixin)
        module.ep_mesh = ep_mesh
        module._ep = _EPGroup(group=ep_mesh.get_group(), rank=ep_mesh.get_local_rank(), size=n_ranks)
        module._replication = rep
        n_exp, n_inst = experts.num_experts, n_local + rep.max_replicas

        def buffer(name, *shape):
            module.register_buffer(name, torch.zeros(*shape, dtype=torch.int64, device=device), persistent=False)

        if standalone:  # the layer has them: the last forward's loads and quotas, summed over ranks
            buffer("last_loads", n_exp)
            buffer("last_quotas", n_exp)
        buffer("ep_loads", n_ranks, n_exp)
        buffer("ep_quotas", n_ranks, n_exp)
        buffer("ep_instances", n_ranks, n_inst)
        buffer("ep_assignment", n_ranks, n_ranks, n_inst)
        buffer("ep_instance_quotas", n_ranks, n_ranks, n_inst)
        buffer("ep_capacity", n_ranks)
        buffer("ep_forward_bytes", 4)  # dispatch, combine, replica weights, replica weight gradients
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


def _refuse_backward_capacity(capacity: float | None) -> None:
    if capacity is not None:
        raise ValueError(
            f"backward_capacity={capacity} is the single-device layer's per-expert capacity; "
            "expert parallelism bounds each rank's backward rows with ExpertParallel(capacity_factor=...)"
        )


_EP_CLASSES: dict[tuple[type, type], type] = {}


def _ep_class(cls: type, mixin: type) -> type:
    """The expert-parallel subclass of an LRMoE class or of its experts' (FSDP2's fully_shard swaps classes the
    same way), so the module stays an instance of its own class, with the EP forward."""
    if (cls, mixin) not in _EP_CLASSES:
        _EP_CLASSES[cls, mixin] = type(f"ExpertParallel{cls.__name__}", (mixin, cls), {})
    return _EP_CLASSES[cls, mixin]


def _ep_step(module: nn.Module, opts, run_experts: Callable[..., torch.Tensor], x_TD: torch.Tensor,
             expert_ids_TK: torch.Tensor, gates_TK: torch.Tensor, probe: torch.Tensor | None) -> torch.Tensor:
    """Steps 2-9 of the module docstring for one forward: the load matrix, the plan, this rank's pair
    destinations and the step's records on ``module`` (its ep_* buffers, last_loads, last_quotas), then
    ``run_experts(x_TD, gates_TK, group_P, plan, probe, cfg, splits, ep)`` (the experts' expert-parallel forward).
    ``opts`` has the selective backward's options (retain, min_retain, policy, selection, metric, generator,
    activations, quota_align) and num_experts: the layer itself, or a standalone experts module's options. x and
    the gates are already in the experts' compute dtype."""
    ep, rep = module._ep, module._replication

    # The tiny [W, E] load matrix, all-gathered (no host sync), then the same plan on every rank.
    loads_E = expert_loads(expert_ids_TK, opts.num_experts)
    loads_WE = funcol.wait_tensor(_all_gather(loads_E, 0, ep.group)).view(ep.size, -1)
    n_local = opts.num_experts // ep.size
    if rep.plan_on == "host":
        # HOST SYNC: the load matrix to the host (the one host read of this step, see ExpertParallel's plan_on);
        # the split sizes below then read CPU tensors, and the plan goes to the device in one copy.
        plan_host = _plan_step(loads_WE.cpu(), opts, rep)
        splits = _host_splits(plan_host, ep, n_local, rep.backward_blocks)
        plan = _plan_to(plan_host, loads_WE)
    else:
        plan = _plan_step(loads_WE, opts, rep)  # plan_expert_parallel, opaque to the compiler (see _ep_plan)
        splits = _host_splits(plan, ep, n_local, rep.backward_blocks)  # the step's one host synchronisation
    n_inst = plan.instances.shape[1]
    dense = opts.retain >= 1.0 and rep.capacity_factor is None
    if module._draws_uniform(probe) and opts.selection == "sample" and not dense:
        # This rank's uniforms, one draw of [G] (one per instance; G = E without replicas) from the layer's
        # generator (the global RNG when None).
        uniform_G = torch.rand(ep.size * n_inst, generator=opts.generator, device=x_TD.device)
        plan = replace(plan, uniform=uniform_G)

    # Which instance runs each of this rank's pairs: g = w * I + i.
    slots_EW = instance_slots(plan.instances, opts.num_experts)
    rank_P, slot_P = pair_destinations(expert_ids_TK, plan.routes[ep.rank], slots_EW)
    group_P = rank_P * n_inst + slot_P

    dtype = x_TD.dtype
    dim, hidden_dim = x_TD.shape[1], opts.hidden_dim
    weight_bytes = 3 * dim * hidden_dim * dtype.itemsize  # one instance's two matrices
    row_bytes = dim * dtype.itemsize
    if not recomputing():  # keep the last forward's plan and bytes (lrmoe.nn.lrmoe.recomputing)
        with torch.no_grad():
            module.ep_loads.copy_(loads_WE)
            module.ep_quotas.copy_(plan.quotas)
            module.ep_instances.copy_(plan.instances)
            module.ep_assignment.copy_(plan.assignment)
            module.ep_instance_quotas.copy_(plan.instance_quotas)
            if plan.capacity is None:
                module.ep_capacity.fill_(-1)
            else:
                module.ep_capacity.copy_(plan.capacity)
            module.last_loads.copy_(loads_WE.sum(0))
            module.last_quotas.copy_(plan.quotas.sum(0))
            module.ep_forward_bytes[0].fill_(_peer_bytes(splits.fwd_send, row_bytes, ep.rank))
            module.ep_forward_bytes[1].fill_(_peer_bytes(splits.fwd_recv, row_bytes + _EXTRA_BYTES, ep.rank))
            if rep.max_replicas:
                module.ep_forward_bytes[2].fill_(_peer_bytes(splits.rep_send, weight_bytes, ep.rank))
                module.ep_forward_bytes[3].fill_(_peer_bytes(splits.rep_recv, weight_bytes, ep.rank))
            else:  # written every step: after a build on the meta device and to_empty they held garbage
                module.ep_forward_bytes[2:].zero_()

    # No backward will run without a probe: then "offload" would copy h to the host for nothing.
    activations = "recompute" if opts.activations == "offload" and probe is None else opts.activations
    cfg = _Config(retain=opts.retain, dense=dense, metric=opts.metric, selection=opts.selection,
                  generator=opts.generator, activations=activations, blocked=rep.backward_blocks)
    return run_experts(x_TD, gates_TK, group_P, plan, probe, cfg, splits, ep)


class _ExpertParallelExpertsMixin:
    """Forward of an expert-parallel layer's experts (steps 5-9 of the module docstring): the rank's instances,
    replicas fetched from their owners, on the rows its pairs dispatch. The layer runs its experts through this
    call, so hooks on ``layer.experts`` see it: FSDP2's ``fully_shard(layer.experts, mesh["dp"])`` gathers the
    weights before it, frees them after, and reduce-scatters their gradients once x's gradient is done."""

    def forward(self, x_TD: torch.Tensor, gates_TK: torch.Tensor, group_P: torch.Tensor, plan: ExpertParallelPlan,
                probe: torch.Tensor | None, cfg: _Config, splits: _Splits, ep: _EPGroup) -> torch.Tensor:
        n_local = self.num_experts // ep.size
        gate_up_LFD = self.gate_up_proj.to_local().to(x_TD.dtype)
        down_LDF = self.down_proj.to_local().to(x_TD.dtype)
        if gate_up_LFD.shape[0] != n_local or down_LDF.shape[0] != n_local:
            # Sharded further and not gathered: the kernels would index past a shard (an IndexError on CPU,
            # garbage on CUDA).
            raise RuntimeError(f"this rank holds {gate_up_LFD.shape[0]} experts' weights, expected E/W = {n_local}: "
                               f"{UNGATHERED_EXPERTS}")
        if plan.instances.shape[1] > n_local:
            # Replica weights from their owners, differentiably: their gradients return and sum into the shards.
            flat_LX = torch.cat([gate_up_LFD.reshape(n_local, -1), down_LDF.reshape(n_local, -1)], dim=1)
            flat_RX = _fetch_replicas(flat_LX, plan, splits, ep)
            n_gu = gate_up_LFD[0].numel()
            gate_up_IFD = torch.cat([gate_up_LFD, flat_RX[:, :n_gu].view(-1, *gate_up_LFD.shape[1:])])
            down_IDF = torch.cat([down_LDF, flat_RX[:, n_gu:].view(-1, *down_LDF.shape[1:])])
        else:
            gate_up_IFD, down_IDF = gate_up_LFD, down_LDF
        return _ExpertParallelSwiGLU.apply(x_TD, gate_up_IFD, down_IDF, gates_TK, group_P, plan.assignment,
                                           plan.instance_quotas, plan.uniform, probe, cfg, splits, ep)


class _ExpertParallelMixin:
    """Forward and statistics of an expert-parallel LRMoE (see the module docstring)."""

    ep_mesh: DeviceMesh
    _ep: _EPGroup
    _replication: _Replication
    _probe_size = N_EP_BACKWARD_STATS
    _probe_dtype = torch.float64  # byte counts stay exact past 2**24

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        x_TD = x.reshape(-1, self.dim)
        routing = self.route(x_TD)
        probe = self._probe_for(x)
        dtype = compute_dtype(x)  # torch.autocast's, else x's
        with torch.autocast(x.device.type, enabled=False):  # the experts run in ``dtype`` exactly
            out_TD = _ep_step(self, self, self.experts, x_TD.to(dtype), routing.expert_ids, routing.gates.to(dtype),
                              probe)
        return self.add_shared(x_TD, out_TD).view(x.shape)

    def stats(self) -> ExpertParallelStats:
        """This step's statistics as tensors (see :class:`ExpertParallelStats`)."""
        acc = self._stats_probe.grad
        if acc is None:
            acc = torch.zeros(N_EP_BACKWARD_STATS, dtype=torch.float64, device=self.ep_loads.device)
        calls = acc[4]
        return ExpertParallelStats(
            loads=self.ep_loads.clone(),
            quotas=self.ep_quotas.clone(),
            instances=self.ep_instances.clone(),
            assignment=self.ep_assignment.clone(),
            instance_quotas=self.ep_instance_quotas.clone(),
            capacity=self.ep_capacity.clone(),
            rank_loads=self.ep_assignment.sum((0, 2)),
            rank_backward_loads=self.ep_instance_quotas.sum((0, 2)),
            total_pairs=self.ep_loads.sum(),
            retained_pairs=self.ep_quotas.sum(),
            dispatch_bytes=self.ep_forward_bytes[0].clone(),
            combine_bytes=self.ep_forward_bytes[1].clone(),
            replica_bytes=self.ep_forward_bytes[2].clone(),
            replica_grad_bytes=self.ep_forward_bytes[3].clone(),
            backward_dispatch_bytes=acc[2].clone(),
            backward_combine_bytes=acc[3].clone(),
            local_retained_pairs=acc[1].clone(),
            score_mass_fraction=acc[0] / calls,
            backward_calls=calls.clone(),
        )


# A standalone experts module's options where it leaves them unset: selective_swiglu_experts' defaults.
_EXPERT_DEFAULTS = {name: p.default for name, p in inspect.signature(selective_swiglu_experts).parameters.items()
                    if name in EXPERT_OPTIONS}


@dataclass(frozen=True)
class _ExpertsOptions:
    """What _ep_step reads of a layer, for a standalone experts module (a dataclass: dynamo traces building it)."""

    num_experts: int
    hidden_dim: int
    retain: float
    metric: str
    selection: str
    policy: str
    min_retain: float
    generator: torch.Generator | None
    activations: str
    quota_align: int
    backward_capacity: float | None


class _ExpertParallelStandaloneMixin(_ExpertParallelExpertsMixin):
    """Forward and statistics of a :class:`SwiGLUExperts` made expert-parallel on its own
    (``parallelize_module(experts, mesh, ExpertParallel())``; e.g. a transformers model's experts after
    ``swap_experts``), called as transformers calls its experts: ``experts(x_TD, expert_ids_TK, gates_TK)``. Steps
    2-9 of the module docstring, with the module's options (retain, selection, ...); the caller's router chose the
    experts and gates (step 1), and its gradient, like the router's, comes from this rank's tokens only."""

    ep_mesh: DeviceMesh
    _ep: _EPGroup
    _replication: _Replication
    _probe_size = N_EP_BACKWARD_STATS
    _probe_dtype = torch.float64
    _draws_uniform = LRMoE._draws_uniform
    _new_probe = LRMoE._new_probe
    _probe_for = LRMoE._probe_for
    stats = _ExpertParallelMixin.stats
    reset_stats = LRMoE.reset_stats

    def forward(self, x_TD: torch.Tensor, expert_ids_TK: torch.Tensor, gates_TK: torch.Tensor,
                **options) -> torch.Tensor:
        if options:
            raise TypeError(
                f"this experts module is expert-parallel on its own (ExpertParallel applied to it) and plans every "
                f"step itself: it takes no per-call options, got {sorted(options)}. Set options when building it "
                "(SwiGLUExperts(..., retain=...), swap_experts(model, retain=...)); for an LRMoE layer apply "
                "ExpertParallel to the layer, not to layer.experts"
            )
        _refuse_backward_capacity(self.options.get("backward_capacity"))  # set after parallelize_module refused it
        check_tensor("x_TD", x_TD, ndim=2, kind="float")
        check_tensor("expert_ids_TK", expert_ids_TK, ndim=2, kind="int")
        check_tensor("gates_TK", gates_TK, ndim=2, kind="float")  # integer gates refused, not cast
        if x_TD.shape[1] != self.dim:
            raise ValueError(f"x_TD must be [T, dim={self.dim}], got shape {tuple(x_TD.shape)}")
        check_same_size("expert_ids_TK", expert_ids_TK, 0, "x_TD", x_TD, 0)
        if gates_TK.shape != expert_ids_TK.shape:
            raise ValueError(f"gates_TK must have expert_ids_TK's shape {tuple(expert_ids_TK.shape)}, got "
                             f"{tuple(gates_TK.shape)}")
        check_same_device(x_TD=x_TD, expert_ids_TK=expert_ids_TK, gates_TK=gates_TK,
                          gate_up_proj=self.gate_up_proj.to_local())
        probe = self._probe_for(x_TD, gates_TK)
        opts = _ExpertsOptions(num_experts=self.num_experts, hidden_dim=self.hidden_dim,
                               **(_EXPERT_DEFAULTS | self.options))
        run = partial(_ExpertParallelExpertsMixin.forward, self)
        dtype = compute_dtype(x_TD)  # torch.autocast's, else x's: computed and sent in it, as the layer does
        with torch.autocast(x_TD.device.type, enabled=False):
            return _ep_step(self, opts, run, x_TD.to(dtype), expert_ids_TK, gates_TK.to(dtype), probe)

    def _apply(self, fn, recurse=True):
        # The probe follows .to()/.cuda(), as LRMoE's does (a leaf that is neither parameter nor buffer).
        module = super()._apply(fn, recurse)
        if self._stats_probe.device != self.ep_loads.device:
            self._stats_probe = self._new_probe(self.ep_loads.device)
        return module
