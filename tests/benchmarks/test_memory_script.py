"""The GPU memory benchmarks' CPU-testable parts: benchmarks/memory.py batch (largest batch under a byte budget,
like the paper's Figure 6), breakdown (stacked bars like Figure 7) and planner, and their helpers in
benchmarks/common.py.

The bisection is checked against every monotone predicate Hypothesis can draw; the model-side largest T against a
scan of lrmoe.memory.layer_memory over every candidate T; the measuring path (probe, OOM handling, LayerStep) with
a real layer on CPU and a fake out-of-memory threshold; the script's subcommands end to end on CPU.
"""

from __future__ import annotations

import json
import math

import common
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lrmoe.memory import ADAMW_FP32, DEFAULT_RETAIN_CHOICES, MemoryConfig, layer_memory

GiB = 2**30


# ---------------------------------------------------------------------------------------------- bisection


@given(lo=st.integers(-50, 50), width=st.integers(0, 3000), threshold=st.integers(-100, 3100))
def test_largest_fitting_finds_the_exact_largest_value_of_a_monotone_predicate(lo, width, threshold):
    # Every monotone predicate on [lo, hi] is "v <= threshold" for some threshold (below lo: nothing fits,
    # at or above hi: everything does).
    hi = lo + width
    calls = []

    def fits(v):
        calls.append(v)
        return v <= threshold

    best = common.largest_fitting(fits, lo, hi)
    assert best == (None if threshold < lo else min(threshold, hi))
    assert all(lo <= v <= hi for v in calls)
    assert len(calls) == len(set(calls))  # never asks twice
    assert len(calls) <= 1 + math.ceil(math.log2(hi - lo + 1))  # bisection, not a scan


def test_largest_fitting_rejects_an_empty_range():
    with pytest.raises(ValueError, match="empty range"):
        common.largest_fitting(lambda v: True, 5, 4)


# ----------------------------------------------------------------------------------- model-side largest T

small_shapes = st.fixed_dictionaries({
    "dim": st.sampled_from([8, 12, 16, 40]),
    "hidden_dim": st.sampled_from([4, 8, 24, 48]),
    "num_experts": st.integers(1, 12),
    "top_k": st.integers(1, 4),
}).filter(lambda s: s["top_k"] <= s["num_experts"])


@given(shape=small_shapes, retain=st.sampled_from([1.0, 0.875, 0.75, 0.5, 0.25]),
       policy=st.sampled_from(["save", "recompute"]), optimizer_bytes=st.sampled_from([0, 8, 12]),
       multiple=st.sampled_from([1, 3, 8, 16]), max_tokens=st.integers(1, 200), where=st.floats(-0.1, 1.1))
def test_model_largest_tokens_equals_a_scan_of_layer_memory(shape, retain, policy, optimizer_bytes, multiple,
                                                            max_tokens, where):
    def peak(tokens):  # independent of the script: layer_memory plus the [T, D] bf16 output the probe holds
        cfg = MemoryConfig(**shape, tokens=tokens, param_dtype=torch.bfloat16,
                           optimizer_bytes_per_param=optimizer_bytes, device_type="cuda")
        return layer_memory(cfg, retain=retain, policy=policy).peak + tokens * shape["dim"] * 2

    grid = range(multiple, max_tokens + 1, multiple)
    if grid:  # a budget anywhere from below the smallest candidate's peak to above the largest's
        lo, hi = peak(grid[0]), peak(grid[-1])
        budget = int(lo + where * (hi - lo)) + (1 if where > 1 else 0)
    else:
        budget = 2**40
    scanned = max((t for t in grid if peak(t) <= budget), default=None)
    found = common.model_largest_tokens(shape, budget, retain=retain, policy=policy, optimizer_bytes=optimizer_bytes,
                                   multiple=multiple, max_tokens=max_tokens)
    assert found == scanned


def test_model_largest_tokens_at_the_qwen3_shape_matches_a_scan_and_grows_as_retain_falls():
    shape = {"dim": 2048, "hidden_dim": 768, "num_experts": 128, "top_k": 8}
    budget = 14 * 2**30  # retain 0.5's largest batch stays below the search's top, 2**17
    found = {}
    for retain in (1.0, 0.75, 0.5):
        found[retain] = common.model_largest_tokens(shape, budget, retain=retain, policy="save",
                                                   optimizer_bytes=ADAMW_FP32, multiple=128, max_tokens=2**17)
        fits = [common.modelled_bytes(shape, t, retain=retain, policy="save", optimizer_bytes=ADAMW_FP32) <= budget
                for t in range(128, 2**17 + 1, 1024)]
        # Coarse scan: everything below the answer fits, nothing 128 tokens above it does.
        assert all(f for t, f in zip(range(128, 2**17 + 1, 1024), fits) if t <= found[retain])
        assert common.modelled_bytes(shape, found[retain] + 128, retain=retain, policy="save",
                                    optimizer_bytes=ADAMW_FP32) > budget
    assert found[1.0] < found[0.75] < found[0.5]


