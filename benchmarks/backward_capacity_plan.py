"""What LRMoE's ``backward_capacity`` keeps and pads, by router skew (CPU; plans only, nothing timed).

    python benchmarks/backward_capacity_plan.py
    python benchmarks/backward_capacity_plan.py --tokens 8192 --experts 128 --top-k 8 --skew 0 0.5 1 2

With ``backward_capacity=c`` every expert keeps at most C = ceil(c * floor(retain * P) / E) pairs (rounded up to 8)
and the backward's four GEMMs run as torch.bmm over E blocks of C rows; without it, the plain waterfill plan keeps
the whole budget and the GEMMs run grouped, in 128-row tiles per expert. The router is softmax top-k over logits
N(0, 1) plus a fixed per-expert bias skew * z_e (z_e ~ N(0, 1), seeded: benchmarks/ep_layer.py's --skew); skew 0
is the near-balanced routing the layer benchmarks time. Per skew, retain and c, one row:

* kept / budget: pairs the capped plan keeps, as a share of floor(retain * P) (the plain plan keeps all of it);
* pad: zero rows of the E * C blocks, as a share of E * C (work the batched GEMMs do for nothing);
* rows / plain: E * C against the plain plan's rows rounded up to whole 128-row tiles per expert (the row count
  torch._grouped_mm's tiles cover): below 1, the blocked backward also does less GEMM work.
"""

from __future__ import annotations

import argparse

import torch

from lrmoe.functional.experts import backward_capacity_rows
from lrmoe.functional.quotas import plan_quotas
from lrmoe.functional.routing import expert_loads


def loads_for(tokens: int, experts: int, top_k: int, skew: float, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    bias_E = skew * torch.randn(experts, generator=gen)
    logits_TE = torch.randn(tokens, experts, generator=gen) + bias_E
    return expert_loads(logits_TE.topk(top_k, dim=-1).indices, experts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--skew", type=float, nargs="+", default=[0.0, 0.25, 0.5, 1.0])
    parser.add_argument("--retain", type=float, nargs="+", default=[0.75, 0.5])
    parser.add_argument("--factor", type=float, nargs="+", default=[1.0, 1.25, 1.5])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    T, E, K = args.tokens, args.experts, args.top_k
    print(f"# T={T}, E={E}, k={K}: P={T * K} pairs; plans only")
    print(f"{'skew':>5} {'max/mean load':>13} {'retain':>6} {'c':>5} {'C':>5} {'kept/budget':>11} {'pad':>6} "
          f"{'rows/plain':>10}")
    for skew in args.skew:
        loads_E = loads_for(T, E, K, skew, args.seed)
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
