"""The multi-GPU benchmarks (benchmarks/ep_layer.py, benchmarks/ep_train.py) run end to end on 2 gloo CPU ranks.

Each script is launched once with torchrun (module-scoped fixtures, ~10 s each on two cores); the tests then check
what the table and JSON say, so a GPU run only has to change the launch line (docs/multi_gpu_results.md).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import common
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"

LAYER_CONFIGS = [
    "dense R=0", "lrmoe r=1 R=0 c=1.25", "lrmoe r=0.75 R=0 c=1.25", "lrmoe r=0.5 R=0 c=1.25",
    "dense R=2", "lrmoe r=1 R=2 c=1.25", "lrmoe r=0.75 R=2 c=1.25", "lrmoe r=0.5 R=2 c=1.25",
]
TINY_DIM = 32


def torchrun(tmp: Path, script: str, *args: str) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(BENCHMARKS / script), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, check=False, cwd=tmp, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


def table_rows(stdout: str, header: str) -> list[str]:
    """The lines after the header line that starts with ``header``, up to the end or the next comment."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 1:]:
        if not line.strip() or line.startswith("#"):
            break
        rows.append(line)
    return rows


@pytest.fixture(scope="module")
def ep_layer(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ep_layer")
    out = torchrun(tmp, "ep_layer.py", "--device", "cpu", "--shape", "tiny", "--tokens", "64", "--steps", "2",
                   "--warmup", "1", "--profile-steps", "1", "--top-ops", "3", "--json", str(tmp / "layer.json"))
    return out, json.loads((tmp / "layer.json").read_text())


@pytest.fixture(scope="module")
def ep_layer_compiled(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ep_layer_compiled")
    torchrun(tmp, "ep_layer.py", "--device", "cpu", "--shape", "tiny", "--tokens", "64", "--steps", "2",
             "--warmup", "1", "--compile", "aot_eager", "--retain", "0.5", "--max-replicas", "0",
             "--profile-steps", "0", "--plan-on", "device",
             "--json", str(tmp / "layer.json"))
    return json.loads((tmp / "layer.json").read_text())


@pytest.fixture(scope="module")
def ep_train(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ep_train")
    out = torchrun(tmp, "ep_train.py", "--tiny", "--device", "cpu", "--runs", "1", "0.5", "--steps", "8",
                   "--eval-every", "4", "--json", str(tmp / "train.json"))
    return out, json.loads((tmp / "train.json").read_text())


@pytest.fixture(scope="module")
def ep_train_compiled(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ep_train_compiled")
    torchrun(tmp, "ep_train.py", "--tiny", "--device", "cpu", "--runs", "1", "--steps", "8", "--eval-every", "4",
             "--compile", "aot_eager", "--json", str(tmp / "train.json"))
    return json.loads((tmp / "train.json").read_text())


def _by_name(data: dict) -> dict[str, dict]:
    return {row["name"]: row for row in data["rows"]}


def test_ep_layer_table_has_one_row_per_configuration(ep_layer):
    stdout, data = ep_layer
    rows = table_rows(stdout, "config")
    assert [line[:24].strip() for line in rows] == LAYER_CONFIGS
    assert [row["name"] for row in data["rows"]] == LAYER_CONFIGS
    assert all(line.split("|")[2].split()[-1] == "n/a" for line in rows)  # peak memory: CUDA only
    assert "NOT MEANINGFUL" in stdout  # CPU timings are labelled
    assert stdout.count("top host time per step") == len(LAYER_CONFIGS)
    assert data["meta"]["world"] == 2 and data["meta"]["backend"] == "gloo"


def test_ep_layer_backward_bytes_follow_retained_rows(ep_layer):
    rows = _by_name(ep_layer[1])
    for reps in (0, 2):
        dense = rows[f"dense R={reps}"]
        # Same tokens, same router: the forward moves the same bytes whatever the backward does.
        assert len({rows[n]["bytes_mean"]["dispatch_fwd"] for n in LAYER_CONFIGS if f"R={reps}" in n}) == 1
        prev = None
        for retain in (1.0, 0.75, 0.5):
            row = rows[f"lrmoe r={retain:g} R={reps} c=1.25"]
            assert retain - 0.05 <= row["retained_fraction"] <= retain + 1e-9
            # Retained rows carry D fp32 values plus a 4-byte index (none in the dense path).
            expected = row["retained_fraction"] * (4 * TINY_DIM + 4) / (4 * TINY_DIM)
            ratio = row["bytes_mean"]["dispatch_bwd"] / dense["bytes_mean"]["dispatch_bwd"]
            assert ratio == pytest.approx(expected, abs=0.12), (row["name"], ratio, expected)
            ret_ratio = row["bytes_mean"]["combine_bwd"] / dense["bytes_mean"]["combine_bwd"]
            assert ret_ratio == pytest.approx(row["retained_fraction"], abs=0.12), (row["name"], ret_ratio)
            if prev is not None:
                assert row["bytes_mean"]["dispatch_bwd"] < prev
            prev = row["bytes_mean"]["dispatch_bwd"]
        assert (dense["bytes_mean"]["replica_fwd"] > 0) == (reps > 0)


def test_ep_layer_split_finds_every_all_to_all(ep_layer):
    for row in ep_layer[1]["rows"]:
        split = row["split_ms"]
        for key in ("expert_fwd", "expert_bwd", "dispatch_fwd", "combine_fwd", "dispatch_bwd", "combine_bwd"):
            assert split[key] > 0, (row["name"], key)
        # A replica-weight all-to-all in forward and its gradient's in backward, only with replica slots.
        assert (split["replica_fwd"] > 0) == (row["max_replicas"] > 0), row["name"]
        assert (split["replica_bwd"] > 0) == (row["max_replicas"] > 0), row["name"]
        assert len(row["per_rank"]["split_dispatch_fwd"]) == 2
        # The plan op was found in every profiled step, and a CPU run launches no GPU kernel.
        assert row["plan_host_ms"] > 0 and row["kernels_per_step"] == 0, row["name"]
        # --top-ops 3: at most three host entries, by decreasing time, no device list on CPU.
        host = row["top_ops"]["host"]
        assert 1 <= len(host) <= 3 and "device" not in row["top_ops"]
        assert [ms for _, _, ms in host] == sorted((ms for _, _, ms in host), reverse=True) and host[-1][2] > 0


def test_ep_layer_compiled_moves_what_eager_moves(ep_layer, ep_layer_compiled):
    """--compile times torch.compile(layer, fullgraph=True), here with the plan on the device: the same tokens and
    router, so the same pairs kept and the same bytes in every all-to-all as the eager rows with the plan on the
    host (the default); --profile-steps 0 leaves the split out (NaN)."""
    assert ep_layer_compiled["meta"]["compiled"] == "aot_eager" and ep_layer[1]["meta"]["compiled"] is None
    eager = _by_name(ep_layer[1])
    names = [row["name"] for row in ep_layer_compiled["rows"]]
    assert names == ["dense R=0", "lrmoe r=0.5 R=0 c=1.25"]
    for row in ep_layer_compiled["rows"]:
        want = eager[row["name"]]
        assert row["retained_pairs"] == want["retained_pairs"] and row["total_pairs"] == want["total_pairs"]
        assert row["bytes_mean"] == want["bytes_mean"], row["name"]
        assert all(v != v for v in row["split_ms"].values())  # NaN: not profiled
        assert row["step_ms"] > 0


def test_ep_layer_blocked_backward_rows_move_the_same_bytes_and_count_their_gemms(tmp_path):
    """--backward-blocks both: every configuration again with ExpertParallel(backward_blocks=True), tagged " blk".
    The blocks change only the expert backward's layout: same pairs kept, same bytes in every all-to-all; their
    batched GEMMs (aten::bmm) count as expert compute."""
    torchrun(tmp_path, "ep_layer.py", "--device", "cpu", "--shape", "tiny", "--tokens", "64", "--steps", "2",
             "--warmup", "1", "--profile-steps", "1", "--retain", "0.5", "--max-replicas", "0",
             "--backward-blocks", "both", "--json", str(tmp_path / "layer.json"))
    data = json.loads((tmp_path / "layer.json").read_text())
    assert data["meta"]["backward_blocks"] == "both"
    rows = _by_name(data)
    assert list(rows) == ["dense R=0", "lrmoe r=0.5 R=0 c=1.25", "dense R=0 blk", "lrmoe r=0.5 R=0 c=1.25 blk"]
    for name in ("dense R=0", "lrmoe r=0.5 R=0 c=1.25"):
        plain, blocked = rows[name], rows[name + " blk"]
        assert blocked["retained_pairs"] == plain["retained_pairs"]
        assert blocked["bytes_mean"] == plain["bytes_mean"], name
        assert blocked["split_ms"]["expert_bwd"] > 0, name
        assert plain["block_padding"] is None and len(blocked["block_padding"]) == 2
        assert all(0 <= p < 1 for p in blocked["block_padding"])


def test_ep_train_reports_time_to_target(ep_train):
    stdout, data = ep_train
    dense, lrmoe = data["runs"]
    assert dense["dense"] and not lrmoe["dense"]
    losses = [h["loss"] for h in dense["history"]]
    assert losses[-1] < losses[0] - 0.3  # it trains
    assert data["meta"]["target"] == pytest.approx(min(losses) * 1.01)
    assert dense["reached"] and dense["time_to_target_s"] is not None
    for run in data["runs"]:
        assert isinstance(run["reached"], bool)
        assert (run["time_to_target_s"] is None) == (not run["reached"])
    assert lrmoe["retained_fraction"] == pytest.approx(0.5, abs=0.05)
    rows = table_rows(stdout, "run")
    assert len(rows) == 2 and rows[0].startswith("dense") and rows[1].startswith("lrmoe r=0.5")


def test_ep_layer_configurations_per_plan_location(run_script):
    def configurations(*args: str) -> list[dict]:
        out = run_script("ep_layer.py", "--list", *args)
        return [json.loads(line) for line in out.splitlines()]

    one = configurations("--retain", "0.5", "--max-replicas", "2", "--capacity-factor", "1.25")
    assert [c["name"] for c in one] == ["dense R=0", "lrmoe r=0.5 R=0 c=1.25", "dense R=2", "lrmoe r=0.5 R=2 c=1.25"]
    assert {c["plan_on"] for c in one} == {"host"}  # ExpertParallel's default
    both = configurations("--retain", "0.5", "--max-replicas", "0", "--capacity-factor", "0", "--plan-on", "device",
                          "host")
    assert [(c["name"], c["plan_on"]) for c in both] == [("dense R=0", "device"), ("lrmoe r=0.5 R=0", "device"),
                                                        ("dense R=0 host", "host"), ("lrmoe r=0.5 R=0 host", "host")]
    only = configurations("--retain", "1", "--max-replicas", "0", "--capacity-factor", "0", "--plan-on", "host")
    assert [c["name"] for c in only] == ["dense R=0", "lrmoe r=1 R=0"]
    blocked = configurations("--retain", "0.5", "--max-replicas", "0", "--capacity-factor", "0", "--backward-blocks",
                             "both")
    assert [(c["name"], c["backward_blocks"]) for c in blocked] == [
        ("dense R=0", False), ("lrmoe r=0.5 R=0", False), ("dense R=0 blk", True), ("lrmoe r=0.5 R=0 blk", True)]


def test_ep_layer_rank_skew_raises_only_rank_zeros_experts():
    from lrmoe.nn import LRMoE

    skew_router = common.skew_router
    logits = []
    for rank_skew in (0.0, 2.0):
        torch.manual_seed(0)
        layer = LRMoE(TINY_DIM, 16, 8, 2)
        skew_router(layer, 1.0, 0, rank_skew, world=4)
        weight = layer.gate.weight.detach()
        logits.append(weight[:, 0].clone())
    sigma = weight[:, 1:].square().sum(1).mean().sqrt()
    # Rank 0 of 4 owns experts 0 and 1: only their bias moves, by rank_skew router standard deviations.
    torch.testing.assert_close(logits[1] - logits[0], torch.tensor([2.0, 2.0, 0, 0, 0, 0, 0, 0]) * sigma)


def test_ep_train_compiled_trains_like_eager(ep_train, ep_train_compiled):
    """--compile trains torch.compile(model): the dense run (same seeds, same batches) gives eager's held-out losses;
    MoE-layer time is not measured then (NaN)."""
    eager = next(r for r in ep_train[1]["runs"] if r["dense"])
    (compiled,) = ep_train_compiled["runs"]
    assert ep_train_compiled["meta"]["compiled"] == "aot_eager" and compiled["dense"]
    assert [h["step"] for h in compiled["history"]] == [h["step"] for h in eager["history"]] == [0, 4, 8]
    for got, want in zip(compiled["history"], eager["history"], strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-4)
    assert compiled["history"][-1]["loss"] < compiled["history"][0]["loss"]  # it trained
    assert math.isnan(compiled["moe_ms"]) and compiled["step_ms"] > 0


def test_ep_train_settle_marks_unreached_runs():
    settle = common.settle
    run = {"history": [{"step": 0, "train_s": 0.0, "moe_s": 0.0, "loss": 5.0},
                       {"step": 4, "train_s": 1.0, "moe_s": 0.5, "loss": 4.0},
                       {"step": 8, "train_s": 2.0, "moe_s": 1.0, "loss": 3.5}]}
    hit = settle(run, 4.0)
    assert hit["reached"] and hit["reached_at"]["step"] == 4 and hit["time_to_target_s"] == 1.0
    miss = settle(run, 3.0)
    assert not miss["reached"] and miss["time_to_target_s"] is None and miss["moe_time_to_target_s"] is None


def test_ep_layer_split_ignores_gpu_copies_of_the_step_ranges():
    """With CUDA activity the profiler repeats each record_function range on the GPU timeline; the split must
    match ops to the host-side ranges only (the first two-GPU run failed on the repeated ranges)."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    bench = common

    def event(name, start, end, device_us=0.0, device=DeviceType.CPU):
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end), thread=0,
                               device_type=device, cpu_time_total=1.0, device_time_total=device_us)

    a2a, gemm = "_c10d_functional::all_to_all_single", "lrmoe::gather_grouped_mm"
    # Forward: dispatch, combine rows, their ||phi||^2; backward: retained rows, their indices, the return.
    host = [event(bench.FORWARD_RANGE, 0, 100), event(gemm, 10, 15, 5000), event(a2a, 20, 25, 2000),
            event(a2a, 30, 35, 3000), event(a2a, 36, 37, 100), event(bench.BACKWARD_RANGE, 100, 200),
            event(a2a, 110, 115, 1000), event(a2a, 116, 117, 200), event(a2a, 120, 125, 4000),
            event(gemm, 130, 135, 6000)]
    gpu_ranges = [event(bench.FORWARD_RANGE, 50, 150, 90000, DeviceType.CUDA),
                  event(bench.BACKWARD_RANGE, 150, 250, 90000, DeviceType.CUDA)]
    (step,) = bench.split_from_profile(host + gpu_ranges, device_time=True, bwd_indices=True)
    assert step["expert_fwd"] == 5 and step["expert_bwd"] == 6
    assert (step["dispatch_fwd"], step["combine_fwd"]) == (2, 3.1)
    assert (step["dispatch_bwd"], step["combine_bwd"]) == (1.2, 4)
    assert step["replica_fwd"] == step["replica_bwd"] == 0
    # The dense backward sends no indices: its second all-to-all is the return.
    (step,) = bench.split_from_profile([e for e in host if e.time_range.start != 116] + gpu_ranges,
                                       device_time=True, bwd_indices=False)
    assert (step["dispatch_bwd"], step["combine_bwd"]) == (1, 4)
