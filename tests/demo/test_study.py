"""The quality-study runner: the grids, the ΔPPL arithmetic, the report, and a tiny real run."""

from __future__ import annotations

import contextlib
import io
import json
import math

import pytest

from lrmoe.__main__ import main
from lrmoe.demo.study import Job, delta_ppl, grid_jobs, report


def test_grids_hold_the_planned_jobs_once_each():
    jobs = grid_jobs(["table2", "figure5"], [0, 1])
    names = [j.name for j in jobs]
    assert len(names) == len(set(names))
    per_seed = [j for j in jobs if j.seed == 0]
    # 2 dense references + 4 metrics x 2 selections x 2 regimes + 3 retains x 3 methods, minus the three
    # continued retain-0.75 jobs the grids share
    assert len(per_seed) == 2 + 16 + 9 - 3
    assert jobs[0].is_pretrain and jobs[1].is_pretrain  # pretraining (checkpoints) first
    assert {j.retain for j in jobs} == {1.0, 0.9, 0.75, 0.5}
    assert Job("continued", 0.5, "random", "top", 1) in jobs
    assert Job("scratch", 0.5, "lrm", "sample", 0) not in jobs  # figure 5 is the continued regime only
    assert len(grid_jobs(["table2"], [0])) == 18


def _log(losses_by_step: dict[int, float], retain=0.75, metric="lrm", selection="sample") -> dict:
    steps = sorted(losses_by_step)
    return {"retain": retain, "metric": metric, "selection": selection,
            "heldout_loss": losses_by_step[steps[-1]],
            "eval_curve": [{"step": s, "heldout_loss": losses_by_step[s]} for s in steps]}


def test_delta_ppl_is_the_mean_gap_after_step_zero():
    dense = _log({0: 5.0, 10: math.log(4.0), 20: math.log(3.0)}, retain=1.0)
    sparse = _log({0: 5.0, 10: math.log(4.5), 20: math.log(3.1)})
    mean, final = delta_ppl(sparse, dense)
    assert mean == pytest.approx((0.5 + 0.1) / 2)
    assert final == pytest.approx(0.1)


def test_report_tables_mean_and_spread_over_seeds(tmp_path):
    def write(job: Job, log: dict):
        path = tmp_path / job.name / f"retain_{job.retain:g}.json"
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps(log))

    for seed, gap in ((0, 0.2), (1, 0.4)):
        write(Job("scratch", 1.0, "lrm", "sample", seed), _log({0: 5.0, 10: math.log(4.0)}, retain=1.0))
        write(Job("scratch", 0.75, "lrm", "top", seed), _log({0: 5.0, 10: math.log(4.0 + gap)}, selection="top"))
    text = report(tmp_path)
    row = next(line for line in text.splitlines() if "lrm-top" in line)
    assert "+0.3000 ± 0.1414 (n=2)" in row  # mean of 0.2 and 0.4, sample standard deviation
    assert "4.0000 ± 0.0000 (n=2)" in text  # dense final perplexity
    assert (tmp_path / "report.md").read_text().strip() == text.strip()


def test_tiny_study_runs_resumes_and_reports(tmp_path):
    argv = ["study", "run", "--preset", "quick", "--steps", "3", "--seeds", "0", "--parallel", "2",
            "--only", "continued/lrm-sample-r0.75", "--out", str(tmp_path)]
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        assert main(argv) == 0
    text = buffer.getvalue()
    assert "3 to run" in text  # the job, its seed's pretraining and the continued dense reference
    assert (tmp_path / "checkpoints" / "dense-scratch-seed0.pt").exists()
    log = json.loads((tmp_path / "continued/lrm-sample-r0.75/seed0/retain_0.75.json").read_text())
    assert log["retained_fraction"] == pytest.approx(0.75, abs=0.05)
    assert "| 0.75 | lrm-sample |" in text
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        assert main(argv) == 0
    assert "3 already done, 0 to run" in buffer.getvalue()


def _fake_jobs(monkeypatch, tmp_path):
    """job_argv replaced by a short process that logs when it starts and ends, then writes the job's log (and the
    checkpoint, for pretraining), so that the scheduling is tested without training anything."""
    import sys

    import lrmoe.demo.study as study

    def fake_argv(job, out_dir, args):
        outputs = [str(study._log_file(out_dir, job))] + ([str(study._checkpoint(out_dir, job.seed))]
                                                           if job.is_pretrain else [])
        code = ("import sys, time, pathlib; t = time.time(); time.sleep(0.3)\n"
                "for p in sys.argv[2:]:\n"
                "    pathlib.Path(p).parent.mkdir(parents=True, exist_ok=True); pathlib.Path(p).write_text('{}')\n"
                "open(sys.argv[1], 'a').write(f'{t} {time.time()}\\n')")
        return [sys.executable, "-c", code, str(tmp_path / (job.name.replace("/", "_") + ".times")), *outputs]

    monkeypatch.setattr(study, "job_argv", fake_argv)
    return study


