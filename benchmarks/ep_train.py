"""Expert-parallel training of the demo MoE language model, dense backward vs LRMoE: time to a fixed held-out loss
(paper Table 1).

    torchrun --nproc-per-node 8 benchmarks/ep_train.py --json ep_train.json                # NCCL, one GPU/rank
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 benchmarks/ep_train.py --tiny --device cpu    # CPU smoke run

The model is lrmoe.demo.model.MoELM scaled up (defaults: d=1024, 8 layers, E=64, k=8, F=512, 16 x 512 tokens per
rank, bf16 on GPU), expert-parallel over all ranks as in examples/train_ep.py: experts sharded with
``ExpertParallel``, everything else replicated and data parallel (gradients all-reduced here), loss divided by W.
Every run starts from the same weights and sees the same batches; AdamW with linear warmup and cosine decay over
--steps, gradient clipping at 1.

Runs (--runs): 1 = dense backward (retain 1, no capacity); r < 1 = LRMoE at retain r with the backward capacity
--capacity-factor (0: none). --max-replicas applies to every run (dense with replicas is the supply-side
baseline, SYMI-like). Held-out loss every --eval-every steps (the same
bytes in every run, split over the ranks; evaluation time is not counted). The target is --target-loss, or, when
the first run is dense and no target is given, that run's best held-out loss times (1 + --target-margin). A run
stops at the first evaluation at or below the target ("reached"), or after --steps steps ("not reached").

Per run: steps and wall-clock training time to the target (device-synchronised after every step, evaluation
and the run's first step excluded: it pays one-time costs, NCCL setup, autotuning and compiling, which would fall
on the dense run that goes first), MoE-layer time to the target (forward + backward of the LRMoE layers only: CUDA
events, or perf_counter on CPU, taken by module hooks; backward is the span between the layer's full backward
pre-hook and hook, so it may include unrelated autograd nodes that run in between), mean step and MoE time, final
held-out loss, retained fraction. Time is resolved to the evaluation interval. On CPU the times are not meaningful.
Rank 0 prints one table; --json PATH writes it with every evaluation.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import Ranks, settle, shutdown
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from lrmoe.demo.data import heldout_batches, load_corpus, sample_batch
from lrmoe.demo.model import ModelConfig, MoELM, lrmoe_layers
from lrmoe.demo.train import TrainConfig, lr_factor
from lrmoe.nn import ExpertParallel, clip_grad_norm_

FULL = {"dim": 1024, "layers": 8, "heads": 16, "experts": 64, "top_k": 8, "expert_hidden": 512, "seq_len": 512,
        "batch_size": 16, "steps": 600, "eval_every": 50, "eval_batches": 4, "warmup_steps": 30, "lr": 1e-3,
        "max_bytes": 16_000_000}
TINY = {"dim": 32, "layers": 1, "heads": 2, "experts": 4, "top_k": 2, "expert_hidden": 64, "seq_len": 32,
        "batch_size": 4, "steps": 16, "eval_every": 4, "eval_batches": 2, "warmup_steps": 2, "lr": 3e-3,
        "max_bytes": 200_000}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="a tiny model and run for CPU smoke tests")
    for name, value in FULL.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=None,
                       help=f"default {value} ({TINY[name]} with --tiny)")
    p.add_argument("--runs", type=float, nargs="+", default=[1.0, 0.75, 0.5],
                   help="retain per run; 1 = dense backward")
    p.add_argument("--selection", choices=("sample", "top"), default="sample")
    p.add_argument("--max-replicas", type=int, default=0, help="replica slots per rank (every run, dense too)")
    p.add_argument("--capacity-factor", type=float, default=1.25, help="LRMoE runs' backward capacity (0: none)")
    p.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                   help="train torch.compile(model, backend=BACKEND) (default inductor; no MoE-layer time then)")
    p.add_argument("--plan-on", choices=("device", "host"), default="host",
                   help="where each layer step's plan runs (ExpertParallel(plan_on=...)), every run")
    p.add_argument("--target-loss", type=float, default=None)
    p.add_argument("--target-margin", type=float, default=0.01)
    p.add_argument("--corpus", default=None, help="built-in corpus name or a text file (default: stdlib sources)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    preset = TINY if args.tiny else FULL
    for name, value in preset.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.target_loss is None and args.runs[0] != 1.0:
        p.error("without --target-loss the first run must be dense (--runs 1 ...): it sets the target")
    return args


class MoETimer:
    """Forward+backward time of a model's LRMoE layers, from module hooks (CUDA events or perf_counter)."""

    def __init__(self, layers, cuda: bool):
        self.cuda = cuda
        self.spans: list[list] = []  # [start, end] per layer call and direction, this step
        self.active = False  # set around the training step (not evaluation)
        for layer in layers:
            layer.register_forward_pre_hook(lambda *_: self._start())
            layer.register_forward_hook(lambda *_: self._stop())
            layer.register_full_backward_pre_hook(lambda *_: self._start())
            layer.register_full_backward_hook(lambda *_: self._stop())

    def _mark(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def _start(self) -> None:
        if self.active:
            self.spans.append([self._mark(), None])

    def _stop(self) -> None:
        if self.active:
            self.spans[-1][1] = self._mark()

    def take_ms(self) -> float:
        """This step's MoE milliseconds (call after a device sync), then forget them."""
        if self.cuda:
            total = sum(a.elapsed_time(b) for a, b in self.spans)
        else:
            total = 1e3 * sum(b - a for a, b in self.spans)
        self.spans = []
        return total


class NoTimer:
    """MoETimer's interface when layers cannot be timed (compiled): every step NaN."""

    active = False

    def take_ms(self) -> float:
        return float("nan")


def train_run(retain: float, target: float | None, args, corpus, heldout, device, dtype, mesh) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = device.type == "cuda"
    dense = retain >= 1.0
    cfg = ModelConfig(dim=args.dim, n_layers=args.layers, n_heads=args.heads, max_seq_len=args.seq_len,
                      num_experts=args.experts, top_k=args.top_k, expert_hidden_dim=args.expert_hidden,
                      retain=retain, selection=args.selection)
    torch.manual_seed(args.seed)  # the same initial weights on every rank and in every run
    torch._dynamo.reset()  # each run compiles its own graphs, as the first (dense) run did
    model = MoELM(cfg).to(device, dtype)
    style = ExpertParallel(max_replicas=args.max_replicas,
                           capacity_factor=None if dense or not args.capacity_factor else args.capacity_factor,
                           plan_on=args.plan_on)
    parallelize_module(model, mesh, {f"blocks.{i}.moe": style for i in range(cfg.n_layers)})
    layers = list(lrmoe_layers(model))
    params = list(model.parameters())
    replicated = [p for p in params if not isinstance(p, DTensor)]
    decay = [p for p in params if p.ndim >= 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                   {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.95), foreach=False)
    schedule = TrainConfig(steps=args.steps, warmup_steps=args.warmup_steps)
    # --compile: the whole model through torch.compile (graph breaks allowed outside the MoE layers, which compile
    # whole); module hooks cannot time layers inside compiled code, so no MoE-layer time then (NaN).
    timer = NoTimer() if args.compile else MoETimer(layers, cuda)
    run_model = torch.compile(model, backend=args.compile) if args.compile else model
    batches = torch.Generator().manual_seed(args.seed + 1 + rank)  # every rank its own batches, same in every run
    torch.manual_seed(args.seed + 1000 + rank)  # and its own sampling uniforms

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def evaluate() -> float:
        with torch.no_grad():
            losses = [F.cross_entropy(run_model(b[:, :-1].to(device)).flatten(0, 1).float(),
                                      b[:, 1:].to(device).flatten())
                      for b in heldout]
            mean = torch.stack(losses).mean().double()
        dist.all_reduce(mean)
        return mean.item() / world

    history = [{"step": 0, "train_s": 0.0, "moe_s": 0.0, "loss": evaluate()}]
    train_s = moe_s = 0.0
    kept = total = 0.0
    reached_at = None
    dist.barrier()
    for step in range(args.steps):
        sync()
        t0 = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = args.lr * lr_factor(step, schedule)
        batch_BL1 = sample_batch(corpus.train_N, args.batch_size, args.seq_len, batches).to(device)
        timer.active = True
        logits_BLV = run_model(batch_BL1[:, :-1])
        loss = F.cross_entropy(logits_BLV.flatten(0, 1).float(), batch_BL1[:, 1:].flatten())
        (loss / world).backward()
        timer.active = False
        flat = torch.cat([p.grad.flatten() for p in replicated])  # one all-reduce for the replicated gradients
        dist.all_reduce(flat)
        offset = 0
        for p in replicated:
            p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        clip_grad_norm_(params, 1.0)  # expert shards counted whole, replicated gradients once
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        step_moe_s = timer.take_ms() / 1e3
        if step > 0:  # each run's first step pays one-time costs (NCCL setup, autotuning, compiling): not counted
            train_s += time.perf_counter() - t0
            moe_s += step_moe_s
        stats = [layer.stats() for layer in layers]
        kept += float(sum(s.retained_pairs for s in stats))
        total += float(sum(s.total_pairs for s in stats))
        for layer in layers:
            layer.reset_stats()
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            # Rank 0's clock decides, so every rank stops at the same step.
            clock = torch.tensor([train_s, moe_s], dtype=torch.float64, device=device)
            dist.broadcast(clock, 0)
            history.append({"step": step + 1, "train_s": clock[0].item(), "moe_s": clock[1].item(), "loss": evaluate()})
            if rank == 0:  # progress, so a run cut short by a time limit still shows how far it got
                h = history[-1]
                print(f"# retain {retain} step {h['step']}: held-out {h['loss']:.4f}, train {h['train_s']:.1f} s, "
                      f"MoE {h['moe_s']:.1f} s", file=sys.stderr, flush=True)
            if target is not None and history[-1]["loss"] <= target:
                reached_at = history[-1]
                break
    return {"retain": retain, "dense": dense, "max_replicas": style.replication.max_replicas,
                "capacity_factor": style.replication.capacity_factor, "history": history, "reached_at": reached_at,
                "steps_run": history[-1]["step"], "retained_fraction": kept / max(total, 1.0),
                "step_ms": 1e3 * history[-1]["train_s"] / max(history[-1]["step"] - 1, 1),
                "moe_ms": 1e3 * history[-1]["moe_s"] / max(history[-1]["step"] - 1, 1)}


def print_table(runs: list[dict], meta: dict) -> None:
    print(f"# MoELM {meta['model']}, W={meta['world']} ({meta['backend']}, {meta['device_name']}), {meta['dtype']}, "
          f"{meta['tokens_per_rank']} tokens/rank/step, {meta['steps']} steps max, eval every {meta['eval_every']}")
    print(f"# target held-out loss {meta['target']:.4f} ({meta['target_source']}); times: {meta['timing']}")
    print(f"{'run':<24} {'reached':>7} {'steps':>6} {'train s':>9} {'MoE s':>9} {'vs dense':>8} {'step ms':>8} "
          f"{'MoE ms':>8} {'kept':>6} {'final loss':>10}")
    base = next((r for r in runs if r["dense"] and r["reached"]), None)
    for r in runs:
        name = "dense" if r["dense"] else f"lrmoe r={r['retain']:g} R={r['max_replicas']}" + (
            f" c={r['capacity_factor']:g}" if r["capacity_factor"] else "")
        if r["reached"]:
            at = r["reached_at"]
            base_s = base["reached_at"]["moe_s"] if base else 0.0
            vs = f"{at['moe_s'] / base_s - 1:+.0%}" if base_s > 0 else "-"
            cols = f"{at['step']:>6} {at['train_s']:>9.2f} {at['moe_s']:>9.2f} {vs:>8}"
        else:
            cols = f"{'-':>6} {'-':>9} {'-':>9} {'-':>8}"
        print(f"{name:<24} {'yes' if r['reached'] else 'no':>7} {cols} {r['step_ms']:>8.1f} {r['moe_ms']:>8.1f} "
              f"{r['retained_fraction']:>6.3f} {r['history'][-1]['loss']:>10.4f}", flush=True)


def main() -> None:
    args = parse_args()
    ranks = Ranks(args.device)
    rank, world, device, cuda, mesh = ranks.rank, ranks.world, ranks.device, ranks.cuda, ranks.mesh
    if args.experts % world:
        raise SystemExit(f"--experts {args.experts} is not divisible by W={world}")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if cuda else "fp32")]
    if args.compile:  # the EP layers' all-to-all split sizes become unbacked SymInts: one graph for every step
        torch._dynamo.config.capture_scalar_outputs = True
    corpus = load_corpus(args.corpus, max_bytes=args.max_bytes)
    # The same held-out bytes in every run, split over the ranks (each evaluates its share, then the mean).
    heldout = heldout_batches(corpus.heldout_N, args.batch_size, args.seq_len, args.eval_batches * world)[rank::world]

    target = args.target_loss
    runs = []
    for retain in args.runs:
        run = train_run(retain, target, args, corpus, heldout, device, dtype, mesh)
        if target is None:  # the first run is dense: it sets the target
            target = min(h["loss"] for h in run["history"]) * (1 + args.target_margin)
            source = f"dense run's best x (1 + {args.target_margin:g})"
        runs.append(run)
        if cuda:
            torch.cuda.empty_cache()
    runs = [settle(r, target) for r in runs]
    if rank == 0:
        meta = {
            "model": {"dim": args.dim, "layers": args.layers, "heads": args.heads, "experts": args.experts,
                      "top_k": args.top_k, "expert_hidden": args.expert_hidden},
            "world": world, "backend": dist.get_backend(),
            "device_name": torch.cuda.get_device_name() if cuda else "cpu",
            "dtype": str(dtype).removeprefix("torch."), "tokens_per_rank": args.batch_size * args.seq_len,
            "steps": args.steps, "eval_every": args.eval_every, "target": target,
            "target_source": "--target-loss" if args.target_loss is not None else source,
            "timing": "device-synchronised wall clock" if cuda else "CPU: NOT MEANINGFUL as performance",
            "corpus": corpus.describe(), "lr": args.lr, "selection": args.selection, "torch": torch.__version__,
            "compiled": args.compile, "plan_on": args.plan_on,
        }
        print_table(runs, meta)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"meta": meta, "runs": runs}, f, indent=1)
    shutdown()


if __name__ == "__main__":
    main()