def test_memory_batch_on_cpu_prints_the_model_column_only(run_script, tmp_path):
    out = run_script("memory.py", "batch", "--device", "cpu", "--budget-gib", "16", "--json", str(tmp_path / "rows.json"))
    result = json.loads((tmp_path / "rows.json").read_text())
    assert "NOT MEASURED" in out and not result["meta"]["measured"]
    rows = result["rows"]
    assert [(r["policy"], r["retain"]) for r in rows] == [(p, r) for p in ("save", "recompute")
                                                          for r in (1.0, 0.75, 0.5)]
    for r in rows:
        assert r["measured_tokens"] is None and r["probes"] == 0 and r["model_tokens"] % 128 == 0
    by = {(r["policy"], r["retain"]): r["model_tokens"] for r in rows}
    for policy in ("save", "recompute"):
        assert by[(policy, 1.0)] < by[(policy, 0.75)] < by[(policy, 0.5)]
        # The search's top leaves room above every prediction, so a measured T can exceed the model's.
        assert rows[0]["top"] >= by[(policy, 0.5)]
    # One layer: at retain 1 "recompute" holds no more than "save"; below it, it holds phi (half of h) through
    # the backward besides the recomputed rows of h, which can peak above "save" (a model saves the difference
    # in every layer, which one layer's budget does not show).
    assert by[("recompute", 1.0)] >= by[("save", 1.0)]


# ------------------------------------------------------------------------------------------- measuring path


def test_probe_turns_out_of_memory_into_none():
    def step(tokens):
        if tokens > 10:
            raise torch.OutOfMemoryError("fake")
        return 7 * tokens

    assert common.probe(step, 10) == 70
    assert common.probe(step, 11) is None
    with pytest.raises(RuntimeError, match="other"):  # only out-of-memory means "does not fit"
        common.probe(lambda t: (_ for _ in ()).throw(RuntimeError("other")), 1)


