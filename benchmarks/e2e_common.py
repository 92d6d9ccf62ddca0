"""The end-to-end comparison's shared pieces: benchmarks/train_e2e.py and benchmarks/layer.py's ``peers`` and
``imports`` (whose bodies, peer_layers and import_orders, are here, beside the SonicMoE pieces they use; layer.py
makes them subcommands). Each end-to-end variant's MoE layer (SonicMoE, transformers' Qwen3 block, LRMoE) and
SonicMoE's first call; the import-order check's child process; the arithmetic of training curves (time to a target
loss, the loss at a clock or a step), the summary table and the curve plots that train_e2e writes. Only torch is
imported at the top (common, lrmoe and transformers inside the functions): the import-order child must start with
nothing else imported.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import torch

PRESETS = {
    "qwen3": dict(dim=2048, heads=32, kv_heads=4, head_dim=128, experts=128, top_k=8, hidden=768, layers=4,
                  seq=4096, batch=8),
    "tiny": dict(dim=64, heads=4, kv_heads=2, head_dim=16, experts=8, top_k=2, hidden=32, layers=2, seq=64, batch=4),
}
VARIANTS = ("transformers", "sonic", "lrmoe-1", "lrmoe-0.75", "lrmoe-0.5")
REFERENCE = "transformers"
START = time.perf_counter()


def log(*parts):
    print(f"[{time.perf_counter() - START:7.1f}s]", *parts, flush=True)


KERNEL_TAGS = ("portable", "hopper")  # LRMoE's kernels= for a variant "lrmoe-<retain>[-top][-savey][-<kernels>]"


def variant_name(name: str) -> str:
    """An argparse type for --variants: "transformers", "sonic", or "lrmoe-<retain>" with retain in (0, 1], an
    optional "-top" (LRMoE's "top" selection instead of the default "sample"), an optional "-savey" (LRMoE's
    save_outputs=True: y saved for the router gradient) and an optional "-portable" or "-hopper" (LRMoE's kernels
    instead of the default "auto"), in that order, e.g. "lrmoe-0.5-top", "lrmoe-0.5-savey", "lrmoe-1-portable"."""
    parts = name.split("-")
    if name in ("transformers", "sonic"):
        return name
    tail = parts[2:]
    if tail and tail[-1] in KERNEL_TAGS:
        tail = tail[:-1]
    if parts[0] == "lrmoe" and len(parts) >= 2 and tail in ([], ["top"], ["savey"], ["top", "savey"]):
        try:
            retain = float(parts[1])
        except ValueError:
            retain = -1.0
        if 0.0 < retain <= 1.0:
            return name
    raise argparse.ArgumentTypeError(f"a variant is transformers, sonic or lrmoe-<retain in (0, 1]>[-top][-savey]"
                                     f"[-portable|-hopper], got {name!r}")


def retain_of(variant: str) -> float:
    return float(variant.split("-")[1]) if variant.startswith("lrmoe") else 1.0


def selection_of(variant: str) -> str:
    """LRMoE's selection of a variant name: "top" for "lrmoe-<retain>-top[-kernels]", else the default "sample"."""
    return "top" if variant.startswith("lrmoe") and "top" in variant.split("-")[2:] else "sample"


def save_outputs_of(variant: str) -> bool:
    """LRMoE's save_outputs of a variant name: True for a "-savey" tag."""
    return variant.startswith("lrmoe") and "savey" in variant.split("-")[2:]


def kernels_of(variant: str) -> str:
    """LRMoE's kernels of a variant name: its "-portable" or "-hopper" tag, else the default "auto"."""
    tag = variant.split("-")[-1]
    return tag if variant.startswith("lrmoe") and tag in KERNEL_TAGS else "auto"


# ------------------------------------------------------------------------------------------------ MoE layers


def sonic_moe(dim: int, hidden: int, experts: int, top_k: int):
    """SonicMoE's MoE layer (SwiGLU experts, no bias, weights N(0, 0.02)); it returns (output, aux loss)."""
    import sonicmoe
    from sonicmoe.enums import ActivationType

    return sonicmoe.MoE(experts, top_k, dim, hidden, activation_function=ActivationType.SWIGLU, add_bias=False,
                        std=0.02)


