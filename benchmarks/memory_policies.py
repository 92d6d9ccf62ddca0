"""Activation memory and time of LRMoE's activation policies on one GPU (bf16), measured against lrmoe.memory.

    python benchmarks/memory_policies.py --shape qwen3-30b-a3b

For each policy ("save", "recompute", "offload") and retain: the bytes forward leaves allocated for backward (measured:
allocated after forward minus before, minus the output; the layer input x is added back because the model counts
it), and the peak over forward+backward above the weights (gradients start as None, so they are allocated in
backward as the model's static gradient bytes), both against lrmoe.memory.layer_memory; then eager and compiled
forward+backward medians ("offload": device bytes only; its host copy is lrmoe.memory's ``offloaded``). transformers' Qwen3-MoE block (compiled) is measured the same way for its forward.
"""

from __future__ import annotations

import argparse

import torch
from layer_fwd_bwd import SHAPES, hf_block

from lrmoe.memory import MemoryConfig, layer_memory
from lrmoe.nn import LRMoE

MiB = 2**20


def measure(fn, params, x, g) -> tuple[int, int]:
    """(bytes left allocated by forward beyond its output, peak bytes over forward+backward above the start)."""
    for p in params:
        p.grad = None
    x.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn(x)
    torch.cuda.synchronize()
    saved = torch.cuda.memory_allocated() - base - out.untyped_storage().nbytes()
    out.backward(g)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return saved, peak


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--retain", type=float, nargs="+", default=[1.0, 0.75, 0.5])
    parser.add_argument("--compile-retain", type=float, default=0.75, help="retain timed compiled too")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/memory_policies.py needs a CUDA GPU")
    from triton.testing import do_bench

    shape = SHAPES[args.shape]
    d, f, E, k, T = shape["dim"], shape["hidden_dim"], shape["num_experts"], shape["top_k"], args.tokens
    print(f"# {args.shape} {shape}, tokens={T}, bf16, {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'layer':>20} {'retain':>6} {'saved MiB':>9} {'model':>7} {'ratio':>6} {'peak MiB':>8} {'model':>7} "
          f"{'ratio':>6} {'eager ms':>8} {'comp. ms':>8}")
    x = torch.randn(T, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn_like(x)
    cfg = MemoryConfig(d, f, E, k, T, optimizer_bytes_per_param=0)
    for policy in ("save", "recompute", "offload"):
        for retain in args.retain:
            torch.manual_seed(0)
            layer = LRMoE(**shape, retain=retain, activations=policy).cuda().bfloat16()
            params = list(layer.parameters())
            measure(layer, params, x, g)  # warm-up: kernels compiled, allocator primed
            saved, peak = measure(layer, params, x, g)
            m = layer_memory(cfg, retain=retain, policy=policy)
            # The model counts x (saved) and the incoming gradient (a backward transient); both exist before.
            saved_model = m.saved_activations
            saved_meas = saved + x.nbytes
            router_w = E * d * 2
            peak_model = m.peak - m.expert_weights - router_w
            peak_meas = peak + x.nbytes + g.nbytes

            def step(fn=layer):
                fn(x).backward(g)

            eager_ms = do_bench(step, warmup=3, rep=30, return_mode="median", grad_to_none=[x, *params])
            comp_ms = float("nan")
            if retain == args.compile_retain:
                torch._dynamo.reset()  # a fresh cache per layer: recompiles would make retain dynamic
                compiled = torch.compile(layer, fullgraph=True)
                comp_ms = do_bench(lambda c=compiled: c(x).backward(g), warmup=3, rep=30, return_mode="median",
                                   grad_to_none=[x, *params])
            print(f"{'lrmoe ' + policy:>20} {retain:>6g} {saved_meas / MiB:>9.1f} {saved_model / MiB:>7.1f} "
                  f"{saved_meas / saved_model:>6.3f} {peak_meas / MiB:>8.1f} {peak_model / MiB:>7.1f} "
                  f"{peak_meas / peak_model:>6.3f} {eager_ms:>8.3f} {comp_ms:>8.3f}", flush=True)
            del layer, params
    torch._dynamo.reset()
    hf = torch.compile(hf_block(**shape).cuda().bfloat16())
    params = list(hf.parameters())
    measure(hf, params, x, g)
    saved, peak = measure(hf, params, x, g)
    ms = do_bench(lambda: hf(x).backward(g), warmup=3, rep=30, return_mode="median", grad_to_none=[x, *params])
    print(f"{'transformers (comp.)':>20} {1:>6g} {(saved + x.nbytes) / MiB:>9.1f} {'':>7} {'':>6} "
          f"{(peak + x.nbytes + g.nbytes) / MiB:>8.1f} {'':>7} {'':>6} {'':>8} {ms:>8.3f}")


if __name__ == "__main__":
    main()
