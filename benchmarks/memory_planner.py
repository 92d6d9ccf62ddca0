"""The planner's budget guarantee on one GPU: the step lrmoe.memory.plan_memory plans for a byte budget runs within
it, and the next larger retain, which the planner rejected, does not fit.

    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python benchmarks/memory_planner.py
    python benchmarks/memory_planner.py --device cpu        # the plans only: nothing is run

One LRMoE layer (bf16, the Qwen3-30B-A3B layer shape by default, ``--tokens`` tokens, AdamW fp32 m + v stand-ins as
in benchmarks/memory_batch.py) on one device. For each budget B (``--budgets-gib``):

    plan = plan_memory(cfg, budget_bytes=B * (1 - margin) - T*D*b, retain_choices=..., policy=...)

``margin`` (default 2 %) is what the caching allocator reserves beyond the allocated bytes the model counts, plus
the model's error: on the H200 the allocator reserved 0.6 % more than the peak allocated at a 16 GiB budget and the
model was 0.4 % under the peak allocated (docs/memory.md, "Largest batch"). T*D*b is the layer output, which the
step holds through backward and the model leaves to the caller. Measured (CUDA): under
``torch.cuda.set_per_process_memory_fraction(B / device memory)``, one warm-up step and one measured step of the
planned retain, then of the next larger retain choice (rejected by the planner: its modelled peak is over the
budget); "fits" means no ``torch.OutOfMemoryError``. Columns: the plan, its modelled peak (+ output), the measured
peak allocated and reserved, and the same for the rejected retain.
"""

from __future__ import annotations

import argparse
import gc

import torch
from layer_fwd_bwd import SHAPES
from memory_batch import DTYPE, OPTIMIZERS, LayerStep, memory_config, probe

from lrmoe.memory import DEFAULT_RETAIN_CHOICES, layer_memory, plan_memory

GiB = 2**30


def plan_rows(shape: dict, tokens: int, budgets_gib: list[float], *, margin: float, policy: str,
              optimizer_bytes: int) -> list[dict]:
    """The planned retain and the rejected next larger one for every budget, with their modelled bytes (peak plus
    the output the step holds). planned is None when no retain choice fits (the planner's error is kept)."""
    cfg = memory_config(shape, tokens, optimizer_bytes)
    out_bytes = tokens * shape["dim"] * DTYPE.itemsize
    rows = []
    for budget_gib in budgets_gib:
        budget = int(budget_gib * GiB)
        row = {"budget": budget, "planned": None, "planned_bytes": None, "rejected": None, "rejected_bytes": None,
               "error": None}
        try:
            plan = plan_memory(cfg, int(budget * (1 - margin)) - out_bytes, retain_choices=DEFAULT_RETAIN_CHOICES,
                               policy=policy)
            row["planned"], row["planned_bytes"] = plan.retain, plan.memory.peak + out_bytes
        except ValueError as err:
            row["error"] = str(err).split(":")[0]
        larger = [r for r in DEFAULT_RETAIN_CHOICES if row["planned"] is None or r > row["planned"]]
        if larger:
            row["rejected"] = min(larger)
            row["rejected_bytes"] = layer_memory(cfg, retain=row["rejected"], policy=policy).peak + out_bytes
        rows.append(row)
    return rows


def measure(shape: dict, tokens: int, retain: float, *, policy: str, optimizer_bytes: int) -> dict:
    """Warm-up and one measured step under the memory fraction already set: fits, peak allocated and reserved."""
    result = {"fits": False, "allocated": None, "reserved": None}
    try:
        step = LayerStep(shape, retain=retain, policy=policy, optimizer_bytes=optimizer_bytes)
    except torch.OutOfMemoryError:
        return result
    if probe(step, tokens) is not None:  # warm-up
        peak = probe(step, tokens)
        if peak is not None:
            result.update(fits=True, allocated=peak, reserved=step.last_reserved)
    del step
    gc.collect()
    torch.cuda.empty_cache()
    return result


def _gib(n) -> str:
    return "-" if n is None else f"{n / GiB:.2f}"


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    # 73,728 tokens and these budgets make every budget plan a different retain below 1 under the current model
    # (at the first run's 40,960 tokens, retain 1 now fits all four budgets: nothing left to plan).
    parser.add_argument("--tokens", type=int, default=73728)
    parser.add_argument("--budgets-gib", type=float, nargs="+", default=[13.2, 14.0, 14.8, 15.6])
    parser.add_argument("--margin", type=float, default=0.02, help="allocator reserve + model error, fraction")
    parser.add_argument("--policy", default="save", choices=("save", "recompute", "offload"))
    parser.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZERS))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda needs a CUDA GPU; --device cpu prints the plans only")
    shape, opt = SHAPES[args.shape], OPTIMIZERS[args.optimizer]
    rows = plan_rows(shape, args.tokens, args.budgets_gib, margin=args.margin, policy=args.policy,
                     optimizer_bytes=opt)
    print(f"# {args.shape} {shape}, {args.tokens} tokens, bf16, optimiser {args.optimizer} ({opt} B/param), "
          f"policy {args.policy}, margin {args.margin:.0%}, retain choices {DEFAULT_RETAIN_CHOICES}; "
          + ("measured" if args.device == "cuda" else "plans only (CPU)"))
    cuda = args.device == "cuda"
    if cuda:
        total = torch.cuda.get_device_properties(0).total_memory
        print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, {total / GiB:.1f} GiB")
    print(f"{'budget':>7} {'plan':>6} {'model':>7} {'fits':>5} {'alloc':>6} {'rsvd':>6} | {'reject':>6} {'model':>7} "
          f"{'fits':>5} {'alloc':>6} {'rsvd':>6}   (GiB)")
    for row in rows:
        for key in ("planned", "rejected"):
            row[f"{key}_measured"] = None
            if cuda and row[key] is not None:
                torch.cuda.set_per_process_memory_fraction(row["budget"] / total)
                row[f"{key}_measured"] = measure(shape, args.tokens, row[key], policy=args.policy,
                                                 optimizer_bytes=opt)
        cols = []
        for key in ("planned", "rejected"):
            m = row[f"{key}_measured"] or {}
            fits = "-" if not m else ("yes" if m["fits"] else "OOM")
            cols.append(f"{row[key] if row[key] is not None else 'none':>6} {_gib(row[f'{key}_bytes']):>7} "
                        f"{fits:>5} {_gib(m.get('allocated')):>6} {_gib(m.get('reserved')):>6}")
        print(f"{row['budget'] / GiB:>7.2f} {cols[0]} | {cols[1]}", flush=True)
        if row["error"]:
            print(f"#   planner: {row['error']}")
    return rows


if __name__ == "__main__":
    main()
