"""``lrmoe demo``: train the same tiny byte-level MoE LM dense and with LRMoE's selective backward, then compare.

The command's help text is ``DESCRIPTION`` below (plain text: argparse prints it as written).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pickle
import time
from dataclasses import replace
from pathlib import Path

import torch

from lrmoe.demo.data import load_corpus
from lrmoe.demo.model import ModelConfig, MoELM
from lrmoe.demo.plots import have_matplotlib, plot_expert_loads, plot_loss_curves
from lrmoe.demo.train import Run, TrainConfig, interleave, warmup
from lrmoe.functional._checks import check_backward_capacity

__all__ = ["add_demo_parser", "run_demo", "format_table"]

DEFAULT_RETAIN = (1.0, 0.75)

DESCRIPTION = """\
Train the same tiny byte-level MoE language model with the dense backward and with LRMoE's selective backward,
then compare.

Every run uses the same seed, so the same initial weights and the same batches; only --retain differs. The
runs train interleaved, a step of each in turn, so that the final table's ms/step (the mean time of a training
step) compares them under the same machine load. The default (two runs of 1,000 steps on the Python stdlib
sources) takes about 2 minutes on two CPU cores and writes a JSON log of every step and PNG plots (training
and held-out loss, the loss difference to the dense run, per-expert load before and after calibration in every
layer) to --out: runs/demo by default, and runs/demo-quick with --quick (runs/demo-PRESET with --preset
PRESET), so a smoke run never overwrites a full run's results. --quick is a few-second smoke run (CI)."""

# Presets: (model config, train config, corpus byte cap). Command-line flags override single fields.
_PRESETS = {
    "default": (
        ModelConfig(dim=128, n_layers=2, n_heads=4, max_seq_len=128, num_experts=8, top_k=2, expert_hidden_dim=128),
        TrainConfig(steps=1000, batch_size=16, seq_len=128, lr=3e-3, warmup_steps=50, eval_batches=8, log_every=10,
                    eval_every=100),
        4_000_000,
    ),
    "quick": (
        ModelConfig(dim=32, n_layers=2, n_heads=2, max_seq_len=32, num_experts=4, top_k=2, expert_hidden_dim=32),
        TrainConfig(steps=20, batch_size=8, seq_len=32, lr=1e-2, warmup_steps=2, eval_batches=2, log_every=5,
                    eval_every=10),
        500_000,
    ),
    # The quality study's size (GPU): ~13.6M parameters, E = 16, k = 4 (see lrmoe.demo.study).
    "study": (
        ModelConfig(dim=256, n_layers=4, n_heads=4, max_seq_len=256, num_experts=16, top_k=4, expert_hidden_dim=256),
        TrainConfig(steps=1000, batch_size=32, seq_len=256, lr=2e-3, warmup_steps=50, eval_batches=16,
                    log_every=50, eval_every=50),
        4_000_000,
    ),
}


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not 0.0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def _retain_value(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"retain must be in (0, 1], got {text}")
    return value


