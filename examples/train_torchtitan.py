"""Train a small torchtitan Qwen3-MoE model with lrmoe's selective expert backward (``convert_moe``).

    python examples/train_torchtitan.py                                   # CPU, one process
    torchrun --nproc-per-node 2 examples/train_torchtitan.py --ep 2       # CPU, gloo: FSDP2 + torchtitan's EP
    python examples/train_torchtitan.py --device cuda --compile           # one GPU, per-block torch.compile

The model is torchtitan's own Qwen3 decoder with MoE blocks (``torchtitan.models.qwen3``), built in code from a
small configuration (random init, nothing downloaded), or with ``--model deepseek_v3`` torchtitan's DeepSeek-V3
debug model (MLA attention, a dense first layer, shared experts); ``--router deepseek`` gives the MoE layers
DeepSeek-V3's full router (sigmoid scores, expert groups, routed scaling; and a shared expert in Qwen3's
blocks). Attention is torchtitan's SDPA backend, since FlexAttention has no CPU backward. The loop is torchtitan's
training step, written out: build the model, ``convert_moe`` (the only lrmoe line), then torchtitan's
parallelisation in its order (expert parallelism through ``model.parallelize``, per-block ``apply_compile``, FSDP2
through ``apply_fsdp_to_decoder``, which on a GPU also gives torchtitan's bf16 mixed precision), AdamW with
torchtitan's expert-bias hook (``register_moe_load_balancing_hook``, aux-loss-free balancing), gradient clipping
over the FSDP2 and EP meshes (``lrmoe.nn.clip_grad_norm_``).

The data is a synthetic language with a learnable rule (each next token is a fixed random permutation of the
current one, with 10 % noise), so the loss falls from log(vocab) within tens of steps. Each step prints the mean
loss over ranks and the fraction of routed rows the experts' backward kept (1.0 with ``--retain 1``).
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule


def _torch_compat() -> None:
    """Let torchtitan 0.3.0 (written against torch 2.13) import and run this example under torch 2.11 as well:
    it imports ``torch.distributed.fsdp.DataParallelMeshDims`` at module level for its "full_dtensor" backend only
    (not used here), and its expert-parallel dispatcher calls ``torch.compiler._is_non_strict_tracing``, which
    torch 2.11 lacks (no non-strict tracing runs here: False). Newer torch is left untouched."""
    import torch.distributed.fsdp as torch_fsdp

    if not hasattr(torch_fsdp, "DataParallelMeshDims"):
        torch_fsdp.DataParallelMeshDims = type("DataParallelMeshDims", (), {})
    if not hasattr(torch.compiler, "_is_non_strict_tracing"):
        torch.compiler._is_non_strict_tracing = lambda: False


_torch_compat()

import torchtitan.distributed.parallel_dims as titan_parallel_dims  # noqa: E402  (after _torch_compat)
import torchtitan.distributed.utils as titan_dist_utils
from torchtitan.components.optimizer.optimizer import register_moe_load_balancing_hook
from torchtitan.config import CompileConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.compile import apply_compile
from torchtitan.distributed.fsdp import apply_fsdp_to_decoder, disable_fsdp_gradient_division
from torchtitan.models.common import CosSinRoPE, Embedding, Linear
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.common.config_utils import make_ffn_config
from torchtitan.models.common.moe import MoE
from torchtitan.models.deepseek_v3 import deepseekv3_configs
from torchtitan.models.deepseek_v3.sharding import set_deepseek_v3_sharding_config
from torchtitan.models.qwen3 import Qwen3Model
from torchtitan.models.qwen3 import _build_qwen3_moe_layers, _qwen3_norm, _EMBEDDING_INIT, _LINEAR_INIT
from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

from lrmoe.integrations.torchtitan import backward_stats, convert_moe
from lrmoe.nn import clip_grad_norm_

# torchtitan's "partial_dtensor" SPMD backend: plain DTensors, what its EP dispatcher and FSDP2 run on over gloo.
SPMD_BACKEND = "partial_dtensor"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=4, help="sequences per rank")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--experts", type=int, default=8, help="divisible by --ep")
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--hidden-dim", type=int, default=64, help="each expert's hidden size F")
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--model", choices=("qwen3", "deepseek_v3"), default="qwen3",
                   help="qwen3: the configuration of the flags below; deepseek_v3: torchtitan's DeepSeek-V3 debug "
                        "model (MLA, a dense first layer, 8 experts, 2 shared; its own sizes, --vocab and --seq-len "
                        "still apply)")
    p.add_argument("--router", choices=("qwen3", "deepseek"), default="qwen3",
                   help="deepseek: DeepSeek-V3's router (sigmoid, 4 groups of which 2, scale 2.5), and a shared "
                        "expert in qwen3's blocks")
    p.add_argument("--retain", type=float, default=0.75)
    p.add_argument("--selection", choices=("sample", "top"), default="sample")
    p.add_argument("--dense", action="store_true", help="torchtitan's own experts, not converted (a baseline)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel degree (torchtitan's EP), divides the ranks")
    p.add_argument("--compile", action="store_true", help="torch.compile every block (torchtitan's apply_compile)")
    p.add_argument("--compile-backend", default="inductor")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    return p.parse_args(argv)


def model_config(*, dim: int, layers: int, experts: int, top_k: int, hidden_dim: int, vocab: int, seq_len: int,
                 router: str = "qwen3", ep: int = 1, model: str = "qwen3"):
    """A small Qwen3-MoE configuration in torchtitan's own config classes (its debug MoE model, shrunk), or
    torchtitan's DeepSeek-V3 debug configuration, with SDPA attention and torchtitan's sharding configuration for
    expert parallelism of degree ``ep``."""
    if model == "deepseek_v3":
        return _deepseek_v3_config(vocab=vocab, router=router, ep=ep)
    head_dim, n_heads = 16, max(1, dim // 16)
    cfg = Qwen3Model.Config(
        vocab_size=vocab, dim=dim, norm=_qwen3_norm(dim),
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=_EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_LINEAR_INIT),
        layers=_build_qwen3_moe_layers(
            n_layers=layers, dim=dim, n_heads=n_heads, n_kv_heads=max(1, n_heads // 2), head_dim=head_dim,
            moe_hidden_dim=hidden_dim, num_experts=experts, top_k=top_k, attn_backend="flex",
            moe_comm_backend="standard", rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=seq_len, theta=1e6)),
    )
    for layer in cfg.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()  # FlexAttention: no CPU backward
        if router == "deepseek":  # DeepSeek-V3's MoE: sigmoid scores, 4 groups of which 2, scaling, a shared expert
            r = layer.moe.router
            r.score_func, r.route_norm, r.route_scale = "sigmoid", True, 2.5
            r.num_expert_groups, r.num_limited_groups = 4, 2
            layer.moe.shared_experts = make_ffn_config(dim=dim, hidden_dim=hidden_dim, w1_param_init=_LINEAR_INIT,
                                                       w2w3_param_init=_LINEAR_INIT)
    set_qwen3_sharding_config(cfg, enable_sp=False, enable_ep=ep > 1)
    return cfg


def _deepseek_v3_config(*, vocab: int, router: str, ep: int):
    cfg = deepseekv3_configs["debugmodel"](attn_backend="flex", moe_comm_backend="standard")
    cfg.vocab_size = vocab
    cfg.tok_embeddings.num_embeddings = vocab
    cfg.lm_head.out_features = vocab
    for layer in cfg.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()  # FlexAttention: no CPU backward
        if router == "deepseek" and getattr(layer, "moe", None) is not None:  # the full model's routing
            r = layer.moe.router
            r.score_func, r.route_norm, r.route_scale = "sigmoid", True, 2.5
            r.num_expert_groups, r.num_limited_groups = 4, 2
    set_deepseek_v3_sharding_config(cfg, enable_sp=False, enable_ep=ep > 1)
    return cfg


def build_model(args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    """torchtitan's model from ``model_config``, initialised by torchtitan's own initialisers from ``args.seed``."""
    cfg = model_config(dim=args.dim, layers=args.layers, experts=args.experts, top_k=args.top_k,
                       hidden_dim=args.hidden_dim, vocab=args.vocab, seq_len=args.seq_len, router=args.router,
                       ep=args.ep, model=args.model)
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = cfg.build()
    model.init_states(buffer_device=device)
    return model


def parallel_dims(world_size: int, ep: int, device: torch.device) -> ParallelDims:
    """torchtitan's ParallelDims for FSDP2 over all ranks with expert parallelism of degree ``ep`` borrowed from
    them, its meshes built on ``device``'s type (torchtitan picks "cuda" where it finds no accelerator)."""
    titan_dist_utils.set_spmd_backend(SPMD_BACKEND)
    titan_parallel_dims.device_type = device.type
    dims = ParallelDims(dp_replicate=1, dp_shard=world_size, cp=1, tp=1, pp=1, ep=ep, world_size=world_size,
                        spmd_backend=SPMD_BACKEND)
    dims.build_mesh()
    return dims


