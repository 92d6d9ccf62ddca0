"""The per-token row kernels (lrmoe_kernels.token_rows) at MoE shapes: combine / input-gradient sum and router
gradient (GPU, bf16).

    PYTHONPATH=. python3 benchmarks/token_rows.py [--tokens 8192] [--top-k 8] [--dims 2048 4096] [--sweep]

"sum" is gather_sum_rows with weights (the forward's combine: out[t] = sum_k w[t, k] * y[rows[t, k]]), "dot" is
gather_dot_rows (the router gradient: out[t, k] = <g[t], y[rows[t, k]]>), "dot + scores" gather_dot_scores (the
same plus the pairs' "lrm" scores from that pass over g) against "dot, then scores" (gather_dot_rows, then
score_pairs reading g again; bytes counted once for both; neither timing includes joining the two outputs), with y
[T*K, D] in expert order and rows each pair's place there (random top-k routing over 128 experts, pairs sorted by
expert, as the layers lay them out). Prints do_bench medians, the bandwidth over the bytes each must move (y once,
plus out for "sum" and g for "dot"), the ratio to a clone of y timed in the same run (read + write: the reference
for a streaming kernel) and whether the result matches the default launch (allclose, rtol 1e-3: a different tile
sums in another order).
--sweep adds the kernels at other column blocks and warp counts.
Importable on a CPU machine; main() needs CUDA.
"""

from __future__ import annotations

import argparse

import torch

EXPERTS = 128
SWEEP = [(bc, nw) for bc in (256, 512, 1024, 2048) for nw in (2, 4, 8)]


def _flat(out: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
    """One fp32 tensor of a kernel's outputs, for the match check; the timed calls return them as they come (a cat
    inside the timing would add a kernel the layers never run)."""
    return torch.cat([o.float().reshape(-1) for o in (out if isinstance(out, tuple) else (out,))])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--dims", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/token_rows.py needs a CUDA device")

    from lrmoe_kernels.scoring import score_pairs_triton
    from lrmoe_kernels.token_rows import gather_dot_rows_triton, gather_dot_scores_triton, gather_sum_rows_triton
    from triton.testing import do_bench

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
            for blocks in [None] + (SWEEP if args.sweep else []):
                kw = {} if blocks is None else {"block_c": blocks[0], "num_warps": blocks[1]}
                if blocks is not None and blocks[0] > D:
                    continue
                ok = torch.allclose(_flat(fn(**kw)), want, rtol=1e-3, atol=1e-2)
                ms = do_bench(lambda kw=kw: fn(**kw), return_mode="median")
                label = "default" if blocks is None else f"{blocks[0]}, {blocks[1]}"
                print(f"| {name} | {D} | {label} | {ms * 1e3:.1f} | {nbytes / ms / 1e9:.2f} | "
                      f"{nbytes / ms / 1e9 / clone_bw:.2f} | {ok} |")
        print(f"| clone of y | {D} | | {clone_ms * 1e3:.1f} | {clone_bw:.2f} | 1.00 | |")


if __name__ == "__main__":
    main()
