"""The quality study: does selective backward preserve model quality, and which score makes that true?

Two grids, after the paper's Table 2 and Figure 5, in two regimes:

* regime "scratch": train from random init on the Python sources;
* regime "continued": start from the dense "scratch" model of the same seed and keep training on a different
  corpus (the Python documentation's English prose), as the paper's Table 2 fine-tunes pretrained models.

Grid "table2": metric lrm / grad_l2 / grad_abs / random x selection top / sample at retain 0.75, both regimes,
against the dense backward of the same seed. Grid "figure5": regime "continued", retain 1.0 / 0.9 / 0.75 / 0.5
for lrm-sample, lrm-top and random-top (uniform dropping). Every job of a seed sees the same batches in the same
order (the data generator is seeded by the seed alone) and the same token budget.

Each job is one ``python -m lrmoe demo`` process; jobs run as parallel processes (they share one GPU well) and
a job whose log exists is not run again, so a grid can be completed over several calls (with the same preset,
steps and learning rate: the first call records them in ``settings.json`` and later calls must match).
``report`` turns the logs into tables (mean over the run of the held-out perplexity gap to dense, with the spread
across seeds) and plots.

    python -m lrmoe study run --grid table2 figure5 --seeds 0 1 2 --device cuda --parallel 14 --out runs/study
    python -m lrmoe study report runs/study
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from lrmoe.demo.cli import _PRESETS, _positive_int

__all__ = ["Job", "grid_jobs", "run_jobs", "load_results", "delta_ppl", "report", "add_study_parser"]

GRIDS = ("table2", "figure5")
TABLE2_METRICS = ("lrm", "grad_l2", "grad_abs", "random")
FIGURE5_METHODS = (("lrm", "sample"), ("lrm", "top"), ("random", "top"))
FIGURE5_RETAINS = (0.9, 0.75, 0.5)


@dataclass(frozen=True)
class Job:
    regime: str  # "scratch" or "continued"
    retain: float
    metric: str
    selection: str
    seed: int

    @property
    def method(self) -> str:
        return "dense" if self.retain >= 1.0 else f"{self.metric}-{self.selection}"

    @property
    def name(self) -> str:
        return f"{self.regime}/{self.method}-r{self.retain:g}/seed{self.seed}"

    @property
    def is_pretrain(self) -> bool:
        """The dense scratch run of a seed: the scratch reference and the continued regime's starting point."""
        return self.regime == "scratch" and self.retain >= 1.0


def grid_jobs(grids: list[str], seeds: list[int]) -> list[Job]:
    """Every job of the grids, deduplicated, pretraining runs first."""
    jobs: list[Job] = []
    for seed in seeds:
        jobs.append(Job("scratch", 1.0, "lrm", "sample", seed))
        jobs.append(Job("continued", 1.0, "lrm", "sample", seed))
        if "table2" in grids:
            for regime in ("scratch", "continued"):
                for metric in TABLE2_METRICS:
                    for selection in ("top", "sample"):
                        jobs.append(Job(regime, 0.75, metric, selection, seed))
        if "figure5" in grids:
            for retain in FIGURE5_RETAINS:
                for metric, selection in FIGURE5_METHODS:
                    jobs.append(Job("continued", retain, metric, selection, seed))
    unique = list(dict.fromkeys(jobs))
    return sorted(unique, key=lambda j: not j.is_pretrain)


def _checkpoint(out_dir: Path, seed: int) -> Path:
    return out_dir / "checkpoints" / f"dense-scratch-seed{seed}.pt"


def _log_file(out_dir: Path, job: Job) -> Path:
    return out_dir / job.name / f"retain_{job.retain:g}.json"


def job_argv(job: Job, out_dir: Path, args: argparse.Namespace) -> list[str]:
    argv = [
        sys.executable, "-m", "lrmoe", "demo", "--preset", args.preset, "--retain", f"{job.retain:g}",
        "--metric", job.metric, "--selection", job.selection, "--seed", str(job.seed), "--device", args.device,
        "--out", str(out_dir / job.name), "--no-progress", "--no-plots", "--threads", str(args.threads),
    ]
    if args.steps:
        argv += ["--steps", str(args.steps)]
    if job.regime == "continued":
        argv += ["--corpus", "prose", "--init", str(_checkpoint(out_dir, job.seed)), "--lr", str(args.continued_lr)]
        if args.continued_steps:
            argv += ["--steps", str(args.continued_steps)]
    elif job.is_pretrain:
        argv += ["--save", str(_checkpoint(out_dir, job.seed))]
    return argv


