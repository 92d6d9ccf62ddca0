"""End-to-end test of ``python -m lrmoe demo --quick``, run in-process through ``lrmoe.__main__.main``.

One module-scoped run (dense then retain 0.75, JSON logs on) backs most tests; the reproducibility tests run the
0.75 case again. The whole file takes a few seconds on two CPU cores.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import time
from pathlib import Path

import pytest

from lrmoe.__main__ import main

SEED = 3
QUICK_STEPS = 20  # the --quick preset
LN_VOCAB = math.log(256)  # loss of a uniform guess over bytes


def run_main(argv: list[str]) -> tuple[int, str]:
    """main(argv) with stdout captured; returns (exit status, printed text)."""
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        status = main(argv)
    return status, buffer.getvalue()


def read_log(out_dir: Path, retain: str) -> dict:
    return json.loads((out_dir / f"retain_{retain}.json").read_text())


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory) -> tuple[int, str, Path]:
    out_dir = tmp_path_factory.mktemp("demo")
    status, text = run_main(["demo", "--quick", "--seed", str(SEED), "--out", str(out_dir)])
    return status, text, out_dir


def table_rows(text: str) -> dict[str, list[str]]:
    """The final table's rows keyed by their retain cell (the lines after the header and its dashes)."""
    lines = text.splitlines()
    header = max(i for i, line in enumerate(lines) if line.split()[:1] == ["retain"] and "held-out" in line)
    rows = {}
    for line in lines[header + 2 :]:
        cells = line.split()
        if not cells:
            break
        rows[cells[0]] = cells
    return rows


def test_exit_status_and_table_has_both_rows(quick_run):
    status, text, _ = quick_run
    assert status == 0
    rows = table_rows(text)
    assert set(rows) == {"1.00", "0.75"}
    assert all(len(cells) == 8 for cells in rows.values())
    # expert-backward rows per step: all routed pairs when dense, 75% of them at retain 0.75
    dense_rows, sparse_rows = float(rows["1.00"][5]), float(rows["0.75"][5])
    assert sparse_rows == pytest.approx(0.75 * dense_rows, abs=1)


def test_training_reduces_heldout_loss(quick_run):
    _, _, out_dir = quick_run
    for retain in ("1", "0.75"):
        result = read_log(out_dir, retain)
        assert result["heldout_loss"] is not None and math.isfinite(result["heldout_loss"])
        assert result["heldout_loss"] < LN_VOCAB
        assert result["heldout_loss"] < result["initial_heldout_loss"] - 0.5
        assert result["heldout_ppl"] == pytest.approx(math.exp(result["heldout_loss"]))


def test_retained_fraction_matches_retain(quick_run):
    _, _, out_dir = quick_run
    dense, sparse = read_log(out_dir, "1"), read_log(out_dir, "0.75")
    assert dense["retained_fraction"] == 1.0
    assert all(step["retained_fraction"] == 1.0 for step in dense["history"])
    assert dense["score_mass_fraction"] == pytest.approx(1.0)
    assert abs(sparse["retained_fraction"] - 0.75) <= 0.05
    # Fewer pairs keep less score mass, but more than their share: the metric favours heavy pairs.
    assert 0.75 <= sparse["score_mass_fraction"] < 1.0


def test_json_log_has_one_entry_per_step(quick_run):
    _, _, out_dir = quick_run
    for retain in ("1", "0.75"):
        history = read_log(out_dir, retain)["history"]
        assert [step["step"] for step in history] == list(range(1, QUICK_STEPS + 1))
        assert all(math.isfinite(step["loss"]) for step in history)
    summary = json.loads((out_dir / "summary.json").read_text())
    assert [row["retain"] for row in summary] == [1.0, 0.75]


def test_same_seed_gives_identical_losses(quick_run, tmp_path):
    _, _, first_dir = quick_run
    status, _ = run_main(["demo", "--quick", "--seed", str(SEED), "--retain", "0.75", "--out", str(tmp_path)])
    assert status == 0
    first, again = read_log(first_dir, "0.75"), read_log(tmp_path, "0.75")
    assert [s["loss"] for s in again["history"]] == [s["loss"] for s in first["history"]]
    assert again["heldout_loss"] == first["heldout_loss"]


