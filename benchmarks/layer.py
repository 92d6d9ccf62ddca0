"""The MoE layer's forward+backward on one GPU (bf16): timed, profiled, its host cost, its offload overlap.

    python benchmarks/layer.py time [--shape qwen3-30b-a3b] [--modes eager compiled compiled-cg] [--retain 1 0.75 0.5]
    python benchmarks/layer.py profile --retain 0.75 [--compiled] [--forward-only] [--timeline]
    python benchmarks/layer.py host [--tokens 256 8192] [--per-call] [--cpu-table]
    python benchmarks/layer.py offload --retain 0.75
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python benchmarks/layer.py peers [--tokens 8192 32768] [--out DIR]
    python benchmarks/layer.py imports [--scenarios sonic ...] [--cold-each]

``time``: LRMoE per retain against transformers' MoE block and a plain torch._grouped_mm layer, eager and compiled,
all in the same run. Prints medians of CUDA-event timings (triton.testing.do_bench over 200 ms, ~45 steps of 4.4
ms; every row timed once in each of --rounds rounds in a rotated order, common.interleaved, the median over rounds
printed with the rounds' spread and the ratio to the transformers block taken round by round; every row's layer is
built first and stays on the GPU, so the rows' parameters add up: DeepSeek-V3's experts are 22 GiB a layer), the
dense-equivalent TFLOP/s (the dense step's GEMM FLOP over the step's time: at retain < 1 the backward does less
work, so this is not the GEMMs' rate), the peak memory of one step measured apart from the timing (do_bench's
256 MiB L2-flush buffer would count), and the host synchronisations of one step after warm-up (-1: not measured,
CUDA graphs). The backward starts from a fixed random gradient of the output (a .sum() would give an all-ones,
stride-0 gradient that eager kernels read from cache). --modes adds compiled-cg (mode="reduce-overhead": CUDA
graphs) and compiled-ma (mode="max-autotune-no-cudagraphs": Inductor autotunes its GEMM templates against
torch._grouped_mm). Several values of --selection, --quota-align, --backward-capacity or --router-dtype run each
LRMoE row once per value, tagged. --block glm / deepseek runs GLM-4.5-Air's / DeepSeek-V3's block (sigmoid scores,
a selection bias, a shared expert; DeepSeek-V3 also 8 expert groups of which 4 are chosen, gates scaled by 2.5)
against transformers' Glm4MoeMoE / DeepseekV3MoE. --skew s biases every layer's router (common.skew_router).
The GEMM floor is 6·T·k·3·d·f FLOP forward+backward (2× for forward alone) at the measured matmul rate.

``profile``: torch.profiler over --steps steps: the wall time per step (unprofiled) next to the GPU time, so a
host-bound step shows as a gap, then the operators (eager) or generated kernels (--compiled) with the largest self
GPU time, the CUDA runtime calls and the host ops. --timeline adds where the GPU sat idle between kernels.

``host``: is the eager layer host-bound? 10 steps with no synchronisation inside the loop: "host" is the time until
the last step's launches are issued, "wall" until the GPU has finished them too; "GPU activities" counts one
step's kernels and copies. --cpu-table prints torch.profiler's host-side table; --per-call the host microseconds
per call of lrmoe::gather_sum_rows on a tiny problem through the op, its CUDA kernel function, the Triton launcher
and the bare kernel[grid] launch (300 calls a round, median of 5 rounds).

``offload``: does activations="offload" hide its device-to-host copy behind compute? (eager) The timeline of one
step (the DtoH copies of h, the share of their time while a kernel runs, the backward's gather of the retained rows
from pinned memory), then medians of "save" against "offload" and the copy alone.

``peers`` (e2e_common.peer_layers): SonicMoE, transformers' block and LRMoE side by side, SonicMoE run first;
``imports`` (e2e_common.import_orders): SonicMoE's first call after each import order, each in a fresh process.
The end-to-end training comparison of the same layers is benchmarks/train_e2e.py (docs/e2e.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F
from common import (
    SHAPES,
    SIGMOID_BLOCKS,
    count_syncs,
    hf_block,
    interleaved,
    kernel_intervals,
    overlap,
    require_cuda,
    skew_router,
    timeline_stats,
    top_kernels,
    union,
)
from e2e_common import SCENARIOS, VARIANTS, import_orders, own_code, peer_layers, variant_name
from torch import nn
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from lrmoe.nn import LRMoE

_COMPILE_MODES = {"eager": None, "compiled": None, "compiled-cg": "reduce-overhead",
                  "compiled-ma": "max-autotune-no-cudagraphs"}


class GroupedMMLayer(nn.Module):
    """The plainest fast MoE layer: softmax top-k, sort by expert, gather, two torch._grouped_mm calls, scatter."""

    def __init__(self, dim, hidden_dim, num_experts, top_k):
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.gate_up = nn.Parameter(torch.randn(num_experts, 2 * hidden_dim, dim) / dim**0.5)
        self.down = nn.Parameter(torch.randn(num_experts, dim, hidden_dim) / hidden_dim**0.5)

    def forward(self, x_TD):
        probs = self.gate(x_TD).float().softmax(-1)
        w_TK, e_TK = probs.topk(self.top_k, dim=-1)
        w_TK = (w_TK / w_TK.sum(-1, keepdim=True)).to(x_TD.dtype)
        order = e_TK.flatten().argsort(stable=True)
        counts = torch.zeros(self.gate_up.shape[0], dtype=torch.int32, device=x_TD.device).scatter_add_(
            0, e_TK.flatten(), torch.ones_like(order, dtype=torch.int32))
        offs = counts.cumsum(0).int()
        x_PD = x_TD.index_select(0, order // self.top_k)
        gate, up = torch._grouped_mm(x_PD, self.gate_up.transpose(-2, -1), offs=offs).chunk(2, -1)
        y_PD = torch._grouped_mm(F.silu(gate) * up, self.down.transpose(-2, -1), offs=offs)
        y_PD = y_PD * w_TK.flatten()[order].unsqueeze(-1)
        return torch.zeros_like(x_TD).index_add(0, order // self.top_k, y_PD)


def _inputs(shape: dict, tokens: int, skew: float, layer: nn.Module | None = None):
    """x (requires grad; feature 0 set to 1 when the router is skewed) and a random output gradient, bf16."""
    x = torch.randn(tokens, shape["dim"], device="cuda", dtype=torch.bfloat16)
    if skew and layer is not None:
        skew_router(layer, skew, seed=0)
        x[:, 0] = 1.0  # the router-skew feature
    return x.requires_grad_(), torch.randn(tokens, shape["dim"], device="cuda", dtype=torch.bfloat16)


# -------------------------------------------------------------------------------------------------------- time


def _skewed_load_ratio(shape: dict, tokens: int, skew: float) -> float:
    """max / mean expert load of an LRMoE layer's router under skew_router, as the benchmark builds it."""
    torch.manual_seed(0)
    layer = LRMoE(**shape).cuda().bfloat16()
    skew_router(layer, skew, seed=0)
    x = torch.randn(tokens, shape["dim"], device="cuda", dtype=torch.bfloat16)
    x[:, 0] = 1.0
    ids = layer.gate(x).float().topk(shape["top_k"], dim=-1).indices
    loads = torch.bincount(ids.flatten(), minlength=shape["num_experts"]).float()  # outside any timed step
    return (loads.max() / loads.mean()).item()


