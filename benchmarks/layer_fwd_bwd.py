"""MoE layer forward+backward on one GPU (bf16): LRMoE per retain against transformers' Qwen3-MoE block and a plain
torch._grouped_mm layer, eager and compiled, all in the same run.

    python benchmarks/layer_fwd_bwd.py --shape qwen3-30b-a3b
    python benchmarks/layer_fwd_bwd.py --shape glm-4.5-air --selection top sample --modes compiled compiled-cg

Prints one table: medians of CUDA-event timings (triton.testing.do_bench over 200 ms, ~45 steps of 4.4 ms; every row
timed once in each of --rounds rounds, 3 by default, in a rotated order, the median over rounds printed with the
rounds' spread and the ratio to the transformers block taken round by round; every row's layer is built first and
stays on the GPU, so the rows' parameters add up: DeepSeek-V3's experts are 22 GiB a layer), the
dense-equivalent TFLOP/s (the dense step's GEMM FLOP over the step's time: at retain < 1 the backward does less
work, so this is not the GEMMs' rate), the peak memory of one step measured apart from the timing (do_bench's
256 MiB L2-flush buffer would count), and the host synchronisations torch.cuda.set_sync_debug_mode("warn") reported
in one step after warm-up (-1: not measured, CUDA graphs). The backward starts from a fixed random gradient of the
output (a .sum() would give an all-ones, stride-0 gradient that eager kernels read from cache).
--modes adds compiled-cg (torch.compile mode="reduce-overhead": CUDA graphs, no launch cost) and
compiled-ma (mode="max-autotune-no-cudagraphs": Inductor autotunes its GEMMs, its Triton grouped-GEMM template
against torch._grouped_mm, and its generated kernels' launch parameters); --compiled-sample reference makes compiled
"sample" selection trace the reference's PyTorch inline instead of calling the custom op (the library's default).
--quota-align 1 128 runs every LRMoE row at retain < 1 with the plain backward quotas and with quotas in multiples
of 128 pairs (LRMoE's quota_align), tagged "a1" / "a128"; --backward-capacity none 1.0 the same with LRMoE's
backward_capacity (E padded blocks, batched GEMMs), tagged "c".
--block glm runs GLM-4.5-Air's block instead of Qwen3's: LRMoE with sigmoid scores, a selection bias and a shared
expert of the routed experts' width, against transformers' Glm4MoeMoE (grouped_mm experts); --block deepseek
DeepSeek-V3's (the same plus 8 expert groups of which 4 are chosen, gates scaled by 2.5) against DeepseekV3MoE.
--router-dtype param float32 runs every LRMoE row with the router's logits in the parameters' dtype and in fp32
(LRMoE's router_dtype; transformers' GLM / DeepSeek routers compute theirs in fp32), the latter tagged "fp32 router".
--skew s biases every layer's router (skew_router: expert e's logits + s * sigma * z_e, through input feature 0,
set to 1) so that loads are uneven; 0, the default, is the near-balanced routing of random weights.
The GEMM floor is 6·T·k·3·d·f FLOP forward+backward (2× for forward alone) at the measured matmul rate.
"""

from __future__ import annotations

import argparse
import statistics
import types
import warnings

import torch
import torch._functorch.config as functorch_config
import torch._inductor.config as inductor_config
import torch.nn.functional as F
from torch import nn

import lrmoe.functional.selection as selection_module
import lrmoe.ops.grouped_gemm as grouped_gemm_module
from lrmoe.nn import LRMoE
from lrmoe.ops.selection import select_within_quota_reference

SHAPES = {
    "qwen3-30b-a3b": dict(dim=2048, hidden_dim=768, num_experts=128, top_k=8),
    "glm-4.5-air": dict(dim=4096, hidden_dim=1408, num_experts=128, top_k=8),
    "deepseek-v3": dict(dim=7168, hidden_dim=2048, num_experts=256, top_k=8),
}


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


# --block glm / deepseek: the routing of GLM-4.5-Air and DeepSeek-V3 (their config.json: sigmoid,
# e_score_correction_bias, groups, routed_scaling_factor; one shared expert of moe_intermediate_size) as LRMoE options.
SIGMOID_BLOCKS = {
    "glm": dict(score_func="sigmoid", selection_bias=True, n_group=1, topk_group=1, routed_scaling_factor=1.0),
    "deepseek": dict(score_func="sigmoid", selection_bias=True, n_group=8, topk_group=4, routed_scaling_factor=2.5),
}


