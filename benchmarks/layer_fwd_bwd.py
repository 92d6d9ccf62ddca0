"""LRMoE layer forward+backward time at a model's MoE shape, per retain, eager and compiled (GPU, bf16).

    python benchmarks/layer_fwd_bwd.py --shape qwen3-30b-a3b

Prints one table: medians of CUDA-event timings (triton.testing.do_bench), peak memory, and host syncs seen
under torch.cuda.set_sync_debug_mode("warn") in one eager step.
"""

from __future__ import annotations

import argparse
import warnings

import torch

from lrmoe.nn import LRMoE

SHAPES = {
    "qwen3-30b-a3b": dict(dim=2048, hidden_dim=768, num_experts=128, top_k=8),
    "glm-4.5-air": dict(dim=4096, hidden_dim=1408, num_experts=128, top_k=8),
}


def count_syncs(step) -> int:
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()
            torch.cuda.synchronize()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def main() -> None:
    from triton.testing import do_bench

    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--retain", type=float, nargs="+", default=[1.0, 0.75, 0.5])
    parser.add_argument("--selection", default="sample")
    args = parser.parse_args()
    shape = SHAPES[args.shape]
    print(f"# {args.shape} {shape}, tokens={args.tokens}, bf16, {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'retain':>6} {'mode':>8} {'fwd ms':>8} {'fwd+bwd ms':>10} {'peak GiB':>8} {'syncs':>5}")
    for retain in args.retain:
        torch.manual_seed(0)
        layer = LRMoE(**shape, retain=retain, selection=args.selection).cuda().bfloat16()
        x = torch.randn(args.tokens, shape["dim"], device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for mode in ("eager", "compiled"):
            fn = layer if mode == "eager" else torch.compile(layer, fullgraph=True)

            def fwd():
                with torch.no_grad():
                    fn(x)

            def step():
                fn(x).sum().backward()

            step()
            syncs = count_syncs(step) if mode == "eager" else -1
            fwd_ms = do_bench(fwd, warmup=5, rep=40, return_mode="median")
            torch.cuda.reset_peak_memory_stats()
            step_ms = do_bench(step, warmup=5, rep=40, return_mode="median", grad_to_none=[x, *layer.parameters()])
            peak = torch.cuda.max_memory_allocated() / 2**30
            print(f"{retain:>6} {mode:>8} {fwd_ms:>8.3f} {step_ms:>10.3f} {peak:>8.2f} {syncs:>5}")


if __name__ == "__main__":
    main()