def add_demo_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the ``demo`` subcommand."""
    parser = subparsers.add_parser(
        "demo",
        help="train a tiny byte-level MoE LM dense and with selective backward, and compare",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--steps", type=_positive_int, help="optimiser steps per run (default 1000; 20 with --quick)")
    parser.add_argument(
        "--retain",
        type=_retain_value,
        nargs="+",
        default=list(DEFAULT_RETAIN),
        help="retain fractions to run, in order (default: 1.0 0.75)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed for weights, data order and sampling")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument(
        "--corpus", metavar="NAME|PATH",
        help="'python' (the stdlib sources, default), 'prose' (the Python docs' English text) or a text file",
    )
    parser.add_argument(
        "--out", metavar="DIR",
        help="write the JSON logs and PNG plots here (default runs/demo; runs/demo-quick with --quick, "
             "runs/demo-PRESET with another --preset); '' writes nothing",
    )
    parser.add_argument("--init", metavar="PATH", help="start from these model weights (continued training)")
    parser.add_argument("--save", metavar="PATH", help="save the final weights of the (last) run here")
    parser.add_argument("--eval-every", type=_non_negative_int,
                        help="held-out evaluation every this many steps (0: end only)")
    parser.add_argument("--no-progress", action="store_true", help="plain progress lines instead of a progress bar")
    parser.add_argument("--no-plots", action="store_true", help="write the JSON logs but no PNG plots")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="a tiny model and a handful of steps (CI smoke run)")
    size.add_argument(
        "--preset", choices=sorted(_PRESETS), help="model and run size (default 'default'; --quick means 'quick')"
    )
    parser.add_argument(
        "--metric", choices=("lrm", "grad_l2", "grad_abs", "random"), default="lrm",
        help="the score that ranks a token-expert pair for the backward (default lrm: gate^2 * |grad out|^2 * "
             "|SwiGLU activation|^2, the squared norm of the pair's term in its expert's weight gradient; grad_l2 "
             "and grad_abs leave out the activation; random is the control)",
    )
    parser.add_argument(
        "--selection", choices=("sample", "top"), default="sample",
        help="which pairs each expert keeps within its quota (default sample: unbiased, inclusion probability "
             "proportional to sqrt(score), kept pairs weighted 1/p; top: the highest scores, weight 1)",
    )
    parser.add_argument(
        "--policy", choices=("waterfill", "proportional"), default="waterfill",
        help="how the retain budget is split into per-expert quotas (default waterfill: trim only the most "
             "loaded experts, flattening the backward load; proportional: every expert keeps the same fraction)",
    )
    parser.add_argument(
        "--backward-capacity", type=float, metavar="FACTOR",
        help="LRMoE's backward_capacity for the runs with retain < 1: every expert keeps at most FACTOR times the "
             "balanced quota, and the backward runs batched GEMMs on padded blocks (the retain 1 run stays dense)",
    )
    parser.add_argument("--batch-size", type=_positive_int, help="sequences per step")
    parser.add_argument("--seq-len", type=_positive_int, help="bytes per sequence")
    parser.add_argument("--lr", type=_positive_float, help="peak learning rate")
    parser.add_argument("--log-every", type=_positive_int, help="print a progress line every this many steps")
    parser.add_argument(
        "--threads", type=_positive_int, help="torch intra-op threads on cpu (default: the cores this process may use)"
    )
    parser.set_defaults(handler=run_demo)
    return parser


def _configs(args: argparse.Namespace) -> tuple[ModelConfig, TrainConfig, int]:
    """The preset chosen by ``--preset`` or ``--quick``, with the flags that were given applied on top."""
    model_cfg, train_cfg, max_bytes = _PRESETS[args.preset or ("quick" if args.quick else "default")]
    overrides = {
        "steps": args.steps,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "lr": args.lr,
        "log_every": args.log_every,
        "eval_every": args.eval_every,
        "init_checkpoint": args.init,
        "save_checkpoint": args.save,
    }
    train_cfg = replace(
        train_cfg,
        seed=args.seed,
        device=args.device,
        compile=args.compile,
        **{k: v for k, v in overrides.items() if v is not None},
    )
    model_cfg = replace(
        model_cfg,
        max_seq_len=max(model_cfg.max_seq_len, train_cfg.seq_len),
        metric=args.metric,
        selection=args.selection,
        policy=args.policy,
    )
    return model_cfg, train_cfg, max_bytes


def _default_threads() -> int:
    """The number of cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _print_progress(record: dict) -> None:
    print(
        f"retain {record['retain']:.2f} | step {record['step']:>{len(str(record['steps']))}}/{record['steps']}"
        f" | loss {record['loss']:.4f} | ppl {math.exp(min(record['loss'], 50)):.2f} | lr {record['lr']:.2e}"
        f" | grad norm {record['grad_norm']:.3f} | retained {record['retained_fraction']:.3f}"
        f" | score mass {record['score_mass_fraction']:.3f} | {record['tokens_per_s']:,.0f} tok/s",
        flush=True,
    )


class _ProgressBar:
    """A tqdm bar (on stderr) updated at every logging step, or plain lines when tqdm is missing or disabled."""

    def __init__(self, retain: float, steps: int, enabled: bool, position: int = 0):
        self._bar = None
        if enabled:
            try:
                from tqdm.auto import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self._bar = tqdm(total=steps, desc=f"retain {retain:.2f}", unit="step", dynamic_ncols=True,
                                 position=position)
        self._done = 0

    def __call__(self, record: dict) -> None:
        if self._bar is None:
            _print_progress(record)
            return
        self._bar.update(record["step"] - self._done)
        self._done = record["step"]
        self._bar.set_postfix(
            loss=f"{record['loss']:.3f}", ppl=f"{math.exp(min(record['loss'], 50)):.2f}",
            retained=f"{record['retained_fraction']:.3f}", tok_s=f"{record['tokens_per_s']:,.0f}",
            refresh=False,
        )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