def time_layers(args) -> None:
    from triton.testing import do_bench

    shape = SHAPES[args.shape]
    d, f, k, T = shape["dim"], shape["hidden_dim"], shape["top_k"], args.tokens
    print(f"# {args.shape} {shape}, tokens={T}, bf16, {torch.cuda.get_device_name()}, torch {torch.__version__}")
    sigmoid_block = SIGMOID_BLOCKS.get(args.block)
    flop_step = 6 * (T * k + (T if sigmoid_block else 0)) * 3 * d * f  # the shared expert: one more pair per token
    print(f"# GEMM FLOP: forward {flop_step / 3 / 1e12:.3f} TFLOP, forward+backward {flop_step / 1e12:.3f} TFLOP")
    if args.skew:
        print(f"# router skew {args.skew:g}: max / mean expert load {_skewed_load_ratio(shape, T, args.skew):.2f} "
              "(LRMoE's router)")
    print(f"# medians over {args.rounds} rounds (each round times every row, in a rotated order); spread: the largest "
          "minus the smallest round's fwd+bwd median; vs: the transformers block's fwd+bwd time over this row's, "
          "the median of the rounds' ratios (same mode)")
    print("# TFLOP/s*: dense-equivalent (the dense step's FLOP over this step's time)")
    print(f"{'layer':>26} {'mode':>8} {'fwd ms':>8} {'fwd+bwd ms':>10} {'spread':>6} {'vs':>7} {'TFLOP/s*':>8} "
          f"{'peak GiB':>8} {'syncs':>5}")

    both = len(args.selection) > 1
    aligns = list(dict.fromkeys(args.quota_align))
    caps = [None if c == "none" else float(c) for c in dict.fromkeys(args.backward_capacity)]
    routers = [None if r == "param" else getattr(torch, r) for r in dict.fromkeys(args.router_dtype)]
    layers = [
        (f"lrmoe r={r:g}" + (f" {sel}" if both and r < 1 else "")
         + (f" a{align}" if len(aligns) > 1 and r < 1 else "") + (f" c{cap or '-'}" if len(caps) > 1 and r < 1 else "")
         + (" fp32 router" if len(routers) > 1 and router is not None else ""),
         lambda r=r, sel=sel, align=align, cap=cap, router=router: LRMoE(
             **shape, retain=r, selection=sel, quota_align=align, backward_capacity=cap, router_dtype=router,
             **(sigmoid_block | dict(shared_hidden_dim=f) if sigmoid_block else {})))
        for r in args.retain for sel in (args.selection if r < 1 else args.selection[:1])
        for align in (aligns if r < 1 else aligns[:1]) for cap in (caps if r < 1 else [None]) for router in routers
    ]
    if not args.skip_baselines:
        if not sigmoid_block:  # softmax routing and no shared expert: not GLM's or DeepSeek's block
            layers.append(("grouped_mm layer", lambda: GroupedMMLayer(**shape)))
        layers.append((f"transformers {args.block}", lambda: hf_block(**shape, block=args.block)))
    rows = []
    for name, make in layers:
        torch.cuda.synchronize()
        others = torch.cuda.memory_allocated()  # the rows built before this one
        torch.manual_seed(0)
        layer = make().cuda().bfloat16()
        x, grad_out = _inputs(shape, T, args.skew, layer)  # the same for every layer (seeded above)
        held = torch.cuda.memory_allocated() - others  # this layer's parameters and buffers, its input, the gradient
        grads = [x, *layer.parameters()]  # no .grad before a mode's first step (cleared after each mode's peak)
        for mode in args.modes:
            before_mode = torch.cuda.memory_allocated()
            fwd, step = _row_steps(layer, x, grad_out, mode, fullgraph=name.startswith("lrmoe"))
            step()
            step()
            syncs = count_syncs(step) if mode != "compiled-cg" else -1
            # Peak memory of one step from no gradients (as do_bench's grad_to_none leaves them), before do_bench
            # allocates its L2-flush buffer, as if the row ran alone (the rows built before it stay allocated): the
            # step's rise, plus what the layer holds (held) and what this mode keeps allocated between steps (kept).
            for t in grads:
                t.grad = None
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            kept = before - before_mode
            torch.cuda.reset_peak_memory_stats()
            step()
            torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - before + kept + held) / 2**30
            for t in grads:
                t.grad = None
            rows.append(dict(name=name, mode=mode, fwd=fwd, step=step, grads=grads, peak=peak, syncs=syncs))

    def time_row(i: int) -> tuple[float, float]:
        row = rows[i]
        # warmup and rep are milliseconds: ~45 timed steps of 4.4 ms (rep=40 gave ~8).
        fwd_ms = do_bench(row["fwd"], warmup=25, rep=200, return_mode="median")
        step_ms = do_bench(row["step"], warmup=25, rep=200, return_mode="median", grad_to_none=row["grads"])
        for t in row["grads"]:  # do_bench leaves the last step's gradients: every row's would add up
            t.grad = None
        return fwd_ms, step_ms

    times = interleaved(list(range(len(rows))), time_row, args.rounds)
    for i, row in enumerate(rows):
        row["fwd_ms"], row["step_ms"] = [t[0] for t in times[i]], [t[1] for t in times[i]]
    base = {row["mode"]: row for row in rows if row["name"].startswith("transformers")}
    for row in rows:
        step_ms = statistics.median(row["step_ms"])
        spread = max(row["step_ms"]) - min(row["step_ms"])
        ref = base.get(row["mode"])
        ratio = (statistics.median(b / s for b, s in zip(ref["step_ms"], row["step_ms"])) if ref is not None
                 else float("nan"))
        print(f"{row['name']:>26} {row['mode']:>8} {statistics.median(row['fwd_ms']):>8.3f} {step_ms:>10.3f} "
              f"{spread:>6.3f} {ratio:>6.2f}x {flop_step / step_ms / 1e9:>8.0f} {row['peak']:>8.2f} "
              f"{row['syncs']:>5}", flush=True)


