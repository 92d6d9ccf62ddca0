"""One MoE layer's memory, measured on one GPU and modelled by lrmoe.memory.

    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python benchmarks/memory.py batch --budget-gib 16
    python benchmarks/memory.py batch --device cpu           # the model's column only: nothing is run
    python benchmarks/memory.py breakdown --device cpu --out docs/results/memory/memory_breakdown.png   # modelled only
    python benchmarks/memory.py breakdown --out memory_breakdown_h200.png                # + measured, one GPU
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python benchmarks/memory.py planner
    python benchmarks/memory.py planner --device cpu         # the plans only: nothing is run
    python benchmarks/memory.py policies --shape qwen3-30b-a3b

``batch``: the largest batch the layer trains (forward + backward) under a fixed per-GPU byte budget, dense backward
against LRMoE (like the paper's Figure 6). LRMoE at each --retain (1: the dense backward) and activations policy,
bf16. For each, the token count T (a multiple of ``--multiple``) is searched by bisection (common.largest_fitting)
for the largest T whose step does not run out of memory. Measured (CUDA): ``torch.cuda.
set_per_process_memory_fraction(budget / device memory)`` caps what the caching allocator may reserve; the layer's
weights and, with ``--optimizer``, stand-ins for its optimiser state (uninitialised buffers of the bytes
lrmoe.memory counts) are allocated once per configuration; each probe (common.LayerStep) starts with gradients
None, runs ``layer(x).backward(g)`` and counts a ``torch.OutOfMemoryError`` as "does not fit". Modelled: the
largest T on the same grid whose ``layer_memory(...).peak`` plus the layer output T·D·b (which the probe holds
through backward) is at most the budget. The budget caps reserved bytes, the model counts allocated ones, so the
allocator's rounding and fragmentation make the measured T the smaller.

``breakdown``: where one rank's memory goes, per method: base experts / replicas / token buffers as stacked bars
(like the paper's Figure 7). Modelled panel: one rank of an expert-parallel layer (``--world-size`` ranks,
``--tokens`` tokens per rank) for "dense", "dense + R replicas" (whatever the budget, as SYMI would add them),
"dense, planned" and "LRMoE r, planned" (the most replicas, <= ``--max-replicas``, whose peak fits the budget:
``plan_memory(cfg, budget, max_replicas, retain_choices=(r,), prefer="replicas")``). The bars are
``LayerMemory.base_experts`` (+ the router), ``replica_bytes`` and ``token_buffers``; their sum is the modelled
peak. Measured panel (``--measure``, the default on CUDA): one device at ``--tokens`` tokens, one LayerStep after a
warm-up; token buffers = the step's peak - what was allocated when it started - the gradients - the output.
Prints every bar in MiB, then writes the chart (needs matplotlib).

``planner``: the planner's budget guarantee: the step lrmoe.memory.plan_memory plans for a byte budget B
(``plan_memory(cfg, B * (1 - margin) - T*D*b, ...)``; the margin covers the allocator's reserve and the model's
error) runs within it, and the next larger retain, which the planner rejected, does not fit (measured on CUDA under
``set_per_process_memory_fraction(B / device memory)``: one warm-up and one measured step of each).

``policies``: per activation policy ("save", "recompute", "offload") and retain, the bytes forward leaves for
backward and the peak over forward+backward, measured against lrmoe.memory.layer_memory, with eager and compiled
medians; transformers' Qwen3-MoE block (compiled) measured the same way.

``--json PATH`` (batch, breakdown, planner) also writes the rows.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from common import (
    DTYPE,
    OPTIMIZERS,
    SHAPES,
    TINY,
    GiB,
    LayerStep,
    hf_block,
    measure_largest_tokens,
    memory_config,
    model_largest_tokens,
    modelled_bytes,
    probe,
    require_cuda,
)

from lrmoe.memory import DEFAULT_RETAIN_CHOICES, LayerMemory, MemoryConfig, layer_memory, plan_memory
from lrmoe.nn import LRMoE

MiB = 2**20
SHAPE_CHOICES = {**SHAPES, "tiny": TINY}  # tiny: the tests' CPU runs
POLICIES = ("save", "recompute")
RETAINS = (1.0, 0.75, 0.5)


def _gib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / GiB:.2f}"


# ------------------------------------------------------------------------------------------------------- batch


def int32_token_cap(shape: dict) -> int:
    """Tokens beyond which a [T·K, max(D, 2F)] row buffer has 2^31 elements or more: a precaution, so that a probe
    above the budget's reach cannot hit 32-bit index arithmetic in a kernel before it runs out of memory."""
    return (2**31 - 1) // (shape["top_k"] * max(shape["dim"], 2 * shape["hidden_dim"]))