_COLUMNS = (
    ("retain", "retain", "{:.2f}"),
    ("train loss", "train_loss", "{:.4f}"),
    ("held-out loss", "heldout_loss", "{:.4f}"),
    ("held-out ppl", "heldout_ppl", "{:.3f}"),
    ("retained pairs", "retained_fraction", "{:.4f}"),
    ("bwd rows/step", "bwd_rows_per_step", "{:.0f}"),
    ("score mass", "score_mass_fraction", "{:.4f}"),
    ("ms/step", "ms_per_step", "{:.1f}"),
)

TIMING_NOTE = (
    "ms/step: the mean time of a training step (forward, backward, optimiser; evaluations not counted). The runs' "
    "steps were interleaved, so other work on the machine slows every run alike and the column compares the runs "
    "on this machine, at this model's size. The selective backward's speed-up is in large layers on a GPU, "
    "compiled (docs/performance.md)."
)


def format_table(results: list[dict]) -> str:
    """A plain-text table, one row per run, columns right-aligned."""
    rows = [[fmt.format(result[key]) for _, key, fmt in _COLUMNS] for result in results]
    headers = [title for title, _, _ in _COLUMNS]
    widths = [max(len(cell) for cell in column) for column in zip(headers, *rows)]
    lines = ["  ".join(cell.rjust(width) for cell, width in zip(line, widths)) for line in [headers, *rows]]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def _write_json(path: Path, payload: dict | list) -> None:
    # JSON has no NaN/Infinity; write them as null so any JSON reader can load the log.
    def clean(value):
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [clean(v) for v in value]
        return value

    path.write_text(json.dumps(clean(payload), indent=1) + "\n")


def _out_dir(args: argparse.Namespace) -> Path | None:
    """--out as given ('' for none), else runs/demo for the default preset and runs/demo-PRESET for another
    (--quick: runs/demo-quick), so a smoke run does not overwrite a full run's logs and plots."""
    if args.out is not None:
        return Path(args.out) if args.out else None
    preset = args.preset or ("quick" if args.quick else "default")
    return Path("runs/demo" if preset == "default" else f"runs/demo-{preset}")


def _log_path(out_dir: Path, retain: float) -> Path:
    return out_dir / f"retain_{retain:g}.json"


