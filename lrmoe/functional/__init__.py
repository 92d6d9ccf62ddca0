"""Pure functional primitives of lrmoe: tensors in, tensors out, static shapes, no host synchronisation."""

from lrmoe.functional import ep_plan as _ep_plan  # noqa: F401  (registers the op lrmoe::ep_plan)
from lrmoe.functional.expert_parallel import (
    ExpertParallelPlan,
    plan_expert_parallel,
    register_placement_policy,
)
from lrmoe.functional.experts import (
    ExpertPlan,
    backward_capacity_rows,
    plan_experts,
    retained_rows_bound,
    selective_swiglu_experts,
)
from lrmoe.functional.gemm import compact_and_gemm
from lrmoe.functional.options import BackwardOptions, RoutingOptions
from lrmoe.functional.quotas import apportion, plan_quotas
from lrmoe.functional.replicas import (
    balanced_capacity,
    instance_experts,
    place_hot_replicas,
    route_to_replicas,
)
from lrmoe.functional.routing import Routing, expert_loads, route_topk, router_logits
from lrmoe.functional.scoring import score_pairs
from lrmoe.functional.selection import Selection, inclusion_probabilities, select_within_quota

__all__ = [
    "BackwardOptions",
    "ExpertParallelPlan",
    "ExpertPlan",
    "Routing",
    "RoutingOptions",
    "Selection",
    "apportion",
    "backward_capacity_rows",
    "balanced_capacity",
    "compact_and_gemm",
    "expert_loads",
    "inclusion_probabilities",
    "instance_experts",
    "place_hot_replicas",
    "plan_expert_parallel",
    "plan_experts",
    "plan_quotas",
    "register_placement_policy",
    "retained_rows_bound",
    "route_to_replicas",
    "route_topk",
    "router_logits",
    "score_pairs",
    "select_within_quota",
    "selective_swiglu_experts",
]
