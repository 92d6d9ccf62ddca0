"""benchmarks/train_e2e.py on the CPU: a tiny model trains a few steps per variant in both regimes and writes its
table, curves and results; the curve arithmetic of benchmarks/e2e_common.py (time to a target loss, loss at a clock
or step) on curves worked out by hand."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import e2e_common
import pytest


def test_tiny_run_trains_every_variant_in_both_regimes_and_writes_table_plots_results(run_script, tmp_path):
    run_script("train_e2e.py", "train", "--preset", "tiny", "--device", "cpu", "--no-compile", "--variants",
               "transformers", "lrmoe-1", "lrmoe-0.5", "--seeds", "0", "--max-steps", "6", "--eval-every", "2",
               "--cap-gib", "0.01", "--corpus-bytes", "300000", "--out", "out", timeout=600)
    run_dir = tmp_path / "out"
    table = (run_dir / "table.md").read_text()
    for name in ("| unconstrained | transformers |", "| unconstrained | lrmoe-0.5 |", "| constrained | transformers+ckpt |",
                 "| constrained | lrmoe-plan", "| constrained | lrmoe (0.5, "):
        assert name in table
    for regime in ("unconstrained", "constrained"):
        assert (run_dir / f"curves_{regime}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

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


def test_curve_arithmetic():
    curve = [(0, 0.0, 5.0), (10, 2.0, 3.0), (20, 4.0, 2.0)]  # (step, clock s, held-out loss)
    assert e2e_common.time_to(curve, 4.0) == pytest.approx(1.0)  # halfway down the first segment
    assert e2e_common.time_to(curve, 2.5) == pytest.approx(3.0)
    assert e2e_common.time_to(curve, 1.9) is None  # never reached
    assert e2e_common.loss_at(curve, 3.0, 1) == pytest.approx(2.5)  # at 3 s
    assert e2e_common.loss_at(curve, 5, 0) == pytest.approx(4.0)  # at step 5
    assert e2e_common.loss_at(curve, 4.0, 1) == pytest.approx(2.0)
    assert e2e_common.loss_at(curve, 5.0, 1) is None  # past the curve's end


def test_summary_ratios():
    ref = dict(steps=20, seconds=4.0, tokens_per_s=1.0, peak_gib=1.0, curve=[(0, 0.0, 5.0), (20, 4.0, 2.0)])
    fast = dict(steps=30, seconds=4.0, tokens_per_s=1.5, peak_gib=1.0, curve=[(0, 0.0, 5.0), (30, 4.0, 1.7)])
    rows = e2e_common.summarize({"unconstrained/transformers": {"0": ref}, "unconstrained/lrmoe-0.5": {"0": fast}})
    row = next(r for r in rows if r["variant"] == "lrmoe-0.5")
    target = 2.0 * 1.005
    # the reference reaches the target at 4 * (5 - 2.01) / 3 s, the faster run at 4 * (5 - 2.01) / 3.3 s
    assert row["ratio"] == pytest.approx(3.0 / 3.3)
    assert row["time_to_target"] == pytest.approx(4.0 * (5.0 - target) / 3.3)
    assert row["step_time_ratio"] == pytest.approx(2.0 / 3.0)
    assert row["loss_at_ref_steps"] == pytest.approx(5.0 - 3.3 * 20 / 30)


def test_import_order_child_starts_without_lrmoe_or_transformers():
    # layer.py imports runs each scenario in a fresh interpreter that imports e2e_common first (scenario_command):
    # importing it must not import what the scenarios put before SonicMoE.
    code = (f"import sys; sys.path.insert(0, {str(Path(e2e_common.__file__).parent)!r}); import e2e_common; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'lrmoe', 'transformers', 'sonicmoe', 'common'}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"
    assert e2e_common.scenario_command("sonic", 5)[-2:] == ["sonic", "5"]


@pytest.mark.parametrize("name", ["transformers", "sonic", "lrmoe-1", "lrmoe-0.75", "lrmoe-0.5-top", "lrmoe-1-top",
                                  "lrmoe-1-hopper", "lrmoe-0.5-top-portable", "lrmoe-0.5-savey",
                                  "lrmoe-0.5-top-savey-portable"])
def test_variant_names_accepted(name):
    assert e2e_common.variant_name(name) == name


def test_a_variant_names_its_kernels_selection_and_saved_outputs():
    assert [(e2e_common.selection_of(v), e2e_common.kernels_of(v), e2e_common.save_outputs_of(v)) for v in
            ("lrmoe-0.5", "lrmoe-0.5-hopper", "lrmoe-0.5-top-portable", "lrmoe-1-top", "lrmoe-0.5-top-savey-hopper",
             "transformers")] == [
        ("sample", "auto", False), ("sample", "hopper", False), ("top", "portable", False), ("top", "auto", False),
        ("top", "hopper", True), ("sample", "auto", False)]


@pytest.mark.parametrize("name", ["lrmoe", "lrmoe-0", "lrmoe-1.5", "lrmoe-x", "lrmoe-0.5-bottom", "lrmoe-0.5-top-x",
                                  "lrmoe-0.5-hopper-top", "lrmoe-0.5-savey-top", "dense", "transformers-top"])
def test_variant_names_refused_with_what_is_expected(name):
    with pytest.raises(Exception, match=r"lrmoe-<retain in \(0, 1\]>\[-top\]\[-savey\]\[-portable\|-hopper\], got"):
        e2e_common.variant_name(name)


def test_a_top_variant_builds_lrmoe_with_top_selection_at_its_retain():
    c = e2e_common.PRESETS["tiny"]
    for name, selection in (("lrmoe-0.5-top", "top"), ("lrmoe-0.5", "sample")):
        assert e2e_common.retain_of(name) == 0.5 and e2e_common.selection_of(name) == selection
        moe = e2e_common.make_moe(name.split("-")[0], c, "cpu", e2e_common.retain_of(name),
                                  selection=e2e_common.selection_of(name))
        assert (moe.backward.selection, moe.backward.retain) == (selection, 0.5)
    assert e2e_common.selection_of("transformers") == "sample"


def test_train_refuses_an_unknown_variant_naming_the_argument():
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "train_e2e.py"
    run = subprocess.run([sys.executable, str(script), "train", "--variants", "lrmoe-0.5-bottom"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "--variants" in run.stderr and "lrmoe-0.5-bottom" in run.stderr, run.stderr
