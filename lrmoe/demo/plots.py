"""PNG plots of demo and study runs (matplotlib, the ``demo`` extra; skipped with a note when it is missing).

* loss curves: training loss (smoothed) and held-out loss against step, one line per run, and the difference of
  each run's training loss to the dense run's at every step (the curves overlap where it matters);
* expert load before and after calibration, one panel per layer: per expert, the pairs routed in forward (mean
  per step) and the pairs kept in backward, experts sorted by forward load, like the paper's Figures 1-2.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["have_matplotlib", "expert_loads_figure", "loss_curves_figure", "plot_loss_curves", "plot_expert_loads"]


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


def _dense(results: list[dict]) -> dict | None:
    return next((r for r in results if r["retain"] >= 1.0), None)


def loss_curves_figure(results: list[dict], title: str = ""):
    """The loss figure (matplotlib Figure): training loss (moving average over ~2% of the run) and held-out loss
    per run; with a dense run (retain 1) and another, a third panel of loss(retain) - loss(dense) at every step,
    per step (faint) and smoothed. The runs share seed and batches, so the difference is the selective
    backward's effect, which the first panel hides when the curves overlap."""
    plt = _pyplot()
    dense = _dense(results)
    others = [r for r in results if r is not dense]
    n_panels = 3 if dense is not None and others else 2
    fig, axes = plt.subplots(1, n_panels, figsize=(5.5 * n_panels, 4))
    ax_train, ax_eval = axes[0], axes[1]
    colors = {}
    for result in results:
        steps = [r["step"] for r in result["history"]]
        losses = [r["loss"] for r in result["history"]]
        window = max(1, len(losses) // 50)
        (line,) = ax_train.plot(steps, _smooth(losses, window), label=_label(result), lw=1.2)
        colors[id(result)] = line.get_color()
        curve = result.get("eval_curve") or []
        ax_eval.plot([p["step"] for p in curve], [p["heldout_loss"] for p in curve], marker="o", ms=3,
                     color=line.get_color(), label=_label(result))
    ax_train.set(xlabel="step", ylabel="training loss (nats/byte, smoothed)", title="training")
    ax_eval.set(xlabel="step", ylabel="held-out loss (nats/byte)", title="held-out")
    if n_panels == 3:
        ax_diff = axes[2]
        dense_loss = {r["step"]: r["loss"] for r in dense["history"]}
        for result in others:
            steps = [r["step"] for r in result["history"] if r["step"] in dense_loss]
            diffs = [r["loss"] - dense_loss[r["step"]] for r in result["history"] if r["step"] in dense_loss]
            color = colors[id(result)]
            ax_diff.plot(steps, diffs, color=color, lw=0.6, alpha=0.35)
            ax_diff.plot(steps, _smooth(diffs, max(1, len(diffs) // 50)), color=color, lw=1.4, label=_label(result))
        ax_diff.axhline(0.0, color="black", lw=0.8)
        ax_diff.set(xlabel="step", ylabel="loss(retain) - loss(dense) (nats/byte)",
                    title="difference to the dense backward")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_loss_curves(results: list[dict], path: Path, title: str = "") -> Path:
    """:func:`loss_curves_figure` written to ``path`` (PNG)."""
    return _save(loss_curves_figure(results, title), path)


def expert_loads_figure(result: dict):
    """Forward load against backward quota per expert (mean pairs per step), sorted by forward load: one panel
    per layer, in a grid of up to 4 columns (matplotlib Figure, one Axes per layer)."""
    plt = _pyplot()
    n_layers = len(result["mean_expert_loads"])
    n_cols = min(n_layers, 4)
    n_rows = -(-n_layers // n_cols)
    fig, grid = plt.subplots(n_rows, n_cols, figsize=(4.5 * n_cols, 3.6 * n_rows), squeeze=False)
    for ax in grid.flat[n_layers:]:
        fig.delaxes(ax)
    for layer, ax in enumerate(grid.flat[:n_layers]):
        loads = result["mean_expert_loads"][layer]
        quotas = result["mean_expert_quotas"][layer]
        order = sorted(range(len(loads)), key=lambda e: -loads[e])
        xs = range(len(order))
        ax.bar(xs, [loads[e] for e in order], color="#c8d6e5", label="forward: routed pairs")
        ax.bar(xs, [quotas[e] for e in order], width=0.5, color="#2e86de", label="backward: kept pairs (quota)")
        ax.set_xticks(list(xs), [str(e) for e in order], fontsize=7)
        ax.set(xlabel="expert (sorted by forward load)", ylabel="pairs per step (mean)", title=f"layer {layer}")
        ax.grid(axis="y", alpha=0.3)
        if layer == 0:
            ax.legend(fontsize=8)
    fig.suptitle(f"load before and after calibration, {_label(result)}")
    fig.tight_layout()
    return fig


def plot_expert_loads(result: dict, path: Path) -> Path:
    """:func:`expert_loads_figure` written to ``path`` (PNG)."""
    return _save(expert_loads_figure(result), path)


def _save(fig, path: Path) -> Path:
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)
    return path
