"""Row gathers that feed torch._grouped_mm: the Triton row-gather kernel against PyTorch eager and Inductor (GPU).

    PYTHONPATH=. python3 benchmarks/row_gather.py [--tokens 8192] [--dims 2048 4096] [--retain 1.0 0.5] [--sweep]

The layers run two row gathers around the grouped GEMMs (the profile in docs/performance.md):
- "x rows" (forward): x_rows[i] = x[tok[i]] for every routed pair, in expert order (P = T * K rows);
- "dy + x rows" (backward, per retained pair): dy[i] = (g[tok[i]] * coef[i]) in fp32, rounded to bf16 (coef =
  gate / selection weight), and x_rows[i] = x[tok[i]] for the gate/up weight gradient. Compiled, Inductor writes
  both from one kernel; lrmoe_kernels.offload's row gather (lrmoe::gather_scale_rows) writes one per launch.

Rows: random top-k routing over 128 experts, pairs sorted by expert (as the dispatch orders them), the retained
subset a random draw of round(retain * P) of them kept in that order. Methods: "eager" (index_select, product,
cast), "compiled" (the same function under torch.compile, one Inductor kernel per case), "triton" (the Triton
kernel with its default blocks; one launch per output). --sweep adds the Triton kernel at other blocks.
Prints the median time (triton.testing.do_bench), the bandwidth counting each output row read once and written
once (2 x output bytes: what a copy of the output would move), and the ratio to a clone of a tensor of the output's
size timed in the same run. The source (32 MiB at T = 8192, D = 2048) fits in the L2 and each token's row is read K
times, so a gather can pass the copy's rate.
Importable on a CPU machine; main() needs CUDA.
"""

from __future__ import annotations

import argparse

import torch

EXPERTS, TOP_K = 128, 8
SWEEP = [(br, bc, nw) for br in (1, 2, 4, 8, 16) for bc in (256, 512, 1024, 2048) for nw in (4, 8)
         if 1024 <= br * bc <= 16384]


def expert_order_tokens(tokens: int, gen: torch.Generator) -> torch.Tensor:
    """Token of every routed pair, pairs sorted (stably) by expert: random top-k of uniform logits."""
    logits = torch.rand(tokens, EXPERTS, generator=gen, device="cuda")
    experts_P = logits.topk(TOP_K, dim=1).indices.reshape(-1)
    return torch.argsort(experts_P, stable=True).div(TOP_K, rounding_mode="floor")


def dy_x_rows(g, x, tok, coef):
    return (g.index_select(0, tok) * coef.unsqueeze(1)).to(g.dtype), x.index_select(0, tok)


def x_rows(x, tok):
    return x.index_select(0, tok)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--dims", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--retain", type=float, nargs="+", default=[1.0, 0.5])
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/row_gather.py needs a CUDA device")

    from lrmoe_kernels.offload import _blocks, gather_host_rows_triton
    from triton.testing import do_bench

    gen = torch.Generator(device="cuda").manual_seed(0)
    compiled_dy_x = torch.compile(dy_x_rows, fullgraph=True, dynamic=False)
    compiled_x = torch.compile(x_rows, fullgraph=True, dynamic=False)
    print("| case | D | rows | method | blocks (R, C, warps) | us | TB/s (2 x out) | vs clone | ok |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for D in args.dims:
        x = torch.randn(args.tokens, D, device="cuda", dtype=torch.bfloat16)
        g = torch.randn(args.tokens, D, device="cuda", dtype=torch.bfloat16)
        tok_all = expert_order_tokens(args.tokens, gen)
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
                for br, bc, nw in SWEEP:
                    if bc > D:
                        continue
                    blocks = {"BLOCK_R": br, "BLOCK_C": bc, "num_warps": nw}
                    row("triton", triton_fn(blocks), f"{br}, {bc}, {nw}", want)
            print(f"| {case} | {D} | {n} | clone of the output size | | {clone_ms * 1e3:.1f} | "
                  f"{2 * out_bytes / clone_ms / 1e9:.2f} | 1.00 | |")


if __name__ == "__main__":
    main()