def run_jobs(jobs: list[Job], out_dir: Path, args: argparse.Namespace) -> dict[Job, str]:
    """Run the jobs whose logs are missing, ``args.parallel`` at a time; a continued job waits until its seed's
    pretraining has written the checkpoint and is neither pending nor running (a re-run rewrites it). A pretraining
    run whose checkpoint is gone runs again. Stops starting jobs after ``args.time_limit`` seconds. Returns the
    jobs that failed or could not run, with why."""
    (out_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
    pretrain = {j.seed: j for j in jobs if j.is_pretrain}
    pending = [j for j in jobs if not _log_file(out_dir, j).exists()]
    for job in jobs:
        first = pretrain.get(job.seed)
        if job in pending and job.regime == "continued" and first is not None and first not in pending \
                and not _checkpoint(out_dir, job.seed).exists():
            pending.insert(0, first)  # its log is there but not the checkpoint the continued jobs start from
    print(f"study: {len(jobs)} jobs, {len(jobs) - len(pending)} already done, {len(pending)} to run", flush=True)
    start = time.monotonic()
    running: dict[Job, subprocess.Popen] = {}
    failed: dict[Job, str] = {}
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    while pending or running:
        for job, proc in list(running.items()):
            if proc.poll() is not None:
                del running[job]
                ok = proc.returncode == 0 and _log_file(out_dir, job).exists()
                if not ok:
                    failed[job] = f"see {out_dir / job.name / 'stdout.log'}"
                print(f"[{time.monotonic() - start:7.1f} s] {'done' if ok else 'FAILED'} {job.name}", flush=True)
        out_of_time = args.time_limit and time.monotonic() - start > args.time_limit
        ready, blocked = [], []
        for job in pending:
            first = pretrain.get(job.seed)
            if job.regime != "continued":
                ready.append(job)
            elif first in failed:
                blocked.append((job, "not run: its pretraining failed"))
            elif first is None and not _checkpoint(out_dir, job.seed).exists():
                blocked.append((job, f"not run: no pretraining job and no {_checkpoint(out_dir, job.seed)}"))
            elif first not in pending and first not in running:
                ready.append(job)
        for job, why in blocked:
            pending.remove(job)
            failed[job] = why
        while ready and len(running) < args.parallel and not out_of_time:
            job = ready.pop(0)
            pending.remove(job)
            log_path = out_dir / job.name / "stdout.log"
            log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(log_path, "w") as log:
                running[job] = subprocess.Popen(job_argv(job, out_dir, args), stdout=log, stderr=subprocess.STDOUT,
                                                env=env)
        if out_of_time and not running:
            print(f"study: time limit reached, {len(pending)} jobs left for a later call", flush=True)
            break
        time.sleep(0.5)
    return failed


def load_results(out_dir: Path) -> dict[tuple[str, str, float], dict[int, dict]]:
    """{(regime, method, retain): {seed: log}} for every finished job under ``out_dir``."""
    results: dict[tuple[str, str, float], dict[int, dict]] = {}
    for path in sorted(out_dir.glob("*/*/seed*/retain_*.json")):
        log = json.loads(path.read_text())
        regime, _, seed_dir = path.parent.relative_to(out_dir).parts
        retain = float(log["retain"])
        method = "dense" if retain >= 1.0 else f"{log['metric']}-{log['selection']}"
        results.setdefault((regime, method, retain), {})[int(seed_dir[4:])] = log
    return results


def _ppl_curve(log: dict) -> dict[int, float]:
    return {p["step"]: math.exp(p["heldout_loss"]) if p["heldout_loss"] is not None else math.inf
            for p in log["eval_curve"]}


def delta_ppl(log: dict, dense: dict) -> tuple[float, float]:
    """(mean over the run, final) held-out perplexity minus the dense run's, at the shared evaluation steps
    after step 0 (step 0 is the same model in both)."""
    mine, ref = _ppl_curve(log), _ppl_curve(dense)
    steps = sorted(s for s in mine if s in ref and s > 0)
    if not steps:
        return math.nan, math.nan
    gaps = [mine[s] - ref[s] for s in steps]
    return sum(gaps) / len(gaps), gaps[-1]


def _mean_sd(values: list[float], signed: bool = True) -> str:
    """mean ± sample standard deviation (n), over the finite values."""
    values = [v for v in values if math.isfinite(v)]
    if not values:
        return "n/a"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):{'+' if signed else ''}.4f} ± {sd:.4f} (n={len(values)})"