def parallelize(model: Qwen3Model, dims: ParallelDims, *, compile_backend: str | None = None,
                param_dtype: torch.dtype = torch.float32) -> Qwen3Model:
    """torchtitan's parallelisation of its Qwen3 models (``parallelize_qwen3``), in its order: expert parallelism
    (``model.parallelize``), per-block compile, FSDP2 of every block (experts on the expert-data-parallel mesh).
    FSDP2 then sums gradients over ranks instead of averaging them (``disable_fsdp_gradient_division``, as
    torchtitan's trainer does; gloo has no pre-multiplied sum): ``train_step`` scales the loss to the mean over
    all ranks' tokens before backward."""
    if dims.ep_enabled:
        model.parallelize(dims)
    if compile_backend is not None:
        apply_compile(model, compile_config=CompileConfig(enable=True, backend=compile_backend), parallel_dims=dims)
    if dims.world_size > 1 or param_dtype != torch.float32:  # FSDP2 on one GPU too: torchtitan's mixed precision
        apply_fsdp_to_decoder(model, dims.get_mesh("fsdp"), param_dtype=param_dtype, reduce_dtype=torch.float32,
                              pp_enabled=False, ep_degree=dims.ep,
                              edp_mesh=dims.get_optional_mesh("efsdp") if dims.ep_enabled else None)
        disable_fsdp_gradient_division(model)
        if dist.get_backend() == "gloo":  # it has no PREMUL_SUM, which FSDP2 uses even for a factor of 1
            for module in model.modules():
                if isinstance(module, FSDPModule):
                    module.set_force_sum_reduction_for_comms(True)
    return model


