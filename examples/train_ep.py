"""Expert-parallel training of the demo MoE language model (lrmoe.demo.model.MoELM), a few steps.

    torchrun --nproc-per-node 2 examples/train_ep.py                    # CPU: gloo
    torchrun --nproc-per-node 8 examples/train_ep.py --retain 0.5       # GPUs: NCCL, one GPU per rank

Every rank builds the same model from the same seed, then ``parallelize_module`` shards the experts of every
LRMoE layer over a 1-D EP mesh of all ranks (``ExpertParallel``); everything else stays replicated. Each rank
trains on its own batches (data parallel over the same ranks), so:

* replicated parameters (attention, norms, embedding, routers) get a gradient from the rank's own tokens only and
  are all-reduced here, as DDP or FSDP would;
* expert shards already receive every rank's rows through the backward all-to-all, so their gradient is complete.

The loss is divided by the world size before backward, so both kinds of gradient are those of the mean loss over
all ranks' tokens. Each step prints the mean loss and the bytes moved by the four all-to-alls of all MoE layers,
summed over ranks: forward dispatch and combine, backward dispatch (retained rows only) and input-gradient return;
with ``--max-replicas`` also the replica weights and their gradients, and the busiest rank's backward rows over
the mean (``--capacity-factor`` bounds it).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from lrmoe.demo.data import load_corpus, sample_batch
from lrmoe.demo.model import ModelConfig, MoELM, lrmoe_layers
from lrmoe.nn import ExpertParallel


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--experts", type=int, default=8, help="must be divisible by the number of ranks")
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--retain", type=float, default=0.5)
    p.add_argument("--selection", choices=("sample", "top"), default="sample")
    p.add_argument("--max-replicas", type=int, default=0, help="replica slots per rank for hot experts")
    p.add_argument("--capacity-factor", type=float, default=None,
                   help="backward capacity per rank, times the balanced share of retained rows (>= 1; none: no limit)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--corpus", default=None, help="built-in corpus name or a text file (default: stdlib sources)")
    p.add_argument("--max-bytes", type=int, default=1_000_000)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    device = torch.device("cuda" if cuda else "cpu")
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("ep",))

    cfg = ModelConfig(
        dim=args.dim, n_layers=args.layers, n_heads=4, max_seq_len=args.seq_len, num_experts=args.experts,
        top_k=args.top_k, expert_hidden_dim=2 * args.dim, retain=args.retain, selection=args.selection,
    )
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = MoELM(cfg).to(device)
    style = ExpertParallel(max_replicas=args.max_replicas, capacity_factor=args.capacity_factor)
    parallelize_module(model, mesh, {f"blocks.{i}.moe": style for i in range(cfg.n_layers)})
    layers = list(lrmoe_layers(model))
    # Build the optimiser after parallelize_module (it replaces the expert parameters). foreach=False: the
    # parameter list mixes plain tensors and DTensors.
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, foreach=False)

    corpus = load_corpus(args.corpus, max_bytes=args.max_bytes)
    batches = torch.Generator().manual_seed(args.seed + 1 + rank)  # every rank its own batches
    torch.manual_seed(args.seed + 1000 + rank)  # and its own sampling uniforms
    if rank == 0:
        n_params = sum(p.numel() for p in model.parameters())
        print(f"{world} ranks ({device.type}, {dist.get_backend()}), {corpus.describe()}")
        print(f"MoELM {n_params:,} parameters, {cfg.n_layers} LRMoE layers, E={cfg.num_experts} "
              f"({cfg.num_experts // world} per rank), k={cfg.top_k}, retain={cfg.retain}, {cfg.selection}, "
              f"max_replicas={args.max_replicas}, capacity_factor={args.capacity_factor}")
        print("step   loss   fwd dispatch+combine KB   bwd dispatch+return KB   replicas KB   max/mean bwd rows   "
              "retained   ms")

    for step in range(args.steps):
        t0 = time.perf_counter()
        batch_BL1 = sample_batch(corpus.train_N, args.batch_size, args.seq_len, batches).to(device)
        logits_BLV = model(batch_BL1[:, :-1])
        loss = F.cross_entropy(logits_BLV.flatten(0, 1).float(), batch_BL1[:, 1:].flatten())
        (loss / world).backward()
        for p in model.parameters():  # replicated parameters: sum the per-rank gradients (expert shards: done)
            if p.grad is not None and not isinstance(p, DTensor):
                dist.all_reduce(p.grad)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        # Statistics of all layers, summed over ranks: one all-reduce, one host read, on the logging step.
        stats = [layer.stats() for layer in layers]
        row = torch.stack([
            loss.detach().double(),
            sum(s.dispatch_bytes + s.combine_bytes for s in stats).double(),
            sum(s.backward_dispatch_bytes + s.backward_combine_bytes for s in stats).double(),
            sum(s.retained_pairs for s in stats).double() / world,  # global counts, the same on every rank
            sum(s.total_pairs for s in stats).double() / world,
            sum(s.replica_bytes + s.replica_grad_bytes for s in stats).double(),
            # backward rows of the busiest rank over the mean, averaged over layers (the same on every rank)
            sum(s.rank_backward_loads.max() / s.rank_backward_loads.double().mean().clamp(min=1) for s in stats)
            / (len(stats) * world),
        ])
        dist.all_reduce(row)
        for layer in layers:
            layer.reset_stats()
        loss_mean, fwd_bytes, bwd_bytes, kept, total, rep_bytes, imbalance = row.tolist()
        if rank == 0:
            print(f"{step:4d} {loss_mean / world:6.3f} {fwd_bytes / 1024:25.1f} {bwd_bytes / 1024:24.1f} "
                  f"{rep_bytes / 1024:13.1f} {imbalance:19.2f} {kept / total:10.3f} "
                  f"{1000 * (time.perf_counter() - t0):5.0f}")

    gloo = dist.get_backend() == "gloo"
    dist.barrier()
    dist.destroy_process_group()
    if gloo:
        # Gloo's worker threads occasionally abort the process at interpreter teardown ("terminate called without
        # an active exception", SIGABRT) even after destroy_process_group; seen here with plain
        # dist.all_to_all_single too, so it is not this library's doing. The run is complete: skip the teardown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
