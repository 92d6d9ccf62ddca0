"""Where the LRMoE layer's forward+backward time goes on one GPU (bf16): torch.profiler, top kernels by GPU time.

    python benchmarks/profile_layer.py --shape qwen3-30b-a3b --retain 0.75 [--compiled] [--forward-only]
        [--quota-align 128] [--gather-gemm triton] [--backward-capacity 1.0] [--skew 0.5]

Prints the wall time per step (unprofiled) next to the GPU time, so a host-bound step shows as a gap, then one
table per run: the operators (eager) or generated kernels (--compiled) with the largest self GPU time
over --steps forward+backward steps, as a share of the total, so the next kernel to fuse or speed up is the one
at the top.
"""

from __future__ import annotations

import argparse
import time

import torch
from layer_fwd_bwd import SHAPES, skew_router
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

import lrmoe.ops.grouped_gemm as grouped_gemm_module
from lrmoe.nn import LRMoE


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--retain", type=float, default=0.75)
    parser.add_argument("--selection", default="sample")
    parser.add_argument("--compiled", action="store_true")
    parser.add_argument("--forward-only", action="store_true", help="profile forward under no_grad")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--quota-align", type=int, default=1, help="LRMoE's quota_align")
    parser.add_argument("--backward-capacity", type=float, default=None, help="LRMoE's backward_capacity")
    parser.add_argument("--skew", type=float, default=0.0,
                        help="router skew (layer_fwd_bwd.skew_router; 0: the near-balanced loads of random weights)")
    parser.add_argument("--gather-gemm", default=None, choices=["grouped_mm", "triton"],
                        help="the kernel of the bf16 GEMMs with a row gather (lrmoe.ops.grouped_gemm._GATHER_KERNEL); "
                             "default: the library's")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/profile_layer.py needs a CUDA GPU")

    if args.gather_gemm is not None:
        grouped_gemm_module._GATHER_KERNEL = args.gather_gemm
    shape = SHAPES[args.shape]
    torch.manual_seed(0)
    layer = LRMoE(**shape, retain=args.retain, selection=args.selection,
                  quota_align=args.quota_align, backward_capacity=args.backward_capacity).cuda().bfloat16()
    fn = torch.compile(layer, fullgraph=True) if args.compiled else layer
    x = torch.randn(args.tokens, shape["dim"], device="cuda", dtype=torch.bfloat16)
    if args.skew:
        skew_router(layer, args.skew, seed=0)
        x[:, 0] = 1.0  # the router-skew feature
    x.requires_grad_()
    grad_out = torch.randn_like(x)  # as layer_fwd_bwd.py: not .sum()'s all-ones, stride-0 gradient

    def step():
        if args.forward_only:
            with torch.no_grad():
                fn(x)
            return
        fn(x).backward(grad_out)
        x.grad = None
        for p in layer.parameters():
            p.grad = None

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - start) / args.steps * 1e3
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
    averages = prof.key_averages()
    events = [e for e in averages if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0]  # kernels
    total = sum(e.self_device_time_total for e in events)
    mode = (("compiled" if args.compiled else "eager") + (", forward only" if args.forward_only else "")
            + f", gathered GEMMs: {grouped_gemm_module._GATHER_KERNEL}")
    print(f"# {args.shape}, tokens={args.tokens}, retain={args.retain:g}, skew={args.skew:g}, {mode}: "
          f"{total / args.steps / 1e3:.3f} ms GPU time per step, {wall_ms:.3f} ms wall per step (unprofiled)")
    print(f"{'share':>6} {'ms/step':>8} {'calls/step':>10}  kernel")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[: args.rows]:
        print(f"{e.self_device_time_total / total:>6.1%} {e.self_device_time_total / args.steps / 1e3:>8.3f} "
              f"{e.count / args.steps:>10.1f}  {e.key[:110]}")
    # Where the host waits or launches: CUDA runtime calls (a synchronising one is a host sync) and the host ops
    # with the most self CPU time, per step.
    runtime = sorted((e for e in averages if e.key.startswith("cuda") and e.self_device_time_total == 0),
                     key=lambda e: -e.self_cpu_time_total)
    print(f"# CUDA runtime calls per step: {'ms/step':>8} {'calls/step':>10}")
    for e in runtime[:8]:
        print(f"{e.self_cpu_time_total / args.steps / 1e3:>8.3f} {e.count / args.steps:>10.1f}  {e.key[:60]}")
    host = sorted((e for e in averages if not e.key.startswith("cuda") and e.self_device_time_total == 0),
                  key=lambda e: -e.self_cpu_time_total)
    print(f"# host ops by self CPU time per step: {'ms/step':>8} {'calls/step':>10}")
    for e in host[:12]:
        print(f"{e.self_cpu_time_total / args.steps / 1e3:>8.3f} {e.count / args.steps:>10.1f}  {e.key[:80]}")


if __name__ == "__main__":
    main()
