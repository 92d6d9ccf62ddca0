"""benchmarks/train_e2e.py on the CPU: a tiny model trains a few steps per variant in both regimes and writes its
table, curves and results; the curve arithmetic (time to a target loss, loss at a clock or step) on curves worked
out by hand."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from benchmark_scripts import load_script_once

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def script():
    return load_script_once("train_e2e")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("e2e")
    cmd = [sys.executable, str(ROOT / "benchmarks" / "train_e2e.py"), "train", "--preset", "tiny", "--device", "cpu",
           "--no-compile", "--variants", "transformers", "lrmoe-1", "lrmoe-0.5", "--seeds", "0", "--max-steps", "6",
           "--eval-every", "2", "--cap-gib", "0.01", "--corpus-bytes", "300000", "--out", str(out)]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


def test_writes_table_and_plots(run_dir):
    table = (run_dir / "table.md").read_text()
    for name in ("| unconstrained | transformers |", "| unconstrained | lrmoe-0.5 |", "| constrained | transformers+ckpt |",
                 "| constrained | lrmoe-plan", "| constrained | lrmoe (0.5, "):
        assert name in table
    for regime in ("unconstrained", "constrained"):
        assert (run_dir / f"curves_{regime}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_every_run_trains_and_evaluates(run_dir):
    results = json.loads((run_dir / "results.json").read_text())
    runs = results["runs"]
    assert len(runs) == 6  # 3 unconstrained; constrained: the checkpointed reference, the plan, retain 0.5
    for key, per_seed in runs.items():
        run = per_seed["0"]
        assert "error" not in run, (key, run)
        steps, losses = [p[0] for p in run["curve"]], [p[2] for p in run["curve"]]
        assert steps == [0, 2, 4, 6], key  # held-out evaluation before training and every 2 steps
        assert all(math.isfinite(x) for x in losses + run["train_loss"]), key
        assert losses[-1] < losses[0] - 0.05, (key, losses)  # six steps at lr 1e-3 move a byte model well off ln 256
    # Every variant starts from the same function: the same initial held-out loss.
    initial = {key: per_seed["0"]["curve"][0][2] for key, per_seed in runs.items()}
    assert max(initial.values()) - min(initial.values()) < 1e-3, initial
    plan = results["plans"]["constrained"]["lrmoe"]
    assert plan["retain"] in (1.0, 0.875, 0.75, 0.625, 0.5, 0.375, 0.25) and plan["activations"] in ("save",
                                                                                                    "recompute")


def test_curve_arithmetic(script):
    curve = [(0, 0.0, 5.0), (10, 2.0, 3.0), (20, 4.0, 2.0)]  # (step, clock s, held-out loss)
    assert script.time_to(curve, 4.0) == pytest.approx(1.0)  # halfway down the first segment
    assert script.time_to(curve, 2.5) == pytest.approx(3.0)
    assert script.time_to(curve, 1.9) is None  # never reached
    assert script.loss_at(curve, 3.0, 1) == pytest.approx(2.5)  # at 3 s
    assert script.loss_at(curve, 5, 0) == pytest.approx(4.0)  # at step 5
    assert script.loss_at(curve, 4.0, 1) == pytest.approx(2.0)
    assert script.loss_at(curve, 5.0, 1) is None  # past the curve's end


def test_summary_ratios(script):
    ref = dict(steps=20, seconds=4.0, tokens_per_s=1.0, peak_gib=1.0, curve=[(0, 0.0, 5.0), (20, 4.0, 2.0)])
    fast = dict(steps=30, seconds=4.0, tokens_per_s=1.5, peak_gib=1.0, curve=[(0, 0.0, 5.0), (30, 4.0, 1.7)])
    rows = script.summarize({"unconstrained/transformers": {"0": ref}, "unconstrained/lrmoe-0.5": {"0": fast}})
    row = next(r for r in rows if r["variant"] == "lrmoe-0.5")
    target = 2.0 * 1.005
    # the reference reaches the target at 4 * (5 - 2.01) / 3 s, the faster run at 4 * (5 - 2.01) / 3.3 s
    assert row["ratio"] == pytest.approx(3.0 / 3.3)
    assert row["time_to_target"] == pytest.approx(4.0 * (5.0 - target) / 3.3)
    assert row["step_time_ratio"] == pytest.approx(2.0 / 3.0)
    assert row["loss_at_ref_steps"] == pytest.approx(5.0 - 3.3 * 20 / 30)