def _fmt_tokens(t: int | None, top: int) -> str:
    if t is None:
        return "none"
    return f">={t}" if t >= top else str(t)


def _ratio(a, b) -> str:
    return f"{a / b:.3f}" if a is not None and b else "n/a"


def batch(args) -> dict:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda needs a CUDA GPU; --device cpu prints the model's column only")
    shape = SHAPE_CHOICES[args.shape]
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


# --------------------------------------------------------------------------------------------------- breakdown

SEGMENTS = (("base_experts", "base experts (weights, grads, optimiser; + router)"),
            ("replicas", "replicas (weights, grads)"),
            ("token_buffers", "token buffers (saved activations + transients)"))


@dataclass(frozen=True)
class Bar:
    """One stacked bar, in bytes. ``fits``: None where no budget applies, else whether peak <= budget."""

    label: str
    base_experts: int
    replicas: int
    token_buffers: int
    source: str  # "modelled" or "measured"
    fits: bool | None = None

    @property
    def total(self) -> int:
        return self.base_experts + self.replicas + self.token_buffers


def _bar(label: str, mem: LayerMemory, budget: int | None = None) -> Bar:
    # base experts + router + replicas + token buffers = peak (LayerMemory.token_buffers = peak - static)
    return Bar(label, mem.base_experts + mem.router, mem.replica_bytes, mem.token_buffers, "modelled",
               None if budget is None else mem.peak <= budget)


def modelled_bars(config: MemoryConfig, budget: int, *, replicas: int, max_replicas: int,
                  retains: tuple[float, ...], policy: str = "save") -> list[Bar]:
    """The modelled panel's bars (see the module docstring). A planned method that nothing fits shows its
    cheapest candidate (no replicas), marked ``fits=False``."""
    bars = [_bar("dense", layer_memory(config, policy=policy), budget),
            _bar(f"dense\n+{replicas} replicas", layer_memory(config, replicas=replicas, policy=policy), budget)]
    for retain in (1.0, *retains):
        name = "dense" if retain == 1.0 else f"LRMoE {retain:g}"
        try:
            plan = plan_memory(config, budget, max_replicas=max_replicas, retain_choices=(retain,),
                               prefer="replicas", policy=policy)
        except ValueError:
            bars.append(_bar(f"{name}\nno plan fits", layer_memory(config, retain=retain, policy=policy), budget))
            continue
        bars.append(_bar(f"{name}, planned\n{plan.replicas} replicas", plan.memory, budget))
    return bars


