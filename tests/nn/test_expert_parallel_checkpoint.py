"""DCP checkpoints of an expert-parallel model (lrmoe/nn/expert_parallel.py) on gloo CPU process groups.

The contract: a parallelised MoELM (experts sharded by ``ExpertParallel``) plus its AdamW state, saved with
``torch.distributed.checkpoint`` after two steps and loaded into a *fresh* process group whose model was built
from a different seed, continues exactly as the run that saved it: the third step's loss and gradients are those
of the original run (model state), and the weights after the third update and the fourth step's loss are too
(optimiser state: AdamW's moments and step counts). Every rank writes and reads only its own expert shard.

Under the default selection "sample", eagerly and compiled, the resumed run matches the continued one bit for bit:
the sampling draws are a hash of each step's routing (lrmoe.functional.rng), so nothing beyond the model and
optimiser state is needed (the recipe of docs/expert_parallel.md saves no RNG state). The compiled case traces
every block with Dynamo and AOTAutograd (backend "aot_eager"): a draw taken from any RNG state inside the graphs
would differ after the resume. Inductor's code for the draws equals eager bit for bit
(tests/functional/test_rng.py); generating it for four processes here would cost a minute of CI.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from ep_harness import run_ranks
from lrmoe.demo.model import ModelConfig, MoELM, lrmoe_layers
from lrmoe.nn import ExpertParallel

CFG = ModelConfig(
    vocab_size=64, dim=16, n_layers=2, n_heads=2, max_seq_len=16, num_experts=4, top_k=2, expert_hidden_dim=16,
    retain=0.75, selection="top",  # "top" by default; the test runs "sample" (the default of LRMoE) too
)
BATCH, SEQ = 4, 12
EXPERT_PARAMS = ("experts.gate_up_proj", "experts.down_proj")


# -------------------------------------------------------------------------------------------- training step


def build(seed, world, selection="top", compiled=False):
    """The model of examples/train_ep.py: same seed on every rank, experts sharded over a 1-D EP mesh, AdamW;
    ``compiled``: every block compiled in place (torchtitan's per-block compile; aot_eager, see the module doc)."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    torch.manual_seed(seed)
    model = MoELM(dataclasses.replace(CFG, selection=selection))
    parallelize_module(model, mesh, {f"blocks.{i}.moe": ExpertParallel() for i in range(CFG.n_layers)})
    if compiled:
        compile_blocks(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    return model, optimizer


def compile_blocks(model):
    for block in model.blocks:
        block.compile(backend="aot_eager")


def batch(rank, step):
    """A fixed batch per (rank, step), the same in both process groups."""
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, CFG.vocab_size, (BATCH, SEQ + 1), generator=g)


def mean_loss(model, rank, world, step):
    """The mean loss over all ranks' tokens (local loss / W, all-reduced) and the local loss, before backward."""
    tokens = batch(rank, step)
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()) / world
    total = loss.detach().clone()
    dist.all_reduce(total)
    return loss, total


def train_step(model, optimizer, rank, world, step):
    """One step of examples/train_ep.py; returns the mean loss and the gradients (local shards for experts)."""
    loss, total = mean_loss(model, rank, world, step)
    loss.backward()
    for p in model.parameters():  # replicated parameters: sum the per-rank gradients (expert shards: complete)
        if p.grad is not None and not isinstance(p, DTensor):
            dist.all_reduce(p.grad)
    grads = {n: _local(p.grad).clone() for n, p in model.named_parameters()}
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total, grads


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def local_params(model):
    return {n: _local(p).detach().clone() for n, p in model.named_parameters()}


def assert_expert_shards(model, optimizer, rank, world):
    """Every expert parameter, and its AdamW moments, is a Shard(0) DTensor holding E / W experts on this rank."""
    n_local = CFG.num_experts // world
    for layer in lrmoe_layers(model):
        for name in ("gate_up_proj", "down_proj"):
            p = getattr(layer.experts, name)
            assert isinstance(p, DTensor) and p.placements[0].is_shard(0)
            assert p.shape[0] == CFG.num_experts and p.to_local().shape == (n_local, *p.shape[1:])
            state = optimizer.state[p]
            for key in ("exp_avg", "exp_avg_sq"):
                assert isinstance(state[key], DTensor), f"rank {rank}: {name} {key} is not a DTensor"
                assert state[key].to_local().shape == p.to_local().shape
    assert not isinstance(model.blocks[0].moe.gate.weight, DTensor)  # the router stays replicated