def sonic_first_step(c: dict, batch: int, seq: int, device) -> float:
    """Seconds of SonicMoE's first fwd+bwd on [batch, seq, d], built here: it autotunes and compiles per shape at
    its first call."""
    t0 = time.perf_counter()
    layer = sonic_moe(c["dim"], c["hidden"], c["experts"], c["top_k"]).to(device, torch.bfloat16)
    x = torch.randn(batch, seq, c["dim"], device=device, dtype=torch.bfloat16, requires_grad=True)
    out = layer(x)[0]
    out.backward(torch.randn_like(out))  # not .sum(): SonicMoE's GEMMs reject its stride-0 gradient
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def make_moe(variant: str, c, device, retain=1.0, activations="save", selection="sample", save_outputs=False,
             kernels="auto"):
    """The MoE layer of a train_e2e variant ("sonic", "transformers", "lrmoe") on [batch, seq, d]: SonicMoE's MoE
    (SwiGLU, no bias, N(0, 0.02)), transformers' Qwen3MoeSparseMoeBlock (grouped_mm experts on CUDA, eager on the CPU)
    or lrmoe.nn.LRMoE (with ``retain``, ``activations``, ``selection``, ``save_outputs`` and ``kernels``). Each
    library is imported here, at the first call that needs it."""
    if variant == "sonic":
        return sonic_moe(c["dim"], c["hidden"], c["experts"], c["top_k"])
    if variant == "transformers":
        import transformers
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

        config = transformers.Qwen3MoeConfig(hidden_size=c["dim"], moe_intermediate_size=c["hidden"],
                                             num_experts=c["experts"], num_experts_per_tok=c["top_k"],
                                             norm_topk_prob=True)
        config._experts_implementation = "grouped_mm" if torch.device(device).type == "cuda" else "eager"
        return Qwen3MoeSparseMoeBlock(config)
    from lrmoe.nn import LRMoE

    return LRMoE(c["dim"], c["hidden"], c["experts"], c["top_k"], retain=retain, activations=activations,
                 selection=selection, save_outputs=save_outputs, kernels=kernels)


