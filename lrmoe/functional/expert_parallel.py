"""Expert-parallel planning: pure functions of the all-gathered [W, E] load matrix (docs/design.md, "Expert
parallelism"). No communication here: every rank calls them with the same input and gets the same plan, which
is what lets a source rank select its own pairs in backward before any communication. The collectives are in
lrmoe.nn._transport; the ParallelStyle in lrmoe.nn.expert_parallel; the plan's custom op in lrmoe.functional.ep_plan.

Shapes: W EP ranks, S source ranks (S == W: source s is rank s), E experts, L = E / W owned experts per rank,
R replica slots per rank (``max_replicas``), I = L + R instance slots per rank, G = W * I instances, K top-k,
P local pairs.

Placement policies: ``(loads_WE, max_replicas) -> replicas_WR``. ``plan_expert_parallel`` takes the callable;
``ExpertParallel`` names one registered in ``PLACEMENT_POLICIES`` (``register_placement_policy``), so that the
plan's op, whose arguments are tensors and scalars, can reach it by name.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lrmoe.functional._checks import check_replica_slots, check_tensor
from lrmoe.functional.quotas import plan_quotas
from lrmoe.functional.replicas import balanced_capacity, instance_experts, place_hot_replicas, route_to_replicas
from lrmoe.ops import argsort_ids
from lrmoe.ops._torch_internals import register_dataclass

__all__ = ["PLACEMENT_POLICIES", "ExpertParallelPlan", "ExpertParallelStats", "PlacementPolicy", "backward_capacity",
           "block_rows", "check_placement", "check_replication", "expert_major_order", "instance_slots",
           "pair_destinations", "placement_policy_name", "plan_expert_parallel", "plan_to", "register_placement_policy"]

PlacementPolicy = Callable[[torch.Tensor, int], torch.Tensor]

# The placement policies ExpertParallel can use, by name: the one table of them. "hot" is the default; a user's
# own policy is added with register_placement_policy (once, at import time of their code, as a torch.library op
# is registered); a name always names the same function.
PLACEMENT_POLICIES: dict[str, PlacementPolicy] = {"hot": place_hot_replicas}


def register_placement_policy(name: str, policy: PlacementPolicy) -> str:
    """Register ``policy`` (``(loads_WE, max_replicas) -> replicas_WR``, deterministic) under ``name``, for
    ``ExpertParallel(placement_policy=name)``. Registering the same function again is a no-op; another function
    under a taken name is refused (a name always names the same function). Returns ``name``."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    if not callable(policy):
        raise TypeError(f"policy must be callable (loads_WE, max_replicas) -> replicas_WR, got "
                        f"{type(policy).__name__}")
    if PLACEMENT_POLICIES.setdefault(name, policy) is not policy:
        raise ValueError(f"a placement policy named {name!r} is registered already ({PLACEMENT_POLICIES[name]!r})")
    return name


def placement_policy_name(policy: str | PlacementPolicy) -> str | None:
    """The registered name of ``policy`` (a name, or a registered function), or None for a callable that is not
    registered. A name that is not registered raises ValueError, anything else TypeError."""
    if isinstance(policy, str):
        if policy not in PLACEMENT_POLICIES:
            raise ValueError(f"placement_policy {policy!r} is not registered; registered: {sorted(PLACEMENT_POLICIES)}"
                             " (lrmoe.functional.expert_parallel.register_placement_policy adds one)")
        return policy
    if not callable(policy):
        raise TypeError(f"placement_policy must be a registered name or a callable (loads_WE, max_replicas) -> "
                        f"replicas_WR, got {type(policy).__name__}")
    return next((name for name, fn in PLACEMENT_POLICIES.items() if fn is policy), None)


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


register_dataclass(ExpertParallelPlan)


def check_replication(max_replicas: int, capacity_factor: float | None,
                      placement_policy: str | PlacementPolicy) -> None:
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
    placement_policy_name(placement_policy)  # a registered name or a callable, or an error naming it


def backward_capacity(loads_WE: torch.Tensor, retain: float, capacity_factor: float) -> torch.Tensor:
    """[W] int64, the backward capacity of every rank: ceil(capacity_factor * budget / W), budget =
    floor(retain * total pairs) (plan_quotas' budget), the same on every rank."""
    n_ranks = loads_WE.shape[0]
    budget = (loads_WE.sum().double() * retain).floor()
    cap = (budget * capacity_factor / n_ranks).ceil().long()
    return cap.expand(n_ranks).clone()


def check_placement(replicas_WR, loads_WE: torch.Tensor, max_replicas: int) -> torch.Tensor:
    """A placement policy's output: an integer [W, R] tensor on the loads' device; on the host (``plan_on="host"``,
    where reading it costs no sync) and not traced by a compiler, also its values: expert ids in [-1, E), none a rank's own expert, no expert
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
    if torch.compiler.is_compiling():
        # Traced, the branches on values below are data-dependent control flow: a graph break (an error under
        # fullgraph=True). The compiled layer trusts the policy, as plan_on="device" does; eager checks it.
        return replicas_WR
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
    placement_policy: str | PlacementPolicy = place_hot_replicas,
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
    [0, E - E/W], ``capacity_factor`` neither None nor a finite float >= 1, ``placement_policy`` neither callable
    nor a registered name (``PLACEMENT_POLICIES``), or returning other than an integer [W, max_replicas] tensor on
    the loads' device (on CPU also: ids outside [-1, E), a rank's own expert, an expert twice on one rank); and
    plan_quotas' errors for ``retain``, ``min_retain``, ``policy`` and ``quota_align``.
    """
    check_tensor("loads_WE", loads_WE, ndim=2, kind="int")  # as plan_quotas: float loads would be truncated
    check_replication(max_replicas, capacity_factor, placement_policy)
    n_ranks, n_exp = loads_WE.shape
    if n_ranks < 1 or n_exp < 1 or n_exp % n_ranks:
        raise ValueError(f"loads_WE must be [W, E] with W >= 1 ranks and E experts a positive multiple of W (every "
                         f"rank owns E/W experts), got shape {tuple(loads_WE.shape)}")
    check_replica_slots("max_replicas", max_replicas, n_exp, n_ranks)
    loads_WE = loads_WE.long()
    device = loads_WE.device
    if isinstance(placement_policy, str):
        placement_policy = PLACEMENT_POLICIES[placement_policy]
    if max_replicas > 0:
        replicas_WR = check_placement(placement_policy(loads_WE, max_replicas), loads_WE, max_replicas)
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


def block_rows(rows_I: torch.Tensor) -> torch.Tensor:
    """Rows per block of a rank's blocked backward (``ExpertParallel(backward_blocks=True)``), from its instances'
    retained rows [..., I]: the most any of them keeps, rounded up to whole 8-row steps (as the single-device
    blocks of ``backward_capacity``)."""
    return (rows_I.max(-1).values + 7) // 8 * 8


def plan_to(plan: ExpertParallelPlan, loads_WE: torch.Tensor) -> ExpertParallelPlan:
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
        slots_W = (block_rows(rows_WI) * rows_WI.shape[1]).double()
        return torch.where(slots_W > 0, 1 - rows_WI.sum(1).double() / slots_W.clamp(min=1), 0.0)
