"""How fast is select_within_quota on the GPU, reference against Triton? (target: P = 65,536, G = 128, <= 60 us)

    PYTHONPATH=. python3 benchmarks/selection.py [--pairs 65536] [--groups 128] [--retain 0.75] [--skew 0]
        [--methods do_bench graph]

Times (medians, us) for modes "top" and "sample", two ways: "do_bench" (triton.testing.do_bench: each call
launched from Python, an L2 flush before each) and "graph" (calls captured in one CUDA graph and replayed,
benchmarks/scoring_bandwidth.py's graph_ms: GPU time without the per-launch host cost, which a step whose host
runs ahead of the GPU does not wait for; the inputs stay in L2, as in the layer, where the scores were just
written; the reference synchronises, so it is not captured). The same "top, order given" row timed 54.8 us
(eighth session) and 80.0 us (eleventh) by do_bench with kernels whose sm_90 code has the same registers: at
this scale do_bench measures the host's launch cost too. Rows:
- reference: lrmoe.ops.selection.select_within_quota_reference (pure PyTorch, the op's CPU kernel) on CUDA;
- triton: lrmoe.ops.selection.select_within_quota_triton (the op's CUDA kernel), sorting the group ids itself;
- triton, order given: the same given the group order (the stable argsort of the group ids), as the MoE layers
  call it (they have that order from their forward dispatch); for "sample" also with a bound on the group sizes,
  which sorts each group in registers instead of all pairs at once: the layers' bound, their token count
  T = P / --top-k (each token picks an expert at most once), and, in a row of its own, the largest group's size
  (tighter than any caller knows without a host read); and with the groups' ends (the single-device layer passes
  its GEMM offsets), which the plan reads instead of searching. "order + bound + ends" is the layers' call;
- and the pieces of the Triton path: the group order (an int32 sort), the one-program plan ("sample"; "top"
  plans inside its one kernel), for "top" that kernel (plan + threshold + write); for "sample" keys + torch.sort
  (lrmoe_kernels.selection.score_order) and its per-group probabilities kernel.
Before timing, each Triton result must equal the reference exactly, and one call runs under
torch.cuda.set_sync_debug_mode("error") to show that it never synchronises with the host.

Inputs: P pairs in G groups (uniform group ids, or with --skew s > 0 a Zipf-like skew: weight of group g is
(g + 1)^-s), fp32 scores (squared normals, a few +inf), quota floor(retain * group size) per group, buffer
max_rows = ceil(retain * P) + G. Importable on a machine without CUDA; main() then says so and returns.
"""

from __future__ import annotations

import argparse
import math

import torch
from scoring_bandwidth import graph_ms

from lrmoe.ops._kernels import kernel_module
from lrmoe.ops.selection import (
    argsort_ids,
    sample_weights,
    select_within_quota_reference,
    select_within_quota_triton,
)