def own_code(fn):
    """A copy of fn with a code object of its own: Dynamo caches compiled code per code object, so each copy keeps
    its own graphs (each variant's MoE half, each benchmark row; no cache limit shared between them)."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


# ---------------------------------------------------------------------------------------------- import order

SCENARIOS = {
    "sonic": [],
    "transformers,sonic": ["transformers"],
    "lrmoe,sonic": ["lrmoe"],
    "lrmoe,transformers,sonic": ["lrmoe", "transformers"],
    "lrmoe,transformers,compiled,sonic": ["lrmoe", "transformers", "compiled"],
}


def scenario_command(name: str, limit: int) -> list[str]:
    """The command of one import-order child: a fresh interpreter that imports only torch and this module, then
    runs run_scenario(name, limit)."""
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parent)!r}); "
            "from e2e_common import run_scenario; run_scenario(sys.argv[1], int(sys.argv[2]))")
    return [sys.executable, "-c", code, name, str(limit)]


def run_scenario(name: str, limit: int) -> None:
    """One import order (SCENARIOS[name]) in this process, then SonicMoE's first fwd+bwd, printed as
    SONIC_FIRST_CALL_S; a stack dump and exit if that call outlasts ``limit`` seconds."""
    import faulthandler

    env0 = dict(os.environ)
    shape, device = dict(PRESETS["qwen3"]), torch.device("cuda")
    for step in SCENARIOS[name]:
        t0 = time.perf_counter()
        if step == "lrmoe":
            import lrmoe.nn  # noqa: F401
        elif step == "transformers":
            import transformers.models.qwen3_moe.modeling_qwen3_moe  # noqa: F401
        elif step == "compiled":
            for v in ("lrmoe-0.75", "transformers"):
                layer = make_moe(v.split("-")[0], shape, device, retain_of(v)).to(device, torch.bfloat16)
                x = torch.randn(2, 4096, shape["dim"], device=device, dtype=torch.bfloat16, requires_grad=True)
                out = torch.compile(layer, dynamic=False)(x)
                out.backward(torch.randn_like(out))
            torch.cuda.synchronize()
        log(f"{step}: {time.perf_counter() - t0:.1f} s")
    changed = {k: v for k, v in os.environ.items() if env0.get(k) != v}
    log(f"environment set since start: {changed}")
    faulthandler.dump_traceback_later(limit, exit=True)
    print(f"SONIC_FIRST_CALL_S {sonic_first_step(shape, 2, 4096, device):.1f}", flush=True)


def import_orders(args) -> None:
    """benchmarks/layer.py imports: every SCENARIOS entry in a fresh interpreter of its own (scenario_command), one
    after another, under a timeout; prints each one's SonicMoE first-call time or its stack dump. The scenarios share
    one quack cache (--cache-dir, kept; a new empty folder by default), which the first fills (on an empty cache
    SonicMoE's autotuner compiles every GEMM config, in worker processes of its own), unless --cold-each gives each
    later one an empty cache of its own. --log-dir keeps each scenario's whole output (QUACK_PRINT_AUTOTUNING=1
    makes quack print how long each GEMM's pre-compilation and autotuning took)."""
    lines = ["| import order | quack cache | exit | wall s | SonicMoE first fwd+bwd s |",
             "| --- | --- | --- | --- | --- |"]
    shared_cache = args.cache_dir or tempfile.mkdtemp(prefix="quack_")
    Path(shared_cache).mkdir(parents=True, exist_ok=True)
    for i, name in enumerate(args.scenarios):
        cache = tempfile.mkdtemp(prefix="quack_") if args.cold_each and i else shared_cache
        cold = not any(Path(cache).iterdir())
        env = dict(os.environ, QUACK_CACHE_DIR=cache, QUACK_HOME=cache, PYTHONUNBUFFERED="1")
        env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # as train_e2e.py runs SonicMoE
        limit = args.cold_limit if cold else args.limit
        t0 = time.perf_counter()
        done = subprocess.run(["timeout", str(limit + 120), *scenario_command(name, limit)], env=env,
                              capture_output=True, text=True)
        text = done.stdout + done.stderr
        subprocess.run(["pkill", "-f", "quack._compile_worker"])  # a timed-out child leaves its compile workers
        first = next((ln.split()[-1] for ln in text.splitlines() if ln.startswith("SONIC_FIRST_CALL_S")), "-")
        lines.append(f"| {name} | {'empty' if cold else 'filled'} | {done.returncode} | "
                     f"{time.perf_counter() - t0:.0f} | {first} |")
        print(f"===== {name} (exit {done.returncode}) =====\n{text[-6000:]}", flush=True)
        if args.log_dir:
            Path(args.log_dir).mkdir(parents=True, exist_ok=True)
            (Path(args.log_dir) / f"imports_{name.replace(',', '_')}.txt").write_text(text)
    print("\n".join(lines), flush=True)


# ---------------------------------------------------------------------------------------------- layer peers


def peer_layers(args) -> None:
    """benchmarks/layer.py peers: fwd+bwd of SonicMoE, transformers' block (compiled) and LRMoE (compiled) side by
    side in one process, weights N(0, 0.02). SonicMoE is built and run at every token count first, before
    transformers' model code is imported and before anything is compiled (see import_orders). A row: CUDA events
    around each of --reps back-to-back steps, the median; every row timed once a round in a rotated order
    (common.interleaved), the median over --rounds printed, the ratio to transformers taken round by round; the
    peak is one step's, above what was allocated before it."""
    # Imported here, not at the top: run_scenario's child process must start with only torch imported (common
    # imports lrmoe).
    from common import SHAPES, hf_block, interleaved

    from lrmoe.nn import LRMoE

    shape, rows = SHAPES[args.shape], []
    for v in sorted(args.variants, key=lambda v: v != "sonic"):
        torch.manual_seed(0)
        try:
            layer = (sonic_moe(shape["dim"], shape["hidden_dim"], shape["num_experts"], shape["top_k"]) if v == "sonic"
                     else hf_block(**shape) if v == "transformers"
                     else LRMoE(**shape, retain=retain_of(v), selection=selection_of(v), kernels=kernels_of(v),
                                save_outputs=save_outputs_of(v)))
        except Exception as err:  # noqa: BLE001 - SonicMoE may be missing: the others still run
            if v != "sonic":
                raise
            log(f"SonicMoE not available: {type(err).__name__}: {err}")
            continue
        with torch.no_grad():
            for p in layer.parameters() if v != "sonic" else ():
                p.normal_(0, 0.02)
        layer = layer.to("cuda", torch.bfloat16)
        fn = layer if v == "sonic" else torch.compile(own_code(lambda x, layer=layer: layer(x)), dynamic=False,
                                                      fullgraph=v.startswith("lrmoe"))
        params, name = [p for p in layer.parameters() if p.requires_grad], "sonicmoe" if v == "sonic" else v
        for T in args.tokens:
            torch.manual_seed(0)
            x = torch.randn(T, shape["dim"], device="cuda", dtype=torch.bfloat16, requires_grad=True)
            grad = torch.randn_like(x)

            def step(x=x, grad=grad, fn=fn, params=params):
                out = fn(x)
                torch.autograd.grad(out[0] if isinstance(out, tuple) else out, [x, *params], grad)

            try:
                t0 = time.perf_counter()
                step()
                torch.cuda.synchronize()
                first = time.perf_counter() - t0
                step()
                torch.cuda.synchronize()
                before = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                step()
                torch.cuda.synchronize()
                peak = (torch.cuda.max_memory_allocated() - before) / 2**30
                rows.append(dict(name=name, tokens=T, step=step, peak=peak))
                log(f"layer {name} T={T}: first call {first:.1f} s, step peak above resident {peak:.2f} GiB")
            except Exception as err:  # noqa: BLE001 - one failing row must not end the run
                log(f"layer {name} T={T}: FAILED: {type(err).__name__}: {str(err)[:300]}")

    def time_row(i: int) -> float:
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(args.reps)]
        for start, end in events:
            start.record()
            rows[i]["step"]()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in events)

    times = interleaved(list(range(len(rows))), time_row, args.rounds)
    lines = [f"# one layer fwd+bwd, {shape}, bf16, {torch.cuda.get_device_name()}, torch {torch.__version__}; "
             f"medians over {args.rounds} rounds of {args.reps} steps; dense-equivalent TFLOP/s = 18 T k d f / time",
             "| layer | tokens | fwd+bwd ms | spread | vs transformers | vs SonicMoE | dense-eq. TFLOP/s | "
             "peak GiB above resident |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]

    def ratio_to(i: int, ref_name: str) -> float:
        """Round by round: the reference row's time over row i's (> 1: row i is faster)."""
        ref = next((j for j, b in enumerate(rows) if b["name"] == ref_name and b["tokens"] == rows[i]["tokens"]),
                   None)
        return statistics.median(b / s for b, s in zip(times[ref], times[i])) if ref is not None else float("nan")

    records = []
    for i, row in enumerate(rows):
        ms = statistics.median(times[i])
        tflops = 18 * row["tokens"] * shape["top_k"] * shape["dim"] * shape["hidden_dim"] / ms / 1e9
        lines.append(f"| {row['name']} | {row['tokens']} | {ms:.3f} | {max(times[i]) - min(times[i]):.3f} | "
                     f"{ratio_to(i, 'transformers'):.2f}x | {ratio_to(i, 'sonicmoe'):.2f}x | {tflops:.0f} | "
                     f"{row['peak']:.2f} |")
        records.append({"variant": "sonic" if row["name"] == "sonicmoe" else row["name"], "tokens": row["tokens"],
                        "ms": round(ms, 4), "peak_gib": round(row["peak"], 3)})
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({
            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d"), "rows": records}, indent=1) + "\n")
    text = "\n".join(lines) + "\n"
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "layer.md").write_text(text)
    print(text, flush=True)
    for row in rows if args.profile else ():
        print(kernel_table(row["step"], 5, args.profile, f"{row['name']} T={row['tokens']}"), flush=True)


def kernel_table(step, steps: int, top: int, title: str) -> str:
    """torch.profiler over ``steps`` calls of step: the GPU time per step and its ``top`` kernels by self time."""
    from common import top_kernels
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    gpu_ms, lines = top_kernels(prof.key_averages(), steps, top)
    return "\n".join([f"## {title}: {gpu_ms:.3f} ms GPU time per step", *lines]) + "\n"


# ---------------------------------------------------------------------------------------------------- curves


def loss_at(curve, x, axis):
    """The held-out loss at clock (axis 1) or step (axis 0) x, linear between evaluations; None past the end."""
    for a, b in zip(curve, curve[1:]):
        if a[axis] <= x <= b[axis] and b[axis] > a[axis]:
            return a[2] + (b[2] - a[2]) * (x - a[axis]) / (b[axis] - a[axis])
    return curve[-1][2] if curve and abs(curve[-1][axis] - x) < 1e-9 else None


def time_to(curve, target):
    """The first wall-clock at which the held-out loss reaches target (linear between evaluations); None if never."""
    for a, b in zip(curve, curve[1:]):
        if b[2] <= target:
            return a[1] + (b[1] - a[1]) * ((a[2] - target) / (a[2] - b[2]) if a[2] > target else 0.0)
    return None


def summarize(runs: dict) -> list[dict]:
    rows = []
    for key, per_seed in runs.items():
        regime, name = key.split("/", 1)
        ref_runs = runs.get(f"{regime}/{REFERENCE}" + ("+ckpt" if regime == "constrained" else ""), {})
        for seed, r in per_seed.items():
            row = dict(regime=regime, variant=name, seed=seed)
            ref = ref_runs.get(seed, {})
            if "curve" not in r:
                rows.append(row | dict(error=r.get("error", "no result")))
                continue
            row |= dict(steps=r["steps"], seconds=r["seconds"], tokens_per_s=r["tokens_per_s"], peak_gib=r["peak_gib"],
                        final=r["curve"][-1][2])
            if "curve" in ref:
                target = ref["curve"][-1][2] * 1.005
                ttt, ref_ttt = time_to(r["curve"], target), time_to(ref["curve"], target)
                row |= dict(target=target, time_to_target=ttt, ref_time_to_target=ref_ttt,
                            ratio=ttt / ref_ttt if ttt is not None and ref_ttt else None,
                            loss_at_ref_clock=loss_at(r["curve"], min(ref["seconds"], r["seconds"]), 1),
                            loss_at_ref_steps=loss_at(r["curve"], ref["steps"], 0),
                            ref_loss_at_own_steps=loss_at(ref["curve"], r["steps"], 0),
                            step_time_ratio=(r["seconds"] / r["steps"]) / (ref["seconds"] / ref["steps"]))
            if "split_ms" in r:
                row["split_ms"] = r["split_ms"]
            rows.append(row)
    return rows


def fmt(x, spec):
    return "-" if x is None else format(x, spec)


def table(results) -> str:
    c, rows = results["config"], results["summary"]
    lines = [f"config: {c}, {c['batch'] * c['seq']} tokens a step; {results['versions']}",
             "| regime | variant | seed | steps | tokens/s | step time vs ref | peak GiB | final held-out | "
             "time to target s | vs ref | loss at ref's clock | loss at ref's steps |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['regime']} | {r['variant']} | {r['seed']} | {r['error']} |")
            continue
        lines.append(f"| {r['regime']} | {r['variant']} | {r['seed']} | {r['steps']} | {r['tokens_per_s']:.0f} | "
                     f"{fmt(r.get('step_time_ratio'), '.3f')} | {r['peak_gib']:.2f} | {r['final']:.4f} | "
                     f"{fmt(r.get('time_to_target'), '.1f')} | {fmt(r.get('ratio'), '.3f')} | "
                     f"{fmt(r.get('loss_at_ref_clock'), '.4f')} | {fmt(r.get('loss_at_ref_steps'), '.4f')} |")
    splits = [r for r in rows if "split_ms" in r]
    if splits:
        keys = list(dict.fromkeys(k for r in splits for k in r["split_ms"]))
        lines += ["", "one step, ms (median of 3; CUDA events, summed over blocks):",
                  "| regime | variant | " + " | ".join(keys) + " |", "| --- " * (len(keys) + 2) + "|"]
        lines += [f"| {r['regime']} | {r['variant']} | "
                  + " | ".join(fmt(r["split_ms"].get(k), ".1f") for k in keys) + " |" for r in splits]
    for regime, plan in results["plans"].items():
        lines.append(f"\n{regime}: cap {plan['cap_gib']:.2f} GiB, LRMoE plan {plan['lrmoe']}")
    return "\n".join(lines) + "\n"


def plot(results, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for regime in ("unconstrained", "constrained"):
        runs = {k.split("/", 1)[1]: v for k, v in results["runs"].items() if k.startswith(regime + "/")}
        if not runs:
            continue
        fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
        lows, highs = [], []
        for i, (name, per_seed) in enumerate(runs.items()):
            for j, (seed, r) in enumerate(per_seed.items()):
                if "curve" not in r:
                    continue
                steps, clock, loss = zip(*r["curve"])
                style = dict(color=f"C{i}", linestyle=("-", "--", ":")[j % 3], label=f"{name} seed {seed}")
                axes[0].plot(clock, loss, **style)
                axes[1].plot(steps, loss, **style)
                lows.append(min(loss))
                highs.append(loss[min(2, len(loss) - 1)])
        for ax, xlabel in zip(axes, ("wall-clock s (training only)", "step")):
            ax.set_xlabel(xlabel)
            ax.set_ylabel("held-out loss (nats / byte)")
            if lows:
                ax.set_ylim(min(lows) - 0.02, max(highs) + 0.02)
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=7)
        fig.suptitle(f"{regime}: {results['config']['layers']} layers, {results['config']['batch']} x "
                     f"{results['config']['seq']} tokens a step")
        fig.tight_layout()
        fig.savefig(out / f"curves_{regime}.png", dpi=90)
        plt.close(fig)
