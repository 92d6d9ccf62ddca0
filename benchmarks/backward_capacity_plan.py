"""What LRMoE's ``backward_capacity`` keeps and pads, by router skew (CPU; plans only, nothing timed).

    python benchmarks/backward_capacity_plan.py
    python benchmarks/backward_capacity_plan.py --shape glm-4.5-air --skew 0 0.25 0.5 1 --factor 1 1.25 1.5

With ``backward_capacity=c`` every expert keeps at most C = ceil(c * floor(retain * P) / E) pairs (rounded up to 8)
and the backward's four GEMMs run as torch.bmm over E blocks of C rows; without it, the plain waterfill plan keeps
the whole budget and the GEMMs run grouped, in 128-row tiles per expert. The router is the one
benchmarks/layer_fwd_bwd.py times with ``--skew``: an LRMoE layer's gate as initialised under seed 0, expert e's
logit biased by skew * sigma * z_e (skew_router), bf16, on random tokens (drawn here on the CPU, so the loads
differ from the GPU run's by sampling noise; max / mean load is printed to compare). Per skew, retain and c:

* kept / budget: pairs the capped plan keeps, as a share of floor(retain * P) (the plain plan keeps all of it);
* pad: zero rows of the E * C blocks, as a share of E * C (work the batched GEMMs do for nothing);
* rows / plain: E * C against the plain plan's rows rounded up to whole 128-row tiles per expert (the row count
  torch._grouped_mm's tiles cover): below 1, the blocked backward also does less GEMM work.
"""

from __future__ import annotations

import argparse

import torch
from layer_fwd_bwd import SHAPES, skew_router
from torch import nn

from lrmoe.functional.experts import backward_capacity_rows
from lrmoe.functional.quotas import plan_quotas
from lrmoe.functional.routing import expert_loads


def loads_for(shape: dict, tokens: int, skew: float) -> torch.Tensor:
    """Expert loads of layer_fwd_bwd.py's router (LRMoE creates its gate first, so seed 0 gives the same weights)."""
    torch.manual_seed(0)
    router = nn.Module()
    router.gate = nn.Linear(shape["dim"], shape["num_experts"], bias=False).bfloat16()
    x_TD = torch.randn(tokens, shape["dim"], dtype=torch.bfloat16)
    if skew:
        skew_router(router, skew, seed=0)
        x_TD[:, 0] = 1.0
    with torch.no_grad():
        ids_TK = router.gate(x_TD).float().topk(shape["top_k"], dim=-1).indices
    return expert_loads(ids_TK, shape["num_experts"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--skew", type=float, nargs="+", default=[0.0, 0.25, 0.5, 1.0])
    parser.add_argument("--retain", type=float, nargs="+", default=[0.75, 0.5])
    parser.add_argument("--factor", type=float, nargs="+", default=[1.0, 1.25, 1.5])
    args = parser.parse_args()

    shape = SHAPES[args.shape]
    T, E, K = args.tokens, shape["num_experts"], shape["top_k"]
    print(f"# {args.shape}, T={T}, E={E}, k={K}: P={T * K} pairs; plans only")
    print(f"{'skew':>5} {'max/mean load':>13} {'retain':>6} {'c':>5} {'C':>5} {'kept/budget':>11} {'pad':>6} "
          f"{'rows/plain':>10}")
    for skew in args.skew:
        loads_E = loads_for(shape, T, skew)
        ratio = loads_E.max().item() / loads_E.float().mean().item()
        for retain in args.retain:
            budget = int(retain * T * K)
            plain_E = plan_quotas(loads_E, retain)
            plain_rows = int(((plain_E + 127) // 128 * 128).sum())
            for factor in args.factor:
                cap = backward_capacity_rows(T, K, E, retain, factor)
                kept = int(plan_quotas(loads_E, retain, capacity=torch.full_like(loads_E, cap)).sum())
                print(f"{skew:5.2f} {ratio:13.2f} {retain:6.2f} {factor:5.2f} {cap:5d} {kept / budget:11.3f} "
                      f"{1 - kept / (E * cap):6.3f} {E * cap / plain_rows:10.3f}")


if __name__ == "__main__":
    main()
