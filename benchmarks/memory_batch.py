"""The largest batch one MoE layer trains (forward + backward) under a fixed per-GPU byte budget, dense backward
against LRMoE, measured on one GPU and predicted by lrmoe.memory (like the paper's Figure 6).

    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python benchmarks/memory_batch.py --budget-gib 16
    python benchmarks/memory_batch.py --device cpu        # the model's column only: nothing is run

Configurations: LRMoE at retain 1 (the dense backward), 0.75 and 0.5, activations "save" and "recompute", bf16,
the Qwen3-30B-A3B layer shape by default. For each, the token count T (a multiple of ``--multiple``) is searched
by bisection (``largest_fitting``) for the largest T whose step does not run out of memory.

Measured (CUDA): ``torch.cuda.set_per_process_memory_fraction(budget / device memory)`` caps what the caching
allocator may reserve. The layer's weights and, with ``--optimizer``, stand-ins for its optimiser state (uninitialised
buffers of the bytes lrmoe.memory counts, e.g. fp32 AdamW m + v) are allocated once per configuration; each probe
starts with gradients None (PyTorch's ``zero_grad`` default, as the model assumes), makes x and the output gradient
g ([T, D] bf16), runs ``layer(x).backward(g)`` and counts a ``torch.OutOfMemoryError`` as "does not fit". The
allocator is emptied after every probe. A warm-up step at the smallest T compiles the kernels first.

Modelled: the largest T on the same grid whose ``layer_memory(...).peak`` (weights, gradients, optimiser state,
saved activations, the largest transient; device_type "cuda") plus the layer output T·D·b, which the probe holds
through backward and the model leaves to the caller, is at most the budget. The budget caps reserved bytes, the
model counts allocated ones, so the allocator's rounding and fragmentation make the measured T the smaller.

Columns: measured and modelled largest T, their ratio, each T relative to the dense backward's (same policy),
and at the measured T the probe's peak allocated and reserved bytes and the modelled peak there.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
from collections.abc import Callable
from pathlib import Path

import torch
from layer_fwd_bwd import SHAPES

from lrmoe.memory import ADAMW_FP32, ADAMW_FP32_MASTER, MemoryConfig, layer_memory

GiB = 2**30
OPTIMIZERS = {"adamw": ADAMW_FP32, "adamw-master": ADAMW_FP32_MASTER, "none": 0}
POLICIES = ("save", "recompute")
RETAINS = (1.0, 0.75, 0.5)
DTYPE = torch.bfloat16


def largest_fitting(fits: Callable[[int], bool], lo: int, hi: int) -> int | None:
    """The largest v in [lo, hi] with ``fits(v)``, for a monotone predicate (fits(v) implies fits(w) for w <= v);
    None when ``fits(lo)`` is false. Calls ``fits`` at most 1 + ceil(log2(hi - lo + 1)) times, never outside
    [lo, hi], and never twice with the same value."""
    if lo > hi:
        raise ValueError(f"empty range [{lo}, {hi}]")
    if not fits(lo):
        return None
    good, bad = lo, hi + 1  # invariant: fits(good); bad is hi + 1 or a value that does not fit
    while bad - good > 1:
        mid = (good + bad) // 2
        if fits(mid):
            good = mid
        else:
            bad = mid
    return good


def memory_config(shape: dict, tokens: int, optimizer_bytes: int) -> MemoryConfig:
    """One device, bf16, gradients starting as None, the CUDA kernels' buffers: what a probe runs."""
    return MemoryConfig(**shape, tokens=tokens, param_dtype=DTYPE, optimizer_bytes_per_param=optimizer_bytes,
                        device_type="cuda")


def modelled_bytes(shape: dict, tokens: int, *, retain: float, policy: str, optimizer_bytes: int) -> int:
    """What a probe of ``tokens`` tokens should peak at: the modelled peak plus the output the probe holds."""
    mem = layer_memory(memory_config(shape, tokens, optimizer_bytes), retain=retain, policy=policy)
    return mem.peak + tokens * shape["dim"] * DTYPE.itemsize


