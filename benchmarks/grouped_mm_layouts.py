"""Does torch._grouped_mm's speed depend on its operands' layouts, and how far is it from a dense GEMM? (GPU, bf16)

    python benchmarks/grouped_mm_layouts.py [--model qwen3|glm] [--rows-per-group 512 384 256] [--rounds 3]

The layers run six grouped GEMMs per step (E experts, groups of rows, fp32 accumulation, bf16 out):
    forward   gate/up  x[M, d]  @ W_gu[e]^T -> [M, 2f]      down  phi[M, f] @ W_d[e]^T -> [M, d]
    input gradient     dh[M, 2f] @ W_gu[e]  -> [M, d]        dy[M, d] @ W_d[e]     -> [M, f]
    weight gradient    dh^T @ x  -> [E, 2f, d]               dy^T @ phi -> [E, d, f]
The weights are stored [E, out, in] (nn.Linear's layout), so the forward's B operand is a transposed ("col")
view and the input gradient's is row-major ("row"). This prints, per GEMM and group size, the time of
torch._grouped_mm with B in either layout (and for the weight gradient with A^T a view or contiguous, and the
output computed transposed), next to torch.bmm on the same equal groups and one dense torch.mm of the same FLOP:
what a different weight layout or a padded batched GEMM could gain. Equal groups of --rows-per-group rows per
expert (512 ~ retain 1 at 8,192 tokens, top-8 of 128; 384 and 256 ~ retain 0.75 and 0.5, where the waterfill
quotas make the groups equal); "jitter" rows give the retain-1 groups their random spread (+-22 rows).
The first row of each GEMM is the layers' layout; "vs first" is its time over the row's (> 1: faster).
Medians of triton.testing.do_bench, then the median over --rounds rounds that time every row of a GEMM in turn.
"""

from __future__ import annotations

import argparse
import statistics

import torch

MODELS = {"qwen3": (2048, 768), "glm": (4096, 1408)}  # (d, f)
EXPERTS = 128


def offsets(sizes: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(sizes, 0).to(device="cuda", dtype=torch.int32)


def col_major(t: torch.Tensor) -> torch.Tensor:
    """The same values with the last two dims stored transposed (a transposed view of a contiguous copy)."""
    return t.transpose(-2, -1).contiguous().transpose(-2, -1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="qwen3")
    parser.add_argument("--rows-per-group", type=int, nargs="+", default=[512, 384, 256])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("grouped_mm_layouts.py times CUDA GEMMs: no CUDA device is visible here, nothing to do.")
        return
    from triton.testing import do_bench

    d, f = MODELS[args.model]
    E = EXPERTS
    gen = torch.Generator().manual_seed(0)
    print(f"# torch._grouped_mm operand layouts, {args.model} d={d} f={f} E={E}, bf16, "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'gemm':>14} {'rows/grp':>9} {'variant':>28} {'ms':>8} {'TFLOP/s':>8} {'vs first':>8}")
    for m in args.rows_per_group:
        for jitter in ((False, True) if m == 512 else (False,)):
            sizes = torch.full((E,), m, dtype=torch.long)
            if jitter:
                sizes = sizes + torch.randint(-22, 23, (E,), generator=gen)
                sizes[-1] += -int(sizes.sum()) % 8  # a total row count divisible by 8: 16-byte strides for B^T
            offs = offsets(sizes)
            M = int(sizes.sum())
            label = f"{m}{'~' if jitter else ''}"
            # (name, K, N): the forward and input-gradient GEMMs as [M, K] @ B[e] -> [M, N]
            for name, K, N in (("fwd gate/up", d, 2 * f), ("fwd down", f, d), ("dgrad gate/up", 2 * f, d),
                               ("dgrad down", d, f)):
                a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
                b_row = torch.randn(E, K, N, device="cuda", dtype=torch.bfloat16)
                b_col = col_major(b_row)
                row = ("B row-major", lambda: torch._grouped_mm(a, b_row, offs=offs))
                col = ("B col-major", lambda: torch._grouped_mm(a, b_col, offs=offs))
                cases = [col, row] if name.startswith("fwd") else [row, col]  # the layers' layout first
                cases += [
                          ("dense mm, same FLOP", lambda: a @ b_row[0])]
                if not jitter:
                    a3 = a.view(E, m, K)
                    cases += [("bmm, B row-major", lambda: torch.bmm(a3, b_row)),
                              ("bmm, B col-major", lambda: torch.bmm(a3, b_col))]
                run_cases(name, label, cases, 2 * M * K * N, args.rounds, do_bench)
            # weight gradients: out[e] = A[e rows]^T @ B[e rows], A [M, P], B [M, Q] -> [E, P, Q]
            for name, P, Q in (("wgrad gate/up", 2 * f, d), ("wgrad down", d, f)):
                a = torch.randn(M, P, device="cuda", dtype=torch.bfloat16)
                b = torch.randn(M, Q, device="cuda", dtype=torch.bfloat16)
                a_t = a.t().contiguous()
                b_cm = col_major(b)
                cases = [("A^T view, B row", lambda: torch._grouped_mm(a.t(), b, offs=offs)),
                         ("A^T view, B col", lambda: torch._grouped_mm(a.t(), b_cm, offs=offs)),
                         ("out^T = B^T A", lambda: torch._grouped_mm(b.t(), a, offs=offs)),
                         ("dense mm, same FLOP", lambda: a_t[:, : M // E * E] @ b[: M // E * E])]
                if not jitter:  # a row-major A^T needs every group's row count a multiple of 8 (16 bytes):
                    # _grouped_mm asserts on the device otherwise (seen on the H200)
                    cases.insert(1, ("A^T contiguous, B row", lambda: torch._grouped_mm(a_t, b, offs=offs)))
                    cases += [("bmm (A^T view)", lambda: torch.bmm(a.view(E, m, P).transpose(1, 2),
                                                                    b.view(E, m, Q)))]
                run_cases(name, label, cases, 2 * M * P * Q, args.rounds, do_bench)


def run_cases(name, label, cases, flop, rounds, do_bench) -> None:
    times = {case: [] for case, _ in cases}
    for _ in range(rounds):
        for case, fn in cases:
            times[case].append(do_bench(fn, warmup=10, rep=40, return_mode="median"))
    first = None
    for case, _ in cases:
        ms = statistics.median(times[case])
        first = first or ms
        print(f"{name:>14} {label:>9} {case:>28} {ms:>8.4f} {flop / ms / 1e9:>8.0f} {first / ms:>8.2f}")


if __name__ == "__main__":
    main()