def single_device_bars(shape: dict, tokens: int, optimizer_bytes: int, retains: tuple[float, ...],
                       policy: str, measure: bool, device: str = "cuda") -> list[Bar]:
    """One device at ``tokens`` tokens: per retain, the measured bar (``measure``) and the modelled one. The
    measurement needs CUDA; ``device="cpu"`` runs the same steps (the tests' smoke run) and reads 0 bytes."""
    config = MemoryConfig(**shape, tokens=tokens, param_dtype=DTYPE, optimizer_bytes_per_param=optimizer_bytes)
    bars = []
    for retain in (1.0, *retains):
        name = "dense" if retain == 1.0 else f"LRMoE {retain:g}"
        if measure:
            step = LayerStep(shape, retain=retain, policy=policy, optimizer_bytes=optimizer_bytes, device=device)
            step(tokens)  # warm-up: kernels compiled and tuned
            peak = step(tokens, keep_grads=True)
            static = step.static_bytes()
            grads = sum(p.grad.nbytes for p in step.layer.parameters())
            output = tokens * shape["dim"] * DTYPE.itemsize
            # Above what was allocated before the step (weights, optimiser state, library workspaces), less the
            # gradients (static) and the output the step holds: what the model calls token buffers.
            bars.append(Bar(f"{name}\nmeasured", static["experts"] + static["router"], 0,
                            peak - step.last_start - grads - output, "measured"))
            del step
            if device == "cuda":
                torch.cuda.empty_cache()
        bars.append(_bar(f"{name}\nmodelled", layer_memory(config, retain=retain, policy=policy)))
    return bars