def hf_block(dim, hidden_dim, num_experts, top_k, block="qwen3"):
    import transformers

    if block in SIGMOID_BLOCKS:
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
        from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeMoE

        opts = SIGMOID_BLOCKS[block]
        config_class, make = ((transformers.Glm4MoeConfig, Glm4MoeMoE) if block == "glm"
                              else (transformers.DeepseekV3Config, DeepseekV3MoE))
        config = config_class(hidden_size=dim, moe_intermediate_size=hidden_dim, n_routed_experts=num_experts,
                              num_experts_per_tok=top_k, n_shared_experts=1, n_group=opts["n_group"],
                              topk_group=opts["topk_group"], routed_scaling_factor=opts["routed_scaling_factor"],
                              norm_topk_prob=True)
    else:
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

        config = transformers.Qwen3MoeConfig(hidden_size=dim, moe_intermediate_size=hidden_dim,
                                             num_experts=num_experts, num_experts_per_tok=top_k, norm_topk_prob=True)
        make = Qwen3MoeSparseMoeBlock
    config._experts_implementation = "grouped_mm"
    block = make(config)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.02)
    return _Tokens3D(block)


class _Tokens3D(nn.Module):
    """[T, d] in and out around a block that wants [batch, seq, d] (and may also return router logits)."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x_TD):
        out = self.block(x_TD.unsqueeze(0))
        return (out[0] if isinstance(out, tuple) else out).reshape(x_TD.shape)


@torch.no_grad()
def skew_router(layer: nn.Module, skew: float, seed: int, rank_skew: float = 0.0, world: int = 1) -> None:
    """Give expert e a fixed logit bias skew * sigma * z_e (z_e ~ N(0, 1), seeded; sigma the std of the random
    logits), through input feature 0, which every benchmark input sets to 1. skew 0: near-balanced loads.
    rank_skew adds rank_skew * sigma to the experts rank 0 owns (the first E / world), so that rank, not only some
    experts, is hot: with many experts per rank, expert skew alone averages out over ranks."""
    weight_ED = (layer.block if isinstance(layer, _Tokens3D) else layer).gate.weight
    sigma = weight_ED[:, 1:].square().sum(1).mean().sqrt()  # std of x . w_e for x ~ N(0, I)
    z_E = torch.randn(weight_ED.shape[0], generator=torch.Generator().manual_seed(seed + 7)).to(weight_ED.device)
    weight_ED[:, 0] = skew * sigma * z_E
    weight_ED[: weight_ED.shape[0] // world, 0] += rank_skew * sigma


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


_COMPILE_MODES = {"eager": None, "compiled": None, "compiled-cg": "reduce-overhead",
                  "compiled-ma": "max-autotune-no-cudagraphs"}


def count_syncs(step) -> int:
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()
            torch.cuda.synchronize()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    # The first use of the mode in a process also warns that it is a prototype ("... does not yet detect all
    # synchronizing operations"): count only the sync reports.
    return sum("called a synchronizing CUDA operation" in str(w.message) for w in caught)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--retain", type=float, nargs="+", default=[1.0, 0.75, 0.5])
    parser.add_argument("--selection", nargs="+", default=["sample"], choices=["sample", "top"],
                        help="one or both: every retain < 1 runs once per selection (retain 1 selects nothing)")
    parser.add_argument("--skip-baselines", action="store_true")
    parser.add_argument("--modes", nargs="+", default=["eager", "compiled"], choices=list(_COMPILE_MODES),
                        help="compiled-cg: torch.compile(mode='reduce-overhead'), CUDA graphs; compiled-ma: "
                             "mode='max-autotune-no-cudagraphs' (Inductor times its Triton GEMM templates against "
                             "the ATen kernels, _grouped_mm included, and keeps the fastest)")
    parser.add_argument("--compiled-sample", default="op", choices=["reference", "op"],
                        help="what compiled 'sample' selection runs (lrmoe.functional.selection._COMPILED_SAMPLE): "
                             "the op (the default) or the reference's PyTorch traced inline")
    parser.add_argument("--gather-gemm", nargs="+", default=["grouped_mm"], choices=["grouped_mm", "triton"],
                        help="the kernel of LRMoE's bf16 GEMMs with a row gather (lrmoe.ops.grouped_gemm."
                             "_GATHER_KERNEL); several: each LRMoE row once per kernel, tagged")
    parser.add_argument("--quota-align", type=int, nargs="+", default=[1],
                        help="LRMoE's quota_align (backward quotas in multiples of it); several: each LRMoE row at "
                             "retain < 1 once per value, tagged 'a<value>'")
    parser.add_argument("--backward-capacity", nargs="+", default=["none"],
                        help="LRMoE's backward_capacity, a factor or 'none'; several: each LRMoE row at retain < 1 "
                             "once per value, tagged 'c<value>'")
    parser.add_argument("--skew", type=float, default=0.0,
                        help="router skew of every layer (skew_router; 0: near-balanced loads)")
    parser.add_argument("--block", choices=["qwen3", *SIGMOID_BLOCKS], default="qwen3",
                        help="glm / deepseek: GLM-4.5-Air's / DeepSeek-V3's block (sigmoid, selection bias, groups, "
                             "a shared expert) for LRMoE, transformers' Glm4MoeMoE / DeepseekV3MoE as the baseline")
    parser.add_argument("--router-dtype", nargs="+", default=["param"], choices=["param", "float32"],
                        help="LRMoE(router_dtype=...): param (default) the router's logits in the parameters' "
                             "dtype (bf16), float32 as transformers' GLM-4.5 / DeepSeek-V3 routers compute them")
    parser.add_argument("--rounds", type=int, default=3,
                        help="times every row once a round, in a rotated order, and prints medians over the rounds")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.compiled_sample == "reference":
        selection_module._COMPILED_SAMPLE = select_within_quota_reference
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/layer_fwd_bwd.py needs a CUDA GPU")
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
    gathers = list(dict.fromkeys(args.gather_gemm))
    aligns = list(dict.fromkeys(args.quota_align))
    caps = [None if c == "none" else float(c) for c in dict.fromkeys(args.backward_capacity)]
    routers = [None if r == "param" else getattr(torch, r) for r in dict.fromkeys(args.router_dtype)]
    layers = [
        (f"lrmoe r={r:g}" + (f" {sel}" if both and r < 1 else "") + (" tri" if gather == "triton" and len(gathers) > 1
                                                                     else "")
         + (f" a{align}" if len(aligns) > 1 and r < 1 else "") + (f" c{cap or '-'}" if len(caps) > 1 and r < 1 else "")
         + (" fp32 router" if len(routers) > 1 and router is not None else ""),
         lambda r=r, sel=sel, align=align, cap=cap, router=router: LRMoE(
             **shape, retain=r, selection=sel, quota_align=align, backward_capacity=cap, router_dtype=router,
             **(sigmoid_block | dict(shared_hidden_dim=f) if sigmoid_block else {})), gather)
        for gather in gathers for r in args.retain for sel in (args.selection if r < 1 else args.selection[:1])
        for align in (aligns if r < 1 else aligns[:1]) for cap in (caps if r < 1 else [None]) for router in routers
    ]
    if not args.skip_baselines:
        if not sigmoid_block:  # softmax routing and no shared expert: not GLM's or DeepSeek's block
            layers.append(("grouped_mm layer", lambda: GroupedMMLayer(**shape), "grouped_mm"))
        layers.append((f"transformers {args.block}", lambda: hf_block(**shape, block=args.block), "grouped_mm"))
    if len(gathers) == 1:
        print(f"# LRMoE's gathered bf16 GEMMs: {gathers[0]}")
    else:
        print("# LRMoE rows tagged 'tri': gathered bf16 GEMMs by the Triton gather-fused kernel; others _grouped_mm")
        # The kernel switch is a Python global that the traced graph depends on but no compile cache keys on: an
        # AOTAutograd cache entry made with one kernel must not serve the other's rows.
        functorch_config.enable_autograd_cache = False
        inductor_config.fx_graph_cache = False
    rows = []
    for name, make, gather in layers:
        grouped_gemm_module._GATHER_KERNEL = gather  # read when an op call runs or is traced
        torch.cuda.synchronize()
        others = torch.cuda.memory_allocated()  # the rows built before this one
        torch.manual_seed(0)
        layer = make().cuda().bfloat16()
        x = torch.randn(T, d, device="cuda", dtype=torch.bfloat16)
        if args.skew:
            skew_router(layer, args.skew, seed=0)
            x[:, 0] = 1.0  # the router-skew feature
        x.requires_grad_()
        grad_out = torch.randn(T, d, device="cuda", dtype=torch.bfloat16)  # the same for every layer (seeded above)
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
            # Memory a CUDA-graph row's pool reserves beyond what is allocated in it counts in neither, as before.
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
            rows.append(dict(name=name, mode=mode, gather=gather, fwd=fwd, step=step, grads=grads, peak=peak,
                             syncs=syncs, fwd_ms=[], step_ms=[]))
    # Every row is timed once a round; round r starts r / rounds of the way down the rows, so that each row takes
    # early and late places over the run and a drift of the GPU's clocks or of the host falls on the rows alike,
    # and the ratio to the baseline is taken within each round.
    for r in range(args.rounds):
        start = r * len(rows) // args.rounds
        for row in rows[start:] + rows[:start]:
            grouped_gemm_module._GATHER_KERNEL = row["gather"]  # eager rows read it at every op call
            # warmup and rep are milliseconds: ~45 timed steps of 4.4 ms (rep=40 gave ~8).
            row["fwd_ms"].append(do_bench(row["fwd"], warmup=25, rep=200, return_mode="median"))
            row["step_ms"].append(do_bench(row["step"], warmup=25, rep=200, return_mode="median",
                                           grad_to_none=row["grads"]))
            for t in row["grads"]:  # do_bench leaves the last step's gradients: every row's would add up
                t.grad = None
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
    recompile), and no row is served another row's graph (two LRMoE layers alike but for a kernel switch that no
    guard sees would otherwise share one)."""

    def call(x):
        return layer(x)

    # A copy of call's code object: Dynamo keeps its cache on the code object, and every row's closure would share
    # this one. (Not a partial or an exec'd function: torch.compile wraps either in one shared function.)
    call = types.FunctionType(call.__code__.replace(), call.__globals__, "call", None, call.__closure__)
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


if __name__ == "__main__":
    main()
