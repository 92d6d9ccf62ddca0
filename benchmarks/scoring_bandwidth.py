"""Does the pair-scoring kernel run at memory bandwidth? (GPU, bf16)

    PYTHONPATH=. python3 benchmarks/scoring_bandwidth.py [--tokens 8192] [--top-k 8] [--dims 2048 4096] [--sweep]

Times lrmoe_kernels.scoring.score_pairs_triton (one pass over g) and the pure-PyTorch reference
(lrmoe.ops.scoring.score_pairs_reference) with triton.testing.do_bench (median), counts the bytes each must move
at least (read g [T, D] bf16, gates [T, K] bf16, phi_sq [T, K] fp32; write scores [T, K] fp32), and prints the
achieved bandwidth against a device copy (clone of a 1 GiB tensor, bytes read + written) measured in the same
run as the ceiling. Target: the kernel at >= 80% of the copy. --sweep also times other block sizes (metric lrm).

At the default T = 8192 the gradient is only 32 MiB (D = 2048), about 8 us at copy speed, so launch latency and
ramp-up weigh heavily and short timings vary between runs; --tokens 131072 shows the steady-state streaming rate.
Measured on one H200 (2026-11-29, torch 2.11, triton 3.6, copy 4.23 TB/s): lrm at T = 8192 read 32% (D = 2048)
and 46% (D = 4096) of the copy rate, at T = 131072 84% and 94%; the reference 2-8%.
"""

from __future__ import annotations

import argparse

import torch

from lrmoe.ops._kernels import kernel_module
from lrmoe.ops.scoring import score_pairs_reference

METRICS = ("lrm", "grad_l2", "grad_abs")
SWEEP = [(bt, bd, nw) for bt in (1, 2, 4, 8) for bd in (512, 1024, 2048) for nw in (4, 8) if bt * bd <= 8192]


def copy_bandwidth(do_bench) -> float:
    """Bytes/s of a device-to-device clone of 1 GiB, counting bytes read and written."""
    x = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    ms = do_bench(lambda: x.clone(), warmup=10, rep=100, return_mode="median")
    return 2 * x.numel() / (ms * 1e-3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--dims", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--sweep", action="store_true", help="also time other (BLOCK_T, BLOCK_D, num_warps)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("scoring_bandwidth.py measures a CUDA kernel: no CUDA device is visible here, nothing to do.")
        return

    from triton.testing import do_bench

    kernels = kernel_module("scoring")
    if kernels is None:
        raise SystemExit("Triton is not installed: the scoring kernel cannot run.")
    copy_bps = copy_bandwidth(do_bench)
    T, K = args.tokens, args.top_k
    print(f"# score_pairs, T={T}, K={K}, g and gates bf16, phi_sq fp32, {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}; copy (clone 1 GiB, read + write) {copy_bps / 1e12:.2f} TB/s")
    print(f"{'D':>5} {'metric':>8} {'impl':>22} {'us':>9} {'TB/s':>6} {'of copy':>7}")
    for D in args.dims:
        torch.manual_seed(0)
        gates = torch.rand(T, K, device="cuda", dtype=torch.bfloat16)
        grad = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
        phi = torch.rand(T, K, device="cuda", dtype=torch.float32)
        nbytes = sum(t.numel() * t.element_size() for t in (gates, grad, phi)) + T * K * 4

        def row(metric, impl, fn, rep=200):
            ms = do_bench(fn, warmup=25, rep=rep, return_mode="median")
            bps = nbytes / (ms * 1e-3)
            print(f"{D:>5} {metric:>8} {impl:>22} {ms * 1e3:>9.1f} {bps / 1e12:>6.2f} {bps / copy_bps:>7.0%}")

        for metric in METRICS:
            want = score_pairs_reference(gates, grad, phi, metric)
            got = kernels.score_pairs_triton(gates, grad, phi, metric)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=0)  # never time a wrong kernel
            row(metric, "triton", lambda: kernels.score_pairs_triton(gates, grad, phi, metric))
            row(metric, "reference", lambda: score_pairs_reference(gates, grad, phi, metric))
            if args.sweep and metric == "lrm":  # the metrics move the same bytes: sweep one
                for bt, bd, nw in SWEEP:
                    row(metric, f"triton t{bt} d{bd} w{nw}",
                        lambda: kernels.score_pairs_triton(gates, grad, phi, metric, block_t=bt, block_d=bd,
                                                           num_warps=nw), rep=100)


if __name__ == "__main__":
    main()