def _row_steps(layer: nn.Module, x: torch.Tensor, grad_out: torch.Tensor, mode: str, fullgraph: bool):
    """The forward (no grad) and the forward+backward step of one row. Each compiled row compiles a function
    with a code object of its own, so every row has its own Dynamo cache: rows built one after another stay
    compiled side by side (no reset between them, no shared recompile limit, no float attribute turned dynamic by a
    recompile)."""

    def call(x):
        return layer(x)

    # A copy of call's code object: Dynamo keeps its cache on the code object, and every row's closure would share
    # this one. (Not a partial or an exec'd function: torch.compile wraps either in one shared function.)
    call = own_code(call)
    fn = call if mode == "eager" else torch.compile(call, fullgraph=fullgraph, mode=_COMPILE_MODES[mode])
    graphs = mode == "compiled-cg"

    def fwd():
        if graphs:  # each call a new step: CUDA-graph outputs of the last one may be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        with torch.no_grad():
            fn(x)

    def step():
        if graphs:  # and no gradient accumulated into a graph output of the last step
            torch.compiler.cudagraph_mark_step_begin()
            for t in (x, *layer.parameters()):
                t.grad = None
        # LRMoE's statistics accumulate in a probe's .grad, in every mode: the layer's CUDA-graph row leaves a graph
        # output there, which another row's graphs may overwrite before this row's next step adds to it
        if hasattr(layer, "reset_stats"):
            layer.reset_stats()
        fn(x).backward(grad_out)

    return fwd, step


