"""PNG plots of demo and study runs (matplotlib, the ``demo`` extra; skipped with a note when it is missing).

* loss curves: training loss (smoothed) and held-out loss against step, one line per run;
* expert load before and after calibration: per expert, the pairs routed in forward (mean per step) and the
  pairs kept in backward, experts sorted by forward load, like the paper's Figures 1-2.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["have_matplotlib", "plot_loss_curves", "plot_expert_loads"]


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    return plt


def _smooth(values: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def _label(result: dict) -> str:
    if result["retain"] >= 1.0:
        return "dense backward"
    return f"retain {result['retain']:g} ({result['metric']}, {result['selection']})"


def plot_loss_curves(results: list[dict], path: Path, title: str = "") -> Path:
    """Training loss (moving average over ~2% of the run) and held-out loss per run."""
    plt = _pyplot()
    fig, (ax_train, ax_eval) = plt.subplots(1, 2, figsize=(11, 4))
    for result in results:
        steps = [r["step"] for r in result["history"]]
        losses = [r["loss"] for r in result["history"]]
        window = max(1, len(losses) // 50)
        (line,) = ax_train.plot(steps, _smooth(losses, window), label=_label(result), lw=1.2)
        curve = result.get("eval_curve") or []
        ax_eval.plot([p["step"] for p in curve], [p["heldout_loss"] for p in curve], marker="o", ms=3,
                     color=line.get_color(), label=_label(result))
    ax_train.set(xlabel="step", ylabel="training loss (nats/byte, smoothed)", title="training")
    ax_eval.set(xlabel="step", ylabel="held-out loss (nats/byte)", title="held-out")
    for ax in (ax_train, ax_eval):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_expert_loads(result: dict, path: Path, layer: int = 0) -> Path:
    """Forward load against backward quota per expert (mean pairs per step), sorted by forward load."""
    plt = _pyplot()
    loads = result["mean_expert_loads"][layer]
    quotas = result["mean_expert_quotas"][layer]
    order = sorted(range(len(loads)), key=lambda e: -loads[e])
    xs = range(len(order))
    fig, ax = plt.subplots(figsize=(7, 3.8))
    ax.bar(xs, [loads[e] for e in order], color="#c8d6e5", label="forward: routed pairs")
    ax.bar(xs, [quotas[e] for e in order], width=0.5, color="#2e86de", label="backward: kept pairs (quota)")
    ax.set_xticks(list(xs), [str(e) for e in order], fontsize=7)
    ax.set(xlabel="expert (sorted by forward load)", ylabel="pairs per step (mean)",
           title=f"layer {layer}: load before and after calibration, {_label(result)}")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