def test_other_seed_gives_other_losses(quick_run, tmp_path):
    _, _, first_dir = quick_run
    argv = ["demo", "--quick", "--seed", str(SEED + 1), "--retain", "1.0", "--steps", "3", "--out", str(tmp_path)]
    assert run_main(argv)[0] == 0
    first, other = read_log(first_dir, "1"), read_log(tmp_path, "1")
    assert other["history"][0]["loss"] != first["history"][0]["loss"]


def test_a_burst_of_load_slows_both_runs_alike(tmp_path, monkeypatch):
    """Other work on the machine during the first half of the demo (here a 0.1 s sleep in each of the first 10
    training steps the process takes, of 2 runs x 10 steps) slows the dense run and the retain 0.75 run alike: they
    train interleaved. Run one after the other, the dense run took all of it and looked 6x slower."""
    import lrmoe.demo.train as train_module

    real_step, calls = train_module._train_step, []

    def loaded_step(*args, **kwargs):
        calls.append(None)
        if len(calls) <= 10:
            time.sleep(0.1)
        return real_step(*args, **kwargs)

    monkeypatch.setattr(train_module, "_train_step", loaded_step)
    argv = ["demo", "--quick", "--steps", "10", "--threads", "1", "--no-progress", "--no-plots", "--out", str(tmp_path)]
    status, text = run_main(argv)
    assert status == 0 and len(calls) == 20
    dense, sparse = read_log(tmp_path, "1")["ms_per_step"], read_log(tmp_path, "0.75")["ms_per_step"]
    assert min(dense, sparse) > 50  # each run took half of the 1 s of load: 5 sleeps of 0.1 s over 10 steps
    assert 0.5 < dense / sparse < 2, (dense, sparse)
    header = [line for line in text.splitlines() if line.split()[:1] == ["retain"] and "held-out" in line][-1]
    assert header.split()[-1] == "ms/step"
    assert "ms/step: the mean time of a training step" in text and "interleaved" in text  # what the figure means


def test_every_run_is_warmed_up_on_its_own_path_before_the_timed_steps(tmp_path, monkeypatch):
    """The first step in a process pays one-off costs (lazy imports; on a GPU, Triton compiling the selection and
    scoring kernels, which only retain < 1 runs). A throwaway step of each run's own configuration pays them before
    any timed step; warming up the dense model alone left them in the retain 0.75 run's ms/step."""
    import lrmoe.demo.cli as cli_module

    events, real_warmup, real_interleave = [], cli_module.warmup, cli_module.interleave

    def spy_warmup(model_cfg, train_cfg):
        events.append(("warmup", model_cfg.retain, model_cfg.backward_capacity))
        return real_warmup(model_cfg, train_cfg)

    def spy_interleave(runs):
        events.append(("train",))
        return real_interleave(runs)

    monkeypatch.setattr(cli_module, "warmup", spy_warmup)
    monkeypatch.setattr(cli_module, "interleave", spy_interleave)
    argv = ["demo", "--quick", "--steps", "2", "--retain", "1.0", "0.5", "--backward-capacity", "1.0", "--threads",
            "1", "--no-progress", "--out", ""]
    assert run_main(argv)[0] == 0
    assert events == [("warmup", 1.0, None), ("warmup", 0.5, 1.0), ("train",)]


