"""Does activations="offload" hide its device-to-host copy behind compute? One GPU, bf16, eager.

    python benchmarks/offload_overlap.py --shape qwen3-30b-a3b --retain 0.75

Two measurements, same run:
1. Timeline (torch.profiler, one forward+backward): the GPU time the DtoH copies of h take, and how much of it
   runs while a compute kernel runs on another stream (overlap = |copy ∩ kernels| / |copy|); the time of the
   backward's gather of the retained rows from pinned memory (the Triton kernel reading over PCIe).
2. Medians (triton.testing.do_bench), forward and forward+backward, "save" against "offload", and the copy alone
   (h's bytes, device to pinned host, on its own). Without overlap the offload forward would take about the
   save forward plus the copy.
"""

from __future__ import annotations

import argparse

import torch
from layer_fwd_bwd import SHAPES
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from lrmoe.nn import LRMoE


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def overlap(copies: list[tuple[float, float]], kernels: list[tuple[float, float]]) -> float:
    """Length of the copies' union that lies inside the kernels' union."""
    busy = _union(kernels)
    total = 0.0
    for a, b in _union(copies):
        for c, d in busy:
            total += max(0.0, min(b, d) - max(a, c))
    return total


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--retain", type=float, default=0.75)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/offload_overlap.py needs a CUDA GPU")
    from triton.testing import do_bench

    shape = SHAPES[args.shape]
    T, d, f, k = args.tokens, shape["dim"], shape["hidden_dim"], shape["top_k"]
    print(f"# {args.shape} {shape}, tokens={T}, retain={args.retain:g}, bf16, eager, {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}")
    x = torch.randn(T, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn_like(x)
    layers = {}
    for policy in ("save", "offload"):
        torch.manual_seed(0)
        layers[policy] = LRMoE(**shape, retain=args.retain, activations=policy).cuda().bfloat16()

    # 1. Timeline of one offload step.
    layer = layers["offload"]
    for _ in range(2):
        layer(x).backward(g)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        layer(x).backward(g)
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    span = lambda e: (e.time_range.start, e.time_range.end)  # noqa: E731  (µs)
    copies = [span(e) for e in events if "DtoH" in e.name]
    kernels = [span(e) for e in events if "Memcpy" not in e.name and "Memset" not in e.name]
    gathers = [span(e) for e in events if "gather_rows" in e.name]
    copy_us = sum(b - a for a, b in _union(copies))
    hidden_us = overlap(copies, kernels)
    gather_us = sum(b - a for a, b in gathers)
    h_bytes = T * k * 2 * f * 2
    print(f"# timeline: {len(copies)} DtoH copies, {copy_us / 1e3:.3f} ms ({h_bytes / max(copy_us, 1e-9) / 1e3:.1f} "
          f"GB/s), {hidden_us / max(copy_us, 1e-9):.1%} of it while a kernel runs; gather of retained rows from "
          f"pinned memory {gather_us / 1e3:.3f} ms")

    # 2. Medians, same run.
    h = torch.empty(T * k, 2 * f, device="cuda", dtype=torch.bfloat16)
    host = torch.empty(h.shape, dtype=h.dtype, pin_memory=True)
    copy_ms = do_bench(lambda: host.copy_(h, non_blocking=True), warmup=3, rep=30, return_mode="median")
    print(f"# copy of h alone ({h_bytes / 2**20:.0f} MiB, device -> pinned): {copy_ms:.3f} ms")
    print(f"{'policy':>8} {'fwd ms':>8} {'fwd+bwd ms':>10}")
    for policy, layer in layers.items():
        params = list(layer.parameters())

        def fwd(layer=layer):
            layer(x)  # with grad: "offload" only copies when a backward can follow

        fwd_ms = do_bench(fwd, warmup=3, rep=30, return_mode="median", grad_to_none=[x, *params])
        step_ms = do_bench(lambda layer=layer: layer(x).backward(g), warmup=3, rep=30, return_mode="median",
                           grad_to_none=[x, *params])
        print(f"{policy:>8} {fwd_ms:>8.3f} {step_ms:>10.3f}", flush=True)


if __name__ == "__main__":
    main()
