"""One expert-parallel MoE layer, forward+backward, over W ranks: where the time goes (expert GEMMs, dispatch and
combine all-to-alls, forward and backward), bytes per all-to-all and peak memory, for dense backward and LRMoE at
several retain values, with and without replicas (paper Figure 8).

    torchrun --nproc-per-node 8 benchmarks/ep_layer.py --shape qwen3-30b-a3b --tokens 8192      # NCCL, one GPU/rank
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 benchmarks/ep_layer.py --device cpu --shape tiny --tokens 64

Every rank builds the same layer (same seed), ``parallelize_module(layer, mesh, ExpertParallel(...))`` shards the
experts, and each rank feeds its own --tokens tokens. The router is skewed (--skew) so that some experts, hence
some ranks, get more pairs than others, as trained routers do.

Configurations, for R in (0, --max-replicas):
  dense R=..        retain 1, no backward capacity: the dense backward path (every pair returns to its instance).
  lrmoe r=.. R=..   retain r with the backward capacity --capacity-factor (LRMoE's per-rank limit); at r=1 this
                    runs the selective backward, which only the capacity trims. --capacity-factor 0: no capacity.
                    --quota-align N (with --capacity-factor 0): LRMoE(quota_align=N), instance quotas in whole
                    N-row tiles.
  ... blk           --backward-blocks on (or both: each configuration twice): ExpertParallel(backward_blocks=True),
                    each rank's expert backward as torch.bmm over one zero-padded block per instance; a line
                    after the table gives each rank's share of padding rows in its blocks.

Per configuration:
  * latency: median over --steps steps of forward and forward+backward, CUDA events on GPU (perf_counter on CPU,
    where the numbers are not meaningful), the slowest rank's median; every step starts after a barrier;
  * split: --profile-steps more steps under torch.profiler. Collective ops are classified by name and order: the
    layer's all-to-alls (``*::all_to_all_single``) plus the ``wait_tensor`` that completes each one; in forward the
    last three are dispatch and combine (y rows, then their ||phi||^2 beside them), any earlier one fetches replica
    weights; in backward the first are the backward dispatch (retained alpha*g rows, and below retain 1 or with a
    capacity their row indices beside them) and the input-gradient return ("combine"), any later one sends replica
    weight gradients back to their owners. Expert compute is the grouped-GEMM ops (``lrmoe::gather_grouped_mm``,
    ``lrmoe::grouped_outer``; ``aten::bmm`` in the blocked backward). Times are device (kernel) time on GPU, CPU
    time on CPU, medians over the profiled steps, then the mean over ranks (so the parts of a row add up); "other"
    = each profiled step's own forward+backward latency (perf_counter around the step, after a device sync) minus
    all of these: routing, the plan and its host read, SwiGLU, scoring and selection, permutations, profiler
    overhead. The load all-gather (and its wait) is subtracted too; its time is only in the JSON
    (split_ms.load_allgather). Per-rank values are in the JSON: an all-to-all's time includes waiting for the
    slowest peer, so it differs between ranks;
  * bytes each rank sends to its peers per all-to-all (``layer.stats()``: dispatch, combine, backward dispatch,
    backward combine, replica weights + their gradients), mean over ranks;
  * retained fraction, load imbalance (busiest rank's rows over the mean, forward and backward), peak memory per
    rank (CUDA: torch.cuda.max_memory_allocated over the timed steps; CPU: n/a).

Rank 0 prints one table; --json PATH writes every number, per rank where it differs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from common import (
    BACKWARD_RANGE,
    FORWARD_RANGE,
    SHAPES,
    SPLIT_KEYS,
    TINY,
    Ranks,
    shutdown,
    skew_router,
    split_from_profile,
)
from torch.distributed.tensor.parallel import parallelize_module
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from lrmoe.nn import ExpertParallel, LRMoE

SHAPES = {**SHAPES, "tiny": TINY}

# Per-step byte keys, in table order (the split's keys: common.SPLIT_KEYS).
BYTE_KEYS = ("dispatch_fwd", "combine_fwd", "dispatch_bwd", "combine_bwd", "replica_fwd", "replica_bwd")
PLAN_OP = "lrmoe::ep_plan"


@dataclass(frozen=True)
class Config:
    name: str
    retain: float
    max_replicas: int
    capacity_factor: float | None
    plan_on: str = "host"
    backward_blocks: bool = False


def configurations(retains: list[float], max_replicas: int, capacity_factor: float | None,
                   plan_on: tuple[str, ...] = ("host",), blocks: tuple[bool, ...] = (False,)) -> list[Config]:
    """Dense and LRMoE rows for R in (0, max_replicas), for each plan_on (named " host" when it is not the only
    one and not "device") and each backward_blocks value (named " blk" when on)."""
    cap = f" c={capacity_factor:g}" if capacity_factor is not None else ""
    configs = []
    for where in plan_on:
        tag = " host" if where == "host" and len(plan_on) > 1 else ""
        for blk in blocks:
            btag = tag + (" blk" if blk else "")
            for reps in dict.fromkeys((0, max_replicas)):  # (0,) when --max-replicas 0
                configs.append(Config(f"dense R={reps}{btag}", 1.0, reps, None, where, blk))
                configs += [Config(f"lrmoe r={r:g} R={reps}{cap}{btag}", r, reps, capacity_factor, where, blk)
                            for r in retains]
    return configs


# ------------------------------------------------------------------------------------------------- profile


def top_ops(averages, n: int, steps: int, cuda: bool) -> dict[str, list]:
    """The n ops with the most self host time and (on GPU) the n kernels with the most device time, per profiled
    step: [name, calls per step, ms per step]."""
    def rows(key):
        ranked = sorted(averages, key=key, reverse=True)[:n]
        return [[e.key, e.count / steps, key(e) / (1e3 * steps)] for e in ranked if key(e) > 0]

    out = {"host": rows(lambda e: e.self_cpu_time_total)}
    if cuda:
        out["device"] = rows(lambda e: e.self_device_time_total)
    return out


def print_top_ops(rows: list[dict]) -> None:
    for r in rows:
        if not r.get("top_ops"):
            continue
        for where, entries in r["top_ops"].items():
            print(f"# {r['name']}: top {where} time per step (rank 0)")
            for name, calls, ms in entries:
                print(f"#   {ms:8.3f} ms  {calls:7.1f} calls  {name[:90]}")


def build_layer(shape: dict, cfg: Config, args, ranks: Ranks, dtype: torch.dtype) -> LRMoE:
    torch.manual_seed(args.seed)  # the same layer on every rank
    layer = LRMoE(**shape, retain=cfg.retain, selection=args.selection, quota_align=args.quota_align)
    skew_router(layer, args.skew, args.seed, args.rank_skew, ranks.world)
    layer = layer.to(ranks.device, dtype)
    style = ExpertParallel(max_replicas=cfg.max_replicas, capacity_factor=cfg.capacity_factor, plan_on=cfg.plan_on,
                           backward_blocks=cfg.backward_blocks)
    return parallelize_module(layer, ranks.mesh, style)


def measure(layer: LRMoE, cfg: Config, args, ranks: Ranks) -> dict:
    dim = layer.dim
    gen = torch.Generator().manual_seed(args.seed + 1 + ranks.rank)  # every rank its own tokens
    x_TD = torch.randn(args.tokens, dim, generator=gen)
    x_TD[:, 0] = 1.0  # the router-skew feature
    dtype = layer.gate.weight.dtype
    x_TD = x_TD.to(ranks.device, dtype).requires_grad_()
    grad_TD = torch.randn(args.tokens, dim, generator=gen).to(ranks.device, dtype)
    params = list(layer.parameters())
    # --compile: one fullgraph compile of the layer; the all-to-all split sizes are unbacked SymInts
    # (capture_scalar_outputs, set in main), so steps with other loads reuse the graph. A fresh Dynamo cache per
    # configuration: the layers of earlier ones would count towards the recompile limit.
    if args.compile:
        torch._dynamo.reset()
    step = torch.compile(layer, fullgraph=True, backend=args.compile) if args.compile else layer

    def clear() -> None:
        x_TD.grad = None
        for p in params:
            p.grad = None
        layer.reset_stats()

    for _ in range(args.warmup):
        clear()
        step(x_TD).backward(grad_TD)

    fwd_ms, step_ms = [], []
    if ranks.cuda:
        torch.cuda.reset_peak_memory_stats()
    for _ in range(args.steps):
        clear()
        ranks.sync()
        if ranks.cuda:
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            ev[0].record()
            out = step(x_TD)
            ev[1].record()
            out.backward(grad_TD)
            ev[2].record()
            torch.cuda.synchronize()
            fwd_ms.append(ev[0].elapsed_time(ev[1]))
            step_ms.append(ev[0].elapsed_time(ev[2]))
        else:
            t0 = time.perf_counter()
            out = step(x_TD)
            t1 = time.perf_counter()
            out.backward(grad_TD)
            t2 = time.perf_counter()
            fwd_ms.append(1e3 * (t1 - t0))
            step_ms.append(1e3 * (t2 - t0))
        del out
    peak_gib = torch.cuda.max_memory_allocated() / 2**30 if ranks.cuda else float("nan")

    s = layer.stats()  # the last timed step (reset_stats before each step)
    padding = s.block_padding.tolist() if cfg.backward_blocks else None
    counts = torch.stack([
        s.dispatch_bytes.double(), s.combine_bytes.double(), s.backward_dispatch_bytes.double(),
        s.backward_combine_bytes.double(), s.replica_bytes.double(), s.replica_grad_bytes.double(),
        s.retained_pairs.double(), s.total_pairs.double(),
        s.rank_loads.max().double() / s.rank_loads.double().mean().clamp(min=1),
        s.rank_backward_loads.max().double() / s.rank_backward_loads.double().mean().clamp(min=1),
        s.loads.sum(0).max().double() / s.loads.sum(0).double().mean().clamp(min=1),
        (s.instances[:, layer.num_experts // ranks.world:] >= 0).sum().double(),
    ]).tolist()

    # The split comes from separate, profiled steps; "other" is their own latency minus the classified parts.
    # --profile-steps 0: no split (NaN columns).
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ranks.cuda else [])
    profiled_ms = []
    with profile(activities=activities) as prof:
        for _ in range(args.profile_steps):
            clear()
            ranks.sync()
            with record_function(FORWARD_RANGE):
                t0 = time.perf_counter()
                out = step(x_TD)
            with record_function(BACKWARD_RANGE):
                out.backward(grad_TD)
                if ranks.cuda:
                    torch.cuda.synchronize()
                profiled_ms.append(1e3 * (time.perf_counter() - t0))
            del out
    if args.profile_steps:
        dense = cfg.retain >= 1.0 and cfg.capacity_factor is None  # the layer's dense backward: no row indices
        split_steps = split_from_profile(list(prof.events()), device_time=ranks.cuda, bwd_indices=not dense)
        for parts, total in zip(split_steps, profiled_ms, strict=True):
            parts["other"] = total - sum(parts.values())
        split = [statistics.median(parts[k] for parts in split_steps) for k in (*SPLIT_KEYS, "other")]
        # Cross-check on GPU: all NCCL kernel time per step, whichever op launched it. If the split's collectives
        # show ~0 while this does not, the profiler did not attribute NCCL kernels to the collective ops.
        averages = prof.key_averages()
        nccl_ms = sum(e.self_device_time_total for e in averages if "nccl" in e.key.lower())
        nccl_ms /= 1e3 * args.profile_steps
        # Host time of the per-step plan (lrmoe::ep_plan with everything it calls), and GPU kernels per step (each
        # one a launch the host pays for; on CPU there are none).
        plan_ms = sum(e.cpu_time_total for e in averages if e.key == PLAN_OP) / (1e3 * args.profile_steps)
        kernels = sum(1 for e in prof.events() if e.device_type == DeviceType.CUDA and not e.is_user_annotation)
        kernels /= args.profile_steps
        tops = top_ops(averages, args.top_ops, args.profile_steps, ranks.cuda) if args.top_ops else None
    else:
        split, nccl_ms, profiled_ms = [float("nan")] * (len(SPLIT_KEYS) + 1), float("nan"), [float("nan")]
        plan_ms = kernels = float("nan")
        tops = None

    mine = [statistics.median(fwd_ms), statistics.median(step_ms), statistics.median(profiled_ms), peak_gib, nccl_ms,
            plan_ms, kernels, *split, *counts[:6]]
    per_rank = ranks.gather(mine)  # [W][n]
    col = dict(zip(["fwd_ms", "step_ms", "profiled_step_ms", "peak_gib", "nccl_kernel_ms", "plan_host_ms",
                    "kernels_per_step",
                    *(f"split_{k}" for k in (*SPLIT_KEYS, "other")),
                    *(f"bytes_{k}" for k in BYTE_KEYS)], zip(*per_rank, strict=True), strict=True))
    retained, total, fwd_imb, bwd_imb, expert_imb, n_replicas = counts[6:]
    return {
        **asdict(cfg),
        "fwd_ms": max(col["fwd_ms"]),
        "step_ms": max(col["step_ms"]),
        "profiled_step_ms": statistics.fmean(col["profiled_step_ms"]),
        "split_ms": {k: statistics.fmean(col[f"split_{k}"]) for k in (*SPLIT_KEYS, "other")},
        "nccl_kernel_ms": max(col["nccl_kernel_ms"]),
        "plan_host_ms": statistics.fmean(col["plan_host_ms"]),
        "kernels_per_step": max(col["kernels_per_step"]),
        "top_ops": tops,  # this rank's (the JSON is rank 0's)
        "bytes_mean": {k: statistics.fmean(col[f"bytes_{k}"]) for k in BYTE_KEYS},
        "retained_fraction": retained / max(total, 1.0),
        "total_pairs": total,
        "retained_pairs": retained,
        "rank_imbalance_fwd": fwd_imb,
        "rank_imbalance_bwd": bwd_imb,
        "expert_imbalance": expert_imb,
        "replicas_placed": n_replicas,
        "block_padding": padding,  # per rank, " blk" rows only
        "peak_gib": None if not ranks.cuda else max(col["peak_gib"]),
        "per_rank": {k: list(v) if k != "peak_gib" or ranks.cuda else None for k, v in col.items()},
    }


# ------------------------------------------------------------------------------------------------- output


def print_table(rows: list[dict], meta: dict) -> None:
    unit, scale = ("MiB", 2**20) if max(max(r["bytes_mean"].values()) for r in rows) > 2**20 else ("KiB", 2**10)
    print(f"# {meta['shape_name']} {meta['shape']}, tokens/rank={meta['tokens']}, W={meta['world']} "
          f"({meta['backend']}, {meta['device_name']}), {meta['dtype']}, torch {meta['torch']}, skew={meta['skew']}, "
          f"rank skew={meta['rank_skew']}, "
          f"selection={meta['selection']}{', compiled: ' + meta['compiled'] if meta['compiled'] else ''}")
    print(f"# times: ms, {meta['timing']}; fwd, fwd+bwd: median of {meta['steps']} steps, slowest rank; split: "
          f"{meta['split_time']}, median of {meta['profile_steps']} profiled steps, mean over ranks. a2a: all-to-all, "
          "f/b forward/backward, disp dispatch, comb combine (backward: input-gradient return), repl replica weights "
          "(+ their gradients)")
    print(f"# bytes: {unit} each rank sends to its peers per all-to-all, mean over ranks. imb: busiest rank's rows "
          "/ mean (forward, backward). peak: GiB, max over ranks. plan: host ms of the per-step plan op "
          "(lrmoe::ep_plan), mean over ranks; kern: GPU kernels per step (profiled), max over ranks")
    print(f"# expert loads: busiest expert / mean = {rows[0]['expert_imbalance']:.2f} (--skew)")
    if meta["backend"] == "nccl":
        unattributed = [r["name"] for r in rows if r["split_ms"]["dispatch_fwd"] + r["split_ms"]["dispatch_bwd"] == 0
                        and r["nccl_kernel_ms"] > 0]
        if unattributed:
            print(f"# WARNING: NCCL kernel time not attributed to the all-to-all ops in {unattributed}: the a2a "
                  "columns are wrong there; see nccl_kernel_ms in the JSON")
    head = (f"{'config':<29} {'kept':>5} {'fwd':>7} {'fwd+bwd':>8} {'expert':>7} {'disp f':>7} {'comb f':>7} "
            f"{'disp b':>7} {'comb b':>7} {'repl':>7} {'other':>7} | {'disp f':>8} {'comb f':>8} {'disp b':>8} "
            f"{'comb b':>8} {'repl':>8} | {'imb f':>5} {'imb b':>5} {'peak':>6} | {'plan':>6} {'kern':>6}")
    print(head)
    for r in rows:
        sp, by = r["split_ms"], r["bytes_mean"]
        peak = "n/a" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
        print(f"{r['name']:<29} {r['retained_fraction']:>5.3f} {r['fwd_ms']:>7.2f} {r['step_ms']:>8.2f} "
              f"{sp['expert_fwd'] + sp['expert_bwd']:>7.2f} {sp['dispatch_fwd']:>7.2f} {sp['combine_fwd']:>7.2f} "
              f"{sp['dispatch_bwd']:>7.2f} {sp['combine_bwd']:>7.2f} {sp['replica_fwd'] + sp['replica_bwd']:>7.2f} "
              f"{sp['other']:>7.2f} | {by['dispatch_fwd'] / scale:>8.1f} {by['combine_fwd'] / scale:>8.1f} "
              f"{by['dispatch_bwd'] / scale:>8.1f} {by['combine_bwd'] / scale:>8.1f} "
              f"{(by['replica_fwd'] + by['replica_bwd']) / scale:>8.1f} | {r['rank_imbalance_fwd']:>5.2f} "
              f"{r['rank_imbalance_bwd']:>5.2f} {peak:>6} | {r['plan_host_ms']:>6.2f} {r['kernels_per_step']:>6.0f}",
              flush=True)
    for r in rows:
        if r["block_padding"] is not None:
            print(f"# {r['name']}: padding of the blocked backward's rows per rank "
                  + " ".join(f"{p:.3f}" for p in r["block_padding"]))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    p.add_argument("--tokens", type=int, default=8192, help="tokens per rank")
    p.add_argument("--retain", type=float, nargs="+", default=[1.0, 0.75, 0.5])
    p.add_argument("--selection", choices=("sample", "top"), default="sample")
    p.add_argument("--max-replicas", type=int, default=2, help="replica slots per rank in the replica rows (0: none)")
    p.add_argument("--capacity-factor", type=float, default=1.25,
                   help="LRMoE rows' backward capacity per rank, times the balanced share (0: no capacity)")
    p.add_argument("--skew", type=float, default=1.0, help="router skew (0: near-balanced loads)")
    p.add_argument("--rank-skew", type=float, default=0.0,
                   help="extra logit (in router std units) for rank 0's experts, to load one rank more than the others")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quota-align", type=int, default=1,
                   help="LRMoE's quota_align (backward quotas in whole tiles); > 1 needs --capacity-factor 0")
    p.add_argument("--json", default=None, help="write the numbers here (rank 0)")
    p.add_argument("--backward-blocks", choices=("off", "on", "both"), default="off",
                   help="ExpertParallel(backward_blocks=...): the expert backward as bmm over padded blocks")
    p.add_argument("--plan-on", nargs="+", default=["host"], choices=["device", "host"],
                   help="where each step's plan runs (ExpertParallel(plan_on=...)); several: every configuration "
                        "for each, rows of the host plan tagged ' host'")
    p.add_argument("--top-ops", type=int, default=0,
                   help="also list the N ops with the most host time and kernels with the most device time in the "
                        "profiled steps, per configuration (rank 0)")
    p.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                   help="time torch.compile(layer, fullgraph=True, backend=BACKEND) (default inductor; the CPU tests "
                        "trace with aot_eager); expert ops inlined into the compiled code on CUDA do not show as "
                        "ops, so the split's expert column is not meaningful then")
    p.add_argument("--list", action="store_true",
                   help="print the configurations it would time (JSON, one per line) and exit: no process group")
    args = p.parse_args(argv)
    if args.steps < 1 or args.profile_steps < 0 or args.warmup < 0:
        p.error("--steps must be >= 1, --profile-steps and --warmup >= 0")
    return args


def main() -> None:
    args = parse_args()
    capacity = args.capacity_factor if args.capacity_factor else None
    blocks = {"off": (False,), "on": (True,), "both": (False, True)}[args.backward_blocks]
    configs = configurations(args.retain, args.max_replicas, capacity, tuple(dict.fromkeys(args.plan_on)), blocks)
    if args.list:
        for cfg in configs:
            print(json.dumps(asdict(cfg)))
        return
    ranks = Ranks(args.device)
    if args.compile:
        torch._dynamo.config.capture_scalar_outputs = True
    shape = SHAPES[args.shape]
    if shape["num_experts"] % ranks.world:
        raise SystemExit(f"--shape {args.shape}: E={shape['num_experts']} is not divisible by W={ranks.world}")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if ranks.cuda else "fp32")]
    if args.quota_align > 1 and capacity is not None:
        raise SystemExit("--quota-align > 1 needs --capacity-factor 0: the EP layer refuses aligned quotas under a "
                         "backward capacity")
    meta = {
        "shape_name": args.shape, "shape": shape, "tokens": args.tokens, "world": ranks.world,
        "backend": dist.get_backend(), "device_name": torch.cuda.get_device_name() if ranks.cuda else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "torch": torch.__version__, "compiled": args.compile, "skew": args.skew, "rank_skew": args.rank_skew,
        "selection": args.selection, "steps": args.steps,
        "profile_steps": args.profile_steps, "max_replicas": args.max_replicas, "capacity_factor": capacity,
        "quota_align": args.quota_align, "backward_blocks": args.backward_blocks,
        "timing": "CUDA events" if ranks.cuda else "perf_counter on CPU ranks: NOT MEANINGFUL as performance",
        "split_time": "device (kernel) time" if ranks.cuda else "CPU time",
    }
    rows = []
    for cfg in configs:
        layer = build_layer(shape, cfg, args, ranks, dtype)
        rows.append(measure(layer, cfg, args, ranks))
        del layer
        if ranks.cuda:
            torch.cuda.empty_cache()
    if ranks.rank == 0:
        print_table(rows, meta)
        print_top_ops(rows)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"meta": meta, "rows": rows}, f, indent=1)
    shutdown()


if __name__ == "__main__":
    main()
