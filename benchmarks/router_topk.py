"""The router's top-k: lrmoe::topk_ids's Triton kernel against torch.topk (GPU).

    PYTHONPATH=. python3 benchmarks/router_topk.py [--shapes 8192x128 8192x256 32768x128] [--top-k 8]

Per shape (T tokens x E experts, fp32 router probabilities): torch.topk, and lrmoe_kernels.routing.topk_ids_triton
with its default rows per program and with 4 / 8 / 16 / 32 rows, each checked against a stable descending sort
(the op's definition). Times in us, medians, by two methods: "graph" (each call on its own copy of the input, the
copies together > 4x the L2, all inside one CUDA graph: benchmarks/scoring_bandwidth.py's graph_ms) and
triton.testing.do_bench (which flushes the L2 before every call and includes the launch's host time for calls this
short). Measured on one H200 in the twelfth session: docs/performance.md.
"""

from __future__ import annotations

import argparse

import torch
from scoring_bandwidth import graph_ms, rotating_copies

from lrmoe.ops._kernels import kernel_module


def main() -> None:
    from triton.testing import do_bench

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["8192x128", "8192x256", "32768x128"])
    parser.add_argument("--top-k", type=int, default=8)
    args = parser.parse_args()
    routing = kernel_module("routing")
    K = args.top_k
    print(f"# router top-k, K={K}, fp32, {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'T':>6} {'E':>4} {'impl':>22} {'us (graph)':>11} {'us (do_bench)':>14} {'same ids':>9}")
    for shape in args.shapes:
        T, E = map(int, shape.split("x"))
        x = torch.randn(T, E, device="cuda").softmax(-1)
        want = torch.sort(x, dim=1, descending=True, stable=True).indices[:, :K]
        rows = {"torch.topk": lambda x: x.topk(K, dim=-1).indices}
        for bt in (None, 4, 8, 16, 32):
            label = "topk_ids (default)" if bt is None else f"topk_ids, {bt} rows"
            rows[label] = lambda x, bt=bt: routing.topk_ids_triton(x, K, block_t=bt)
        sets = rotating_copies((x,))
        for name, fn in rows.items():
            same = torch.equal(fn(x), want)  # torch.topk too: random probabilities have no ties
            ms_graph = graph_ms(fn, sets)
            ms_bench = do_bench(lambda: fn(x), return_mode="median")
            print(f"{T:>6} {E:>4} {name:>22} {ms_graph * 1e3:>11.1f} {ms_bench * 1e3:>14.1f} {str(same):>9}")


if __name__ == "__main__":
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/router_topk.py needs a CUDA device")
    main()
