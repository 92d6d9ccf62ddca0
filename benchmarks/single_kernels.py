"""Single kernels of the layers against PyTorch and against the device's copy bandwidth (GPU, bf16).

    python benchmarks/single_kernels.py scoring [--tokens 8192] [--dims 2048 4096] [--sweep] [--methods do_bench graph]
    python benchmarks/single_kernels.py selection [--pairs 65536] [--groups 128] [--retain 0.75] [--skew 0]
    python benchmarks/single_kernels.py topk [--shapes 8192x128 8192x256 32768x128]
    python benchmarks/single_kernels.py token-rows [--tokens 8192] [--dims 2048 4096] [--sweep]
    python benchmarks/single_kernels.py row-gather [--tokens 8192] [--dims 2048 4096] [--retain 1.0 0.5] [--sweep]

Two timing methods, both medians: "do_bench" (triton.testing.do_bench: each call launched from Python, an L2 flush
before each, so for a kernel of a few microseconds it also measures the launch's host cost) and "graph"
(common.graph_ms: the calls captured in one CUDA graph, on input copies that together pass 4x the L2, so every call
reads HBM; GPU time without the per-launch host cost, as in a step whose host runs ahead). Every Triton result is
checked against its reference before it is timed.

``scoring``: lrmoe_kernels.scoring.score_pairs_triton (one pass over g) and the PyTorch reference, with the bytes
each must move at least (g [T, D] bf16, gates [T, K] bf16, phi_sq [T, K] fp32, scores [T, K] fp32) and the
achieved bandwidth against a 1 GiB device copy measured in the same run (target: >= 80 % of it). --sweep times
other block sizes (metric lrm). At T = 8192 the gradient is only 32 MiB (D = 2048), so launch latency weighs
heavily; --tokens 131072 shows the steady-state rate.

``selection``: select_within_quota, reference against Triton (target: P = 65,536, G = 128, <= 60 us), modes "top"
and "sample": the reference (the op's CPU kernel, on CUDA), the Triton path sorting the group ids itself, and given
the group order, a bound on the group sizes (the layers' token count T = P / --top-k, and the largest group's size)
and the groups' ends, as the layers call it; then the pieces of the Triton path. One call of each runs under
torch.cuda.set_sync_debug_mode("error"): it never synchronises with the host. Inputs: P pairs in G groups (uniform,
or with --skew s a Zipf-like weight (g + 1)^-s), squared-normal scores with a few +inf, quota floor(retain * size).

``topk``: lrmoe::topk_ids's Triton kernel (lrmoe_kernels.routing) with its default rows per program and 4-32 rows,
against torch.topk, on fp32 router probabilities, each checked against a stable descending sort.

``token-rows``: lrmoe_kernels.token_rows (the combine's per-token sum, the router gradient's dot products, and
those with the pair scores) on top-k routing over 128 experts, against a clone of y's bandwidth; --sweep: other
blocks.

``row-gather``: the row gathers around the grouped GEMMs: "x rows" (forward, every routed pair in expert order) and
"dy + x rows" (backward, per retained pair: g[tok] * coef rounded to bf16, and x[tok]), by PyTorch eager, compiled
(Inductor writes both from one kernel) and lrmoe_kernels.offload's row gather (one launch per output), against a
clone of the output's size. --sweep: other blocks.
"""

from __future__ import annotations

import argparse
import math

import torch
from common import copy_bandwidth, graph_ms, lrmoe_kernels, require_cuda, rotating_copies

from lrmoe.ops.scoring import DETERMINISTIC_METRICS, score_pairs_reference
from lrmoe.ops.selection import (
    argsort_ids,
    sample_weights,
    select_within_quota_reference,
    select_within_quota_triton,
)

EXPERTS = 128


# ----------------------------------------------------------------------------------------------------- scoring

SCORING_SWEEP = [(bt, bd, nw) for bt in (1, 2, 4, 8, 16) for bd in (128, 256, 512, 1024, 2048) for nw in (2, 4)
         if 512 <= bt * bd <= 8192]