def batch(vocab: int, batch_size: int, seq_len: int, step: int, rank: int, device: torch.device) -> torch.Tensor:
    """[batch_size, seq_len + 1] tokens of the synthetic language: t[i + 1] = perm[t[i]], a random token 10 % of
    the time. The permutation is fixed; each (step, rank) draws its own sequences."""
    perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(1234))
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    toks = torch.empty(batch_size, seq_len + 1, dtype=torch.long)
    toks[:, 0] = torch.randint(vocab, (batch_size,), generator=g)
    noise = torch.rand(batch_size, seq_len, generator=g) < 0.1
    rand = torch.randint(vocab, (batch_size, seq_len), generator=g)
    for i in range(seq_len):
        toks[:, i + 1] = torch.where(noise[:, i], rand[:, i], perm[toks[:, i]])
    return toks.to(device)


def loss_fn(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


def train_step(model: torch.nn.Module, tokens: torch.Tensor, world_size: int) -> torch.Tensor:
    """Forward and backward of this rank's tokens; returns its (unscaled) loss. Every rank holds as many tokens,
    so dividing by the world size makes the gradients those of the mean loss over all ranks: FSDP2 sums the
    replicated parameters' over ranks, and each expert shard already receives every rank's rows through the
    expert-parallel all-to-all."""
    loss = loss_fn(model, tokens)
    (loss / world_size).backward()
    return loss.detach()


def main(argv=None) -> list[float]:
    """Run the example with command-line ``argv``; returns the mean loss over ranks of every step."""
    args = parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if world_size > 1:
        dist.init_process_group(backend)
    else:  # one process: a group of one, as torchtitan's trainer makes, for its meshes and the expert-bias hook
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        return train(args, world_size, device)
    finally:
        dist.destroy_process_group()


def train(args: argparse.Namespace, world_size: int, device: torch.device) -> list[float]:
    """Build, convert, parallelise and train, inside the process group ``main`` set up."""
    rank = dist.get_rank()
    if world_size % args.ep or args.experts % args.ep:
        raise SystemExit(f"--ep {args.ep} must divide the ranks ({world_size}) and --experts ({args.experts})")

    model = build_model(args, device)
    pairs_per_token = sum(m.router.top_k for m in model.modules() if isinstance(m, MoE))  # over all MoE layers
    if not args.dense:
        converted = convert_moe(model, retain=args.retain, selection=args.selection)
        if rank == 0:
            print(f"converted {len(converted)} MoE layers' experts: retain {args.retain}, selection {args.selection}")
    dims = parallel_dims(world_size, args.ep, device)
    parallelize(model, dims, compile_backend=args.compile_backend if args.compile else None,
                param_dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    register_moe_load_balancing_hook(opt, [model], dims)  # expert-bias update before every optimiser step

    losses, step_ms = [], []
    for step in range(args.steps):
        tokens = batch(args.vocab, args.batch_size, args.seq_len, step, rank, device)
        t0 = time.perf_counter()
        loss = train_step(model, tokens, world_size)
        clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        mean = loss.clone()
        stats = backward_stats(model)
        kept = sum((s["retained_rows"] for s in stats.values()), torch.zeros((), device=device))
        if world_size > 1:
            dist.all_reduce(mean)
            mean /= world_size
            dist.all_reduce(kept)
        losses.append(mean.item())  # waits for the step: the time below is the whole step's
        step_ms.append((time.perf_counter() - t0) * 1e3)
        routed = world_size * args.batch_size * args.seq_len * pairs_per_token
        if rank == 0:
            print(f"step {step:3d}  loss {losses[-1]:.4f}  kept rows {kept.item() / routed if stats else 1.0:.3f}  "
                  f"{step_ms[-1]:.0f} ms", flush=True)
    if rank == 0:
        steady = sorted(step_ms[len(step_ms) // 2:])  # the second half: compilation and warm-up are over
        peak = ""
        if device.type == "cuda":
            peak = f", peak memory {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB"
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {args.steps} steps (log vocab = "
              f"{math.log(args.vocab):.4f}); median step {steady[len(steady) // 2]:.1f} ms over the last "
              f"{len(steady)}{peak}")
    return losses


if __name__ == "__main__":
    main()
