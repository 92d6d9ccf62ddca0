"""Where the LRMoE layer's forward+backward time goes on one GPU (bf16): torch.profiler, top kernels by GPU time.

    python benchmarks/profile_layer.py --shape qwen3-30b-a3b --retain 0.75 [--compiled] [--forward-only]
        [--quota-align 128] [--gather-gemm triton] [--backward-capacity 1.0] [--skew 0.5] [--timeline]

Prints the wall time per step (unprofiled) next to the GPU time, so a host-bound step shows as a gap, then one
table per run: the operators (eager) or generated kernels (--compiled) with the largest self GPU time
over --steps forward+backward steps, as a share of the total, so the next kernel to fuse or speed up is the one
at the top. --timeline adds where the GPU sat idle between kernels over the profiled steps (print_timeline).
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
    parser.add_argument("--timeline", action="store_true",
                        help="also the GPU timeline of the profiled steps: busy, idle between kernels, largest gaps")
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
    if args.timeline:
        print_timeline(prof, args.steps)
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


def kernel_intervals(trace: dict) -> list[tuple[float, float, str]]:
    """(start, end, name) in µs of every GPU kernel, memset and memcpy of a Chrome trace, in start order."""
    return sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in trace["traceEvents"]
                  if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy"))


def timeline_stats(intervals: list[tuple[float, float, str]]) -> tuple[float, float, list]:
    """(span, busy, gaps) of GPU work: span from the first start to the last end, busy the union of the intervals
    (kernels of two streams may overlap), gaps (idle µs, kernel before, kernel after) between consecutive work."""
    busy, gaps = 0.0, []
    cur_start, cur_end, cur_name = intervals[0]
    for start, end, name in intervals[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            gaps.append((start - cur_end, cur_name, name))
            cur_start = start
        if end >= cur_end:
            cur_end, cur_name = end, name
    busy += cur_end - cur_start
    return cur_end - intervals[0][0], busy, gaps  # the latest end: the last kernel to start may end earlier


def print_timeline(prof, steps: int) -> None:
    """The GPU's timeline over the profiled steps, launched back to back: span and busy time per step, the idle time
    between kernels (the GPU waiting for the host's launches, and for the profiler's own buffer requests, which are
    printed apart), and the largest gaps. The profiler slows the host, so compare the span with the unprofiled wall
    time printed first: on the H200 (twenty-fourth session) a step at retain 1 was 4.417 ms wall against 4.383 ms of
    kernels."""
    import json
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as trace_file:
            trace = json.load(trace_file)
    intervals = kernel_intervals(trace)
    if not intervals:
        print("# timeline: no GPU events in the trace")
        return
    span, busy, gaps = timeline_stats(intervals)
    idle = span - busy
    stalls = sum(g for g, *_ in gaps if g > 1000)  # the profiler's own buffer requests stop the host for ~2 ms
    print(f"# timeline over {steps} steps: {span / steps / 1e3:.3f} ms span per step, {busy / steps / 1e3:.3f} busy, "
          f"{idle / steps / 1e3:.3f} idle in {len(gaps) / steps:.0f} gaps per step "
          f"({sum(g for g, *_ in gaps if 5 < g <= 1000) / steps / 1e3:.3f} ms in gaps of 5 µs to 1 ms, "
          f"{stalls / steps / 1e3:.3f} in longer ones)")
    print(f"{'gap µs':>8}  kernel before -> kernel after (largest gaps)")
    for gap, before, after in sorted(gaps, reverse=True)[:12]:
        print(f"{gap:>8.1f}  {before[:60]} -> {after[:60]}")


if __name__ == "__main__":
    main()