def test_measure_largest_tokens_runs_a_real_layer_step_under_a_fake_budget():
    # The GPU path on CPU: a tiny LRMoE, a step that "runs out of memory" above 200 tokens. The bisection must
    # land on the largest multiple of 16 below it and leave no gradients behind.
    shape = {"dim": 16, "hidden_dim": 8, "num_experts": 4, "top_k": 2}
    made = []

    class FakeBudget(common.LayerStep):
        def __call__(self, tokens, keep_grads=False):
            if tokens > 200:
                raise torch.OutOfMemoryError("fake budget")
            return super().__call__(tokens, keep_grads)

    def make():
        made.append(FakeBudget(shape, retain=0.5, policy="recompute", optimizer_bytes=ADAMW_FP32, device="cpu"))
        return made[-1]

    result = common.measure_largest_tokens(make, multiple=16, max_tokens=1000)
    assert result["tokens"] == 192
    assert 1 <= result["probes"] <= 1 + math.ceil(math.log2(1000 // 16))
    step = made[0]
    assert all(p.grad is None for p in step.layer.parameters())
    step(32, keep_grads=True)
    static = step.static_bytes()
    cfg = MemoryConfig(**shape, tokens=32, param_dtype=torch.bfloat16, optimizer_bytes_per_param=ADAMW_FP32)
    mem = layer_memory(cfg, retain=0.5, policy="recompute")
    assert static == {"experts": mem.base_experts, "router": mem.router}


# --------------------------------------------------------------------------------------------- breakdown


def _bars(path) -> list[list[dict]]:
    return [panel["bars"] for panel in json.loads(path.read_text())]


def test_modelled_bars_sum_to_the_peak_and_planned_ones_fit(run_script, tmp_path):
    cfg = MemoryConfig(2048, 768, 128, 8, 8192, world_size=8, optimizer_bytes_per_param=ADAMW_FP32)
    # Between the dense peak without replicas and with 32 of them, so the supply-side bar is over it.
    budget = (layer_memory(cfg).peak + layer_memory(cfg, replicas=32).peak) // 2
    run_script("memory.py", "breakdown", "--device", "cpu", "--tokens", "8192", "--world-size", "8",
               "--budget-gib", repr(budget / GiB), "--replicas", "32", "--max-replicas", "112", "--retain", "0.75",
               "0.5", "--no-out", "--json", str(tmp_path / "bars.json"))
    (bars,) = _bars(tmp_path / "bars.json")
    total = [b["base_experts"] + b["replicas"] + b["token_buffers"] for b in bars]
    assert [b["label"].split("\n")[0] for b in bars] == ["dense", "dense", "dense, planned", "LRMoE 0.75, planned",
                                                         "LRMoE 0.5, planned"]
    (dense, dense_r, *planned), (t_dense, t_dense_r, *t_planned) = bars, total
    assert t_dense == layer_memory(cfg).peak and dense["replicas"] == 0
    assert t_dense_r == layer_memory(cfg, replicas=32).peak and not dense_r["fits"]
    assert all(b["fits"] and t <= budget for b, t in zip(planned, t_planned))
    n_replicas = [int(b["label"].split("\n")[1].split()[0]) for b in planned]
    assert n_replicas == sorted(n_replicas) and n_replicas[-1] > n_replicas[0]  # less backward, more replicas
    # A budget nothing fits: the bar is the cheapest candidate, marked.
    run_script("memory.py", "breakdown", "--device", "cpu", "--budget-gib", "1", "--replicas", "4",
               "--max-replicas", "8", "--retain", "0.5", "--no-out", "--json", str(tmp_path / "tight.json"))
    (tight,) = _bars(tmp_path / "tight.json")
    assert "no plan fits" in tight[-1]["label"] and tight[-1]["fits"] is False


def test_single_device_bars_run_the_measuring_path_on_cpu(run_script, tmp_path):
    # What a GPU run measures, at the tiny shape on CPU, where the allocator reads 0: the bars come in
    # measured/modelled pairs and the measured base is the module's own weights, gradients and optimiser state.
    run_script("memory.py", "breakdown", "--device", "cpu", "--shape", "tiny", "--tokens", "32", "--world-size", "2",
               "--replicas", "2", "--retain", "0.5", "--measure", "--no-out", "--json", str(tmp_path / "bars.json"))
    _, bars = _bars(tmp_path / "bars.json")
    assert [b["label"] for b in bars] == ["dense\nmeasured", "dense\nmodelled", "LRMoE 0.5\nmeasured",
                                          "LRMoE 0.5\nmodelled"]
    cfg = MemoryConfig(**common.TINY, tokens=32, param_dtype=torch.bfloat16, optimizer_bytes_per_param=ADAMW_FP32)
    assert all(b["base_experts"] == layer_memory(cfg).base_experts + layer_memory(cfg).router for b in bars)
    assert [b["source"] for b in bars] == ["measured", "modelled"] * 2


def test_breakdown_script_writes_a_png_on_cpu(run_script, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "chart" / "memory_breakdown.png"
    stdout = run_script("memory.py", "breakdown", "--device", "cpu", "--out", str(out), "--json",
                        str(tmp_path / "bars.json"))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert "NOT MEASURED" in stdout and f"wrote {out}" in stdout
    panels = _bars(tmp_path / "bars.json")
    assert len(panels) == 1 and all(b["source"] == "modelled" for b in panels[0])


# ---------------------------------------------------------------------------------------------- memory planner


def test_memory_planner_plans_the_largest_retain_whose_bytes_fit_and_rejects_the_next(run_script, tmp_path):
    budgets, margin, tokens = [7.0, 7.25, 7.5], 0.02, 4096  # the experts alone (weights, grads, AdamW) ~6.9 GiB
    stdout = run_script("memory.py", "planner", "--device", "cpu", "--tokens", str(tokens), "--margin", str(margin),
                        "--budgets-gib", *map(str, budgets), "--json", str(tmp_path / "rows.json"))
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert [r["budget"] for r in rows] == [int(b * 2**30) for b in budgets]
    choices = DEFAULT_RETAIN_CHOICES
    for row in rows:
        usable = int(row["budget"] * (1 - margin))
        if row["planned"] is not None:
            assert row["planned_bytes"] <= usable  # the planned step's modelled bytes, output included, fit
        else:
            assert row["error"].startswith("budget_bytes=")  # the planner said why
        if row["rejected"] is not None:
            # The next larger choice does not fit: the plan is the largest retain that does.
            assert row["rejected_bytes"] > usable
            assert row["rejected"] == min(r for r in choices if row["planned"] is None or r > row["planned"])
    assert len({r["planned"] for r in rows}) > 1  # the budgets span different plans
    assert "plans only" in stdout
