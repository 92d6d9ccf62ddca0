"""Quota planning's water-filling in one program (the kernel behind ``lrmoe::waterfill``).

Shapes: G groups (experts or expert instances), all held by one program.

kept(lambda) = sum_g clamp(lambda, floor_g, load_g) is non-decreasing in the integer level lambda, so the largest
lambda in [0, max load] with kept(lambda) <= budget is found by bisection (at most 64 rounds of one reduction over
the groups); then every group gets clamp(lambda, floor, load), and the first groups still growing at lambda
(floor <= lambda < load, in group order, a cumulative sum) one more each until the budget is met. Where the floors
alone exceed the budget lambda stays 0 and every group keeps its floor. Integer arithmetic throughout: the same
quotas as lrmoe.ops.quotas.waterfill_reference, exactly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import known_empty, launch

__all__ = ["MAX_GROUPS", "waterfill_triton"]

# More groups go to the reference: one program holds every group's load, floor and quota.
MAX_GROUPS = 4096


@triton.jit
def _waterfill_kernel(loads_ptr, floors_ptr, budget_ptr, quotas_ptr, G, BLOCK_G: tl.constexpr):
    g_G = tl.arange(0, BLOCK_G)
    ok_G = g_G < G
    load_G = tl.load(loads_ptr + g_G, mask=ok_G, other=0)  # padding groups: load = floor = 0, keep nothing
    floor_G = tl.load(floors_ptr + g_G, mask=ok_G, other=0)
    budget = tl.load(budget_ptr)
    hi = tl.max(load_G, axis=0)
    lo = hi * 0
    while lo < hi:  # invariant: kept(lo) <= budget or lo == 0; the answer is in [lo, hi]
        mid = (lo + hi + 1) // 2
        fits = tl.sum(tl.minimum(tl.maximum(floor_G, mid), load_G), axis=0) <= budget
        lo = tl.where(fits, mid, lo)
        hi = tl.where(fits, hi, mid - 1)
    quota_G = tl.minimum(tl.maximum(floor_G, lo), load_G)
    short = budget - tl.sum(quota_G, axis=0)  # fewer than the groups growing at lo, by lo's maximality
    growing_G = ok_G & (floor_G <= lo) & (lo < load_G)
    rank_G = tl.cumsum(growing_G.to(tl.int64), axis=0) - 1
    quota_G += (growing_G & (rank_G < short)).to(tl.int64)
    tl.store(quotas_ptr + g_G, quota_G, mask=ok_G)


def waterfill_triton(loads_G: torch.Tensor, floors_G: torch.Tensor, budget: torch.Tensor) -> torch.Tensor:
    """int64 quotas_G (lrmoe::waterfill): loads, floors int64 [G] with 0 <= floor <= load, budget one int64 value,
    G <= MAX_GROUPS (checked by the caller). No host sync."""
    G = loads_G.shape[0]
    loads_G, floors_G = loads_G.contiguous(), floors_G.contiguous()  # read as flat arrays
    quotas_G = torch.empty_like(loads_G)
    if known_empty(G):
        return quotas_G
    block_g = triton.next_power_of_2(G)
    launch(_waterfill_kernel, (1,))(
        loads_G, floors_G, budget, quotas_G, G, BLOCK_G=block_g, num_warps=4 if block_g <= 1024 else 8
    )
    return quotas_G