# ----------------------------------------------------------------------------------------------------- profile


def profile_layer(args) -> None:
    shape = SHAPES[args.shape]
    torch.manual_seed(0)
    layer = LRMoE(**shape, retain=args.retain, selection=args.selection,
                  quota_align=args.quota_align, backward_capacity=args.backward_capacity).cuda().bfloat16()
    fn = torch.compile(layer, fullgraph=True) if args.compiled else layer
    x, grad_out = _inputs(shape, args.tokens, args.skew, layer)

    def step():
        if args.forward_only:
            with torch.no_grad():
                fn(x)
            return
        fn(x).backward(grad_out)
        x.grad = None
        for p in layer.parameters():
            p.grad = None

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - start) / args.steps * 1e3
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
    averages = prof.key_averages()
    gpu_ms, lines = top_kernels(averages, args.steps, args.rows)
    mode = ("compiled" if args.compiled else "eager") + (", forward only" if args.forward_only else "")
    print(f"# {args.shape}, tokens={args.tokens}, retain={args.retain:g}, skew={args.skew:g}, {mode}: "
          f"{gpu_ms:.3f} ms GPU time per step, {wall_ms:.3f} ms wall per step (unprofiled)")
    print("\n".join(lines))
    if args.timeline:
        print_timeline(prof, args.steps)
    # Where the host waits or launches: CUDA runtime calls (a synchronising one is a host sync) and the host ops
    # with the most self CPU time, per step.
    runtime = sorted((e for e in averages if e.key.startswith("cuda") and e.self_device_time_total == 0),
                     key=lambda e: -e.self_cpu_time_total)
    print(f"# CUDA runtime calls per step: {'ms/step':>8} {'calls/step':>10}")
    for e in runtime[:8]:
        print(f"{e.self_cpu_time_total / args.steps / 1e3:>8.3f} {e.count / args.steps:>10.1f}  {e.key[:60]}")
    host = sorted((e for e in averages if not e.key.startswith("cuda") and e.self_device_time_total == 0),
                  key=lambda e: -e.self_cpu_time_total)
    print(f"# host ops by self CPU time per step: {'ms/step':>8} {'calls/step':>10}")
    for e in host[:12]:
        print(f"{e.self_cpu_time_total / args.steps / 1e3:>8.3f} {e.count / args.steps:>10.1f}  {e.key[:80]}")