def make_inputs(P: int, G: int, retain: float, skew: float, device: str = "cuda", seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    if skew > 0:
        w = torch.arange(1, G + 1, dtype=torch.float64) ** -skew
        gids = torch.multinomial(w, P, replacement=True, generator=gen)
    else:
        gids = torch.randint(0, G, (P,), generator=gen)
    scores = torch.randn(P, generator=gen).square()
    scores[torch.randint(0, P, (max(1, P // 1000),), generator=gen)] = float("inf")
    sizes = torch.bincount(gids, minlength=G)
    quotas = torch.floor(retain * sizes.double()).long()
    uniform = torch.rand(G, generator=gen, dtype=torch.float64)
    max_rows = math.ceil(retain * P) + G
    return scores.to(device), gids.to(device), quotas.to(device), max_rows, uniform.to(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=65536)
    parser.add_argument("--groups", type=int, default=128)
    parser.add_argument("--retain", type=float, default=0.75)
    parser.add_argument("--skew", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=8,
                        help="k of the layers' routing: the group-size bound they pass is T = P / k")
    parser.add_argument("--methods", nargs="+", choices=("do_bench", "graph"), default=["do_bench", "graph"])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("selection.py measures CUDA kernels: no CUDA device is visible here, nothing to do.")
        return
    from triton.testing import do_bench

    kernels = kernel_module("selection")
    if kernels is None:
        raise SystemExit("Triton is not installed: the selection kernels cannot run.")
    P, G = args.pairs, args.groups
    scores, gids, quotas, R, uniform = make_inputs(P, G, args.retain, args.skew)
    print(f"# select_within_quota, P={P}, G={G}, retain={args.retain}, skew={args.skew}, R={R}, "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'mode':>7} {'impl':>26} " + " ".join(f"{'us (' + m + ')':>14}" for m in args.methods))

    def row(mode, impl, fn, capturable=True):
        cells = []
        for method in args.methods:
            if method == "do_bench":
                ms = do_bench(fn, warmup=25, rep=200, return_mode="median")
            else:
                ms = graph_ms(fn, [()]) if capturable else float("nan")
            cells.append(f"{ms * 1e3:>14.1f}")
        print(f"{mode:>7} {impl:>26} " + " ".join(cells))

    order = argsort_ids(gids)
    biggest = int(torch.bincount(gids).max())  # the largest group (a host read: fine in a benchmark)
    bound = max(P // args.top_k, biggest)  # the layers': their token count (no group exceeds it there)
    ends = torch.bincount(gids, minlength=G).cumsum(0).int()  # the groups' ends, as the layer's GEMM offsets
    for mode in ("top", "sample"):
        want = select_within_quota_reference(scores, gids, quotas, R, mode, uniform)
        for given, given_bound, given_ends in ((None, None, None), (order, None, None), (order, bound, None),
                                               (order, None, ends), (order, bound, ends), (order, biggest, ends)):
            got = select_within_quota_triton(scores, gids, quotas, R, mode, uniform, given, given_bound, given_ends)
            for name, w, g in zip(("pair_ids", "weights", "counts", "offsets"), want, got):
                if not torch.equal(w, g):  # never time a wrong kernel
                    raise SystemExit(f"{mode}: Triton {name} differs from the reference (order given: "
                                     f"{given is not None}, ends given: {given_ends is not None})")
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                select_within_quota_triton(scores, gids, quotas, R, mode, uniform, given, given_bound, given_ends)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        row(mode, "reference", lambda: select_within_quota_reference(scores, gids, quotas, R, mode, uniform),
            capturable=False)
        row(mode, "triton", lambda: select_within_quota_triton(scores, gids, quotas, R, mode, uniform))
        row(mode, "triton, order given",
            lambda: select_within_quota_triton(scores, gids, quotas, R, mode, uniform, order))
        row(mode, "triton, order + ends",
            lambda: select_within_quota_triton(scores, gids, quotas, R, mode, uniform, order, None, ends))
        if mode == "sample" and bound <= kernels.SORT_MAX:  # the layers also pass a bound on the group sizes
            row(mode, "triton, order + size bound",
                lambda: select_within_quota_triton(scores, gids, quotas, R, mode, uniform, order, bound))
            row(mode, "triton, order + bound + ends",
                lambda: select_within_quota_triton(scores, gids, quotas, R, mode, uniform, order, bound, ends))
            row(mode, "the same, tight bound",
                lambda: select_within_quota_triton(scores, gids, quotas, R, mode, uniform, order, biggest, ends))

    row("both", "  group order (int32 sort)", lambda: argsort_ids(gids))
    row("sample", "  plan (1 program)", lambda: kernels.plan_groups(gids, order, quotas, R))
    row("sample", "  plan from the ends", lambda: kernels.plan_groups(gids, order, quotas, R, ends))
    row("top", "  plan + threshold + write", lambda: kernels.select_top(scores, gids, order, quotas, R))
    row("top", "  the same from the ends", lambda: kernels.select_top(scores, gids, order, quotas, R, ends))
    # The "sample" path's score order and its probabilities kernel (one program per group).
    by_score_P, _, _ = kernels.score_order(scores, gids, 0)
    s_plan = kernels.plan_groups(gids, by_score_P, quotas, R)
    row("sample", "  keys + torch.sort (int64)", lambda: kernels.score_order(scores, gids, 0))
    w_P = sample_weights(scores)
    row("sample", "  probabilities (program/group)", lambda: kernels.sample_probabilities(w_P, by_score_P, s_plan))


if __name__ == "__main__":
    main()
