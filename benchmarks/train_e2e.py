"""End-to-end MoE training on one GPU: does LRMoE reach a held-out loss sooner than the best dense MoE layers?

    python benchmarks/train_e2e.py train --out runs/e2e                # both regimes, two seeds, table + PNGs
    python benchmarks/train_e2e.py report A/results.json B/results.json --out DIR    # runs made apart, merged

train: a byte-level decoder with Qwen3-30B-A3B's layer shapes (d 2048; 32 query / 4 key-value heads of 128 with
q/k RMSNorm, rotary, causal SDPA; RMSNorm; E 128, k 8, f 768 SwiGLU experts; tied byte embedding), bf16 weights,
AdamW (fused, bf16 moments) with clipping, trained on the Python standard library's sources (every 10th file held
out). Variants share the seed's initial weights (the same values in every layout), its data order and its held-out
batches; only the MoE layer differs: transformers' Qwen3MoeSparseMoeBlock (grouped_mm experts), LRMoE at retain
1 / 0.75 / 0.5 (default "sample" selection; --variants takes any lrmoe-<retain>[-top][-savey][-portable|-hopper]:
"top" selection, y saved for the router gradient, a kernel backend), SonicMoE (run first, see `benchmarks/layer.py
imports`; `report` merges runs made apart). Each block's attention half and MoE half are compiled separately (one
attention graph for all variants; SonicMoE's layer runs as its own kernels, uncompiled). Each (regime, variant,
seed) trains for --seconds of wall-clock after a warm-up model has compiled everything; held-out loss is evaluated
every --eval-every steps (the clock stops during evaluation).
Regimes: unconstrained (the batch every variant fits); constrained: a per-process memory cap
(torch.cuda.set_per_process_memory_fraction) of --cap-fraction of the transformers run's measured peak, under which
the transformers reference checkpoints every block, while LRMoE takes retain and its activation policy from
lrmoe.memory.plan_memory and does not checkpoint.
Reported: tokens/s, peak memory, time to the reference's final held-out loss x 1.005, the loss at the reference's
wall-clock and at its step count, and a split of one step (CUDA events around each block's attention and MoE
halves, tensor hooks for their backward, and around the optimizer).
"""

from __future__ import annotations

import os

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # before CUDA starts

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import sysconfig  # noqa: E402
import time  # noqa: E402
import zlib  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from e2e_common import (  # noqa: E402
    PRESETS,
    REFERENCE,
    START,
    VARIANTS,
    kernels_of,
    log,
    make_moe,
    own_code,
    plot,
    retain_of,
    save_outputs_of,
    selection_of,
    sonic_first_step,
    summarize,
    table,
    variant_name,
)
from torch import nn  # noqa: E402

# ------------------------------------------------------------------------------------------------------ data


def load_corpus(max_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The stdlib's .py sources in sorted order, every 10th file held out: (train_N, heldout_N) uint8."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
    files = sorted((p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts[:-1])),
                   key=lambda p: p.relative_to(root).as_posix())
    parts, total = ([], []), 0
    for index, path in enumerate(files):
        if total >= max_bytes:
            break
        data = path.read_bytes()
        parts[index % 10 == 9].append(data)
        total += len(data)
    as_tensor = lambda chunks: torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)  # noqa: E731
    return as_tensor(parts[0]), as_tensor(parts[1])


def windows(data_N: torch.Tensor, starts_B: torch.Tensor, seq: int, device) -> torch.Tensor:
    return data_N[starts_B[:, None] + torch.arange(seq + 1)].long().to(device, non_blocking=True)


# ----------------------------------------------------------------------------------------------------- model


