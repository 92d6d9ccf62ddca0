"""torch.library registrations (namespace ``lrmoe``): schema, fake, autograd, CPU reference, CUDA launch.

One module per group of ops, each op defined from its parts by lrmoe.ops._define.define_op. Importing this package
registers the ops; the functional API calls them, so Dynamo's graph holds one op per kernel. On CUDA, AOTAutograd
then traces the kernel ops into their Triton kernels (and PyTorch ops), which Inductor launches itself
(lrmoe.ops._kernels.inline_when_compiled); on CPU each stays one opaque op (the reference). The expert-parallel
plan's op, lrmoe::ep_plan, is defined in lrmoe.functional.ep_plan (its kernel is the functional planner).
"""

from lrmoe.ops.grouped_gemm import gather_grouped_mm, grouped_outer
from lrmoe.ops.hopper import (
    hopper_available,
    hopper_down,
    hopper_gate_up,
    hopper_rows_backward,
    hopper_token_rows_backward,
)
from lrmoe.ops.offload import gather_host_rows, offload_to_host, offload_wait
from lrmoe.ops.quotas import waterfill
from lrmoe.ops.routing import topk_ids
from lrmoe.ops.rows import gather_scale_rows
from lrmoe.ops.scoring import score_pairs
from lrmoe.ops.selection import argsort_ids, select_within_quota
from lrmoe.ops.swiglu import swiglu, swiglu_backward, swiglu_backward_scaled, swiglu_dot, swiglu_sqnorm
from lrmoe.ops.token_rows import gather_dot_rows, gather_dot_scores, gather_sum_rows

__all__ = [
    "argsort_ids",
    "gather_dot_rows",
    "gather_dot_scores",
    "gather_grouped_mm",
    "gather_host_rows",
    "gather_scale_rows",
    "gather_sum_rows",
    "grouped_outer",
    "hopper_available",
    "hopper_down",
    "hopper_gate_up",
    "hopper_rows_backward",
    "hopper_token_rows_backward",
    "offload_to_host",
    "offload_wait",
    "score_pairs",
    "select_within_quota",
    "swiglu",
    "swiglu_backward",
    "swiglu_backward_scaled",
    "swiglu_dot",
    "swiglu_sqnorm",
    "topk_ids",
    "waterfill",
]