def test_user_corpus(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog.\n" * 500)
    argv = ["demo", "--quick", "--corpus", str(corpus), "--retain", "0.5", "--steps", "10", "--out", str(tmp_path)]
    status, text = run_main(argv)
    assert status == 0
    assert str(corpus) in text
    result = read_log(tmp_path, "0.5")
    assert len(result["history"]) == 10
    assert abs(result["retained_fraction"] - 0.5) <= 0.05
    assert result["heldout_loss"] < result["initial_heldout_loss"]


def test_plots_and_eval_curve_are_written(quick_run):
    _, text, out_dir = quick_run
    for name in ("loss_curves.png", "expert_loads_retain_0.75.png"):
        data = (out_dir / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5_000
    curve = read_log(out_dir, "0.75")["eval_curve"]
    assert [p["step"] for p in curve] == [0, 10, 20]  # --quick evaluates every 10 steps
    assert curve[-1]["heldout_loss"] == read_log(out_dir, "0.75")["heldout_loss"]
    loads = read_log(out_dir, "0.75")["mean_expert_loads"]
    quotas = read_log(out_dir, "0.75")["mean_expert_quotas"]
    assert all(q <= l for ql, ll in zip(quotas, loads) for q, l in zip(ql, ll))
    assert sum(map(sum, quotas)) == pytest.approx(0.75 * sum(map(sum, loads)), rel=0.01)


def test_continued_training_from_a_saved_checkpoint(tmp_path):
    ckpt = tmp_path / "dense.pt"
    argv = ["demo", "--quick", "--retain", "1.0", "--steps", "15", "--save", str(ckpt), "--out", str(tmp_path / "a")]
    assert run_main(argv)[0] == 0
    pretrained = read_log(tmp_path / "a", "1")
    argv = ["demo", "--quick", "--retain", "0.75", "--steps", "5", "--corpus", "prose", "--init", str(ckpt),
            "--out", str(tmp_path / "b")]
    status, text = run_main(argv)
    assert status == 0 and "prose" in text
    continued = read_log(tmp_path / "b", "0.75")
    # starting from the pretrained weights: the first step's loss is far below a fresh model's (ln 256)
    assert continued["history"][0]["loss"] < pretrained["history"][0]["loss"] - 0.5


def test_save_needs_a_single_run(tmp_path):
    with pytest.raises(SystemExit, match="--save"):
        run_main(["demo", "--quick", "--save", str(tmp_path / "x.pt"), "--out", ""])


def test_backward_capacity_runs_the_capped_blocked_backward_at_retain_below_one(tmp_path):
    # Factor 1.0 under the quick model's untrained router: the runs at retain < 1 cap every expert at the balanced
    # quota, so they keep at most what retain asks (less where an expert's load passes it); retain 1 stays dense.
    status, text = run_main(["demo", "--quick", "--seed", str(SEED), "--retain", "1.0", "0.5",
                             "--backward-capacity", "1.0", "--out", str(tmp_path)])
    assert status == 0 and "backward capacity 1 (retain < 1)" in text
    dense, capped = read_log(tmp_path, "1"), read_log(tmp_path, "0.5")
    assert dense["backward_capacity"] is None and dense["retained_fraction"] == 1.0
    assert capped["backward_capacity"] == 1.0
    assert 0 < capped["retained_fraction"] <= 0.5
    assert math.isfinite(capped["heldout_loss"]) and capped["heldout_loss"] < LN_VOCAB
    # The backward's GEMMs run E padded blocks of C rows per layer, not the kept pairs: quick model, 2 layers,
    # E = 4, k = 2, 8 x 32 tokens a step, C = ceil(1.0 * floor(0.5 * 512) / 4) rounded up to 8 = 64.
    assert capped["bwd_rows_per_step"] == 2 * 4 * 64
    assert dense["bwd_rows_per_step"] == 2 * 8 * 32 * 2


@pytest.mark.parametrize("argv, match", [
    (["--backward-capacity", "0.5"], "finite float >= 1"),
    (["--backward-capacity", "1.0", "--retain", "1.0"], "retain < 1"),
    (["--backward-capacity", "1.0", "--policy", "proportional"], "waterfill"),
])
def test_bad_backward_capacity_is_refused_before_training(argv, match):
    with pytest.raises(SystemExit, match=match):
        run_main(["demo", "--quick", "--out", "", *argv])


def test_bad_files_and_values_are_refused_before_training(tmp_path):
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("tiny")
    cases = [
        (["--corpus", str(tmp_path / "missing.txt")], "--corpus"),
        (["--corpus", str(tiny)], "fewer than a window"),
        (["--init", str(tmp_path / "missing.pt")], "--init: no file"),
        (["--retain", "1", "--save", str(tmp_path / "no_dir" / "w.pt")], "--save: no directory"),
    ]
    for argv, match in cases:
        with pytest.raises(SystemExit, match=match):
            run_main(["demo", "--quick", "--steps", "1", "--out", "", *argv])
    for argv in (["--eval-every", "-3"], ["--lr", "nan"], ["--preset", "default"]):  # argparse: exit status 2
        with pytest.raises(SystemExit):
            run_main(["demo", "--quick", "--steps", "1", "--out", "", *argv])


# ------------------------------------------------------------------------------------- output folder, help, plots


def test_quick_writes_to_its_own_folder_not_over_the_full_runs(tmp_path, monkeypatch):
    """--quick once wrote to runs/demo, over the full run's logs and plots; it has runs/demo-quick now."""
    monkeypatch.chdir(tmp_path)
    full = tmp_path / "runs" / "demo"
    full.mkdir(parents=True)
    (full / "retain_1.json").write_text("{}")  # a full run's log
    status, text = run_main(["demo", "--quick", "--steps", "2", "--retain", "1.0", "--no-progress", "--no-plots"])
    assert status == 0 and "written to runs/demo-quick" in text
    assert read_log(tmp_path / "runs" / "demo-quick", "1")["steps"] == 2
    assert (full / "retain_1.json").read_text() == "{}"
    from lrmoe.__main__ import build_parser
    from lrmoe.demo.cli import _out_dir

    def out(*argv):
        return _out_dir(build_parser().parse_args(["demo", *argv]))

    assert (out(), out("--preset", "study"), out("--quick", "--out", "x"), out("--out", "")) == (
        Path("runs/demo"), Path("runs/demo-study"), Path("x"), None)


def test_help_is_plain_text_and_explains_every_choice():
    from lrmoe.__main__ import build_parser

    parser = build_parser()
    demo = parser._subparsers._group_actions[0].choices["demo"]
    text = demo.format_help()
    assert "``" not in text and "runs/demo-quick" in text
    helps = {a.dest: a.help for a in demo._actions}
    assert "inclusion probability" in helps["selection"] and "waterfill" in helps["policy"]
    assert "gate^2" in helps["metric"]
    for dest in ("metric", "selection", "policy"):  # each choice named in its help
        action = next(a for a in demo._actions if a.dest == dest)
        assert all(choice in action.help for choice in action.choices), dest


def _run_result(retain: float, losses: list[float], n_layers: int = 3) -> dict:
    return {"retain": retain, "metric": "lrm", "selection": "sample",
            "history": [{"step": i + 1, "loss": v} for i, v in enumerate(losses)],
            "eval_curve": [{"step": 0, "heldout_loss": 5.0}, {"step": len(losses), "heldout_loss": losses[-1]}],
            "mean_expert_loads": [[8.0, 4.0, 2.0, 2.0]] * n_layers,
            "mean_expert_quotas": [[5.0, 4.0, 2.0, 1.0]] * n_layers}


def test_loss_figure_has_a_difference_panel_and_loads_one_panel_per_layer():
    pytest.importorskip("matplotlib")
    from lrmoe.demo.plots import expert_loads_figure, loss_curves_figure

    dense, sparse = _run_result(1.0, [5.0, 4.0, 3.5, 3.0]), _run_result(0.5, [5.0, 4.25, 3.5, 3.125])
    fig = loss_curves_figure([dense, sparse])
    assert len(fig.axes) == 3
    diff_ax = fig.axes[2]
    raw = diff_ax.lines[0]  # the per-step difference of the retain-0.5 run
    assert list(raw.get_xdata()) == [1, 2, 3, 4] and list(raw.get_ydata()) == [0.0, 0.25, 0.0, 0.125]
    assert "dense" in diff_ax.get_ylabel()
    assert len(loss_curves_figure([sparse]).axes) == 2  # no dense run: nothing to subtract
    loads = expert_loads_figure(sparse)
    assert [ax.get_title() for ax in loads.axes] == ["layer 0", "layer 1", "layer 2"]
    assert [p.get_height() for p in loads.axes[2].patches[4:]] == [5.0, 4.0, 2.0, 1.0]  # quotas, by load


def test_the_demo_writes_its_plot_files(quick_run):
    pytest.importorskip("matplotlib")
    import matplotlib.image

    _, _, out_dir = quick_run
    loss = matplotlib.image.imread(out_dir / "loss_curves.png")
    loads = matplotlib.image.imread(out_dir / "expert_loads_retain_0.75.png")
    # Pixel sizes are the figure sizes at 120 dpi: 3 panels of 5.5 x 4 inches (2 panels would be 11 x 4), and the
    # quick model's 2 layers of 4.5 x 3.6 (one layer was 7 x 3.8).
    assert loss.shape[:2] == (480, 1980)
    assert loads.shape[:2] == (432, 1080)
