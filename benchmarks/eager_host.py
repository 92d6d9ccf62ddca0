"""Is the eager LRMoE layer host-bound? Host time per forward+backward step against the step's wall time (GPU).

    PYTHONPATH=. python3 benchmarks/eager_host.py [--shape qwen3-30b-a3b] [--tokens 256 8192] [--retain 1 0.75 0.5]

For each (tokens, retain): the eager layer (bf16, top selection) runs 10 steps with no synchronisation inside the
loop: "host" is the time until the last step's launches are issued, "wall" the time until the GPU has finished
them too (both per step). When host ≈ wall the step waits on the host (Python, dispatch, launches); at a small
token count the GPU work is negligible and host is the layer's pure launch cost. "GPU activities" counts the
kernels and copies of one step (torch.profiler), i.e. the launches the host pays for.

--cpu-table prints, per (tokens, retain), torch.profiler's host-side table over 5 steps: the ops with the most
self CPU time (each lrmoe op's row includes its Python, the launcher's included). --per-call adds where one custom
op's host time goes: host microseconds per call of lrmoe::gather_sum_rows on a tiny problem (256 tokens, K = 8,
C = 2,048, bf16; the GPU work is negligible) through the op, the op with an input that requires grad, its CUDA
kernel function called directly (no dispatcher), the Triton launcher, the bare ``kernel[grid]`` launch, and an
aten index_select and empty for scale (300 calls a round, median of 5 rounds).
"""

from __future__ import annotations

import argparse
import time

import torch
from layer_fwd_bwd import SHAPES

from lrmoe.nn import LRMoE


def make_step(shape: dict, retain: float, tokens: int):
    torch.manual_seed(0)
    layer = LRMoE(**shape, retain=retain, selection="top").cuda().bfloat16()
    x = torch.randn(tokens, shape["dim"], device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def step():
        layer(x).sum().backward()
        x.grad = None
        for p in layer.parameters():
            p.grad = None

    return step


def host_and_wall(step, n: int = 10) -> tuple[float, float]:
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        step()
    host = (time.perf_counter() - start) / n * 1e3
    torch.cuda.synchronize()
    return host, (time.perf_counter() - start) / n * 1e3


def per_call() -> None:
    import triton

    import lrmoe.ops.token_rows as token_rows
    from lrmoe.ops._kernels import kernel_module

    T, K, C = 256, 8, 2048
    src = torch.randn(T * K, C, device="cuda", dtype=torch.bfloat16)
    src_grad = src.clone().requires_grad_()
    rows = torch.randperm(T * K, device="cuda").view(T, K)
    w = torch.rand(T, K, device="cuda", dtype=torch.bfloat16)
    kernels = kernel_module("token_rows")
    block_c = kernels._block_c(C, 2, K, 16384)
    out = torch.empty(T, C, device="cuda", dtype=torch.bfloat16)

    def bare():
        kernels._gather_sum_rows_kernel[(T, triton.cdiv(C, block_c))](
            src, rows, w, out, C, K, src.stride(0), out.stride(0), HAS_W=True, KP=K, BLOCK_C=block_c, num_warps=4)

    cases = {
        "op": lambda: token_rows.gather_sum_rows(src, rows, w),
        "op, src requires grad": lambda: token_rows.gather_sum_rows(src_grad, rows, w),
        "CUDA kernel fn, direct": lambda: token_rows._gather_sum_rows_cuda(src, rows, w),
        "Triton launcher": lambda: kernels.gather_sum_rows_triton(src, rows, w),
        "kernel[grid]": bare,
        "aten index_select": lambda: src.index_select(0, rows.view(-1)),
        "aten empty": lambda: torch.empty(T, C, device="cuda", dtype=torch.bfloat16),
    }
    print(f"{'lrmoe::gather_sum_rows, host us per call':>40}")
    for name, fn in cases.items():
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        rounds = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(300):
                fn()
            rounds.append((time.perf_counter() - start) / 300 * 1e6)
            torch.cuda.synchronize()
        print(f"{name:>40} {sorted(rounds)[2]:8.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 8192])
    parser.add_argument("--retain", type=float, nargs="+", default=[1.0, 0.75, 0.5])
    parser.add_argument("--per-call", action="store_true", help="also one op's host time per call, by layer")
    parser.add_argument("--cpu-table", action="store_true", help="also the ops with the most self CPU time")
    args = parser.parse_args()
    print(f"# eager LRMoE, {args.shape}, bf16, top selection, {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}")
    print(f"{'tokens':>7} {'retain':>6} {'host ms/step':>13} {'wall ms/step':>13} {'GPU activities':>15}")
    for tokens in args.tokens:
        for retain in args.retain:
            step = make_step(SHAPES[args.shape], retain, tokens)
            host, wall = host_and_wall(step)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                step()
                torch.cuda.synchronize()
            launches = sum(e.count for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA)
            print(f"{tokens:>7} {retain:>6g} {host:>13.3f} {wall:>13.3f} {launches:>15}")
            if args.cpu_table:
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                    for _ in range(5):
                        step()
                    torch.cuda.synchronize()
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30,
                                                max_name_column_width=50))
    if args.per_call:
        per_call()


if __name__ == "__main__":
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/eager_host.py needs a CUDA device")
    main()