class Attention(nn.Module):
    """Qwen3's attention: q/k/v/o projections, RMSNorm on each query and key head, rotary, causal SDPA."""

    def __init__(self, c):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c["heads"], c["kv_heads"], c["head_dim"]
        self.q_proj = nn.Linear(c["dim"], c["heads"] * c["head_dim"], bias=False)
        self.k_proj = nn.Linear(c["dim"], c["kv_heads"] * c["head_dim"], bias=False)
        self.v_proj = nn.Linear(c["dim"], c["kv_heads"] * c["head_dim"], bias=False)
        self.o_proj = nn.Linear(c["heads"] * c["head_dim"], c["dim"], bias=False)
        self.q_norm, self.k_norm = nn.RMSNorm(c["head_dim"], eps=1e-6), nn.RMSNorm(c["head_dim"], eps=1e-6)

    def forward(self, x_BLD, cos_LC, sin_LC):
        B, L, _ = x_BLD.shape
        H, G, C = self.heads, self.kv_heads, self.head_dim
        q_BHLC = self.q_norm(self.q_proj(x_BLD).view(B, L, H, C)).transpose(1, 2)
        k_BGLC = self.k_norm(self.k_proj(x_BLD).view(B, L, G, C)).transpose(1, 2)
        v_BGLC = self.v_proj(x_BLD).view(B, L, G, C).transpose(1, 2)
        q_BHLC, k_BGLC = rotary(q_BHLC, cos_LC, sin_LC), rotary(k_BGLC, cos_LC, sin_LC)
        # each key-value head serves H / G query heads (expanded here: every SDPA backend takes it)
        k_BHLC = k_BGLC[:, :, None].expand(B, G, H // G, L, C).reshape(B, H, L, C)
        v_BHLC = v_BGLC[:, :, None].expand(B, G, H // G, L, C).reshape(B, H, L, C)
        out_BHLC = F.scaled_dot_product_attention(q_BHLC, k_BHLC, v_BHLC, is_causal=True)
        return self.o_proj(out_BHLC.transpose(1, 2).reshape(B, L, H * C))


def rotary(x, cos_LC, sin_LC):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos_LC + torch.cat([-x2, x1], dim=-1) * sin_LC


class Block(nn.Module):
    def __init__(self, c, moe):
        super().__init__()
        self.attn_norm, self.attn = nn.RMSNorm(c["dim"], eps=1e-6), Attention(c)
        self.moe_norm, self.moe = nn.RMSNorm(c["dim"], eps=1e-6), moe


def attn_half(block, x_BLD, cos_LC, sin_LC):
    return x_BLD + block.attn(block.attn_norm(x_BLD), cos_LC, sin_LC)


def moe_half(block, x_BLD):
    out = block.moe(block.moe_norm(x_BLD))
    return x_BLD + (out[0] if isinstance(out, tuple) else out)  # SonicMoE returns (output, aux loss)


def head_loss(model, h_BLD, targets_BL):
    logits = F.linear(model.norm(h_BLD), model.embed.weight).float()
    return F.cross_entropy(logits.flatten(0, 1), targets_BL.flatten())


class LM(nn.Module):
    def __init__(self, c, variant, device, compile_fns, retain=1.0, activations="save", checkpoint=False,
                 selection="sample", save_outputs=False, kernels="auto"):
        super().__init__()
        self.embed = nn.Embedding(256, c["dim"])
        self.blocks = nn.ModuleList(Block(c, make_moe(variant, c, device, retain, activations, selection,
                                                      save_outputs, kernels))
                                    for _ in range(c["layers"]))
        self.norm = nn.RMSNorm(c["dim"], eps=1e-6)
        inv_freq = 1e6 ** (-torch.arange(0, c["head_dim"], 2, dtype=torch.float32) / c["head_dim"])
        angles = torch.outer(torch.arange(c["seq"], dtype=torch.float32), inv_freq).repeat(1, 2)
        self.register_buffer("cos_LC", angles.cos(), persistent=False)
        self.register_buffer("sin_LC", angles.sin(), persistent=False)
        self.fns, self.checkpoint, self.events = compile_fns, checkpoint, None

    def block(self, block, h):
        attn, moe = self.fns["attn"], self.fns["moe"]
        cos, sin = self.cos_LC.to(h.dtype), self.sin_LC.to(h.dtype)
        if self.events is None:
            return moe(block, attn(block, h, cos, sin))
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(6)]
        self.events.append(ev)
        h.register_hook(lambda g: ev[5].record())  # its gradient complete: the attention backward is done
        ev[0].record()
        x1 = attn(block, h, cos, sin)
        ev[1].record()
        x1.register_hook(lambda g: ev[4].record())  # the MoE backward is done
        x2 = moe(block, x1)
        ev[2].record()
        x2.register_hook(lambda g: ev[3].record())  # the MoE backward starts
        return x2

    def forward(self, tokens_BL1):
        h = self.embed(tokens_BL1[:, :-1])
        for block in self.blocks:
            if self.checkpoint and torch.is_grad_enabled():
                h = torch.utils.checkpoint.checkpoint(self.block, block, h, use_reentrant=False)
            else:
                h = self.block(block, h)
        return self.fns["head"](self, h, tokens_BL1[:, 1:])


def canonical(name: str) -> str:
    """SonicMoE's parameter names as transformers' / LRMoE's."""
    return (name.replace("moe.router.weight", "moe.gate.weight").replace("moe.c_fc.weight", "moe.experts.gate_up_proj")
            .replace("moe.c_proj.weight", "moe.experts.down_proj"))


@torch.no_grad()
def init_weights(model: LM, seed: int, layers: int, sonic: bool) -> None:
    """N(0, 0.02), output projections / sqrt(2 layers), norms at 1, each parameter from a generator seeded by the
    seed and its canonical name: every variant starts from the same function. SonicMoE's gate/up rows interleave
    (gate even, up odd): drawn in the [gate; up] layout, then interleaved."""
    for name, p in model.named_parameters():
        name = canonical(name)
        if "norm" in name:
            p.fill_(1.0)
            continue
        gen = torch.Generator(p.device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        std = 0.02 / math.sqrt(2 * layers) if name.endswith(("o_proj.weight", "down_proj")) else 0.02
        value = torch.empty(p.shape, device=p.device, dtype=torch.float32).normal_(0, std, generator=gen)
        if sonic and name.endswith("gate_up_proj"):
            E, F2, D = value.shape
            value = torch.stack([value[:, : F2 // 2], value[:, F2 // 2:]], dim=2).reshape(E, F2, D)
        p.copy_(value)


def compile_fns(variant: str, compiled: bool, shared: dict) -> dict:
    if not compiled:
        return dict(attn=attn_half, moe=moe_half, head=head_loss)
    if "attn" not in shared:
        shared["attn"] = torch.compile(attn_half, dynamic=False)
        shared["head"] = torch.compile(head_loss, dynamic=False)
    if variant not in shared:  # SonicMoE's layer is CuTe / Triton kernels of its own: not compiled
        shared[variant] = (own_code(moe_half) if variant == "sonic" else
                           torch.compile(own_code(moe_half), dynamic=False, fullgraph=variant.startswith("lrmoe")))
    return dict(attn=shared["attn"], moe=shared[variant], head=shared["head"])


# ------------------------------------------------------------------------------------------------- training


def peak_gib(device) -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def build(spec, c, seed, device, fns):
    with torch.device(device):
        old = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            model = LM(c, spec["variant"], device, fns, spec["retain"], spec["activations"], spec["checkpoint"],
                       spec.get("selection", "sample"), spec.get("save_outputs", False), spec.get("kernels", "auto"))
        finally:
            torch.set_default_dtype(old)
    model.to(device=device, dtype=torch.bfloat16)
    init_weights(model, seed, c["layers"], spec["variant"] == "sonic")
    opt = torch.optim.AdamW(model.parameters(), lr=0.0, betas=(0.9, 0.95), weight_decay=0.1,
                            **({"fused": True} if device.type == "cuda" else {"foreach": True}))
    return model, opt


def train_step(model, opt, batch, step, args):
    for group in opt.param_groups:
        group["lr"] = args.lr * min(1.0, (step + 1) / args.warmup)
    loss = model(batch)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def evaluate(model, heldout):
    # with autograd on, as in training, so the compiled graphs are the training ones (no second compile); the
    # graph is dropped unused
    return torch.stack([model(batch).detach() for batch in heldout]).mean().item()


def time_split(model, opt, batch) -> dict:
    """Median over 3 steps of each part's milliseconds (CUDA events; summed over blocks). A checkpointed model runs
    each block twice (the recompute inside the backward): only its forward+backward and optimizer are split."""
    parts = []
    for i in range(3):
        model.events = None if model.checkpoint else []
        start, mid, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        start.record()
        loss = model(batch)
        loss.backward()
        mid.record()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        end.record()
        torch.cuda.synchronize()
        ev = model.events
        if ev is None:
            parts.append(dict(fwd_bwd=start.elapsed_time(mid), optimizer=mid.elapsed_time(end),
                              step=start.elapsed_time(end)))
            continue
        split = dict(attention_fwd=sum(e[0].elapsed_time(e[1]) for e in ev),
                     moe_fwd=sum(e[1].elapsed_time(e[2]) for e in ev),
                     moe_bwd=sum(e[3].elapsed_time(e[4]) for e in ev),
                     attention_bwd=sum(e[4].elapsed_time(e[5]) for e in ev),
                     optimizer=mid.elapsed_time(end), step=start.elapsed_time(end))
        split["rest"] = split["step"] - sum(v for k, v in split.items() if k != "step")
        parts.append(split)
    model.events = None
    return {k: statistics.median(p[k] for p in parts) for k in parts[0]}


def run_one(spec, c, seed, data, args, device, fns, split_profile):
    """Train one (variant, seed) for args.seconds of wall-clock (evaluation excluded)."""
    train_N, heldout = data
    model, opt = build(spec, c, seed, device, fns)
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    gen = torch.Generator().manual_seed(seed)
    n_starts = train_N.numel() - c["seq"] - 1
    curve, losses, step, clock = [(0, 0.0, evaluate(model, heldout))], [], 0, 0.0
    while True:
        sync(device)
        t0 = time.perf_counter()
        for _ in range(args.eval_every):
            batch = windows(train_N, torch.randint(n_starts, (c["batch"],), generator=gen), c["seq"], device)
            losses.append(train_step(model, opt, batch, step, args))
            step += 1
        sync(device)
        clock += time.perf_counter() - t0
        curve.append((step, clock, evaluate(model, heldout)))
        if clock >= args.seconds or step >= args.max_steps:
            break
    out = dict(steps=step, seconds=clock, tokens_per_s=step * c["batch"] * c["seq"] / clock, peak_gib=peak_gib(device),
               curve=curve, train_loss=torch.stack(losses).float().tolist())
    if split_profile and device.type == "cuda":
        try:
            out["split_ms"] = time_split(model, opt, batch)
        except Exception as err:  # noqa: BLE001 - the split is extra; the run's numbers stand
            log(f"time split failed: {type(err).__name__}: {err}")
    del model, opt
    return out


def moe_plan(c, tokens, cap_bytes, other_bytes):
    """LRMoE's retain and activation policy under the cap, from lrmoe.memory.plan_memory: the per-layer budget is
    what the cap leaves after the rest of the model (other_bytes), split over the layers, with one layer's largest
    transient (retain 1's, the largest) counted once rather than once per layer. The highest retain wins; "save"
    before "recompute" (no extra GEMM) at equal retain."""
    from lrmoe.memory import ADAMW_FP32, MemoryConfig, layer_memory, plan_memory

    config = MemoryConfig(c["dim"], c["hidden"], c["experts"], c["top_k"], tokens=tokens,
                          optimizer_bytes_per_param=ADAMW_FP32 // 2)  # bf16 moments
    base = layer_memory(config, retain=1.0)
    transient = max(base.forward_transient, base.backward_transient)
    budget = int((cap_bytes - other_bytes - transient) // c["layers"] + transient)
    plans = []
    for policy in ("save", "recompute"):
        try:
            plans.append(plan_memory(config, budget, policy=policy))
        except ValueError as err:
            log(f"plan_memory(policy={policy!r}): {err}")
    if not plans:
        return None
    best = max(plans, key=lambda p: (p.retain, p.memory.policy == "save"))
    return dict(retain=best.retain, activations=best.memory.policy, layer_budget_gib=budget / 2**30,
                modelled_layer_peak_gib=best.memory.peak / 2**30, other_gib=other_bytes / 2**30)


def modelled_moe_bytes(c, tokens, retain=1.0, policy="save") -> int:
    from lrmoe.memory import ADAMW_FP32, MemoryConfig, layer_memory

    m = layer_memory(MemoryConfig(c["dim"], c["hidden"], c["experts"], c["top_k"], tokens=tokens,
                                  optimizer_bytes_per_param=ADAMW_FP32 // 2), retain=retain, policy=policy)
    return c["layers"] * (m.static + m.saved_activations) + max(m.forward_transient, m.backward_transient)


def free(device):
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_variant(name, spec, c, data, args, device, shared, seeds):
    """Warm up (compile, autotune) on a throwaway model, then train each seed; failures are recorded, not raised."""
    if time.perf_counter() - START + 60 > args.deadline:
        log(f"{name}: skipped (deadline)")
        return {str(seed): dict(error="skipped: --deadline") for seed in seeds}
    results = {}
    try:
        t0 = time.perf_counter()
        if spec["variant"] == "sonic" and device.type == "cuda":
            # SonicMoE autotunes (and compiles) per shape at its first call: done here, before Inductor compiles
            # anything in this process (see `layer.py imports`); training and evaluation use this shape only.
            log(f"{name}: SonicMoE first call {sonic_first_step(c, c['batch'], c['seq'], device):.1f} s")
        fns = compile_fns(spec["variant"], args.compile, shared)
        model, opt = build(spec, c, 999, device, fns)
        batch = windows(data[0], torch.arange(c["batch"]) * 997, c["seq"], device)
        for step in range(args.warmup_steps):
            train_step(model, opt, batch, step, args)
        evaluate(model, data[1][:1])
        sync(device)
        del model, opt
        free(device)
        log(f"{name}: warm-up (compile) {time.perf_counter() - t0:.1f} s")
    except Exception as err:  # noqa: BLE001 - one variant's failure must not end the run
        error = f"{type(err).__name__}: {str(err)[:300]}"
    else:
        error = None
    if error is not None:
        free(device)  # after the except block: the traceback no longer holds the model's frames
        log(f"{name}: FAILED in warm-up: {error}")
        return {str(seed): dict(error=error) for seed in seeds}
    for i, seed in enumerate(seeds):
        seed = str(seed)  # as JSON gives it back (the SonicMoE child's results)
        if time.perf_counter() - START + args.seconds + 15 > args.deadline:
            results[seed] = dict(error="skipped: --deadline")
            log(f"{name} seed {seed}: skipped (deadline)")
            continue
        try:
            results[seed] = run_one(spec, c, int(seed), data, args, device, fns, split_profile=i == 0)
            r = results[seed]
            log(f"{name} seed {seed}: {r['steps']} steps in {r['seconds']:.1f} s, {r['tokens_per_s']:.0f} tok/s, "
                f"peak {r['peak_gib']:.2f} GiB, held-out {r['curve'][-1][2]:.4f}"
                + (f", split {json.dumps({k: round(v, 1) for k, v in r['split_ms'].items()})}" if "split_ms" in r
                   else ""))
        except Exception as err:  # noqa: BLE001
            results[seed] = dict(error=f"{type(err).__name__}: {str(err)[:300]}")
            log(f"{name} seed {seed}: FAILED: {results[seed]['error']}")
        free(device)
    return results


def train_main(args):
    device = torch.device(args.device)
    c = dict(PRESETS[args.preset])
    c.update({k: getattr(args, k) for k in ("layers", "batch", "seq") if getattr(args, k) is not None})
    tokens = c["batch"] * c["seq"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = dict(config=c, args={k: v for k, v in vars(args).items() if k != "func"}, runs={}, plans={},
                   versions=dict(torch=torch.__version__, python=sys.version.split()[0],
                                 gpu=torch.cuda.get_device_name() if device.type == "cuda" else "cpu"))
    # SonicMoE first: its autotuner compiles per shape at its first call, before Inductor compiles anything here
    variants = sorted(dict.fromkeys(args.variants), key=lambda v: v != "sonic")
    train_N, heldout_N = load_corpus(args.corpus_bytes)
    heldout = [windows(heldout_N, starts, c["seq"], device) for starts in
               torch.linspace(0, heldout_N.numel() - c["seq"] - 2, c["batch"] * args.eval_batches).long()
               .split(c["batch"])]
    data = (train_N, heldout)
    log(f"config {c}; {tokens} tokens a step; corpus {train_N.numel():,} train / {heldout_N.numel():,} held-out bytes")
    shared = {}
    if "unconstrained" in args.regimes:
        for v in variants:
            spec = dict(variant=v.split("-")[0], retain=retain_of(v), activations="save", checkpoint=False,
                        selection=selection_of(v), save_outputs=save_outputs_of(v), kernels=kernels_of(v))
            results["runs"][f"unconstrained/{v}"] = run_variant(v, spec, c, data, args, device, shared, args.seeds)
    if "constrained" in args.regimes and REFERENCE in variants:
        ref = results["runs"].get(f"unconstrained/{REFERENCE}", {})
        peaks = [r["peak_gib"] for r in ref.values() if "peak_gib" in r]
        cap = args.cap_gib * 2**30 if args.cap_gib else (args.cap_fraction * max(peaks) * 2**30 if peaks else None)
        r1 = [r["peak_gib"] for r in results["runs"].get("unconstrained/lrmoe-1", {}).values() if "peak_gib" in r]
        n_attn = sum(p.numel() for p in Attention(c).parameters()) + 2 * c["dim"]
        other = (max(r1) * 2**30 - modelled_moe_bytes(c, tokens) if r1 and device.type == "cuda" else
                 c["layers"] * (n_attn * 8 + tokens * 24 * c["dim"]))  # weights+grads+moments, ~12 [T, D] bf16
        if cap is None:
            log("constrained regime: no cap (no reference peak and no --cap-gib); skipped")
        else:
            plan = moe_plan(c, tokens, 0.97 * cap, other)
            results["plans"]["constrained"] = dict(cap_gib=cap / 2**30, lrmoe=plan)
            log(f"constrained: cap {cap / 2**30:.2f} GiB; LRMoE plan {plan}")
            if device.type == "cuda":
                torch.cuda.set_per_process_memory_fraction(cap / torch.cuda.get_device_properties(0).total_memory)
            specs = {f"{REFERENCE}+ckpt": dict(variant=REFERENCE, retain=1.0, activations="save", checkpoint=True)}
            if plan is not None:
                specs[f"lrmoe-plan ({plan['retain']:g}, {plan['activations']})"] = dict(
                    variant="lrmoe", retain=plan["retain"], activations=plan["activations"], checkpoint=False)
                for retain in args.constrained_retain:  # lower retain under the plan's policy: less memory, faster
                    if retain < plan["retain"]:
                        specs[f"lrmoe ({retain:g}, {plan['activations']})"] = dict(
                            variant="lrmoe", retain=retain, activations=plan["activations"], checkpoint=False)
            for name, spec in specs.items():
                results["runs"][f"constrained/{name}"] = run_variant(name, spec, c, data, args, device, shared,
                                                                     args.seeds)
            if device.type == "cuda":
                torch.cuda.set_per_process_memory_fraction(1.0)
    write_report(results, out)


def write_report(results, out: Path):
    results["summary"] = summarize(results["runs"])
    text = table(results)
    (out / "table.md").write_text(text)
    (out / "results.json").write_text(json.dumps(results, default=str))
    plot(results, out)
    print(text, flush=True)


def report_main(args):
    """Merge the runs of several results.json (e.g. a SonicMoE run made in another call) into one report."""
    merged = None
    for path in args.results:
        results = json.loads(Path(path).read_text())
        if merged is None:
            merged = results
        else:
            merged["runs"].update(results["runs"])
            merged["plans"].update(results.get("plans", {}))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    write_report(merged, Path(args.out))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("train")
    p.add_argument("--preset", default="qwen3", choices=sorted(PRESETS))
    for key in ("layers", "batch", "seq"):
        p.add_argument(f"--{key}", type=int)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), type=variant_name,
                   help="transformers, sonic, lrmoe-<retain>[-top][-savey][-portable|-hopper] (default: \"sample\" "
                        "selection, y not saved, kernels \"auto\")")
    p.add_argument("--regimes", nargs="+", default=["unconstrained", "constrained"],
                   choices=["unconstrained", "constrained"])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--seconds", type=float, default=20.0, help="training wall-clock per run (evaluation excluded)")
    p.add_argument("--max-steps", type=int, default=10**9)
    p.add_argument("--eval-every", type=int, default=10, help="steps between held-out evaluations")
    p.add_argument("--eval-batches", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=10, help="steps of linear learning-rate warm-up")
    p.add_argument("--warmup-steps", type=int, default=2, help="compile steps on a throwaway model per variant")
    p.add_argument("--cap-fraction", type=float, default=0.9,
                   help="constrained regime: memory cap as a fraction of the transformers run's peak")
    p.add_argument("--cap-gib", type=float, help="constrained regime: the cap in GiB (instead of --cap-fraction)")
    p.add_argument("--constrained-retain", type=float, nargs="*", default=[0.5],
                   help="constrained regime: also LRMoE at these retains (under the plan's policy) when below the "
                        "plan's")
    p.add_argument("--corpus-bytes", type=int, default=16_000_000)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument("--deadline", type=float, default=1e9, help="seconds from start after which no run starts")
    p.add_argument("--out", default="runs/e2e")
    p.set_defaults(func=train_main)
    p = sub.add_parser("report")
    p.add_argument("results", nargs="+")
    p.add_argument("--out", required=True)
    p.set_defaults(func=report_main)
    args = parser.parse_args()
    if getattr(args, "eval_every", 1) < 1 or getattr(args, "seconds", 1) <= 0:
        parser.error("--eval-every must be >= 1 and --seconds > 0")
    args.func(args)


if __name__ == "__main__":
    main()
