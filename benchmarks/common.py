"""What the benchmark scripts share, and what their tests check without a GPU (tests/benchmarks/ import this module;
no script imports another): shapes and routed-row problems, baselines (transformers' MoE blocks, a skewed router),
timing (CUDA graphs, CUDA events, interleaved rounds, host-sync counts), profiles (GPU timelines, the
expert-parallel step's split), distributed setup and teardown, and the memory probes. Run the scripts from the
repository root, e.g. ``python benchmarks/layer.py time``; each script's docstring lists its subcommands.
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import warnings
from collections.abc import Callable

import torch
from torch import nn

from lrmoe.memory import ADAMW_FP32, ADAMW_FP32_MASTER, MemoryConfig, layer_memory

# ------------------------------------------------------------------------------------------------------ shapes

# The layers of the models the results quote (their config.json: hidden_size, moe_intermediate_size, experts, top-k).
SHAPES = {
    "qwen3-30b-a3b": dict(dim=2048, hidden_dim=768, num_experts=128, top_k=8),
    "glm-4.5-air": dict(dim=4096, hidden_dim=1408, num_experts=128, top_k=8),
    "deepseek-v3": dict(dim=7168, hidden_dim=2048, num_experts=256, top_k=8),
    "mixtral-8x7b": dict(dim=4096, hidden_dim=14336, num_experts=8, top_k=2),
}
TINY = dict(dim=32, hidden_dim=64, num_experts=8, top_k=2)  # CPU smoke runs (the multi-rank scripts' --shape tiny)


def require_cuda(what: str) -> None:
    if not torch.cuda.is_available():
        raise SystemExit(f"{what} needs a CUDA GPU")


def lrmoe_kernels(name: str):
    """``lrmoe_kernels.<name>``, found as lrmoe finds it (lrmoe.ops._kernels.kernel_module), so a script and the
    layers it times use the same modules; without an install of lrmoe that raises an ImportError saying how to
    install."""
    from lrmoe.ops._kernels import kernel_module

    module = kernel_module(name)
    if module is None:
        raise SystemExit(f"lrmoe_kernels.{name} is not available: it needs Triton")
    return module


def router_group_sizes(rows: int, experts: int, top_k: int, kind: str, gen: torch.Generator) -> torch.Tensor:
    """[E] int64 group sizes summing to ``rows``: "bal" equal; "jitter" what a router with random logits gives
    (rows / top_k tokens each pick top_k distinct experts); "skew" popularity exp(N(0, 1)) per expert."""
    if kind == "bal":
        return torch.full((experts,), rows // experts, dtype=torch.long) + (torch.arange(experts) < rows % experts)
    if kind == "jitter":
        ids = torch.randn(rows // top_k, experts, generator=gen).topk(top_k, dim=1).indices
        return torch.bincount(ids.reshape(-1), minlength=experts)
    popularity = torch.exp(torch.randn(experts, generator=gen))
    return torch.bincount(torch.multinomial(popularity, rows, replacement=True, generator=gen), minlength=experts)


def retained_rows_problem(shape: dict, tokens: int, retain: float, device: str = "cuda") -> dict:
    """The compact expert backward's operands for ``tokens`` tokens routed by random logits, each expert keeping its
    first round(retain * load) pairs (as a balanced plan keeps): bf16 x, gate/up weight, dy, phi, dh rows, each
    row's token (tok_R), the group ends (offsets_E), each pair's row or -1 (slot_TK), and the GEMM FLOP."""
    n_exp, top_k, dim, ffn = shape["num_experts"], shape["top_k"], shape["dim"], shape["hidden_dim"]
    gen = torch.Generator().manual_seed(0)
    ids_TK = torch.randn(tokens, n_exp, generator=gen).topk(top_k, dim=1).indices
    flat_P = ids_TK.reshape(-1)
    order_P = torch.argsort(flat_P, stable=True)
    loads_E = torch.bincount(flat_P, minlength=n_exp)
    keep_E = torch.round(retain * loads_E.double()).long()
    rank_P = torch.arange(flat_P.shape[0]) - torch.repeat_interleave(loads_E.cumsum(0) - loads_E, loads_E)
    pair_R = order_P[rank_P < torch.repeat_interleave(keep_E, loads_E)]
    n_rows = pair_R.shape[0]
    slot_P = torch.full((flat_P.shape[0],), -1, dtype=torch.long)
    slot_P[pair_R] = torch.arange(n_rows)

    def rand(*size, scale=1.0):
        return (torch.randn(*size, generator=gen) * scale).bfloat16().to(device)

    return dict(
        x_TD=rand(tokens, dim), gate_up_EFD=rand(n_exp, 2 * ffn, dim, scale=dim**-0.5),
        dy_RD=rand(n_rows, dim), phi_RF=rand(n_rows, ffn), dh_RF2=rand(n_rows, 2 * ffn),
        tok_R=(pair_R // top_k).to(device), offsets_E=keep_E.cumsum(0).int().to(device),
        slot_TK=slot_P.view(tokens, top_k).to(device), rows=n_rows, loads_E=loads_E, ids_TK=ids_TK, pair_R=pair_R,
        flop=2 * n_rows * (dim * ffn + 2 * ffn * dim + 2 * ffn * dim),
    )


def backward_ops(p: dict) -> dict:
    """The compact expert backward's last three GEMMs on a retained_rows_problem: the down and gate/up weight
    gradients, and the input gradient with its per-token sum (lrmoe.functional.experts runs them in this order)."""
    from lrmoe.ops import gather_grouped_mm, gather_sum_rows, grouped_outer

    return {
        "down": lambda: grouped_outer(p["dy_RD"], p["phi_RF"], None, p["offsets_E"]),
        "gu": lambda: grouped_outer(p["dh_RF2"], p["x_TD"], p["tok_R"], p["offsets_E"]),
        "dx": lambda: gather_sum_rows(
            gather_grouped_mm(p["dh_RF2"], p["gate_up_EFD"].transpose(1, 2), None, p["offsets_E"]), p["slot_TK"]),
    }


# benchmarks/gemm.py streams: lists of backward_ops names, the first on the caller's stream, each other on a side
# stream of its own.
STREAM_VARIANTS = {
    "one stream": [["down", "gu", "dx"]],
    "dx | down, gu": [["dx"], ["down", "gu"]],
    "dx, down | gu": [["dx", "down"], ["gu"]],
    "three streams": [["dx"], ["down"], ["gu"]],
}


# --------------------------------------------------------------------------------------------------- baselines


# The routing of GLM-4.5-Air and DeepSeek-V3 (their config.json: sigmoid, e_score_correction_bias, groups,
# routed_scaling_factor; one shared expert of moe_intermediate_size) as LRMoE options.
SIGMOID_BLOCKS = {
    "glm": dict(score_func="sigmoid", selection_bias=True, n_group=1, topk_group=1, routed_scaling_factor=1.0),
    "deepseek": dict(score_func="sigmoid", selection_bias=True, n_group=8, topk_group=4, routed_scaling_factor=2.5),
}


def hf_block(dim, hidden_dim, num_experts, top_k, block="qwen3"):
    """transformers' MoE block ("qwen3": Qwen3MoeSparseMoeBlock; "glm", "deepseek": with a shared expert) with its
    grouped_mm experts, weights N(0, 0.02), taking and returning [T, d]."""
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
    module = make(config)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.02)
    return Tokens2D(module)


class Tokens2D(nn.Module):
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
    weight_ED = (layer.block if isinstance(layer, Tokens2D) else layer).gate.weight
    sigma = weight_ED[:, 1:].square().sum(1).mean().sqrt()  # std of x . w_e for x ~ N(0, I)
    z_E = torch.randn(weight_ED.shape[0], generator=torch.Generator().manual_seed(seed + 7)).to(weight_ED.device)
    weight_ED[:, 0] = skew * sigma * z_E
    weight_ED[: weight_ED.shape[0] // world, 0] += rank_skew * sigma


# ------------------------------------------------------------------------------------------------------ timing


def graph_ms(fn, inputs: list[tuple], replays: int = 20) -> float:
    """Median ms per call of fn(*inputs[i]), called on each input set in turn inside one CUDA graph, replayed
    ``replays`` times and timed with CUDA events: GPU time without the per-launch host cost. With inputs from
    rotating_copies every call reads HBM, not the L2 (triton.testing.do_bench's L2 flush instead leaves the L2 full
    of dirty lines, which made a 13 us kernel time 19-39 us on the H200)."""
    calls = 5
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (compiles, allocator) outside the capture
        for args in inputs:
            fn(*args)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            for args in inputs:
                fn(*args)
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / (calls * len(inputs)))
    return sorted(times)[len(times) // 2]


def rotating_copies(tensors: tuple[torch.Tensor, ...]) -> list[tuple[torch.Tensor, ...]]:
    """Copies of ``tensors`` whose bytes together pass 4x the L2 (at least two sets)."""
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    n = max(2, -(-4 * l2 // nbytes))
    return [tuple(t.clone() for t in tensors) for _ in range(n)]


def copy_bandwidth() -> float:
    """Bytes/s of a device-to-device clone of 1 GiB, counting bytes read and written."""
    from triton.testing import do_bench

    x = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    ms = do_bench(lambda: x.clone(), warmup=10, rep=100, return_mode="median")
    return 2 * x.numel() / (ms * 1e-3)


def events_ms(fn, reps: int = 20) -> float:
    """Median ms of ``fn`` launched from Python, each call between two CUDA events (after one warm-up call)."""
    fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def interleaved(names: list, time_one: Callable[[object], float], rounds: int) -> dict:
    """{name: [ms per round]}: every name timed once a round, round r starting r / rounds of the way down the list,
    so each takes early and late places and a drift of the GPU's clocks or of the host falls on all alike."""
    times = {name: [] for name in names}
    for r in range(rounds):
        start = r * len(names) // rounds
        for name in names[start:] + names[:start]:
            times[name].append(time_one(name))
    return times


