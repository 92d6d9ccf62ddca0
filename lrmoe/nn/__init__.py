"""Modules and parallel styles: the only place with module state, collectives and DTensor."""

from lrmoe.nn.clip import clip_grad_norm_
from lrmoe.nn.expert_parallel import ExpertParallel, ExpertParallelPlan, ExpertParallelStats, plan_expert_parallel
from lrmoe.nn.lrmoe import LRMoE, LRMoEStats, SwiGLUExperts, SwiGLUMLP
from lrmoe.nn.swap import from_transformers, replace_moe_blocks, swap_experts

__all__ = [
    "ExpertParallel",
    "ExpertParallelPlan",
    "ExpertParallelStats",
    "LRMoE",
    "LRMoEStats",
    "SwiGLUExperts",
    "SwiGLUMLP",
    "clip_grad_norm_",
    "from_transformers",
    "plan_expert_parallel",
    "replace_moe_blocks",
    "swap_experts",
]