def plot(panels: list[tuple[str, list[Bar], int | None]], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    colors = ("#4c72b0", "#dd8452", "#55a868")
    fig, axes = plt.subplots(1, len(panels), figsize=(8 * len(panels), 5.6), squeeze=False)
    for ax, (panel_title, bars, budget) in zip(axes[0], panels, strict=True):
        xs = range(len(bars))
        bottom = [0.0] * len(bars)
        for (key, _), color in zip(SEGMENTS, colors, strict=True):
            heights = [getattr(b, key) / GiB for b in bars]
            ax.bar(xs, heights, bottom=bottom, color=color, width=0.65,
                   hatch=[None if b.source == "modelled" else "//" for b in bars], edgecolor="white")
            bottom = [lo + h for lo, h in zip(bottom, heights, strict=True)]
        for x, b in zip(xs, bars, strict=True):
            mark = "" if b.fits is None else (" ✓" if b.fits else " ✗")
            ax.text(x, b.total / GiB, f"{b.total / GiB:.2f}{mark}", ha="center", va="bottom", fontsize=8)
        if budget is not None:
            ax.axhline(budget / GiB, color="black", ls="--", lw=1)
        ax.set_xticks(list(xs), [b.label for b in bars], fontsize=8)
        ax.set(ylabel="GiB per layer and rank", title=panel_title)
        ax.set_ylim(0, max(max(b.total for b in bars), budget or 0) / GiB * 1.4)  # room for the legend
        handles = [Patch(color=c, label=legend) for (_, legend), c in zip(SEGMENTS, colors, strict=True)]
        if any(b.source == "measured" for b in bars):
            handles.append(Patch(facecolor="lightgray", hatch="//", edgecolor="white", label="measured"))
        if budget is not None:
            handles.append(Line2D([], [], color="black", ls="--", lw=1, label=f"budget {budget / GiB:g} GiB"))
        ax.legend(handles=handles, fontsize=7, loc="upper left", ncol=2)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def breakdown(args) -> list[tuple[str, list[Bar], int | None]]:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda needs a CUDA GPU; --device cpu draws the modelled panel only")
    shape = SHAPE_CHOICES[args.shape]
    opt = OPTIMIZERS[args.optimizer]
    retains = tuple(sorted((r for r in set(args.retain) if r < 1.0), reverse=True))
    budget = int(args.budget_gib * GiB)
    ep = MemoryConfig(**shape, tokens=args.tokens, world_size=args.world_size, param_dtype=DTYPE,
                      optimizer_bytes_per_param=opt)
    max_replicas = ep.num_experts - ep.local_experts if args.max_replicas is None else args.max_replicas
    panels = [(f"modelled: one rank of EP={args.world_size}, {args.tokens} tokens/rank",
               modelled_bars(ep, budget, replicas=args.replicas, max_replicas=max_replicas, retains=retains,
                             policy=args.policy), budget)]
    measured = args.device == "cuda"
    if args.measure if args.measure is not None else measured:  # on CPU a smoke run of the steps: 0 bytes read
        panels.append((f"one device, {args.tokens} tokens: measured (hatched) vs modelled",
                       single_device_bars(shape, args.tokens, opt, retains, args.policy, measure=True,
                                          device=args.device), None))
    where = torch.cuda.get_device_name() if measured else "NOT MEASURED (--device cpu: model only)"
    print(f"# {args.shape} {shape}, bf16, optimiser {args.optimizer} ({opt} B/param), budget {args.budget_gib:g} "
          f"GiB per layer and rank, max_replicas {max_replicas}; {where}")
    print(f"{'panel':>8} {'method':>32} {'base MiB':>9} {'replicas MiB':>12} {'tokens MiB':>10} {'total MiB':>10} "
          f"{'fits':>5}")
    for i, (_, bars, _) in enumerate(panels):
        for b in bars:
            fits = "" if b.fits is None else ("yes" if b.fits else "no")
            print(f"{'EP' if i == 0 else 'one dev':>8} {b.label.replace(chr(10), ' '):>32} "
                  f"{b.base_experts / MiB:>9.1f} {b.replicas / MiB:>12.1f} {b.token_buffers / MiB:>10.1f} "
                  f"{b.total / MiB:>10.1f} {fits:>5}")
    if args.json:
        args.json.write_text(json.dumps([{"title": t, "budget": budget_, "bars": [asdict(b) for b in bars]}
                                         for t, bars, budget_ in panels], indent=1))
    if args.out is None:
        return panels
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("# matplotlib is not installed: no chart (pip install 'lrmoe[demo]')")
        return panels
    kind = "modelled (lrmoe.memory) and measured" if measured else "MODELLED (lrmoe.memory), NOT MEASURED"
    title = (f"{kind}\n{args.shape} MoE layer, bf16, {args.optimizer} ({opt} B/param), activations {args.policy}; "
             "✓/✗: peak within / over the budget")
    print(f"# wrote {plot(panels, args.out, title)}")
    return panels


# ----------------------------------------------------------------------------------------------------- planner


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


def _measure_plan(shape: dict, tokens: int, retain: float, *, policy: str, optimizer_bytes: int) -> dict:
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


def planner(args) -> list[dict]:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda needs a CUDA GPU; --device cpu prints the plans only")
    shape, opt = SHAPE_CHOICES[args.shape], OPTIMIZERS[args.optimizer]
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
                row[f"{key}_measured"] = _measure_plan(shape, args.tokens, row[key], policy=args.policy,
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
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return rows


# ---------------------------------------------------------------------------------------------------- policies


def _saved_and_peak(fn, params, x, g) -> tuple[int, int]:
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


def policies(args) -> None:
    require_cuda("benchmarks/memory.py policies")
    from triton.testing import do_bench

    shape = SHAPE_CHOICES[args.shape]
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
            layer = LRMoE(**shape, retain=retain, activations=policy,
                          save_outputs=args.save_outputs).cuda().bfloat16()
            params = list(layer.parameters())
            _saved_and_peak(layer, params, x, g)  # warm-up: kernels compiled, allocator primed
            saved, peak = _saved_and_peak(layer, params, x, g)
            m = layer_memory(cfg, retain=retain, policy=policy, save_outputs=args.save_outputs)
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
            name = f"lrmoe {policy}" + (" +y" if args.save_outputs else "")
            print(f"{name:>20} {retain:>6g} {saved_meas / MiB:>9.1f} {saved_model / MiB:>7.1f} "
                  f"{saved_meas / saved_model:>6.3f} {peak_meas / MiB:>8.1f} {peak_model / MiB:>7.1f} "
                  f"{peak_meas / peak_model:>6.3f} {eager_ms:>8.3f} {comp_ms:>8.3f}", flush=True)
            del layer, params
    torch._dynamo.reset()
    hf = torch.compile(hf_block(**shape).cuda().bfloat16())
    params = list(hf.parameters())
    _saved_and_peak(hf, params, x, g)
    saved, peak = _saved_and_peak(hf, params, x, g)
    ms = do_bench(lambda: hf(x).backward(g), warmup=3, rep=30, return_mode="median", grad_to_none=[x, *params])
    print(f"{'transformers (comp.)':>20} {1:>6g} {(saved + x.nbytes) / MiB:>9.1f} {'':>7} {'':>6} "
          f"{(peak + x.nbytes + g.nbytes) / MiB:>8.1f} {'':>7} {'':>6} {'':>8} {ms:>8.3f}")


# --------------------------------------------------------------------------------------------------------- CLI


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    p = sub.add_parser("batch", help="the largest batch under a byte budget, measured and modelled")
    p.add_argument("--budget-gib", type=float, default=16.0, help="per-GPU byte budget, GiB")
    p.add_argument("--retain", type=float, nargs="+", default=list(RETAINS), help="1 = the dense backward")
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    p.add_argument("--multiple", type=int, default=128, help="token granularity of the search")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="top of the search (default: twice the largest modelled T, within the int32 cap)")
    p = sub.add_parser("breakdown", help="stacked bars: base experts / replicas / token buffers per method")
    p.add_argument("--tokens", type=int, default=8192, help="tokens per rank")
    p.add_argument("--world-size", type=int, default=8, help="EP ranks of the modelled panel")
    p.add_argument("--budget-gib", type=float, default=4.25, help="per layer and rank, for the planned bars")
    p.add_argument("--replicas", type=int, default=32, help="replicas of the unplanned 'dense + R' bar")
    p.add_argument("--max-replicas", type=int, default=None, help="planner's limit (default E - E/W)")
    p.add_argument("--retain", type=float, nargs="+", default=[0.75, 0.5])
    p.add_argument("--policy", default="save", choices=("save", "recompute"), help="activations (both panels)")
    p.add_argument("--measure", action=argparse.BooleanOptionalAction, default=None,
                   help="the measured one-device panel (default: on CUDA only)")
    p.add_argument("--out", type=Path, default=Path("memory_breakdown.png"), help="the chart (--no-out: none)")
    p.add_argument("--no-out", dest="out", action="store_const", const=None)
    p = sub.add_parser("planner", help="plan_memory's retain runs within its budget; the next larger does not")
    # 73,728 tokens and these budgets make every budget plan a different retain below 1 under the current model.
    p.add_argument("--tokens", type=int, default=73728)
    p.add_argument("--budgets-gib", type=float, nargs="+", default=[13.2, 14.0, 14.8, 15.6])
    p.add_argument("--margin", type=float, default=0.02, help="allocator reserve + model error, fraction")
    p.add_argument("--policy", default="save", choices=("save", "recompute", "offload"))
    p = sub.add_parser("policies", help="activation policies' saved bytes, peak and time against the model")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--retain", type=float, nargs="+", default=[1.0, 0.75, 0.5])
    p.add_argument("--compile-retain", type=float, default=0.75, help="retain timed compiled too")
    p.add_argument("--save-outputs", action="store_true",
                   help="LRMoE(save_outputs=True): y saved for the router gradient below retain 1 (rows '+y')")
    for name, p in sub.choices.items():
        p.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPE_CHOICES))
        if name != "policies":
            p.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZERS),
                           help="optimiser state per parameter: adamw = fp32 m + v (8 bytes), adamw-master = + an "
                                "fp32 master copy (12), none")
            p.add_argument("--device", default=default_device, choices=("cuda", "cpu"))
            p.add_argument("--json", type=Path, default=None, help="also write the rows here")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    return {"batch": batch, "breakdown": breakdown, "planner": planner, "policies": policies}[args.command](args)


if __name__ == "__main__":
    main()