def model_largest_tokens(shape: dict, budget: int, *, retain: float, policy: str, optimizer_bytes: int,
                         multiple: int, max_tokens: int) -> int | None:
    """The largest T in {multiple, 2·multiple, …} ∩ [1, max_tokens] whose ``modelled_bytes`` fit ``budget``;
    None when not even ``multiple`` tokens fit. (The modelled bytes grow with T, so bisection finds the largest;
    tests/test_memory_benchmarks.py checks it against a scan of every T at small shapes.)"""
    def fits(i: int) -> bool:
        return modelled_bytes(shape, i * multiple, retain=retain, policy=policy,
                              optimizer_bytes=optimizer_bytes) <= budget

    best = largest_fitting(fits, 1, max_tokens // multiple) if max_tokens >= multiple else None
    return None if best is None else best * multiple


def int32_token_cap(shape: dict) -> int:
    """Tokens beyond which a [T·K, max(D, 2F)] row buffer has 2^31 elements or more: a precaution, so that a probe
    above the budget's reach cannot hit 32-bit index arithmetic in a kernel before it runs out of memory."""
    return (2**31 - 1) // (shape["top_k"] * max(shape["dim"], 2 * shape["hidden_dim"]))


# ------------------------------------------------------------------------------------------------ measuring


def probe(step: Callable[[int], int], tokens: int) -> int | None:
    """``step(tokens)`` (its peak bytes), or None when it ran out of device memory. The exception (and the
    frames it holds) is gone before the allocator's cache is emptied, so the next probe starts clean."""
    try:
        peak = step(tokens)
    except torch.OutOfMemoryError:
        peak = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return peak


class LayerStep:
    """One LRMoE layer on the GPU with its optimiser-state stand-in; ``__call__(T)`` runs one forward + backward
    of T tokens from gradients None and returns the peak allocated bytes (``max_memory_allocated``), recording
    the peak reserved bytes in ``last_reserved`` and the bytes allocated when it started (weights, optimiser
    state, whatever else the process holds) in ``last_start``. The gradients it makes are dropped on return
    unless ``keep_grads``. On ``device="cpu"`` (the tests' smoke run of this path) it runs the same step and reports
    0 bytes: there is no allocator to ask."""

    def __init__(self, shape: dict, *, retain: float, policy: str, optimizer_bytes: int, seed: int = 0,
                 device: str = "cuda"):
        from lrmoe.nn import LRMoE

        torch.manual_seed(seed)
        self.dim, self.device, self.cuda = shape["dim"], device, device == "cuda"
        self.layer = LRMoE(**shape, retain=retain, activations=policy).to(device=device, dtype=DTYPE)
        # Uninitialised uint8 buffers of numel * optimizer_bytes: the bytes a mixed-precision AdamW holds.
        self.optimizer_state = {name: torch.empty(p.numel() * optimizer_bytes, dtype=torch.uint8, device=device)
                                for name, p in self.layer.named_parameters()}
        self.last_reserved = self.last_start = 0

    def static_bytes(self) -> dict[str, int]:
        """Bytes held at the end of a step, split as lrmoe.memory splits them: "experts" (weights, gradients,
        optimiser state of gate_up_proj and down_proj) and "router" (the same for gate.weight). Call it after a
        step, while the gradients exist."""
        out = {"experts": 0, "router": 0}
        for name, p in self.layer.named_parameters():
            grad = p.grad.nbytes if p.grad is not None else 0
            out["router" if name.startswith("gate.") else "experts"] += (
                p.nbytes + grad + self.optimizer_state[name].nbytes)
        return out

    def __call__(self, tokens: int, keep_grads: bool = False) -> int:
        try:
            self.free_grads()
            if self.cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                self.last_start = torch.cuda.memory_allocated()
            x = torch.randn(tokens, self.dim, device=self.device, dtype=DTYPE, requires_grad=True)
            g = torch.randn_like(x)
            self.layer(x).backward(g)  # the output lives through backward: modelled_bytes counts it
            if not self.cuda:
                return 0
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated()
        finally:
            self.last_reserved = torch.cuda.max_memory_reserved() if self.cuda else 0
            if not keep_grads:
                self.free_grads()

    def free_grads(self) -> None:
        for p in self.layer.parameters():
            p.grad = None


def measure_largest_tokens(make_step: Callable[[], LayerStep], *, multiple: int, max_tokens: int) -> dict:
    """Bisection on the GPU under the memory fraction already set: the largest T whose step fits, with the
    probe's peak allocated and reserved bytes there and the number of probes (the warm-up not counted)."""
    result = {"tokens": None, "peak_allocated": None, "peak_reserved": None, "probes": 0}
    try:
        step = make_step()
    except torch.OutOfMemoryError:  # the weights and optimiser state alone exceed the budget
        return result
    if probe(step, multiple) is None:  # warm-up: kernels compiled and tuned before anything is judged
        return result
    peaks: dict[int, tuple[int, int]] = {}

    def fits(i: int) -> bool:
        result["probes"] += 1
        peak = probe(step, i * multiple)
        if peak is not None:
            peaks[i * multiple] = (peak, step.last_reserved)
        return peak is not None

    best = largest_fitting(fits, 1, max_tokens // multiple)
    if best is not None:
        result["tokens"] = best * multiple
        result["peak_allocated"], result["peak_reserved"] = peaks[best * multiple]
    return result


# ------------------------------------------------------------------------------------------------ the table


def _fmt_tokens(t: int | None, top: int) -> str:
    if t is None:
        return "none"
    return f">={t}" if t >= top else str(t)


def _gib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / GiB:.2f}"


def _ratio(a, b) -> str:
    return f"{a / b:.3f}" if a is not None and b else "n/a"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    parser.add_argument("--budget-gib", type=float, default=16.0, help="per-GPU byte budget, GiB")
    parser.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZERS),
                        help="optimiser state counted (and allocated on CUDA) per parameter: adamw = fp32 m + v "
                             "(8 bytes), adamw-master = + an fp32 master copy (12), none")
    parser.add_argument("--retain", type=float, nargs="+", default=list(RETAINS), help="1 = the dense backward")
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    parser.add_argument("--multiple", type=int, default=128, help="token granularity of the search")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="top of the search (default: twice the largest modelled T, within the int32 cap)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda needs a CUDA GPU; --device cpu prints the model's column only")
    shape = SHAPES[args.shape]
    budget = int(args.budget_gib * GiB)
    opt = OPTIMIZERS[args.optimizer]
    retains = sorted(set(args.retain), reverse=True)
    cap = int32_token_cap(shape) // args.multiple * args.multiple

    modelled = {(policy, r): model_largest_tokens(shape, budget, retain=r, policy=policy, optimizer_bytes=opt,
                                                  multiple=args.multiple, max_tokens=cap)
                for policy in args.policies for r in retains}
    if all(t is None for t in modelled.values()):
        static = layer_memory(memory_config(shape, args.multiple, opt)).static
        raise SystemExit(f"nothing fits {args.budget_gib} GiB in the model: the layer's weights, gradients and "
                         f"optimiser state alone take {static / GiB:.2f} GiB")
    top = args.max_tokens or min(cap, 2 * max(t for t in modelled.values() if t is not None))
    top = top // args.multiple * args.multiple

    measured_note = "measured" if args.device == "cuda" else "NOT MEASURED (--device cpu: model side only)"
    print(f"# {args.shape} {shape}, bf16, budget {args.budget_gib:g} GiB per GPU, optimiser {args.optimizer} "
          f"({opt} B/param), T searched in multiples of {args.multiple} up to {top}; {measured_note}")
    if args.device == "cuda":
        total = torch.cuda.get_device_properties(0).total_memory
        if budget >= total:
            raise SystemExit(f"--budget-gib {args.budget_gib} is not below the device's {total / GiB:.1f} GiB")
        torch.cuda.set_per_process_memory_fraction(budget / total)
        print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, memory fraction {budget / total:.4f} "
              f"of {total / GiB:.1f} GiB, PYTORCH_CUDA_ALLOC_CONF={os.environ.get('PYTORCH_CUDA_ALLOC_CONF', '')!r}")
    print(f"{'config':>12} {'policy':>9} {'retain':>6} {'meas. T':>8} {'model T':>8} {'meas/mod':>8} "
          f"{'meas x dense':>12} {'model x dense':>13} {'peak GiB@T':>10} {'model GiB@T':>11} {'rsvd GiB@T':>10} "
          f"{'probes':>6}")
    rows = []
    for policy in args.policies:
        dense = {}
        for r in retains:
            model_t = modelled[(policy, r)]
            model_t = None if model_t is None else min(model_t, top)
            if args.device == "cuda":
                meas = measure_largest_tokens(
                    lambda r=r, policy=policy: LayerStep(shape, retain=r, policy=policy, optimizer_bytes=opt),
                    multiple=args.multiple, max_tokens=top)
                gc.collect()  # the layer and its optimiser-state stand-in go before the next configuration
                torch.cuda.empty_cache()
            else:
                meas = {"tokens": None, "peak_allocated": None, "peak_reserved": None, "probes": 0}
            if r == 1.0:
                dense = {"measured": meas["tokens"], "model": model_t}
            row = {"config": "dense" if r == 1.0 else "lrmoe", "policy": policy, "retain": r,
                   "measured_tokens": meas["tokens"], "model_tokens": model_t, "top": top,
                   "peak_allocated": meas["peak_allocated"], "peak_reserved": meas["peak_reserved"],
                   "model_bytes_at_measured": None if meas["tokens"] is None else modelled_bytes(
                       shape, meas["tokens"], retain=r, policy=policy, optimizer_bytes=opt),
                   "probes": meas["probes"]}
            rows.append(row)
            label = "dense" if r == 1.0 else f"lrmoe {r:g}"
            meas_t = "n/a" if args.device == "cpu" else _fmt_tokens(meas["tokens"], top)
            print(f"{label:>12} {policy:>9} {r:>6g} {meas_t:>8} {_fmt_tokens(model_t, top):>8} "
                  f"{_ratio(meas['tokens'], model_t):>8} {_ratio(meas['tokens'], dense.get('measured')):>12} "
                  f"{_ratio(model_t, dense.get('model')):>13} {_gib(row['peak_allocated']):>10} "
                  f"{_gib(row['model_bytes_at_measured']):>11} {_gib(row['peak_reserved']):>10} "
                  f"{meas['probes']:>6}", flush=True)
    result = {"meta": {"shape": args.shape, **shape, "budget_bytes": budget, "optimizer_bytes": opt,
                       "multiple": args.multiple, "top": top, "device": args.device,
                       "measured": args.device == "cuda"}, "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