def run_demo(args: argparse.Namespace) -> int:
    """Run one training per ``--retain`` value with the same seed and data, print progress and a final table."""
    if len(set(args.retain)) != len(args.retain):
        raise SystemExit(f"lrmoe demo: --retain values must be distinct, got {args.retain}")
    model_cfg, train_cfg, max_bytes = _configs(args)
    if args.save and len(args.retain) > 1:
        raise SystemExit("lrmoe demo: --save keeps one run's weights; give a single --retain with it")
    if args.backward_capacity is not None:  # refused before any run trains, not when its layer is built
        if min(args.retain) >= 1.0:
            raise SystemExit("lrmoe demo: --backward-capacity applies to the runs with retain < 1, and --retain "
                             f"gives none ({args.retain})")
        try:
            check_backward_capacity(args.backward_capacity, min(args.retain), 1, False, args.policy)
        except ValueError as err:
            raise SystemExit(f"lrmoe demo: --backward-capacity: {err}") from None
    # Files named on the command line are checked before training, not found missing after it.
    if args.init and not Path(args.init).is_file():
        raise SystemExit(f"lrmoe demo: --init: no file {args.init}")
    if args.init:
        try:  # the preset's model must take these weights (a demo model: cheap to build twice)
            MoELM(model_cfg).load_state_dict(torch.load(args.init, map_location="cpu", weights_only=True))
        except (OSError, RuntimeError, ValueError, pickle.UnpicklingError) as err:
            raise SystemExit(f"lrmoe demo: --init {args.init}: not weights of this model (dim {model_cfg.dim}, "
                             f"{model_cfg.n_layers} layers, {model_cfg.num_experts} experts): "
                             f"{str(err).splitlines()[0]}") from None
    if args.save and not Path(args.save).resolve().parent.is_dir():
        raise SystemExit(f"lrmoe demo: --save: no directory {Path(args.save).resolve().parent}")
    out_dir = _out_dir(args)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)

    previous_threads = torch.get_num_threads()
    previous_precision = torch.get_float32_matmul_precision()
    if train_cfg.device == "cpu":
        torch.set_num_threads(args.threads or _default_threads())
    else:
        torch.set_float32_matmul_precision("high")  # TF32 tensor cores for the fp32 model on GPUs
    try:
        start = time.perf_counter()
        try:
            corpus = load_corpus(args.corpus, max_bytes)
        except (OSError, ValueError, RuntimeError) as err:
            raise SystemExit(f"lrmoe demo: --corpus {args.corpus}: {err}") from None
        for part, data_N in (("training", corpus.train_N), ("held-out", corpus.heldout_N)):
            if data_N.numel() <= train_cfg.seq_len:  # a window is seq_len + 1 bytes
                raise SystemExit(f"lrmoe demo: the corpus's {part} part has {data_N.numel()} bytes, fewer than a "
                                 f"window of seq_len + 1 = {train_cfg.seq_len + 1}")
        print(f"corpus: {corpus.describe()} (loaded in {time.perf_counter() - start:.2f} s)")
        print(
            f"model: dim {model_cfg.dim}, {model_cfg.n_layers} layers, {model_cfg.num_experts} experts, "
            f"top-{model_cfg.top_k}, expert hidden {model_cfg.expert_hidden_dim}; "
            f"metric {model_cfg.metric}, selection {model_cfg.selection}, policy {model_cfg.policy}"
            + (f", backward capacity {args.backward_capacity:g} (retain < 1)"
               if args.backward_capacity is not None else "")
        )
        print(
            f"train: {train_cfg.steps} steps, batch {train_cfg.batch_size} x {train_cfg.seq_len} bytes, "
            f"peak lr {train_cfg.lr:g}, seed {train_cfg.seed}, device {train_cfg.device}, "
            f"threads {torch.get_num_threads()}, compile {train_cfg.compile}",
            flush=True,
        )
        run_cfgs = [replace(model_cfg, retain=r, backward_capacity=args.backward_capacity if r < 1.0 else None)
                    for r in args.retain]
        for run_cfg in run_cfgs:  # each run's own path (retain < 1 runs kernels retain 1 does not), outside the timing
            warmup(run_cfg, train_cfg)
        bars = [_ProgressBar(retain, train_cfg.steps, enabled=not args.no_progress, position=i)
                for i, retain in enumerate(args.retain)]
        try:
            results = interleave([Run(run_cfg, train_cfg, corpus, log=bar) for run_cfg, bar in zip(run_cfgs, bars)])
        finally:
            for bar in bars:
                bar.close()
        for result in results:
            print(
                f"retain {result['retain']:.2f} done: held-out loss {result['initial_heldout_loss']:.4f} -> "
                f"{result['heldout_loss']:.4f}",
                flush=True,
            )
            if out_dir is not None:
                _write_json(_log_path(out_dir, result["retain"]), result)
    finally:
        torch.set_num_threads(previous_threads)
        torch.set_float32_matmul_precision(previous_precision)

    print()
    print(format_table(results))
    print()
    print(TIMING_NOTE)
    if out_dir is not None:
        summary = [{k: v for k, v in r.items() if k != "history"} for r in results]
        _write_json(out_dir / "summary.json", summary)
        written = [] if args.no_plots else _write_plots(results, out_dir)
        print(f"\nlogs{' and plots' if written else ''} written to {out_dir}")
    return 0


def _write_plots(results: list[dict], out_dir: Path) -> list[Path]:
    """loss_curves.png (with the difference to the dense run when there is one), and expert_loads_retain_R.png
    (every layer) for every run with retain < 1 (matplotlib permitting)."""
    if not have_matplotlib():
        print("matplotlib is not installed: no plots (pip install 'lrmoe[demo]')")
        return []
    paths = [plot_loss_curves(results, out_dir / "loss_curves.png", title="lrmoe demo")]
    for result in results:
        if result["retain"] < 1.0:
            paths.append(plot_expert_loads(result, out_dir / f"expert_loads_retain_{result['retain']:g}.png"))
    return paths