def report(out_dir: Path) -> str:
    """Markdown tables of the finished jobs, and plots next to them. Returns the markdown."""
    results = load_results(out_dir)
    lines: list[str] = []
    regimes = [r for r in ("scratch", "continued") if (r, "dense", 1.0) in results]
    for regime in regimes:
        dense = results[(regime, "dense", 1.0)]
        # A diverged run logs its NaN loss as null: infinite perplexity, left out of the mean and named.
        final = [math.exp(log["heldout_loss"]) if log["heldout_loss"] is not None else math.inf
                 for log in dense.values()]
        diverged = sorted(seed for seed, log in dense.items() if log["heldout_loss"] is None)
        lines += [f"### Regime {regime}: dense backward, final held-out perplexity {_mean_sd(final, signed=False)}"
                  + (f"; diverged seeds {diverged}" if diverged else ""), ""]
        lines += ["| retain | method | mean ΔPPL over the run | final ΔPPL | seeds |", "| --- | --- | --- | --- | --- |"]
        keys = sorted((k for k in results if k[0] == regime and k[1] != "dense"), key=lambda k: (-k[2], k[1]))
        for key in keys:
            pairs = [(log, dense[seed]) for seed, log in results[key].items() if seed in dense]
            gaps = [delta_ppl(log, ref) for log, ref in pairs]
            lines.append(f"| {key[2]:g} | {key[1]} | {_mean_sd([g[0] for g in gaps])} | "
                         f"{_mean_sd([g[1] for g in gaps])} | {sorted(results[key])} |")
        lines.append("")
    text = "\n".join(lines)
    (out_dir / "report.md").write_text(text + "\n")
    (out_dir / "results.json").write_text(json.dumps(_compact(results), indent=0) + "\n")
    for regime in regimes:
        _plot_table2_curves(results, regime, out_dir / f"table2_{regime}_curves.png")
    _plot_figure5(results, out_dir / "figure5_curves.png")
    return text


def _compact(results: dict) -> list[dict]:
    """Every finished job without its per-step history: what a report needs, small enough to keep in docs/results/."""
    keep = ("heldout_loss", "heldout_ppl", "train_loss", "retained_fraction", "score_mass_fraction", "ms_per_step",
            "eval_curve")
    return [
        {"regime": regime, "method": method, "retain": retain, "seed": seed, **{k: log.get(k) for k in keep},
         "steps": log["train_config"]["steps"] if "train_config" in log else None}
        for (regime, method, retain), logs in sorted(results.items())
        for seed, log in sorted(logs.items())
    ]


def _mean_curve(logs: list[dict]) -> tuple[list[int], list[float], list[float], list[float]]:
    """Steps, mean, min and max held-out perplexity over the logs, at the steps they share."""
    curves = [_ppl_curve(log) for log in logs]
    steps = sorted(set.intersection(*(set(c) for c in curves)))
    return (steps, [statistics.mean(c[s] for c in curves) for s in steps],
            [min(c[s] for c in curves) for s in steps], [max(c[s] for c in curves) for s in steps])


def _pyplot():
    from lrmoe.demo.plots import _pyplot as pyplot

    return pyplot()