def _times(tmp_path, job):
    return [tuple(map(float, line.split())) for line in
            (tmp_path / (job.name.replace("/", "_") + ".times")).read_text().splitlines()]


def test_continued_jobs_wait_for_a_rerun_pretraining_and_a_lost_checkpoint_reruns_it(monkeypatch, tmp_path):
    import argparse

    study = _fake_jobs(monkeypatch, tmp_path)
    jobs = [Job("scratch", 1.0, "lrm", "sample", 0), Job("continued", 1.0, "lrm", "sample", 0),
            Job("continued", 0.5, "lrm", "top", 0)]
    out = tmp_path / "study"
    args = argparse.Namespace(parallel=3, time_limit=60)
    # Pretraining's log is there but its checkpoint is not: it must run again (this hung before), and the
    # continued jobs must start after it ends (they started at once, from whatever checkpoint was there).
    study._log_file(out, jobs[0]).parent.mkdir(parents=True)
    study._log_file(out, jobs[0]).write_text("{}")
    assert study.run_jobs(jobs, out, args) == {}
    (pre_start, pre_end), = _times(tmp_path, jobs[0])
    for job in jobs[1:]:
        (start, _), = _times(tmp_path, job)
        assert start >= pre_end
    # A second call finds everything done and runs nothing.
    assert study.run_jobs(jobs, out, args) == {} and len(_times(tmp_path, jobs[0])) == 1


def test_continued_jobs_without_any_pretraining_fail_with_a_reason(monkeypatch, tmp_path):
    import argparse

    study = _fake_jobs(monkeypatch, tmp_path)
    job = Job("continued", 0.5, "lrm", "top", 0)
    failed = study.run_jobs([job], tmp_path / "study", argparse.Namespace(parallel=1, time_limit=60))
    assert list(failed) == [job] and "no pretraining job" in failed[job]


@pytest.mark.parametrize("flag, value", [("--parallel", "0"), ("--threads", "0"), ("--steps", "0"),
                                         ("--continued-steps", "0"), ("--preset", "bogus")])
def test_study_run_refuses_bad_arguments_up_front(flag, value, tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["study", "run", flag, value, "--out", str(tmp_path)])
    assert flag in capsys.readouterr().err


def test_report_names_diverged_dense_seeds_and_refuses_a_missing_directory(tmp_path):
    for seed, loss in ((0, math.log(4.0)), (1, None)):
        path = tmp_path / Job("scratch", 1.0, "lrm", "sample", seed).name / "retain_1.json"
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps(_log({0: 5.0, 10: loss}, retain=1.0)))
    text = report(tmp_path)
    assert "4.0000 ± 0.0000 (n=1)" in text and "diverged seeds [1]" in text
    with pytest.raises(SystemExit, match="no study directory"):
        main(["study", "report", str(tmp_path / "missing")])


def test_study_run_refuses_to_resume_with_other_settings(tmp_path, capsys):
    # --only matching no job: the settings are checked and recorded, nothing is trained.
    base = ["study", "run", "--only", "no such job", "--out", str(tmp_path), "--steps", "6"]
    assert main(base) == 0
    assert json.loads((tmp_path / "settings.json").read_text())["steps"] == 6
    assert main(base + ["--device", "meta", "--threads", "2"]) == 0  # device and threads may change
    for extra, named in ((["--steps", "8"], "--steps 6 there, 8 now"), (["--continued-lr", "0.01"], "--continued-lr"),
                         (["--preset", "quick"], "--preset 'study' there, 'quick' now")):
        with pytest.raises(SystemExit, match=named):
            main(base + extra)
    assert json.loads((tmp_path / "settings.json").read_text())["steps"] == 6  # not overwritten


def test_readme_quotes_the_study_commands_its_help_prints():
    """README's study commands are the ones `python -m lrmoe study --help` prints, options and values alike (the
    help said --parallel 12 where the README said 14)."""
    from pathlib import Path

    from lrmoe.__main__ import build_parser

    study = build_parser()._subparsers._group_actions[0].choices["study"]
    helped = [line.strip() for line in study.format_help().splitlines() if line.strip().startswith("python -m lrmoe")]
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    quoted = [line.strip() for line in readme.splitlines() if line.strip().startswith("python -m lrmoe study")]
    assert len(helped) == 2 and quoted == helped, (quoted, helped)
