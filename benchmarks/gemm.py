"""Grouped GEMMs at MoE shapes on one GPU (bf16): the Triton kernels against torch._grouped_mm, operand layouts,
the backward's GEMMs on side streams, and the matrix rate under sustained load.

    python benchmarks/gemm.py grouped [--problems qwen3-up qwen3-down glm-up glm-down] [--rows 65536] [--configs]
    python benchmarks/gemm.py layouts [--model qwen3-30b-a3b] [--rows-per-group 512 384 256]
    python benchmarks/gemm.py streams [--shape qwen3-30b-a3b] [--retain 1 0.75 0.5]
    python benchmarks/gemm.py sustained [--seconds 6] [--window 0.5]

``grouped``: forward (y_RO = weight[e] @ x[rows]): (a) lrmoe_kernels.grouped_gemm's Triton kernel with the gather
fused into its operand load (the weight through a TMA descriptor, the default for bf16; rows "weight by pointers"
and "O-contiguous" time the pointer loads and a weight stored transposed, the input gradient's layout), (b)
index_select then torch._grouped_mm, (c) torch._grouped_mm alone on pre-gathered rows. Weight gradient (w[e] = sum
outer(a[i], b[rows[i]])): the Triton kernel (a through a ragged TMA descriptor; "a by pointers") against (b) and
(c) of the same kind. Problems: "<model>-up" (d -> f), "-down" (f -> d), "-gateup" (d -> 2f, as the layers run it)
of Qwen3-30B-A3B ("qwen3") and GLM-4.5-Air ("glm"). Group sizes (--groups, common.router_group_sizes): "bal",
"jitter" (a router with random logits) or "skew". --configs also times each launch config of the autotuner's
lists. Rows are interleaved over --rounds rounds; the median of their medians.

``layouts``: per GEMM of the layers' six (forward gate/up and down, their input and weight gradients) and group
size, torch._grouped_mm with B in either layout (and for the weight gradient with A^T a view or contiguous, and the
output computed transposed), next to torch.bmm on the same equal groups and one dense torch.mm of the same FLOP.
Equal groups of --rows-per-group rows per expert (512 ~ retain 1 at 8,192 tokens, top-8 of 128; 384 and 256 ~
retain 0.75 and 0.5, where the waterfill quotas make the groups equal); "~" rows give the retain-1 groups a random
spread (+-22 rows). The first row of each GEMM is the layers' layout; "vs first" is its time over the row's.

``streams``: do the backward's last three expert GEMMs (the down and gate/up weight gradients, the input gradient
with its per-token sum) run faster side by side on CUDA streams? Variants fork from and join back to the caller's
stream with events (no host sync); each must give the one-stream results exactly before it is timed, by "graph"
(common.graph_ms; the graph keeps the streams' fork and join) and "eager" (common.events_ms), over --rounds rounds.
Rows: common.retained_rows_problem.

``sustained``: the GPU's matrix rate in a short burst and under sustained load. An H200 at full matrix load can
reach its power limit and lower its clocks, so a rate timed over milliseconds after idle may not be the rate a
training step gets. Per problem (the dense 8192^3 matmul, and torch._grouped_mm at the Qwen3-30B-A3B gate/up shape
on equal and on router groups): --idle seconds idle, then back-to-back batches for --seconds, timed with CUDA
events: the fastest batch in the first 0.2 s (burst), the median batch of each --window of GPU time
(common.window_medians), and the last window over the burst. To see the clocks and the power, run ``nvidia-smi
--query-gpu=timestamp,clocks.sm,power.draw,clocks_event_reasons.active --format=csv -lms 100`` beside it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import (
    SHAPES,
    events_ms,
    graph_ms,
    interleaved,
    lrmoe_kernels,
    require_cuda,
    STREAM_VARIANTS,
    backward_ops,
    retained_rows_problem,
    router_group_sizes,
    window_medians,
)


EXPERTS, TOP_K = 128, 8
MODELS = {"qwen3": SHAPES["qwen3-30b-a3b"], "glm": SHAPES["glm-4.5-air"]}
# name: (I, O) of one grouped GEMM: up = d -> f, down = f -> d, gateup = d -> 2f (the layers' gate/up projection).
PROBLEMS = {f"{m}-{kind}": io for m, s in MODELS.items() for kind, io in (
    ("up", (s["dim"], s["hidden_dim"])), ("down", (s["hidden_dim"], s["dim"])),
    ("gateup", (s["dim"], 2 * s["hidden_dim"])))}
GROUPS = ("bal", "jitter", "skew")


# ----------------------------------------------------------------------------------------------------- grouped


def config_rows(current: list, tag: str = "cfg") -> list:
    """(label, config) for --configs: each candidate of an autotuner list, labelled ``tag`` and its blocks."""
    return [(f"{tag} {c.kwargs['BLOCK_M']}x{c.kwargs['BLOCK_N']}x{c.kwargs['BLOCK_K']} w{c.num_warps} "
             f"s{c.num_stages}", c) for c in current]


def make_inputs(R: int, I: int, O: int, groups: str, device: str = "cuda"):
    """MoE-like layout: N = R / top_k tokens, each buffer row a token id, sorted by expert then token."""
    gen = torch.Generator().manual_seed(0)
    E, N = EXPERTS, R // TOP_K
    sizes_E = router_group_sizes(R, E, TOP_K, groups, gen)
    expert_R = torch.repeat_interleave(torch.arange(E), sizes_E)
    token_R = torch.randint(0, N, (R,), generator=gen)
    rows_R = (expert_R * N + token_R).sort().values % N
    offsets_E = sizes_E.cumsum(0).int()
    x_NI = torch.randn(N, I, generator=gen).bfloat16()
    weight_EOI = (torch.randn(E, O, I, generator=gen) / I**0.5).bfloat16()
    a_RO = torch.randn(R, O, generator=gen).bfloat16()
    return [t.to(device) for t in (x_NI, weight_EOI, a_RO, rows_R, offsets_E)], sizes_E


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp(min=1e-30)).item()


def grouped(args) -> None:
    from triton.testing import do_bench

    gg = lrmoe_kernels("grouped_gemm")
    _gpu_configs, _outer_gpu_configs, _outer_tma_gpu_configs = (gg._gpu_configs, gg._outer_gpu_configs,
                                                                gg._outer_tma_gpu_configs)
    gather_grouped_mm_triton, grouped_outer_triton = gg.gather_grouped_mm_triton, gg.grouped_outer_triton

    def bench(fn) -> float:
        return do_bench(fn, warmup=25, rep=args.rep, return_mode="median")

    print(f"# R={args.rows} rows, E={EXPERTS}, bf16, {torch.cuda.get_device_name()}, torch {torch.__version__}")
    head = f"{'shape':>10} {'groups':>8} {'op':>5} {'kernel':>30} {'ms':>8} {'TFLOP/s':>8} {'vs (c)':>7} {'rel err':>8}"
    print(head)
    for name in args.problems:
        I, O = PROBLEMS[name]
        for groups in args.groups:
            (x_NI, weight_EOI, a_RO, rows_R, offsets_E), sizes_E = make_inputs(args.rows, I, O, groups)
            x_RI = x_NI.index_select(0, rows_R)
            w_t = weight_EOI.transpose(-2, -1)
            w_cm = weight_EOI.transpose(1, 2).contiguous().transpose(1, 2)  # same values, O contiguous
            fwd = {
                "(a) triton gather-fused": lambda: gather_grouped_mm_triton(x_NI, weight_EOI, rows_R, offsets_E),
                "(a) weight by pointers": lambda: gather_grouped_mm_triton(x_NI, weight_EOI, rows_R, offsets_E,
                                                                           b_desc=False),
                "(a) weight O-contiguous": lambda: gather_grouped_mm_triton(x_NI, w_cm, rows_R, offsets_E),
                "(a) O-contiguous, pointers": lambda: gather_grouped_mm_triton(x_NI, w_cm, rows_R, offsets_E,
                                                                               b_desc=False),
                "(b) index_select+_grouped_mm": lambda: torch._grouped_mm(
                    x_NI.index_select(0, rows_R), w_t, offs=offsets_E
                ),
                "(c) _grouped_mm pre-gathered": lambda: torch._grouped_mm(x_RI, w_t, offs=offsets_E),
            }
            wgrad = {
                "(a) triton gather-fused": lambda: grouped_outer_triton(a_RO, x_NI, rows_R, offsets_E),
                "(a) a by pointers": lambda: grouped_outer_triton(a_RO, x_NI, rows_R, offsets_E, a_tma=False),
                "(b) index_select+_grouped_mm": lambda: torch._grouped_mm(
                    a_RO.t(), x_NI.index_select(0, rows_R), offs=offsets_E
                ),
                "(c) _grouped_mm pre-gathered": lambda: torch._grouped_mm(a_RO.t(), x_RI, offs=offsets_E),
            }
            if args.configs:
                for label, cfg in config_rows(_gpu_configs()):
                    fwd[label] = lambda cfg=cfg: gather_grouped_mm_triton(x_NI, weight_EOI, rows_R, offsets_E, cfg)
                for label, cfg in config_rows(_outer_gpu_configs()):
                    wgrad[label] = lambda cfg=cfg: grouped_outer_triton(a_RO, x_NI, rows_R, offsets_E, cfg,
                                                                        a_tma=False)
                for label, cfg in config_rows(_outer_tma_gpu_configs(), tag="tma"):  # a through TMA
                    wgrad[label] = lambda cfg=cfg: grouped_outer_triton(a_RO, x_NI, rows_R, offsets_E, cfg,
                                                                        a_tma=True)
            ops = [("fwd", fwd), ("wgrad", wgrad)]
            groups = f"{groups} {int(sizes_E.max())}"
            for op, fns in ops:
                flop = 2 * args.rows * O * I
                want = fns["(b) index_select+_grouped_mm"]()
                times = interleaved(list(fns), lambda k: bench(fns[k]), args.rounds)
                ms = {k: statistics.median(t) for k, t in times.items()}
                for k, fn in fns.items():
                    tflops = flop / ms[k] / 1e9
                    ratio = ms["(c) _grouped_mm pre-gathered"] / ms[k]
                    out = fn()
                    err = rel_err(out, want)
                    print(f"{name:>10} {groups:>8} {op:>5} {k:>30} ", end="")
                    print(f"{ms[k]:>8.3f} {tflops:>8.1f} {ratio:>7.2f} {err:>8.1e}")




# ----------------------------------------------------------------------------------------------------- layouts


def col_major(t: torch.Tensor) -> torch.Tensor:
    """The same values with the last two dims stored transposed (a transposed view of a contiguous copy)."""
    return t.transpose(-2, -1).contiguous().transpose(-2, -1)


def layouts(args) -> None:
    from triton.testing import do_bench

    d, f = SHAPES[args.model]["dim"], SHAPES[args.model]["hidden_dim"]
    E = SHAPES[args.model]["num_experts"]
    gen = torch.Generator().manual_seed(0)
    print(f"# torch._grouped_mm operand layouts, {args.model} d={d} f={f} E={E}, bf16, "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'gemm':>14} {'rows/grp':>9} {'variant':>28} {'ms':>8} {'TFLOP/s':>8} {'vs first':>8}")
    for m in args.rows_per_group:
        for jitter in ((False, True) if m == 512 else (False,)):
            sizes = torch.full((E,), m, dtype=torch.long)
            if jitter:
                sizes = sizes + torch.randint(-22, 23, (E,), generator=gen)
                sizes[-1] += -int(sizes.sum()) % 8  # a total row count divisible by 8: 16-byte strides for B^T
            offs = torch.cumsum(sizes, 0).to(device="cuda", dtype=torch.int32)
            M = int(sizes.sum())
            label = f"{m}{'~' if jitter else ''}"
            # (name, K, N): the forward and input-gradient GEMMs as [M, K] @ B[e] -> [M, N]
            for name, K, N in (("fwd gate/up", d, 2 * f), ("fwd down", f, d), ("dgrad gate/up", 2 * f, d),
                               ("dgrad down", d, f)):
                a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
                b_row = torch.randn(E, K, N, device="cuda", dtype=torch.bfloat16)
                b_col = col_major(b_row)
                row = ("B row-major", lambda: torch._grouped_mm(a, b_row, offs=offs))
                col = ("B col-major", lambda: torch._grouped_mm(a, b_col, offs=offs))
                cases = [col, row] if name.startswith("fwd") else [row, col]  # the layers' layout first
                cases += [
                          ("dense mm, same FLOP", lambda: a @ b_row[0])]
                if not jitter:
                    a3 = a.view(E, m, K)
                    cases += [("bmm, B row-major", lambda: torch.bmm(a3, b_row)),
                              ("bmm, B col-major", lambda: torch.bmm(a3, b_col))]
                run_cases(name, label, cases, 2 * M * K * N, args.rounds, do_bench)
            # weight gradients: out[e] = A[e rows]^T @ B[e rows], A [M, P], B [M, Q] -> [E, P, Q]
            for name, P, Q in (("wgrad gate/up", 2 * f, d), ("wgrad down", d, f)):
                a = torch.randn(M, P, device="cuda", dtype=torch.bfloat16)
                b = torch.randn(M, Q, device="cuda", dtype=torch.bfloat16)
                a_t = a.t().contiguous()
                b_cm = col_major(b)
                cases = [("A^T view, B row", lambda: torch._grouped_mm(a.t(), b, offs=offs)),
                         ("A^T view, B col", lambda: torch._grouped_mm(a.t(), b_cm, offs=offs)),
                         ("out^T = B^T A", lambda: torch._grouped_mm(b.t(), a, offs=offs)),
                         ("dense mm, same FLOP", lambda: a_t[:, : M // E * E] @ b[: M // E * E])]
                if not jitter:  # a row-major A^T needs every group's row count a multiple of 8 (16 bytes):
                    # _grouped_mm asserts on the device otherwise (seen on the H200)
                    cases.insert(1, ("A^T contiguous, B row", lambda: torch._grouped_mm(a_t, b, offs=offs)))
                    cases += [("bmm (A^T view)", lambda: torch.bmm(a.view(E, m, P).transpose(1, 2),
                                                                    b.view(E, m, Q)))]
                run_cases(name, label, cases, 2 * M * P * Q, args.rounds, do_bench)


def run_cases(name, label, cases, flop, rounds, do_bench) -> None:
    fns = dict(cases)
    times = interleaved(list(fns), lambda case: do_bench(fns[case], warmup=10, rep=40, return_mode="median"), rounds)
    first = None
    for case, _ in cases:
        ms = statistics.median(times[case])
        first = first or ms
        print(f"{name:>14} {label:>9} {case:>28} {ms:>8.4f} {flop / ms / 1e9:>8.0f} {first / ms:>8.2f}")



# ----------------------------------------------------------------------------------------------------- streams


def run_variant(fns: dict, lanes: list[list[str]], side: list[torch.cuda.Stream]) -> dict:
    main = torch.cuda.current_stream()
    fork = torch.cuda.Event()
    fork.record(main)
    out = {}
    for stream, names in zip(side, lanes[1:]):
        stream.wait_event(fork)
        with torch.cuda.stream(stream):
            out.update({n: fns[n]() for n in names})
    side_outputs = list(out.values())
    out.update({n: fns[n]() for n in lanes[0]})
    for stream in side[: len(lanes) - 1]:
        main.wait_stream(stream)
    for t in side_outputs:  # allocated on a side stream, used and freed on the caller's: tell the allocator
        t.record_stream(main)
    return out


def streams(args) -> None:
    side = [torch.cuda.Stream() for _ in range(2)]
    print(f"{args.shape}, {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| retain | rows | variant | graph ms | eager ms | vs one stream (graph) | TFLOP/s (graph) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for retain in args.retain:
        p = retained_rows_problem(SHAPES[args.shape], args.tokens, retain)
        fns = backward_ops(p)
        want = run_variant(fns, STREAM_VARIANTS["one stream"], side)
        for name, lanes in STREAM_VARIANTS.items():
            got = run_variant(fns, lanes, side)
            torch.cuda.synchronize()
            bad = [k for k in want if not torch.equal(got[k], want[k])]
            if bad:
                raise AssertionError(f"{name}: {bad} differ from one stream")

        def time_variant(name: str) -> tuple[float, float]:
            call = lambda lanes=STREAM_VARIANTS[name]: run_variant(fns, lanes, side)  # noqa: E731
            return graph_ms(call, [()]), events_ms(call)

        times = interleaved(list(STREAM_VARIANTS), time_variant, args.rounds)
        base = statistics.median(t[0] for t in times["one stream"])
        for name, rounds in times.items():
            g, eager = statistics.median(t[0] for t in rounds), [t[1] for t in rounds]
            print(f"| {retain} | {p['rows']} | {name} | {g:.3f} | {statistics.median(eager):.3f} | "
                  f"{base / g:.3f} | {p['flop'] / g / 1e9:.0f} |")



# --------------------------------------------------------------------------------------------------- sustained


def problems(device: str = "cuda") -> dict:
    gen = torch.Generator().manual_seed(0)
    n = 8192
    a, b = (torch.randn(n, n, generator=gen).bfloat16().to(device) for _ in range(2))
    rows, experts, dim, out = 65536, 128, 2048, 1536
    x = torch.randn(rows, dim, generator=gen).bfloat16().to(device)
    w = (torch.randn(experts, out, dim, generator=gen) / dim**0.5).bfloat16().to(device).transpose(-2, -1)
    equal = torch.full((experts,), rows // experts).cumsum(0).int().to(device)
    ids = torch.randn(rows // 8, experts, generator=gen).topk(8, dim=1).indices.reshape(-1)
    router = torch.bincount(ids, minlength=experts).cumsum(0).int().to(device)
    gemm_flop = 2 * rows * dim * out
    return {
        "matmul 8192^3": (lambda: a @ b, 2 * n**3),
        "_grouped_mm gate/up, equal groups": (lambda: torch._grouped_mm(x, w, offs=equal), gemm_flop),
        "_grouped_mm gate/up, router groups": (lambda: torch._grouped_mm(x, w, offs=router), gemm_flop),
    }


def sustained(fn, seconds: float, batch: int) -> list[tuple[float, float]]:
    """(GPU ms, ms per call) of consecutive batches of ``batch`` calls, back to back for about ``seconds``."""
    events = []
    wall_end = time.perf_counter() + seconds
    while time.perf_counter() < wall_end:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(batch):
            fn()
        end.record()
        events.append((start, end))
        if len(events) % 8 == 0:
            events[-8][1].synchronize()  # keep the host at most 16 batches ahead, so the wall time bounds the GPU's
    torch.cuda.synchronize()
    out, clock = [], 0.0
    for start, end in events:
        ms = start.elapsed_time(end)
        clock += ms
        out.append((clock, ms / batch))
    return out


def sustained_rate(args) -> None:
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; TFLOP/s per window of GPU time")
    for name, (fn, flop) in problems().items():
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        time.sleep(args.idle)
        batches = sustained(fn, args.seconds, args.batch)
        rate = [flop / ms / 1e9 for ms in window_medians(batches, args.window * 1e3)]
        if not rate:
            raise SystemExit(f"--seconds {args.seconds} gave no whole --window {args.window} of GPU time")
        # clocks ramp up from idle: the fastest batch ending in the first 0.2 s (or the first batch)
        burst = max(flop / ms / 1e9 for clock, ms in batches if clock <= 200 or clock == batches[0][0])
        print(f"{name}: burst (the fastest batch of {args.batch} calls in the first 0.2 s) {burst:.0f}; windows "
              + " ".join(f"{r:.0f}" for r in rate) + f"; last / burst {rate[-1] / burst:.3f}")




# --------------------------------------------------------------------------------------------------------- CLI


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("grouped", help="the Triton grouped GEMMs against torch._grouped_mm")
    p.add_argument("--problems", nargs="+", default=["qwen3-up", "qwen3-down", "glm-up", "glm-down"],
                   choices=sorted(PROBLEMS))
    p.add_argument("--rows", type=int, default=65536)
    p.add_argument("--rep", type=int, default=100, help="do_bench rep (ms)")
    p.add_argument("--configs", action="store_true", help="also time each launch config of the autotuner")
    p.add_argument("--groups", nargs="+", default=["bal", "skew"], choices=GROUPS, help="group sizes")
    p = sub.add_parser("layouts", help="torch._grouped_mm by operand layout, against bmm and a dense mm")
    p.add_argument("--model", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    p.add_argument("--rows-per-group", type=int, nargs="+", default=[512, 384, 256])
    p = sub.add_parser("streams", help="the backward's last three GEMMs on one, two or three streams")
    p.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--retain", type=float, nargs="+", default=[1.0, 0.75, 0.5])
    p = sub.add_parser("sustained", help="the matrix rate in a burst and under sustained load")
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--window", type=float, default=0.5, help="seconds of GPU time per printed window")
    p.add_argument("--idle", type=float, default=5.0, help="seconds of idle before each problem")
    p.add_argument("--batch", type=int, default=10, help="calls per timed batch")
    for name in ("grouped", "layouts", "streams"):
        sub.choices[name].add_argument("--rounds", type=int, default=3, help="interleaved rounds (common.interleaved)")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    require_cuda(f"benchmarks/gemm.py {args.command}")
    {"grouped": grouped, "layouts": layouts, "streams": streams, "sustained": sustained_rate}[args.command](args)


if __name__ == "__main__":
    main()
