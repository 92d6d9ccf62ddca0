"""``lrmoe demo``: train the same tiny byte-level MoE LM dense and with LRMoE's selective backward, then compare.

Every run uses the same seed, so the same initial weights and the same batches; only ``retain`` differs. The
default (two runs of 300 steps on the stdlib sources) takes about a minute on two CPU cores; ``--quick`` is a
few-second smoke run for CI.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import replace
from pathlib import Path

import torch

from lrmoe.demo.data import load_corpus
from lrmoe.demo.model import ModelConfig
from lrmoe.demo.train import TrainConfig, train, warmup

__all__ = ["add_demo_parser", "run_demo", "format_table"]

DEFAULT_RETAIN = (1.0, 0.75)

# Presets: (model config, train config, corpus byte cap). Command-line flags override single fields.
_PRESETS = {
    "default": (
        ModelConfig(dim=128, n_layers=2, n_heads=4, max_seq_len=128, num_experts=8, top_k=2, expert_hidden_dim=128),
        TrainConfig(steps=300, batch_size=16, seq_len=128, lr=3e-3, warmup_steps=20, eval_batches=8, log_every=10),
        4_000_000,
    ),
    "quick": (
        ModelConfig(dim=32, n_layers=2, n_heads=2, max_seq_len=32, num_experts=4, top_k=2, expert_hidden_dim=32),
        TrainConfig(steps=20, batch_size=8, seq_len=32, lr=1e-2, warmup_steps=2, eval_batches=2, log_every=5),
        500_000,
    ),
}


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
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
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--steps", type=_positive_int, help="optimiser steps per run (default 300; 20 with --quick)")
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
    parser.add_argument("--corpus", metavar="PATH", help="train on this text file instead of the stdlib sources")
    parser.add_argument("--out", metavar="DIR", help="write a JSON log of every step and a summary here")
    parser.add_argument("--quick", action="store_true", help="a tiny model and a handful of steps (CI smoke run)")
    parser.add_argument("--metric", choices=("lrm", "grad_l2", "grad_abs", "random"), default="lrm")
    parser.add_argument("--selection", choices=("sample", "top"), default="sample")
    parser.add_argument("--policy", choices=("waterfill", "proportional"), default="waterfill")
    parser.add_argument("--batch-size", type=_positive_int, help="sequences per step")
    parser.add_argument("--seq-len", type=_positive_int, help="bytes per sequence")
    parser.add_argument("--lr", type=float, help="peak learning rate")
    parser.add_argument("--log-every", type=_positive_int, help="print a progress line every this many steps")
    parser.add_argument(
        "--threads", type=_positive_int, help="torch intra-op threads on cpu (default: the cores this process may use)"
    )
    parser.set_defaults(handler=run_demo)
    return parser


def _configs(args: argparse.Namespace) -> tuple[ModelConfig, TrainConfig, int]:
    """The preset chosen by ``--quick``, with the flags that were given applied on top."""
    model_cfg, train_cfg, max_bytes = _PRESETS["quick" if args.quick else "default"]
    overrides = {
        "steps": args.steps,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "lr": args.lr,
        "log_every": args.log_every,
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
        f" | loss {record['loss']:.4f} | lr {record['lr']:.2e} | grad norm {record['grad_norm']:.3f}"
        f" | retained {record['retained_fraction']:.3f} | score mass {record['score_mass_fraction']:.3f}"
        f" | {record['ms_per_step']:.0f} ms/step",
        flush=True,
    )


_COLUMNS = (
    ("retain", "retain", "{:.2f}"),
    ("train loss", "train_loss", "{:.4f}"),
    ("held-out loss", "heldout_loss", "{:.4f}"),
    ("held-out ppl", "heldout_ppl", "{:.3f}"),
    ("retained pairs", "retained_fraction", "{:.4f}"),
    ("score mass", "score_mass_fraction", "{:.4f}"),
    ("wall s", "wall_s", "{:.1f}"),
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


def _log_path(out_dir: Path, retain: float) -> Path:
    return out_dir / f"retain_{retain:g}.json"


def run_demo(args: argparse.Namespace) -> int:
    """Run one training per ``--retain`` value with the same seed and data, print progress and a final table."""
    if len(set(args.retain)) != len(args.retain):
        raise SystemExit(f"lrmoe demo: --retain values must be distinct, got {args.retain}")
    model_cfg, train_cfg, max_bytes = _configs(args)
    out_dir = Path(args.out) if args.out else None
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)

    previous_threads = torch.get_num_threads()
    if train_cfg.device == "cpu":
        torch.set_num_threads(args.threads or _default_threads())
    try:
        start = time.perf_counter()
        corpus = load_corpus(args.corpus, max_bytes)
        print(f"corpus: {corpus.describe()} (loaded in {time.perf_counter() - start:.2f} s)")
        print(
            f"model: dim {model_cfg.dim}, {model_cfg.n_layers} layers, {model_cfg.num_experts} experts, "
            f"top-{model_cfg.top_k}, expert hidden {model_cfg.expert_hidden_dim}; "
            f"metric {model_cfg.metric}, selection {model_cfg.selection}, policy {model_cfg.policy}"
        )
        print(
            f"train: {train_cfg.steps} steps, batch {train_cfg.batch_size} x {train_cfg.seq_len} bytes, "
            f"peak lr {train_cfg.lr:g}, seed {train_cfg.seed}, device {train_cfg.device}, "
            f"threads {torch.get_num_threads()}, compile {train_cfg.compile}",
            flush=True,
        )
        warmup(model_cfg, train_cfg)
        results = []
        for retain in args.retain:
            result = train(replace(model_cfg, retain=retain), train_cfg, corpus, log=_print_progress)
            print(
                f"retain {retain:.2f} done: held-out loss {result['initial_heldout_loss']:.4f} -> "
                f"{result['heldout_loss']:.4f} in {result['wall_s']:.1f} s",
                flush=True,
            )
            if out_dir is not None:
                _write_json(_log_path(out_dir, retain), result)
            results.append(result)
    finally:
        torch.set_num_threads(previous_threads)

    print()
    print(format_table(results))
    if out_dir is not None:
        summary = [{k: v for k, v in r.items() if k != "history"} for r in results]
        _write_json(out_dir / "summary.json", summary)
        print(f"\nlogs written to {out_dir}")
    return 0
