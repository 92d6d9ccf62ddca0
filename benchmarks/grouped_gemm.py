"""Gather-fused Triton grouped GEMMs against torch._grouped_mm at MoE shapes (GPU, bf16).

    python benchmarks/grouped_gemm.py [--shapes qwen3-up qwen3-down glm-up glm-down] [--rows 65536] [--configs]
    (also --shapes qwen3-gateup glm-gateup: the 2f-wide gate/up GEMM the layers run)

Forward (y_RO = weight[e] @ x[rows]): (a) the Triton kernel with the gather fused into its operand load,
(b) index_select gather then torch._grouped_mm, (c) torch._grouped_mm alone on pre-gathered rows.
The forward's (a) reads the weight through a TMA descriptor (the default for bf16); the rows "weight by pointers"
time the pointer loads it had before, and the two "O-contiguous" rows the same on a weight stored transposed (the
layout the input gradient's weight.transpose(1, 2) view has), each way.
Weight gradient (w[e] = sum outer(a[i], b[rows[i]])): the Triton kernel against (b) and (c) of the same kind
(torch._grouped_mm 2D x 2D with offsets); its (a) reads a through a ragged TMA descriptor (the default for bf16),
the row "a by pointers" through the pointer loads it had before. The gate/up GEMM with the SwiGLU (``-up`` shapes,
weight [E, 2f, d], op "swiglu", FLOP of the 2f-wide GEMM): (a) the Triton kernel with the gather and the SwiGLU +
||phi||^2 in its epilogue, writing h, phi and ||phi||^2; (b) index_select + torch._grouped_mm + the SwiGLU and
||phi||^2 compiled (Inductor fuses them into one pass); (c) torch._grouped_mm alone on pre-gathered rows (h only).
Group sizes (--groups): balanced ("bal", R/E each), "jitter" (what a router with random logits gives: each of
R / 8 tokens picks 8 distinct experts; at 65,536 rows 512 +- ~22 a group, the spread the layer benchmarks see, which
costs 128-row tiles a mostly empty last tile per group) and skewed ("skew", a multinomial draw with log-normal expert
popularity, sigma 1, fixed seed: at 65,536 rows the hottest expert gets 8,150 rows, 16x the mean, the coldest 23).
The "groups" column shows the largest group.

Prints one table: median time (triton.testing.do_bench's median, then the median over --rounds rounds that
time every row of a problem in turn, so that a drift in clocks or power during the run hits all rows alike; one
run of the ninth session, timing each row once, had torch._grouped_mm on pre-gathered rows 37 % slower than an
earlier run and slower than gather + _grouped_mm), TFLOP/s (2·R·O·I / time), the ratio to (c) (target:
the fused kernel at >= 0.90 of torch._grouped_mm), and the largest relative error against (b).
--configs adds a row per launch config (fwd and wgrad): each candidate of the autotuner's lists in
lrmoe_kernels.grouped_gemm (wgrad: the pointer path's, and the ragged-TMA path's tagged "tma"), and the lists it had
before the ninth session ("old"), timed on the same problem, with its relative error against (b) like every row.
Importable on a CPU machine; main() needs CUDA.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import triton
from lrmoe_kernels.grouped_gemm import (
    _gpu_configs,
    _outer_gpu_configs,
    _outer_tma_gpu_configs,
    _swiglu_gpu_configs,
    gather_grouped_mm_triton,
    gather_grouped_swiglu_triton,
    grouped_outer_triton,
)

# name: (I, O). Qwen3-30B-A3B d=2048, f=768; GLM-4.5-Air d=4096, f=1408 (DESIGN.md §7); up = d -> f, down = f -> d.
SHAPES = {
    "qwen3-up": (2048, 768),
    "qwen3-down": (768, 2048),
    "glm-up": (4096, 1408),
    "glm-down": (1408, 4096),
    # the gate and up projections in one GEMM, as the layers run them (d -> 2f); not in the default set
    "qwen3-gateup": (2048, 1536),
    "glm-gateup": (4096, 2816),
}
DEFAULT_SHAPES = ["qwen3-up", "qwen3-down", "glm-up", "glm-down"]
EXPERTS = 128
TOP_K = 8
# The autotuner's one list for both kernels until the ninth session (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages).
OLD_CONFIGS = [(128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (64, 128, 64, 4, 4), (128, 128, 128, 8, 3),
               (64, 64, 32, 4, 3)]


def config_rows(current: list, tag: str = "cfg", old: bool = True) -> list[tuple[str, triton.Config]]:
    """(label, config) for --configs: the current candidates (labelled ``tag``), then, with ``old``, the old ones not
    among them."""
    def key(c):
        return (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.num_warps, c.num_stages)

    def label(k, tag):
        return f"{tag} {k[0]}x{k[1]}x{k[2]} w{k[3]} s{k[4]}"

    rows = [(label(key(c), tag), c) for c in current]
    have = {key(c) for c in current}
    missing = [k for k in OLD_CONFIGS if old and k not in have]
    return rows + [(label(k, "old"), triton.Config(dict(BLOCK_M=k[0], BLOCK_N=k[1], BLOCK_K=k[2]), num_warps=k[3],
                                                   num_stages=k[4])) for k in missing]


GROUPS = ("bal", "jitter", "skew")


def group_sizes(R: int, E: int, groups: str, gen: torch.Generator) -> torch.Tensor:
    if groups == "bal":
        return torch.full((E,), R // E, dtype=torch.long) + (torch.arange(E) < R % E)
    if groups == "jitter":  # a router with random logits: each of R / top_k tokens picks top_k distinct experts
        ids = torch.randn(R // TOP_K, E, generator=gen).topk(TOP_K, dim=1).indices
        return torch.bincount(ids.reshape(-1), minlength=E)
    popularity = torch.exp(torch.randn(E, generator=gen))
    return torch.bincount(torch.multinomial(popularity, R, replacement=True, generator=gen), minlength=E)


def make_inputs(R: int, I: int, O: int, groups: str, device: str = "cuda"):
    """MoE-like layout: N = R / top_k tokens, each buffer row a token id, sorted by expert then token."""
    gen = torch.Generator().manual_seed(0)
    E, N = EXPERTS, R // TOP_K
    sizes_E = group_sizes(R, E, groups, gen)
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


def swiglu_fns(x_NI, x_RI, rows_R, offsets_E, F, configs: bool = False) -> dict:
    """The three ways to the gate/up projection (2F wide) and phi; each returns phi, except (c): h. ``configs``:
    also the fused kernel at each launch config (rows "cfg BLOCK_M x gate columns x BLOCK_K")."""
    E, I = offsets_E.shape[0], x_NI.shape[1]
    gen = torch.Generator().manual_seed(1)
    gate_up_EFI = (torch.randn(E, 2 * F, I, generator=gen) / I**0.5).bfloat16().to(x_NI.device)
    w_t = gate_up_EFI.transpose(-2, -1)

    @torch.compile(fullgraph=True)
    def unfused(x_NI, rows_R):
        h = torch._grouped_mm(x_NI.index_select(0, rows_R), w_t, offs=offsets_E)
        gate, up = h.chunk(2, dim=-1)
        phi = torch.nn.functional.silu(gate) * up
        return h, phi, phi.float().square().sum(-1)

    fns = {
        "(a) triton gather+SwiGLU fused": lambda: gather_grouped_swiglu_triton(x_NI, gate_up_EFI, rows_R,
                                                                               offsets_E)[1],
        "(a) weight by pointers": lambda: gather_grouped_swiglu_triton(x_NI, gate_up_EFI, rows_R, offsets_E,
                                                                       b_desc=False)[1],
        "(b) index_select+_grouped_mm": lambda: unfused(x_NI, rows_R)[1],
        "(c) _grouped_mm pre-gathered": lambda: torch._grouped_mm(x_RI, w_t, offs=offsets_E),
    }
    if configs:  # each candidate of the autotuner's list, at 64 and 128 gate columns a program
        for c in _swiglu_gpu_configs():
            for bn in (64, 128):
                bm, bk = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_K"]
                if (bm + 2 * bn) * bk * 2 * c.num_stages > 227 * 1024:  # past an H200 block's shared memory
                    continue
                label = f"cfg {bm}x{bn}x{bk} w{c.num_warps} s{c.num_stages}"
                fns[label] = lambda c=c, bn=bn: gather_grouped_swiglu_triton(x_NI, gate_up_EFI, rows_R, offsets_E,
                                                                             config=c, block_n=bn)[1]
    return fns


def main() -> None:
    from triton.testing import do_bench

    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES, choices=sorted(SHAPES))
    parser.add_argument("--rows", type=int, default=65536)
    parser.add_argument("--rep", type=int, default=100, help="do_bench rep (ms)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the median of their medians")
    parser.add_argument("--configs", action="store_true", help="also time each launch config (see the docstring)")
    parser.add_argument("--groups", nargs="+", default=["bal", "skew"], choices=GROUPS,
                        help="group sizes (see the docstring)")
    args = parser.parse_args()

    def bench(fn) -> float:
        return do_bench(fn, warmup=25, rep=args.rep, return_mode="median")

    print(f"# R={args.rows} rows, E={EXPERTS}, bf16, {torch.cuda.get_device_name()}, torch {torch.__version__}")
    head = f"{'shape':>10} {'groups':>8} {'op':>5} {'kernel':>30} {'ms':>8} {'TFLOP/s':>8} {'vs (c)':>7} {'rel err':>8}"
    print(head)
    for name in args.shapes:
        I, O = SHAPES[name]
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
                for label, cfg in config_rows(_outer_tma_gpu_configs(), tag="tma", old=False):  # a through TMA
                    wgrad[label] = lambda cfg=cfg: grouped_outer_triton(a_RO, x_NI, rows_R, offsets_E, cfg,
                                                                        a_tma=True)
            ops = [("fwd", fwd), ("wgrad", wgrad)]
            if name.endswith("-up"):
                ops.append(("swiglu", swiglu_fns(x_NI, x_RI, rows_R, offsets_E, O, args.configs)))
            groups = f"{groups} {int(sizes_E.max())}"
            for op, fns in ops:
                flop = 2 * args.rows * O * I * (2 if op == "swiglu" else 1)
                want = fns["(b) index_select+_grouped_mm"]()
                times = {k: [] for k in fns}
                for _ in range(args.rounds):  # interleaved: clock or power drift hits every row alike
                    for k, fn in fns.items():
                        times[k].append(bench(fn))
                ms = {k: statistics.median(t) for k, t in times.items()}
                for k, fn in fns.items():
                    tflops = flop / ms[k] / 1e9
                    ratio = ms["(c) _grouped_mm pre-gathered"] / ms[k]
                    out = fn()
                    err = rel_err(out, want) if out.shape == want.shape else float("nan")  # swiglu (c): h
                    print(f"{name:>10} {groups:>8} {op:>5} {k:>30} ", end="")
                    print(f"{ms[k]:>8.3f} {tflops:>8.1f} {ratio:>7.2f} {err:>8.1e}")


if __name__ == "__main__":
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/grouped_gemm.py needs a CUDA device")
    main()
