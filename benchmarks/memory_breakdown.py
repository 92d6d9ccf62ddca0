"""Where one rank's memory goes, per method: base experts / replicas / token buffers as stacked bars (like the
paper's Figure 7), from lrmoe.memory, and on one GPU the measured single-device bars next to the modelled ones.

    python benchmarks/memory_breakdown.py --device cpu --out docs/memory_breakdown.png   # modelled only
    python benchmarks/memory_breakdown.py --out memory_breakdown_h200.png                # + measured, one GPU

Modelled panel: one rank of an expert-parallel layer (default the Qwen3-30B-A3B layer on W = 8 ranks, 8,192
tokens per rank, bf16, fp32 AdamW m + v, activations ``--policy`` (default "save"), balanced dispatch), for these
methods:
    dense                      retain 1, no replicas
    dense + R replicas         retain 1, ``--replicas`` replicas per rank, whatever the budget (supply side, as
                               SYMI would add them)
    dense, planned             retain 1, the most replicas (<= ``--max-replicas``) whose peak fits the budget
    LRMoE r, planned           retain r (``--retain``), the same: ``plan_memory(cfg, budget, max_replicas,
                               retain_choices=(r,), prefer="replicas")``
The bars are ``LayerMemory.base_experts`` (weights, gradients, optimiser state of the owned experts; the router's
few MiB are added to it), ``replica_bytes`` (weights and gradients of the replicas) and ``token_buffers`` (peak
minus the bytes held at the end of the step: saved activations and the largest transient); their sum is the
modelled peak. The dashed line is the budget (``--budget-gib``, per layer and rank).

Measured panel (CUDA only): one device (W = 1, no replicas) at ``--tokens`` tokens, retain 1 and each ``--retain``:
one step of benchmarks/memory_batch.py's ``LayerStep`` without a budget (after a warm-up step); base experts = the
experts' weights, gradients and optimiser-state stand-in (+ router), token buffers = ``max_memory_allocated``
over the step − what was allocated when it started − the gradients − the layer output the step holds through
backward (T·D·b, which the model leaves to the caller). Next to each, the modelled
one-device bar. Prints every bar in MiB, then writes the chart (needs matplotlib).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import torch
from layer_fwd_bwd import SHAPES
from memory_batch import DTYPE, OPTIMIZERS, LayerStep

from lrmoe.memory import LayerMemory, MemoryConfig, layer_memory, plan_memory

MiB, GiB = 2**20, 2**30
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


def main(argv: list[str] | None = None) -> list[tuple[str, list[Bar], int | None]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per rank")
    parser.add_argument("--world-size", type=int, default=8, help="EP ranks of the modelled panel")
    parser.add_argument("--budget-gib", type=float, default=4.25, help="per layer and rank, for the planned bars")
    parser.add_argument("--replicas", type=int, default=32, help="replicas of the unplanned 'dense + R' bar")
    parser.add_argument("--max-replicas", type=int, default=None, help="planner's limit (default E - E/W)")
    parser.add_argument("--retain", type=float, nargs="+", default=[0.75, 0.5])
    parser.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZERS))
    parser.add_argument("--policy", default="save", choices=("save", "recompute"),
                        help="activations (both panels)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    parser.add_argument("--out", type=Path, default=Path("memory_breakdown.png"))
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda needs a CUDA GPU; --device cpu draws the modelled panel only")
    shape = SHAPES[args.shape]
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
    if measured:
        panels.append((f"one device, {args.tokens} tokens: measured (hatched) vs modelled",
                       single_device_bars(shape, args.tokens, opt, retains, args.policy, measure=True), None))
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


if __name__ == "__main__":
    main()
