"""``lrmoe::ep_plan``: ``plan_expert_parallel`` as one opaque op (docs/design.md, "Expert parallelism").

Every rank must compute the same plan, or the split sizes of the all-to-alls disagree and gloo aborts ("Received
data size doesn't match expected size"). Compiled, each rank traces its own graph (its rank is a constant in it),
so Inductor fuses and orders the plan's kernels differently on every rank. On 2 gloo ranks with replicas (torch
2.13), rank 1's kernels read balanced_capacity's index_add_ result (an IndexPutFallback into a zeros buffer)
before the index_add_ ran: the ordering edge in the pre-fusion IR was lost in scheduling. Rank 1 planned with zero
instances per expert, rank 0 planned right. Behind this op the plan runs the same eager kernels on every rank,
compiled or not: the same plan everywhere by construction, not by trusting every rank's compiled code (float64
sums in the placement policy included). It is [W, E]-sized integer work: nothing worth fusing is lost.

The placement policy reaches the op by its registered name (``lrmoe.functional.expert_parallel.
PLACEMENT_POLICIES``), or as its output: ``replicas_WR``, computed by a policy that is not registered before the
op (then in the caller's graph, see ``ExpertParallel``'s ``placement_policy``).

Every device runs the planner itself (no kernel of its own). The op is defined here, not in lrmoe.ops, because its
kernel is this package's planner and imports run one way (lrmoe.ops never imports lrmoe.functional).
"""

from __future__ import annotations

import torch

from lrmoe.functional.expert_parallel import PLACEMENT_POLICIES, ExpertParallelPlan, plan_expert_parallel
from lrmoe.ops._define import define_op

__all__ = ["ep_plan"]


def _fake(loads_WE, replicas_WR, retain, min_retain, policy, max_replicas, capacity_factor, placement, quota_align):
    n_ranks, n_exp = loads_WE.shape
    n_inst = n_exp // n_ranks + max_replicas

    def new(*shape):
        return loads_WE.new_empty(shape, dtype=torch.int64)

    return (new(n_ranks, n_inst), new(n_ranks, n_exp, n_ranks), new(n_ranks, n_ranks, n_inst),
            new(n_ranks, n_ranks, n_inst), new(n_ranks, n_exp), new(n_ranks))


@define_op("lrmoe::ep_plan", fake=_fake)
def ep_plan(
    loads_WE: torch.Tensor, replicas_WR: torch.Tensor | None, retain: float, min_retain: float, policy: str,
    max_replicas: int, capacity_factor: float | None, placement: str, quota_align: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(instances, routes, assignment, instance_quotas, quotas, capacity) of ``plan_expert_parallel`` with the
    placement policy registered as ``placement``, or the placement ``replicas_WR`` when given; capacity is a [W]
    tensor of -1 without ``capacity_factor``. Integers: forward only."""
    placement_policy = PLACEMENT_POLICIES[placement] if replicas_WR is None else (lambda loads, r: replicas_WR)
    plan = plan_expert_parallel(
        loads_WE, retain, min_retain=min_retain, policy=policy, max_replicas=max_replicas,
        capacity_factor=capacity_factor, placement_policy=placement_policy, quota_align=quota_align,
    )
    capacity_W = plan.capacity if plan.capacity is not None else torch.full_like(plan.loads[:, 0], -1)
    return plan.instances, plan.routes, plan.assignment, plan.instance_quotas, plan.quotas, capacity_W


def plan_step(loads_WE: torch.Tensor, replicas_WR: torch.Tensor | None, retain: float, min_retain: float,
              policy: str, max_replicas: int, capacity_factor: float | None, placement: str,
              quota_align: int) -> ExpertParallelPlan:
    """``plan_expert_parallel`` through the op, as an ``ExpertParallelPlan`` (uniform None)."""
    inst, routes, assign, inst_quotas, quotas, capacity = ep_plan(
        loads_WE.long(), replicas_WR, retain, min_retain, policy, max_replicas, capacity_factor, placement,
        quota_align)
    return ExpertParallelPlan(loads=loads_WE.long(), instances=inst, routes=routes, assignment=assign,
                              instance_quotas=inst_quotas, quotas=quotas,
                              capacity=None if capacity_factor is None else capacity)