# ------------------------------------------------------------------------------------------------ the phases


def _save_phase(rank, world, ckpt, results, selection="top", compiled=False):
    model, optimizer = build(seed=0, world=world, selection=selection, compiled=compiled)
    for step in (1, 2):
        train_step(model, optimizer, rank, world, step)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=ckpt)
    # The saved model entries of the experts are this rank's shard only.
    for fqn in ("blocks.0.moe." + n for n in EXPERT_PARAMS):
        assert isinstance(model_sd[fqn], DTensor) and model_sd[fqn].to_local().shape[0] == CFG.num_experts // world
    assert_expert_shards(model, optimizer, rank, world)

    loss3, grads3 = train_step(model, optimizer, rank, world, 3)
    params3 = local_params(model)
    loss4, _ = train_step(model, optimizer, rank, world, 4)
    torch.save({"loss3": loss3, "grads3": grads3, "params3": params3, "loss4": loss4},
               os.path.join(results, f"rank{rank}.pt"))


def _load_phase(rank, world, ckpt, results, selection="top", compiled=False):
    want = torch.load(os.path.join(results, f"rank{rank}.pt"))
    # Another initialisation (and another global RNG state): only the checkpoint can make it match.
    model, optimizer = build(seed=1, world=world, selection=selection)
    with torch.no_grad():  # eager, before the blocks are compiled: a no-grad graph would be one more trace
        _, before = mean_loss(model, rank, world, 3)
    assert not torch.allclose(before, want["loss3"], rtol=1e-3, atol=0), "the fresh model already matches"
    if compiled:
        compile_blocks(model)
    assert not optimizer.state

    model_sd, optim_sd = get_state_dict(model, optimizer)  # initialises AdamW's state (lr 0 step), to load into
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=ckpt)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for fqn in ("blocks.1.moe." + n for n in EXPERT_PARAMS):
        loaded = state["model"][fqn]
        assert isinstance(loaded, DTensor) and loaded.to_local().shape[0] == CFG.num_experts // world
    assert_expert_shards(model, optimizer, rank, world)
    steps = {float(s["step"]) for s in optimizer.state.values()}
    assert steps == {2.0}, f"rank {rank}: AdamW step counts {steps}"

    # "top" within rounding; "sample" bit for bit (its draws as well as its arithmetic are the continued run's).
    exact = selection == "sample"
    tol = dict(rtol=0 if exact else 1e-6, atol=0 if exact else 1e-7, msg=lambda m: f"rank {rank}: {m}")
    loss3, grads3 = train_step(model, optimizer, rank, world, 3)
    torch.testing.assert_close(loss3, want["loss3"], **tol)  # the model state
    assert grads3.keys() == want["grads3"].keys()
    for name, g in grads3.items():  # router: all-reduced, plain; experts: this rank's shard
        torch.testing.assert_close(g, want["grads3"][name], **tol)
    for name, p in local_params(model).items():  # the optimiser state: the third update is the same
        torch.testing.assert_close(p, want["params3"][name], **tol)
    loss4, _ = train_step(model, optimizer, rank, world, 4)
    torch.testing.assert_close(loss4, want["loss4"], **tol)


# "sample" (the default) needs its draws to resume too, so it covers what "top" would; eager and per-block compiled.
@pytest.mark.parametrize("selection, compiled", [("sample", False), ("sample", True)])
def test_dcp_checkpoint_resumes_in_a_fresh_process_group(tmp_path, selection, compiled):
    ckpt, results = tmp_path / "ckpt", tmp_path / "results"
    results.mkdir()
    run_ranks(2, _save_phase, str(ckpt), str(results), selection, compiled)
    # Each rank wrote its own file (its expert shards); the metadata names every fqn once.
    assert (ckpt / ".metadata").is_file() and len(list(ckpt.glob("*.distcp"))) == 2
    run_ranks(2, _load_phase, str(ckpt), str(results), selection, compiled)