def count_syncs(step) -> int:
    """Host synchronisations torch.cuda.set_sync_debug_mode("warn") reports in one call of ``step``."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()
            torch.cuda.synchronize()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    # The first use of the mode in a process also warns that it is a prototype: count only the sync reports.
    return sum("called a synchronizing CUDA operation" in str(w.message) for w in caught)


# ---------------------------------------------------------------------------------------------------- profiles


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of (start, end) intervals as disjoint sorted intervals (touching ones merged)."""
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def overlap(copies: list[tuple[float, float]], kernels: list[tuple[float, float]]) -> float:
    """Length of the copies' union that lies inside the kernels' union."""
    busy = union(kernels)
    return sum(max(0.0, min(b, d) - max(a, c)) for a, b in union(copies) for c, d in busy)


def kernel_intervals(trace: dict) -> list[tuple[float, float, str]]:
    """(start, end, name) in µs of every GPU kernel, memset and memcpy of a Chrome trace, in start order."""
    return sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in trace["traceEvents"]
                  if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy"))


def timeline_stats(intervals: list[tuple[float, float, str]]) -> tuple[float, float, list]:
    """(span, busy, gaps) of GPU work: span from the first start to the last end, busy the union of the intervals
    (kernels of two streams may overlap), gaps (idle µs, kernel before, kernel after) between consecutive work."""
    busy, gaps = 0.0, []
    cur_start, cur_end, cur_name = intervals[0]
    for start, end, name in intervals[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            gaps.append((start - cur_end, cur_name, name))
            cur_start = start
        if end >= cur_end:
            cur_end, cur_name = end, name
    busy += cur_end - cur_start
    return cur_end - intervals[0][0], busy, gaps  # the latest end: the last kernel to start may end earlier


def window_medians(batches: list[tuple[float, float]], window_ms: float) -> list[float]:
    """The median ms per call of the (GPU ms at the batch's end, ms per call) batches in each window
    [i * window_ms, (i + 1) * window_ms) of GPU time, in window order: windows without a batch are skipped, and the
    window of the last batch is dropped (the run ended inside it)."""
    windows: dict[int, list[float]] = {}
    for clock, ms in batches:
        windows.setdefault(int(clock // window_ms), []).append(ms)
    if batches:
        del windows[int(batches[-1][0] // window_ms)]
    return [statistics.median(windows[i]) for i in sorted(windows)]


# The expert-parallel step (benchmarks/ep_layer.py): per-step split keys (milliseconds), in table order.
SPLIT_KEYS = ("expert_fwd", "expert_bwd", "dispatch_fwd", "combine_fwd", "dispatch_bwd", "combine_bwd",
              "replica_fwd", "replica_bwd", "load_allgather")
EXPERT_OPS = ("lrmoe::gather_grouped_mm", "lrmoe::grouped_outer", "aten::bmm")  # bmm: the blocked backward
FORWARD_RANGE, BACKWARD_RANGE = "ep_bench.forward", "ep_bench.backward"


def outermost(events: list) -> list:
    """Drop events nested inside another kept event of the same thread (an op and the ops it calls)."""
    kept, open_end = [], {}
    for e in sorted(events, key=lambda e: (e.time_range.start, -e.time_range.end)):
        if e.time_range.end <= open_end.get(e.thread, -1):
            continue
        kept.append(e)
        open_end[e.thread] = e.time_range.end
    return kept


def top_kernels(averages, steps: int, top: int) -> tuple[float, list[str]]:
    """torch.profiler key averages over ``steps`` steps: (the GPU's kernel ms per step, a header and a line for each
    of the ``top`` kernels by self device time: share, ms per step, calls per step, name)."""
    from torch.autograd import DeviceType

    events = [e for e in averages if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0]
    total = sum(e.self_device_time_total for e in events)
    lines = [f"{'share':>6} {'ms/step':>8} {'calls/step':>10}  kernel"]
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:top]:
        lines.append(f"{e.self_device_time_total / total:>6.1%} {e.self_device_time_total / steps / 1e3:>8.3f} "
                     f"{e.count / steps:>10.1f}  {e.key[:110]}")
    return total / steps / 1e3, lines


def split_from_profile(events: list, device_time: bool, bwd_indices: bool) -> list[dict[str, float]]:
    """Per profiled expert-parallel step, milliseconds per SPLIT_KEYS from torch.profiler events (see
    benchmarks/ep_layer.py); ``bwd_indices``: whether the backward dispatch sends row indices beside its rows (not
    the dense backward). Steps are the FORWARD_RANGE / BACKWARD_RANGE ranges the caller recorded; an op belongs to
    the range in which it starts (backward ops may run on autograd's thread, inside the range in time)."""
    from torch.autograd import DeviceType

    def ms(e) -> float:
        return (e.device_time_total if device_time else e.cpu_time_total) / 1e3

    # With CUDA activity each record_function range also appears on the GPU timeline (a "user annotation" event of
    # the same name); the ops and ranges to match are the host-side events.
    events = [e for e in events if e.device_type == DeviceType.CPU]
    ranges = sorted((e for e in events if e.name in (FORWARD_RANGE, BACKWARD_RANGE)), key=lambda e: e.time_range.start)
    comm = outermost([e for e in events if e.name.endswith(("::all_to_all_single", "::all_gather_into_tensor"))
                      or e.name == "_c10d_functional::wait_tensor"])
    gemms = outermost([e for e in events if e.name in EXPERT_OPS])

    # Collectives in time order, each with the time of the wait_tensor that completes it (on gloo the transfer
    # happens there; on NCCL the wait is a stream dependency, the kernel is the collective op's device time).
    collectives: list[list] = []  # [event, ms, completed]
    for e in sorted(comm, key=lambda e: e.time_range.start):
        if e.name != "_c10d_functional::wait_tensor":
            collectives.append([e, ms(e), False])
            continue
        for entry in reversed(collectives):
            if not entry[2]:
                entry[1] += ms(e)
                entry[2] = True
                break

    def inside(e, r) -> bool:
        return r.time_range.start <= e.time_range.start < r.time_range.end

    steps = []
    for fwd, bwd in zip(ranges[::2], ranges[1::2], strict=True):
        assert fwd.name == FORWARD_RANGE and bwd.name == BACKWARD_RANGE, (fwd.name, bwd.name)
        row = dict.fromkeys(SPLIT_KEYS, 0.0)
        row["expert_fwd"] = sum(ms(e) for e in gemms if inside(e, fwd))
        row["expert_bwd"] = sum(ms(e) for e in gemms if inside(e, bwd))
        for phase, r in (("fwd", fwd), ("bwd", bwd)):
            a2a = []
            for e, t, _ in collectives:
                if not inside(e, r):
                    continue
                if e.name.endswith("all_gather_into_tensor"):
                    row["load_allgather"] += t
                else:
                    a2a.append(t)
            need = 3 if phase == "fwd" or bwd_indices else 2
            if len(a2a) < need:
                raise RuntimeError(f"expected >= {need} all-to-alls in {phase}, found {len(a2a)}: the layer changed?")
            if phase == "fwd":  # [replica weights], dispatch, combine (rows, ||phi||^2)
                *rep, row["dispatch_fwd"], combine_rows, combine_scalars = a2a
                row["combine_fwd"] = combine_rows + combine_scalars
            else:  # dispatch (retained rows[, their indices]), input-gradient return, [replica weight gradients]
                if bwd_indices:
                    dispatch_rows, dispatch_indices, row["combine_bwd"], *rep = a2a
                    row["dispatch_bwd"] = dispatch_rows + dispatch_indices
                else:
                    row["dispatch_bwd"], row["combine_bwd"], *rep = a2a
            row[f"replica_{phase}"] = sum(rep)
        steps.append(row)
    return steps


# ------------------------------------------------------------------------------------------------- distributed


class Ranks:
    """The process group (NCCL with one GPU per rank, or gloo on CPU), this rank's device and an "ep" mesh."""

    def __init__(self, device: str):
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
        dist.init_process_group("nccl" if cuda else "gloo")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.local_rank = int(os.environ.get("LOCAL_RANK", self.rank))
        if cuda:
            torch.cuda.set_device(self.local_rank)
        self.cuda = cuda
        self.device = torch.device("cuda", self.local_rank) if cuda else torch.device("cpu")
        self.mesh = init_device_mesh(self.device.type, (self.world,), mesh_dim_names=("ep",))

    def sync(self) -> None:
        import torch.distributed as dist

        if self.cuda:
            torch.cuda.synchronize()
        dist.barrier(device_ids=[self.local_rank] if self.cuda else None)
        if self.cuda:
            torch.cuda.synchronize()

    def gather(self, values: list[float]) -> list[list[float]]:
        """values of every rank, [W][n] (one all-gather)."""
        import torch.distributed as dist

        mine = torch.tensor(values, dtype=torch.float64, device=self.device)
        out = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(out, mine)
        return [t.tolist() for t in out]


def shutdown() -> None:
    """Leave the process group; under gloo, exit at once (it may abort at interpreter teardown after all work is
    done, docs/expert_parallel.md)."""
    import torch.distributed as dist

    gloo = dist.get_backend() == "gloo"
    dist.barrier()
    dist.destroy_process_group()
    if gloo:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def settle(run: dict, target: float) -> dict:
    """A training run's first evaluation at or below ``target`` (a dense run that set the target trained to the
    end), as reached / reached_at / time_to_target_s / moe_time_to_target_s (None when not reached)."""
    hit = next((h for h in run["history"] if h["loss"] <= target), None)
    return {**run, "reached": hit is not None, "reached_at": hit,
            "time_to_target_s": None if hit is None else hit["train_s"],
            "moe_time_to_target_s": None if hit is None else hit["moe_s"]}


# ------------------------------------------------------------------------------------------------------ memory

GiB = 2**30
DTYPE = torch.bfloat16
OPTIMIZERS = {"adamw": ADAMW_FP32, "adamw-master": ADAMW_FP32_MASTER, "none": 0}


def largest_fitting(fits: Callable[[int], bool], lo: int, hi: int) -> int | None:
    """The largest v in [lo, hi] with ``fits(v)``, for a monotone predicate (fits(v) implies fits(w) for w <= v);
    None when ``fits(lo)`` is false. Calls ``fits`` at most 1 + ceil(log2(hi - lo + 1)) times, never outside
    [lo, hi], and never twice with the same value."""
    if lo > hi:
        raise ValueError(f"empty range [{lo}, {hi}]")
    if not fits(lo):
        return None
    good, bad = lo, hi + 1  # invariant: fits(good); bad is hi + 1 or a value that does not fit
    while bad - good > 1:
        mid = (good + bad) // 2
        if fits(mid):
            good = mid
        else:
            bad = mid
    return good


def memory_config(shape: dict, tokens: int, optimizer_bytes: int) -> MemoryConfig:
    """One device, bf16, gradients starting as None, the CUDA kernels' buffers: what a probe runs."""
    return MemoryConfig(**shape, tokens=tokens, param_dtype=DTYPE, optimizer_bytes_per_param=optimizer_bytes,
                        device_type="cuda")


def modelled_bytes(shape: dict, tokens: int, *, retain: float, policy: str, optimizer_bytes: int) -> int:
    """What a probe of ``tokens`` tokens should peak at: the modelled peak plus the output the probe holds."""
    mem = layer_memory(memory_config(shape, tokens, optimizer_bytes), retain=retain, policy=policy)
    return mem.peak + tokens * shape["dim"] * DTYPE.itemsize


def model_largest_tokens(shape: dict, budget: int, *, retain: float, policy: str, optimizer_bytes: int,
                         multiple: int, max_tokens: int) -> int | None:
    """The largest T in {multiple, 2·multiple, …} ∩ [1, max_tokens] whose ``modelled_bytes`` fit ``budget``;
    None when not even ``multiple`` tokens fit (the modelled bytes grow with T, so bisection finds the largest)."""
    def fits(i: int) -> bool:
        return modelled_bytes(shape, i * multiple, retain=retain, policy=policy,
                              optimizer_bytes=optimizer_bytes) <= budget

    best = largest_fitting(fits, 1, max_tokens // multiple) if max_tokens >= multiple else None
    return None if best is None else best * multiple


def probe(step: Callable[[int], int], tokens: int) -> int | None:
    """``step(tokens)`` (its peak bytes), or None when it ran out of device memory. The exception (and the
    frames it holds) is gone before the allocator's cache is emptied, so the next probe starts clean."""
    try:
        peak = step(tokens)
    except torch.OutOfMemoryError:
        peak = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return peak


class LayerStep:
    """One LRMoE layer with its optimiser-state stand-in; ``__call__(T)`` runs one forward + backward of T tokens
    from gradients None and returns the peak allocated bytes (``max_memory_allocated``), recording the peak
    reserved bytes in ``last_reserved`` and the bytes allocated when it started in ``last_start``. The gradients
    it makes are dropped on return unless ``keep_grads``. On ``device="cpu"`` (the tests' smoke run of this path)
    it runs the same step and reports 0 bytes: there is no allocator to ask."""

    def __init__(self, shape: dict, *, retain: float, policy: str, optimizer_bytes: int, seed: int = 0,
                 device: str = "cuda"):
        from lrmoe.nn import LRMoE

        torch.manual_seed(seed)
        self.dim, self.device, self.cuda = shape["dim"], device, device == "cuda"
        self.layer = LRMoE(**shape, retain=retain, activations=policy).to(device=device, dtype=DTYPE)
        # Uninitialised uint8 buffers of numel * optimizer_bytes: the bytes a mixed-precision AdamW holds.
        self.optimizer_state = {name: torch.empty(p.numel() * optimizer_bytes, dtype=torch.uint8, device=device)
                                for name, p in self.layer.named_parameters()}
        self.last_reserved = self.last_start = 0

    def static_bytes(self) -> dict[str, int]:
        """Bytes held at the end of a step, split as lrmoe.memory splits them: "experts" (weights, gradients,
        optimiser state of gate_up_proj and down_proj) and "router" (the same for gate.weight). Call it after a
        step, while the gradients exist."""
        out = {"experts": 0, "router": 0}
        for name, p in self.layer.named_parameters():
            grad = p.grad.nbytes if p.grad is not None else 0
            out["router" if name.startswith("gate.") else "experts"] += (
                p.nbytes + grad + self.optimizer_state[name].nbytes)
        return out

    def __call__(self, tokens: int, keep_grads: bool = False) -> int:
        try:
            self.free_grads()
            if self.cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                self.last_start = torch.cuda.memory_allocated()
            x = torch.randn(tokens, self.dim, device=self.device, dtype=DTYPE, requires_grad=True)
            g = torch.randn_like(x)
            self.layer(x).backward(g)  # the output lives through backward: modelled_bytes counts it
            if not self.cuda:
                return 0
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated()
        finally:
            self.last_reserved = torch.cuda.max_memory_reserved() if self.cuda else 0
            if not keep_grads:
                self.free_grads()

    def free_grads(self) -> None:
        for p in self.layer.parameters():
            p.grad = None


def measure_largest_tokens(make_step: Callable[[], LayerStep], *, multiple: int, max_tokens: int) -> dict:
    """Bisection under the memory fraction already set: the largest T whose step fits, with the probe's peak
    allocated and reserved bytes there and the number of probes (the warm-up not counted)."""
    result = {"tokens": None, "peak_allocated": None, "peak_reserved": None, "probes": 0}
    try:
        step = make_step()
    except torch.OutOfMemoryError:  # the weights and optimiser state alone exceed the budget
        return result
    if probe(step, multiple) is None:  # warm-up: kernels compiled and tuned before anything is judged
        return result
    peaks: dict[int, tuple[int, int]] = {}

    def fits(i: int) -> bool:
        result["probes"] += 1
        peak = probe(step, i * multiple)
        if peak is not None:
            peaks[i * multiple] = (peak, step.last_reserved)
        return peak is not None

    best = largest_fitting(fits, 1, max_tokens // multiple)
    if best is not None:
        result["tokens"] = best * multiple
        result["peak_allocated"], result["peak_reserved"] = peaks[best * multiple]
    return result
