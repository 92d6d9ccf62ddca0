"""Does the pair-scoring kernel run at memory bandwidth? (GPU, bf16)

    PYTHONPATH=. python3 benchmarks/scoring_bandwidth.py [--tokens 8192] [--top-k 8] [--dims 2048 4096] [--sweep]
        [--methods do_bench graph]

Times lrmoe_kernels.scoring.score_pairs_triton (one pass over g) and the pure-PyTorch reference
(lrmoe.ops.scoring.score_pairs_reference), counts the bytes each must move at least (read g [T, D] bf16, gates
[T, K] bf16, phi_sq [T, K] fp32; write scores [T, K] fp32), and prints the achieved bandwidth against a device copy
(clone of a 1 GiB tensor, bytes read + written, do_bench) measured in the same run as the ceiling. Target: the
kernel at >= 80% of the copy. --sweep also times other block sizes (metric lrm), each checked against the
reference first.

Two timing methods, both medians, both reading g from HBM (not L2):
- do_bench: triton.testing.do_bench, which writes a 256 MB buffer before every call to flush the L2. For a kernel
  of a few microseconds that flush is not neutral: the same kernel timed 19.4 us this way and 13.4 us by the graph
  method (H200, T = 8192, D = 2048). A likely cause, not verified: the flush leaves the L2 full of dirty lines,
  written back to HBM while the kernel reads.
- graph: the call made on each of several copies of the inputs in turn (together > 4x the L2, so every call reads
  its g from HBM, and the L2 holds only clean lines and small outputs), all captured in one CUDA graph and replayed;
  time per call = replay time / calls, which also leaves out the per-launch CPU cost, as in a training step where
  the CPU runs ahead. The row "copy, same bytes" times a clone moving the kernel's bytes the same way, for scale.

At the default T = 8192 the gradient is only 32 MiB (D = 2048), about 8 us at copy speed, so launch latency and
ramp-up weigh heavily; --tokens 131072 shows the steady-state streaming rate. Measured on one H200 (2026-11-29,
torch 2.11, triton 3.6, copy 4.25 TB/s, graph method, docs/performance.md "Ninth GPU session"): lrm at T = 8192
read 76 % (D = 2048) and 83 % (D = 4096) of the copy rate, at T = 131072 99 % and 101 %; a copy of the scoring's
bytes 89-90 % at T = 8192; the reference 5-8 %.
"""

from __future__ import annotations

import argparse

import torch

from lrmoe.ops._kernels import kernel_module
from lrmoe.ops.scoring import score_pairs_reference

METRICS = ("lrm", "grad_l2", "grad_abs")
SWEEP = [(bt, bd, nw) for bt in (1, 2, 4, 8, 16) for bd in (128, 256, 512, 1024, 2048) for nw in (2, 4)
         if 512 <= bt * bd <= 8192]


def graph_ms(fn, inputs: list[tuple], replays: int = 20) -> float:
    """Median ms per call of fn(*inputs[i]), called on each input set in turn inside one CUDA graph (see the
    module docstring): replays of the graph, each timed with CUDA events, divided by the calls per replay."""
    calls = 5
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (compiles, allocator) outside the capture
        for args in inputs:
            fn(*args)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            for args in inputs:
                fn(*args)
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / (calls * len(inputs)))
    return sorted(times)[len(times) // 2]


def rotating_copies(tensors: tuple[torch.Tensor, ...]) -> list[tuple[torch.Tensor, ...]]:
    """Copies of ``tensors`` whose bytes together pass 4x the L2 (at least two sets)."""
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    n = max(2, -(-4 * l2 // nbytes))
    return [tuple(t.clone() for t in tensors) for _ in range(n)]


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
    parser.add_argument("--methods", nargs="+", choices=("do_bench", "graph"), default=["do_bench", "graph"])
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
        for metric in METRICS:
            want = score_pairs_reference(gates, grad, phi, metric)
            got = kernels.score_pairs_triton(gates, grad, phi, metric)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=0)  # never time a wrong kernel
            row(metric, "triton", lambda a, g, p: kernels.score_pairs_triton(a, g, p, metric))
            row(metric, "reference", lambda a, g, p: score_pairs_reference(a, g, p, metric))
            if args.sweep and metric == "lrm":  # the metrics move the same bytes: sweep one
                for bt, bd, nw in SWEEP:
                    def swept(a, g, p, bt=bt, bd=bd, nw=nw):
                        return kernels.score_pairs_triton(a, g, p, metric, block_t=bt, block_d=bd, num_warps=nw)

                    torch.testing.assert_close(swept(gates, grad, phi), want, rtol=1e-4, atol=0)
                    row(metric, f"triton t{bt} d{bd} w{nw}", swept, rep=100)


if __name__ == "__main__":
    main()