def _plot_table2_curves(results: dict, regime: str, path: Path) -> None:
    """Held-out perplexity minus dense against step at retain 0.75, one panel per selection rule, one line per
    metric (mean over seeds of the per-seed gap; band = min..max over seeds)."""
    from lrmoe.demo.plots import have_matplotlib

    dense = results.get((regime, "dense", 1.0))
    if not have_matplotlib() or dense is None:
        return
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, selection in zip(axes, ("top", "sample")):
        for metric in TABLE2_METRICS:
            runs = results.get((regime, f"{metric}-{selection}", 0.75), {})
            gaps = []
            for seed, log in runs.items():
                if seed in dense:
                    mine, ref = _ppl_curve(log), _ppl_curve(dense[seed])
                    gaps.append({s: mine[s] - ref[s] for s in mine if s in ref and s > 0})
            if not gaps:
                continue
            steps = sorted(set.intersection(*(set(g) for g in gaps)))
            (line,) = ax.plot(steps, [statistics.mean(g[s] for g in gaps) for s in steps], label=metric)
            ax.fill_between(steps, [min(g[s] for g in gaps) for s in steps], [max(g[s] for g in gaps) for s in steps],
                            color=line.get_color(), alpha=0.15)
        ax.axhline(0.0, color="black", lw=0.8)
        ax.set(title=f"{regime}, retain 0.75, selection {selection}", xlabel="step",
               ylabel="held-out PPL minus dense (same seed)")
        ax.set_yscale("symlog", linthresh=0.05)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_figure5(results: dict, path: Path) -> None:
    """Held-out perplexity against step in the continued regime: one panel per method, one line per retain
    (mean over seeds, band = min..max)."""
    from lrmoe.demo.plots import have_matplotlib

    methods_present = any(("continued", f"{m}-{s}", r) in results for m, s in FIGURE5_METHODS for r in (0.9, 0.5))
    if not have_matplotlib() or ("continued", "dense", 1.0) not in results or not methods_present:
        return
    plt = _pyplot()
    methods = [f"{m}-{s}" for m, s in FIGURE5_METHODS]
    fig, axes = plt.subplots(1, len(methods), figsize=(5 * len(methods), 4), sharey=True)
    for ax, method in zip(axes, methods):
        for retain in (1.0, *FIGURE5_RETAINS):
            key = ("continued", "dense" if retain >= 1.0 else method, retain)
            if key not in results:
                continue
            steps, mean, low, high = _mean_curve(list(results[key].values()))
            (line,) = ax.plot(steps, mean, label=f"retain {retain:g}" + (" (dense)" if retain >= 1.0 else ""))
            ax.fill_between(steps, low, high, color=line.get_color(), alpha=0.15)
        ax.set(title=f"continued training: {method}", xlabel="step", ylabel="held-out perplexity")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_study_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("study", help="the quality study (ablation grids), run and report",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="study_command", required=True)
    run = commands.add_parser("run", help="run the missing jobs of the grids")
    run.add_argument("--grid", nargs="+", choices=GRIDS, default=list(GRIDS))
    run.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    run.add_argument("--device", default="cpu")
    run.add_argument("--preset", default="study", choices=sorted(_PRESETS),
                     help="model and run size passed to every demo job")
    run.add_argument("--steps", type=_positive_int, help="steps of the scratch runs (default: the preset's)")
    run.add_argument("--continued-steps", type=_positive_int, default=300,
                     help="steps of the continued runs (default 300: ~1 pass over the 2.1 MB prose corpus)")
    run.add_argument("--continued-lr", type=float, default=1e-3, help="peak learning rate of continued training")
    run.add_argument("--parallel", type=_positive_int, default=1, help="jobs at a time")
    run.add_argument("--threads", type=_positive_int, default=1, help="CPU threads per job")
    run.add_argument("--time-limit", type=float, default=0, help="start no job after this many seconds (0: none)")
    run.add_argument("--only", help="run only jobs whose name contains this text")
    run.add_argument("--out", default="runs/study")
    run.set_defaults(handler=_run_command)
    rep = commands.add_parser("report", help="tables and plots of the finished jobs")
    rep.add_argument("out", nargs="?", default="runs/study")
    rep.set_defaults(handler=_report_command)


def _report_command(args: argparse.Namespace) -> int:
    out_dir = Path(args.out)
    if not out_dir.is_dir():
        raise SystemExit(f"lrmoe study report: no study directory {out_dir}")
    text = report(out_dir)
    print(text if text.strip() else f"lrmoe study report: no finished jobs under {out_dir}")
    return 0 if text.strip() else 1


# The run settings every job's numbers depend on; a study directory holds jobs of one set of them, or the report
# would compare runs of different lengths (a resumed grid used to reuse a 6-step log beside 8-step runs). The
# device and thread count are not among them: a grid may be finished on another machine.
_SETTINGS = ("preset", "steps", "continued_steps", "continued_lr")


def _check_settings(out_dir: Path, args: argparse.Namespace) -> None:
    """Record the run settings in ``out_dir/settings.json`` on the first call; refuse a later call whose
    settings differ (SystemExit naming each differing option and both values)."""
    want = {key: getattr(args, key) for key in _SETTINGS}
    path = out_dir / "settings.json"
    if path.exists():
        have = json.loads(path.read_text())
        diff = [f"--{key.replace('_', '-')} {have.get(key)!r} there, {want[key]!r} now"
                for key in _SETTINGS if have.get(key) != want[key]]
        if diff:
            raise SystemExit(f"lrmoe study run: {out_dir} holds jobs run with other settings ({'; '.join(diff)}); "
                             f"run with the same settings or another --out")
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(want, indent=1) + "\n")


def _run_command(args: argparse.Namespace) -> int:
    out_dir = Path(args.out)
    _check_settings(out_dir, args)
    jobs = grid_jobs(args.grid, args.seeds)
    if args.only:
        selected = [j for j in jobs if args.only in j.name]
        # a continued job needs its seed's pretraining run (its checkpoint), and every job its dense reference
        needed = [j for j in jobs if j.retain >= 1.0 and any(
            (c.regime == j.regime or j.is_pretrain and c.regime == "continued") and c.seed == j.seed
            for c in selected)]
        jobs = list(dict.fromkeys(needed + selected))
    failed = run_jobs(jobs, out_dir, args)
    for job, why in failed.items():
        print(f"failed: {job.name} ({why})")
    print(report(out_dir))
    return 1 if failed else 0