def scoring(args) -> None:
    from triton.testing import do_bench

    kernels = lrmoe_kernels("scoring")
    copy_bps = copy_bandwidth()
    T, K = args.tokens, args.top_k
    print(f"# score_pairs, T={T}, K={K}, g and gates bf16, phi_sq fp32, {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}; copy (clone 1 GiB, read + write) {copy_bps / 1e12:.2f} TB/s")
    print(f"{'D':>5} {'metric':>8} {'impl':>22} {'method':>8} {'us':>9} {'TB/s':>6} {'of copy':>7}")
    for D in args.dims:
        torch.manual_seed(0)
        gates = torch.rand(T, K, device="cuda", dtype=torch.bfloat16)
        grad = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
        phi = torch.rand(T, K, device="cuda", dtype=torch.float32)
        nbytes = sum(t.numel() * t.element_size() for t in (gates, grad, phi)) + T * K * 4

        sets = rotating_copies((gates, grad, phi)) if "graph" in args.methods else []

        def row(metric, impl, fn, rep=200):
            """fn(gates, grad, phi), timed by each method."""
            for method in args.methods:
                if method == "do_bench":
                    ms = do_bench(lambda: fn(gates, grad, phi), warmup=25, rep=rep, return_mode="median")
                else:
                    try:
                        ms = graph_ms(fn, sets)
                    except RuntimeError as err:  # e.g. an op that cannot be captured: say so, time the rest
                        print(f"{D:>5} {metric:>8} {impl:>22} {method:>8} not captured: {str(err)[:60]}")
                        continue
                bps = nbytes / (ms * 1e-3)
                print(f"{D:>5} {metric:>8} {impl:>22} {method:>8} {ms * 1e3:>9.1f} {bps / 1e12:>6.2f} "
                      f"{bps / copy_bps:>7.0%}")

        if "graph" in args.methods:  # a copy of the same bytes (half read, half written), timed the same way
            src = [(torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda"),) for _ in range(len(sets))]
            ms = graph_ms(torch.clone, src)
            bps = nbytes / (ms * 1e-3)
            print(f"{D:>5} {'-':>8} {'copy, same bytes':>22} {'graph':>8} {ms * 1e3:>9.1f} {bps / 1e12:>6.2f} "
                  f"{bps / copy_bps:>7.0%}")
        for metric in DETERMINISTIC_METRICS:
            want = score_pairs_reference(gates, grad, phi, metric)
            got = kernels.score_pairs_triton(gates, grad, phi, metric)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=0)  # never time a wrong kernel
            row(metric, "triton", lambda a, g, p: kernels.score_pairs_triton(a, g, p, metric))
            row(metric, "reference", lambda a, g, p: score_pairs_reference(a, g, p, metric))
            if args.sweep and metric == "lrm":  # the metrics move the same bytes: sweep one
                for bt, bd, nw in SCORING_SWEEP:
                    def swept(a, g, p, bt=bt, bd=bd, nw=nw):
                        return kernels.score_pairs_triton(a, g, p, metric, block_t=bt, block_d=bd, num_warps=nw)

                    torch.testing.assert_close(swept(gates, grad, phi), want, rtol=1e-4, atol=0)
                    row(metric, f"triton t{bt} d{bd} w{nw}", swept, rep=100)


# --------------------------------------------------------------------------------------------------- selection


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


def selection(args) -> None:
    from triton.testing import do_bench

    kernels = lrmoe_kernels("selection")
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


# -------------------------------------------------------------------------------------------------------- topk


def topk(args) -> None:
    from triton.testing import do_bench

    routing = lrmoe_kernels("routing")
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


# -------------------------------------------------------------------------------------------------- token rows

TOKEN_ROWS_SWEEP = [(bc, nw) for bc in (256, 512, 1024, 2048) for nw in (2, 4, 8)]


def _flat(out: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
    """One fp32 tensor of a kernel's outputs, for the match check; the timed calls return them as they come (a cat
    inside the timing would add a kernel the layers never run)."""
    return torch.cat([o.float().reshape(-1) for o in (out if isinstance(out, tuple) else (out,))])


def token_rows(args) -> None:
    from triton.testing import do_bench

    score_pairs_triton = lrmoe_kernels("scoring").score_pairs_triton
    token_rows_k = lrmoe_kernels("token_rows")
    gather_dot_rows_triton, gather_dot_scores_triton, gather_sum_rows_triton = (
        token_rows_k.gather_dot_rows_triton, token_rows_k.gather_dot_scores_triton, token_rows_k.gather_sum_rows_triton)

    T, K = args.tokens, args.top_k
    gen = torch.Generator(device="cuda").manual_seed(0)
    experts_P = torch.rand(T, EXPERTS, generator=gen, device="cuda").topk(K, dim=1).indices.reshape(-1)
    order_P = torch.argsort(experts_P, stable=True)
    rows_TK = torch.empty_like(order_P).scatter_(0, order_P, torch.arange(T * K, device="cuda")).view(T, K)
    print("| kernel | D | blocks (cols, warps) | us | TB/s | vs clone | matches default |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for D in args.dims:
        y = torch.randn(T * K, D, device="cuda", dtype=torch.bfloat16)
        g = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
        w = torch.rand(T, K, generator=gen, device="cuda").to(torch.bfloat16)
        clone_ms = do_bench(lambda: y.clone(), return_mode="median")
        clone_bw = 2 * y.numel() * 2 / clone_ms / 1e9
        phi_sq = torch.rand(T, K, generator=gen, device="cuda") * 4
        kernels = {"sum": (lambda **kw: gather_sum_rows_triton(y, rows_TK, w, **kw), (T * K + T) * D * 2),
                   "dot": (lambda **kw: gather_dot_rows_triton(y, rows_TK, g, **kw), (T * K + T) * D * 2 + T * K * 4),
                   "dot + scores": (lambda **kw: gather_dot_scores_triton(y, rows_TK, g, w, phi_sq, "lrm", **kw),
                                    (T * K + T) * D * 2 + T * K * (4 + 2 + 4 + 4)),
                   "dot, then scores": (lambda **kw: (gather_dot_rows_triton(y, rows_TK, g, **kw),
                                                      score_pairs_triton(w, g, phi_sq, "lrm")),
                                        (T * K + T) * D * 2 + T * K * (4 + 2 + 4 + 4))}
        for name, (fn, nbytes) in kernels.items():
            want = _flat(fn())
            for blocks in [None] + (TOKEN_ROWS_SWEEP if args.sweep else []):
                kw = {} if blocks is None else {"block_c": blocks[0], "num_warps": blocks[1]}
                if blocks is not None and blocks[0] > D:
                    continue
                ok = torch.allclose(_flat(fn(**kw)), want, rtol=1e-3, atol=1e-2)
                ms = do_bench(lambda kw=kw: fn(**kw), return_mode="median")
                label = "default" if blocks is None else f"{blocks[0]}, {blocks[1]}"
                print(f"| {name} | {D} | {label} | {ms * 1e3:.1f} | {nbytes / ms / 1e9:.2f} | "
                      f"{nbytes / ms / 1e9 / clone_bw:.2f} | {ok} |")
        print(f"| clone of y | {D} | | {clone_ms * 1e3:.1f} | {clone_bw:.2f} | 1.00 | |")


# -------------------------------------------------------------------------------------------------- row gather

ROW_GATHER_SWEEP = [(br, bc, nw) for br in (1, 2, 4, 8, 16) for bc in (256, 512, 1024, 2048) for nw in (4, 8)
         if 1024 <= br * bc <= 16384]


def expert_order_tokens(tokens: int, top_k: int, gen: torch.Generator) -> torch.Tensor:
    """Token of every routed pair, pairs sorted (stably) by expert: random top-k of uniform logits."""
    logits = torch.rand(tokens, EXPERTS, generator=gen, device="cuda")
    experts_P = logits.topk(top_k, dim=1).indices.reshape(-1)
    return torch.argsort(experts_P, stable=True).div(top_k, rounding_mode="floor")


def dy_x_rows(g, x, tok, coef):
    return (g.index_select(0, tok) * coef.unsqueeze(1)).to(g.dtype), x.index_select(0, tok)


def x_rows(x, tok):
    return x.index_select(0, tok)


def row_gather(args) -> None:
    from triton.testing import do_bench

    offload = lrmoe_kernels("offload")
    _blocks, gather_host_rows_triton = offload._blocks, offload.gather_host_rows_triton

    gen = torch.Generator(device="cuda").manual_seed(0)
    compiled_dy_x = torch.compile(dy_x_rows, fullgraph=True, dynamic=False)
    compiled_x = torch.compile(x_rows, fullgraph=True, dynamic=False)
    print("| case | D | rows | method | blocks (R, C, warps) | us | TB/s (2 x out) | vs clone | ok |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for D in args.dims:
        x = torch.randn(args.tokens, D, device="cuda", dtype=torch.bfloat16)
        g = torch.randn(args.tokens, D, device="cuda", dtype=torch.bfloat16)
        tok_all = expert_order_tokens(args.tokens, args.top_k, gen)
        cases = [("x rows", 1.0)] + [("dy + x rows", r) for r in args.retain]
        for case, retain in cases:
            n = round(retain * tok_all.numel())
            keep = torch.randperm(tok_all.numel(), generator=gen, device="cuda")[:n].sort().values
            tok = tok_all.index_select(0, keep)
            coef = torch.rand(n, generator=gen, device="cuda") * 2
            outputs = 1 if case == "x rows" else 2
            out_bytes = outputs * n * D * 2
            clone_src = torch.empty(outputs * n, D, device="cuda", dtype=torch.bfloat16)
            clone_ms = do_bench(lambda: clone_src.clone(), return_mode="median")

            def row(method, fn, blocks="", want=None):
                got = fn()
                ok = "" if want is None else all(torch.equal(a, b) for a, b in zip(got, want))
                ms = do_bench(fn, return_mode="median")
                print(f"| {case} | {D} | {n} | {method} | {blocks} | {ms * 1e3:.1f} | {2 * out_bytes / ms / 1e9:.2f} | "
                      f"{clone_ms / ms:.2f} | {ok} |")
                return got

            if case == "x rows":
                want = row("eager", lambda: (x_rows(x, tok),))
                row("compiled", lambda: (compiled_x(x, tok),), want=want)

                def triton_fn(blocks=None):
                    return lambda: (gather_host_rows_triton(x, tok, blocks=blocks),)
            else:
                want = row("eager", lambda: dy_x_rows(g, x, tok, coef))
                row("compiled", lambda: compiled_dy_x(g, x, tok, coef), want=want)

                def triton_fn(blocks=None):
                    return lambda: (gather_host_rows_triton(g, tok, coef, blocks=blocks),
                                    gather_host_rows_triton(x, tok, blocks=blocks))
            default = _blocks(D, 2)
            row("triton", triton_fn(), f"{default['BLOCK_R']}, {default['BLOCK_C']}, {default['num_warps']}", want)
            if args.sweep:
                for br, bc, nw in ROW_GATHER_SWEEP:
                    if bc > D:
                        continue
                    blocks = {"BLOCK_R": br, "BLOCK_C": bc, "num_warps": nw}
                    row("triton", triton_fn(blocks), f"{br}, {bc}, {nw}", want)
            print(f"| {case} | {D} | {n} | clone of the output size | | {clone_ms * 1e3:.1f} | "
                  f"{2 * out_bytes / clone_ms / 1e9:.2f} | 1.00 | |")


# --------------------------------------------------------------------------------------------------------- CLI


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("scoring", help="the pair-scoring kernel against the copy bandwidth")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--dims", type=int, nargs="+", default=[2048, 4096])
    p.add_argument("--sweep", action="store_true", help="also time other (BLOCK_T, BLOCK_D, num_warps)")
    p = sub.add_parser("selection", help="select_within_quota: reference against Triton, and its pieces")
    p.add_argument("--pairs", type=int, default=65536)
    p.add_argument("--groups", type=int, default=128)
    p.add_argument("--retain", type=float, default=0.75)
    p.add_argument("--skew", type=float, default=0.0)
    p = sub.add_parser("topk", help="the router's top-k kernel against torch.topk")
    p.add_argument("--shapes", nargs="+", default=["8192x128", "8192x256", "32768x128"], help="T x E")
    p = sub.add_parser("token-rows", help="per-token sums and dot products over K gathered rows")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--dims", type=int, nargs="+", default=[2048, 4096])
    p.add_argument("--sweep", action="store_true")
    p = sub.add_parser("row-gather", help="the layers' row gathers: Triton against PyTorch eager and Inductor")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--dims", type=int, nargs="+", default=[2048, 4096])
    p.add_argument("--retain", type=float, nargs="+", default=[1.0, 0.5])
    p.add_argument("--sweep", action="store_true")
    for name, p in sub.choices.items():
        p.add_argument("--top-k", type=int, default=8, help="k of the routing" + (
            " (the layers' group-size bound is T = P / k)" if name == "selection" else ""))
        if name in ("scoring", "selection"):
            p.add_argument("--methods", nargs="+", choices=("do_bench", "graph"), default=["do_bench", "graph"])
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    require_cuda(f"benchmarks/single_kernels.py {args.command}")
    {"scoring": scoring, "selection": selection, "topk": topk, "token-rows": token_rows,
     "row-gather": row_gather}[args.command](args)


if __name__ == "__main__":
    main()