def print_timeline(prof, steps: int) -> None:
    """The GPU's timeline over the profiled steps, launched back to back: span and busy time per step, the idle time
    between kernels (the GPU waiting for the host's launches, and for the profiler's own buffer requests, which are
    printed apart), and the largest gaps. The profiler slows the host: compare the span with the unprofiled wall
    time printed first."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as trace_file:
            trace = json.load(trace_file)
    intervals = kernel_intervals(trace)
    if not intervals:
        print("# timeline: no GPU events in the trace")
        return
    span, busy, gaps = timeline_stats(intervals)
    idle = span - busy
    stalls = sum(g for g, *_ in gaps if g > 1000)  # the profiler's own buffer requests stop the host for ~2 ms
    print(f"# timeline over {steps} steps: {span / steps / 1e3:.3f} ms span per step, {busy / steps / 1e3:.3f} busy, "
          f"{idle / steps / 1e3:.3f} idle in {len(gaps) / steps:.0f} gaps per step "
          f"({sum(g for g, *_ in gaps if 5 < g <= 1000) / steps / 1e3:.3f} ms in gaps of 5 µs to 1 ms, "
          f"{stalls / steps / 1e3:.3f} in longer ones)")
    print(f"{'gap µs':>8}  kernel before -> kernel after (largest gaps)")
    for gap, before, after in sorted(gaps, reverse=True)[:12]:
        print(f"{gap:>8.1f}  {before[:60]} -> {after[:60]}")


# -------------------------------------------------------------------------------------------------------- host


def _eager_step(shape: dict, retain: float, tokens: int):
    torch.manual_seed(0)
    layer = LRMoE(**shape, retain=retain, selection="top").cuda().bfloat16()
    x = torch.randn(tokens, shape["dim"], device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def step():
        layer(x).sum().backward()
        x.grad = None
        for p in layer.parameters():
            p.grad = None

    return step


def _host_and_wall(step, n: int = 10) -> tuple[float, float]:
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        step()
    host = (time.perf_counter() - start) / n * 1e3
    torch.cuda.synchronize()
    return host, (time.perf_counter() - start) / n * 1e3


def _per_call() -> None:
    import triton

    import lrmoe.ops.token_rows as token_rows
    from lrmoe.ops._kernels import kernel_module

    T, K, C = 256, 8, 2048
    src = torch.randn(T * K, C, device="cuda", dtype=torch.bfloat16)
    src_grad = src.clone().requires_grad_()
    rows = torch.randperm(T * K, device="cuda").view(T, K)
    w = torch.rand(T, K, device="cuda", dtype=torch.bfloat16)
    kernels = kernel_module("token_rows")
    block_c = kernels._block_c(C, 2, K, 16384)
    out = torch.empty(T, C, device="cuda", dtype=torch.bfloat16)

    def bare():
        kernels._gather_sum_rows_kernel[(T, triton.cdiv(C, block_c))](
            src, rows, w, out, C, K, src.stride(0), out.stride(0), HAS_W=True, KP=K, BLOCK_C=block_c, num_warps=4)

    cases = {
        "op": lambda: token_rows.gather_sum_rows(src, rows, w),
        "op, src requires grad": lambda: token_rows.gather_sum_rows(src_grad, rows, w),
        "CUDA kernel fn, direct": lambda: token_rows._gather_sum_rows_cuda(src, rows, w),
        "Triton launcher": lambda: kernels.gather_sum_rows_triton(src, rows, w),
        "kernel[grid]": bare,
        "aten index_select": lambda: src.index_select(0, rows.view(-1)),
        "aten empty": lambda: torch.empty(T, C, device="cuda", dtype=torch.bfloat16),
    }
    print(f"{'lrmoe::gather_sum_rows, host us per call':>40}")
    for name, fn in cases.items():
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        rounds = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(300):
                fn()
            rounds.append((time.perf_counter() - start) / 300 * 1e6)
            torch.cuda.synchronize()
        print(f"{name:>40} {sorted(rounds)[2]:8.1f}")


def host_cost(args) -> None:
    print(f"# eager LRMoE, {args.shape}, bf16, top selection, {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}")
    print(f"{'tokens':>7} {'retain':>6} {'host ms/step':>13} {'wall ms/step':>13} {'GPU activities':>15}")
    for tokens in args.tokens:
        for retain in args.retain:
            step = _eager_step(SHAPES[args.shape], retain, tokens)
            host, wall = _host_and_wall(step)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                step()
                torch.cuda.synchronize()
            launches = sum(e.count for e in prof.key_averages() if e.device_type == DeviceType.CUDA)
            print(f"{tokens:>7} {retain:>6g} {host:>13.3f} {wall:>13.3f} {launches:>15}")
            if args.cpu_table:
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    for _ in range(5):
                        step()
                    torch.cuda.synchronize()
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30,
                                                max_name_column_width=50))
    if args.per_call:
        _per_call()


# ----------------------------------------------------------------------------------------------------- offload


def offload_overlap(args) -> None:
    from triton.testing import do_bench

    shape = SHAPES[args.shape]
    T, d, f, k = args.tokens, shape["dim"], shape["hidden_dim"], shape["top_k"]
    print(f"# {args.shape} {shape}, tokens={T}, retain={args.retain:g}, bf16, eager, {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}")
    x = torch.randn(T, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn_like(x)
    layers = {}
    for policy in ("save", "offload"):
        torch.manual_seed(0)
        layers[policy] = LRMoE(**shape, retain=args.retain, activations=policy).cuda().bfloat16()

    # 1. Timeline of one offload step.
    layer = layers["offload"]
    for _ in range(2):
        layer(x).backward(g)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        layer(x).backward(g)
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    span = lambda e: (e.time_range.start, e.time_range.end)  # noqa: E731  (µs)
    copies = [span(e) for e in events if "DtoH" in e.name]
    kernels = [span(e) for e in events if "Memcpy" not in e.name and "Memset" not in e.name]
    gathers = [span(e) for e in events if "gather_rows" in e.name]
    copy_us = sum(b - a for a, b in union(copies))
    hidden_us = overlap(copies, kernels)
    gather_us = sum(b - a for a, b in gathers)
    h_bytes = T * k * 2 * f * 2
    print(f"# timeline: {len(copies)} DtoH copies, {copy_us / 1e3:.3f} ms ({h_bytes / max(copy_us, 1e-9) / 1e3:.1f} "
          f"GB/s), {hidden_us / max(copy_us, 1e-9):.1%} of it while a kernel runs; gather of retained rows from "
          f"pinned memory {gather_us / 1e3:.3f} ms")

    # 2. Medians, same run.
    h = torch.empty(T * k, 2 * f, device="cuda", dtype=torch.bfloat16)
    host = torch.empty(h.shape, dtype=h.dtype, pin_memory=True)
    copy_ms = do_bench(lambda: host.copy_(h, non_blocking=True), warmup=3, rep=30, return_mode="median")
    print(f"# copy of h alone ({h_bytes / 2**20:.0f} MiB, device -> pinned): {copy_ms:.3f} ms")
    print(f"{'policy':>8} {'fwd ms':>8} {'fwd+bwd ms':>10}")
    for policy, layer in layers.items():
        params = list(layer.parameters())

        def fwd(layer=layer):
            layer(x)  # with grad: "offload" only copies when a backward can follow

        fwd_ms = do_bench(fwd, warmup=3, rep=30, return_mode="median", grad_to_none=[x, *params])
        step_ms = do_bench(lambda layer=layer: layer(x).backward(g), warmup=3, rep=30, return_mode="median",
                           grad_to_none=[x, *params])
        print(f"{policy:>8} {fwd_ms:>8.3f} {step_ms:>10.3f}", flush=True)


# --------------------------------------------------------------------------------------------------------- CLI


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("time", help="LRMoE against transformers' block and a _grouped_mm layer, interleaved rounds")
    p.add_argument("--retain", type=float, nargs="+", default=[1.0, 0.75, 0.5])
    p.add_argument("--selection", nargs="+", default=["sample"], choices=["sample", "top"],
                   help="one or both: every retain < 1 runs once per selection (retain 1 selects nothing)")
    p.add_argument("--skip-baselines", action="store_true")
    p.add_argument("--modes", nargs="+", default=["eager", "compiled"], choices=list(_COMPILE_MODES))
    p.add_argument("--quota-align", type=int, nargs="+", default=[1], help="LRMoE's quota_align; several: tagged")
    p.add_argument("--backward-capacity", nargs="+", default=["none"],
                   help="LRMoE's backward_capacity, a factor or 'none'; several: tagged 'c<value>'")
    p.add_argument("--block", choices=["qwen3", *SIGMOID_BLOCKS], default="qwen3")
    p.add_argument("--router-dtype", nargs="+", default=["param"], choices=["param", "float32"],
                   help="LRMoE(router_dtype=...): the parameters' dtype (bf16) or fp32; several: tagged")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (common.interleaved)")
    p = sub.add_parser("profile", help="torch.profiler: top kernels, runtime calls, host ops (--timeline: gaps)")
    p.add_argument("--retain", type=float, default=0.75)
    p.add_argument("--selection", default="sample", choices=["sample", "top"])
    p.add_argument("--compiled", action="store_true")
    p.add_argument("--forward-only", action="store_true", help="profile forward under no_grad")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--quota-align", type=int, default=1, help="LRMoE's quota_align")
    p.add_argument("--backward-capacity", type=float, default=None, help="LRMoE's backward_capacity")
    p.add_argument("--timeline", action="store_true", help="also the GPU's busy and idle time, largest gaps")
    p = sub.add_parser("host", help="the eager layer's host time against its wall time")
    p.add_argument("--retain", type=float, nargs="+", default=[1.0, 0.75, 0.5])
    p.add_argument("--per-call", action="store_true", help="also one op's host time per call, by layer")
    p.add_argument("--cpu-table", action="store_true", help="also the ops with the most self CPU time")
    p = sub.add_parser("offload", help='activations="offload": copy overlap and time against "save"')
    p.add_argument("--retain", type=float, default=0.75)
    p = sub.add_parser("peers", help="SonicMoE, transformers' block and LRMoE side by side (SonicMoE first)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), type=variant_name,
                   help="transformers, sonic, lrmoe-<retain>[-top][-savey][-portable|-hopper] (SonicMoE runs first)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (common.interleaved)")
    p.add_argument("--reps", type=int, default=20, help="back-to-back steps a round, their median")
    p.add_argument("--out", help="also write the table to OUT/layer.md")
    p.add_argument("--json", help="also write the rows as JSON to this file, in the format of docs/results/peers.json")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="after the table, each row's N largest kernels (torch.profiler, 5 steps)")
    p = sub.add_parser("imports", help="SonicMoE's first call after each import order, each in a fresh process")
    p.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    p.add_argument("--limit", type=int, default=120, help="seconds before a scenario dumps its stack and exits")
    p.add_argument("--cold-limit", type=int, default=600, help="--limit of a scenario with an empty quack cache")
    p.add_argument("--cold-each", action="store_true", help="an empty quack cache for every scenario")
    p.add_argument("--cache-dir", help="the quack cache the scenarios share (default: a new temporary folder)")
    p.add_argument("--log-dir", help="write each scenario's whole output to LOG_DIR/imports_<order>.txt")
    for name, p in sub.choices.items():
        if name == "imports":
            continue
        p.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
        if name in ("host", "peers"):
            p.add_argument("--tokens", type=int, nargs="+", default=[256, 8192] if name == "host" else [8192, 32768])
        else:
            p.add_argument("--tokens", type=int, default=8192)
        if name in ("time", "profile"):
            p.add_argument("--skew", type=float, default=0.0,
                           help="router skew of every layer (common.skew_router; 0: near-balanced loads)")
    args = parser.parse_args(argv)
    for flag in ("rounds", "reps"):
        if getattr(args, flag, 1) < 1:
            parser.error(f"--{flag} must be at least 1, got {getattr(args, flag)}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    require_cuda(f"benchmarks/layer.py {args.command}")
    {"time": time_layers, "profile": profile_layer, "host": host_cost, "offload": offload_overlap, "peers": peer_layers,
     "imports": import_orders}[args.command](args)


if __name__ == "__main__":
    main()
