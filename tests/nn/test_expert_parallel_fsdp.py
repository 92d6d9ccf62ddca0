"""FSDP2 over an LRMoE layer's experts in a unit of their own, torchtitan's layout: beside expert parallelism on a
(dp, ep) = (2, 2) mesh of 4 gloo ranks, and over plain data parallelism on 2.

Both layers run their experts through ``layer.experts(...)``, so FSDP's hooks on that module gather the weights
before it, free them after, and reduce-scatter their gradients in backward, with no help from the user. Before
that, the layers read the weights directly and saw half a rank's experts (an IndexError on CPU, garbage on CUDA).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import parallelize_module

from ep_harness import run_ranks
from lrmoe.nn import ExpertParallel, LRMoE

D, FF, E, K, T = 8, 6, 4, 2, 6


def _expert_grads_match(layer, summed_grads, n_dp, msg):
    # FSDP averages over dp (its default divide factor, the dp size): the mean of the dp groups' sums.
    for name, summed in summed_grads.items():
        got = getattr(layer.experts, name).grad.full_tensor()
        torch.testing.assert_close(got, summed / n_dp, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, name=name: f"{msg} {name}: {m}")


def _fsdp_beside_ep(rank, world, retain, max_replicas, device="cpu", n_dp=2):
    mesh = init_device_mesh(device, (n_dp, world // n_dp), mesh_dim_names=("dp", "ep"))
    torch.manual_seed(0)
    ref = LRMoE(D, FF, E, K, retain=retain, selection="top").to(device)
    u = torch.nn.functional.normalize(torch.randn(D, device=device), dim=0)
    if max_replicas:  # most tokens to experts 0 and 1, both on EP rank 0, so the hot-expert policy replicates them
        with torch.no_grad():
            ref.gate.weight[:2] += 4 * u
    style = ExpertParallel(mesh_dim_name="ep", max_replicas=max_replicas)
    plain = parallelize_module(copy.deepcopy(ref), mesh, style)
    layer = parallelize_module(copy.deepcopy(ref), mesh, style)
    fully_shard(layer.experts, mesh=mesh["dp"])
    fully_shard(layer, mesh=mesh["dp", "ep"]._flatten("dp_ep"))
    # Each rank holds 1/dp of its EP shard until experts(...) gathers it.
    n_held = E // mesh["ep"].size() // n_dp
    assert layer.experts.gate_up_proj.to_local().shape[0] == n_held
    torch.manual_seed(10 + rank)
    x, c = torch.randn(T, D, device=device) + 2 * u * max_replicas, torch.randn(T, D, device=device)

    for step in range(2):  # the second step after the weights were freed and gathered again
        out, want = layer(x), plain(x)
        torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-7, msg=lambda m: f"step {step} output: {m}")
        assert layer.experts.gate_up_proj.to_local().shape[0] == n_held, "the gathered experts were not freed"
        (out * c).sum().backward()
        (want * c).sum().backward()
        summed = {}
        for name in ("gate_up_proj", "down_proj"):
            summed[name] = getattr(plain.experts, name).grad.full_tensor()
            dist.all_reduce(summed[name], group=mesh["dp"].get_group())
        _expert_grads_match(layer, summed, n_dp, f"step {step}")
        if max_replicas:  # the replica path ran only if the plan placed some
            assert plain.stats().instances.ge(0).sum() > E
        layer.zero_grad()
        plain.zero_grad()
        x = x.flip(0) * 1.5


def _fsdp_beside_ep_cases(rank, world):
    for retain, max_replicas in ((1.0, 0), (0.5, 0), (0.5, 1)):  # one spawn of 4 ranks for all three
        _fsdp_beside_ep(rank, world, retain, max_replicas)


def test_fsdp2_on_the_experts_beside_expert_parallelism_gathers_them():
    """retain 1 and 0.5, and 0.5 with a replica of a hot expert."""
    run_ranks(4, _fsdp_beside_ep_cases)


def _fsdp_single_device_layer(rank, world, device="cpu"):
    mesh = init_device_mesh(device, (world,))
    torch.manual_seed(0)
    plain = LRMoE(D, FF, E, K, retain=0.5, selection="top").to(device)
    layer = copy.deepcopy(plain)
    fully_shard(layer.experts, mesh=mesh)
    fully_shard(layer, mesh=mesh)
    torch.manual_seed(10 + rank)
    x, c = torch.randn(T, D, device=device), torch.randn(T, D, device=device)
    out, want = layer(x), plain(x)
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-7)
    (out * c).sum().backward()
    (want * c).sum().backward()
    summed = {}
    for name in ("gate_up_proj", "down_proj"):
        summed[name] = getattr(plain.experts, name).grad.clone()
        dist.all_reduce(summed[name])
    _expert_grads_match(layer, summed, world, "plain data parallelism")

    # Mixed precision: the sharded weights stay fp32 while experts(...) computes in bf16; the layer's dtype check
    # must not refuse the bf16 input for them.
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    mixed = copy.deepcopy(plain)
    fully_shard(mixed.experts, mesh=mesh, mp_policy=bf16)
    fully_shard(mixed, mesh=mesh, mp_policy=bf16)
    torch.testing.assert_close(mixed(x), copy.deepcopy(plain).bfloat16()(x.bfloat16()), rtol=0, atol=0)

    # Weights sharded some other way reach experts(...) as DTensors: a clear error, not the ops' own.
    other = copy.deepcopy(plain)
    for name in ("gate_up_proj", "down_proj"):
        weight = distribute_tensor(getattr(other.experts, name).detach(), mesh, [Shard(0)])
        other.experts.register_parameter(name, torch.nn.Parameter(weight))
    with pytest.raises(RuntimeError, match="the experts' weights are DTensors: they are sharded"):
        other(x)


def test_fsdp2_on_the_experts_of_a_single_device_layer_gathers_them():
    run_ranks(2, _fsdp_single_device_layer)


# --------------------------------------------------- checkpoints and clipping in the (dp, ep) = (2, 2) layout


class _Net(torch.nn.Module):
    """A layer between two dense ones; the head's 3 rows leave one of the 4 dp * ep shards empty."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(D, D)
        self.moe = LRMoE(D, FF, E, K, retain=0.5, selection="top")  # "top" draws nothing: a step is deterministic
        self.head = torch.nn.Linear(D, 3)

    def forward(self, x):
        h = self.inp(x)
        return self.head(h + self.moe(h))


def _titan_layout(seed):
    """torchtitan's layout on (2, 2): experts over dp with the divide factor dp * ep (the mean loss over all ranks),
    the rest over the flattened mesh; Adam."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    torch.manual_seed(seed)
    net = _Net()
    parallelize_module(net.moe, mesh, ExpertParallel(mesh_dim_name="ep"))
    fully_shard(net.moe.experts, mesh=mesh["dp"])
    net.moe.experts.set_gradient_divide_factor(float(mesh.size()))
    net.moe.experts.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM (dp > 1 here)
    fully_shard(net, mesh=mesh["dp", "ep"]._flatten("dp_ep"))
    return net, torch.optim.Adam(net.parameters(), lr=1e-2, foreach=False)


def _step(net, opt, rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    x, y = torch.randn(T, D, generator=g), torch.randn(T, 3, generator=g)
    loss = torch.nn.functional.mse_loss(net(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def _full_state(net, opt):
    params = {n: p.full_tensor() for n, p in net.named_parameters()}
    moments = {f"{n}.{k}": v.full_tensor() for n, p in net.named_parameters() for k, v in opt.state[p].items()
               if isinstance(v, DTensor)}
    return params | moments


def _checkpoint_round_trip(rank, world, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    net, opt = _titan_layout(0)
    _step(net, opt, rank, 1)
    model_sd, optim_sd = get_state_dict(net, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    saved = _full_state(net, opt)

    fresh, fresh_opt = _titan_layout(1)  # other weights, no optimiser state yet
    model_sd, optim_sd = get_state_dict(fresh, fresh_opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    loaded = _full_state(fresh, fresh_opt)
    assert loaded.keys() == saved.keys() and any(".exp_avg_sq" in k for k in loaded)
    for name, value in saved.items():
        torch.testing.assert_close(loaded[name], value, rtol=0, atol=0, msg=lambda m, name=name: f"{name}: {m}")
    # The next step from the checkpoint is the uninterrupted run's, bit for bit.
    torch.testing.assert_close(_step(fresh, fresh_opt, rank, 2), _step(net, opt, rank, 2), rtol=0, atol=0)
    after, want = _full_state(fresh, fresh_opt), _full_state(net, opt)
    for name, value in want.items():
        torch.testing.assert_close(after[name], value, rtol=0, atol=0, msg=lambda m, name=name: f"step 2 {name}: {m}")


def test_dcp_round_trip_under_fsdp2_beside_expert_parallelism(tmp_path):
    run_ranks(4, _checkpoint_round_trip, str(tmp_path / "checkpoint"))


def _clip_across_meshes(rank, world):
    from lrmoe.nn import clip_grad_norm_

    net, _ = _titan_layout(0)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(T, D, generator=g), torch.randn(T, 3, generator=g)
    torch.nn.functional.mse_loss(net(x), y).backward()
    meshes = {p.grad.device_mesh for p in net.parameters()}
    assert len(meshes) == 2 and (net.head.weight.to_local().numel() == 0) == (rank == 3)  # an empty shard
    grads = {n: p.grad.clone() for n, p in net.named_parameters()}
    before = {n: grad.full_tensor() for n, grad in grads.items()}
    for norm_type in (2.0, float("inf")):
        for n, p in net.named_parameters():
            p.grad = grads[n].clone()
        want = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g, norm_type) for g in before.values()]), norm_type)
        max_norm = float(want) / 4  # clips
        total = clip_grad_norm_(net.parameters(), max_norm, norm_type)
        torch.testing.assert_close(total, want, rtol=1e-6, atol=0, msg=lambda m, t=norm_type: f"norm {t}: {m}")
        coef = max_norm / (float(want) + 1e-6)
        for n, p in net.named_parameters():
            torch.testing.assert_close(p.grad.full_tensor(), before[n] * coef, rtol=1e-6, atol=1e-9,
                                       msg=lambda m, n=n, t=norm_type: f"norm {t} {n}: {m}")


def test_clip_grad_norm_over_the_two_meshes_of_fsdp2_beside_expert_parallelism():
    """Norms 2 and inf."""
    run_ranks(4, _clip_across_meshes)


# ------------------------------------------------------------------------------------------- torch.compile


def _two_layers_with_fsdp_experts(world, expert_parallel, max_replicas=0):
    """Two copies of one layer (retain 0.5, "top"), each with its experts an FSDP unit: over the ranks (plain data
    parallelism), or expert-parallel on (dp, ep) = (1, W), the experts an FSDP unit over the one-rank dp."""
    torch.manual_seed(0)
    ref = LRMoE(D, FF, E, K, retain=0.5, selection="top")
    layers = [copy.deepcopy(ref), copy.deepcopy(ref)]
    for layer in layers:
        if expert_parallel:
            mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "ep"))
            parallelize_module(layer, mesh, ExpertParallel(mesh_dim_name="ep", max_replicas=max_replicas))
            fully_shard(layer.experts, mesh=mesh["dp"])
            fully_shard(layer, mesh=mesh["dp", "ep"]._flatten("dp_ep"))
        else:
            mesh = init_device_mesh("cpu", (world,))
            fully_shard(layer.experts, mesh=mesh)
            fully_shard(layer, mesh=mesh)
    return layers


def _compiled_with_fsdp_experts(rank, world, expert_parallel):
    # FSDP's hooks on layer.experts are skipped by dynamo (torch._dynamo.config.skip_fsdp_hooks): one graph break
    # around the experts call, so fullgraph=False; the compiled layer must still equal the eager one. Traced by
    # Dynamo and AOTAutograd (aot_eager): the graphs around FSDP's hooks are what this checks; Inductor's code for
    # the layer is tests/nn/test_compile.py's and test_expert_parallel_compile.py's.
    torch._dynamo.config.capture_scalar_outputs = True
    layers = _two_layers_with_fsdp_experts(world, expert_parallel)
    eager, compiled = layers[0], torch.compile(layers[1], backend="aot_eager")
    torch.manual_seed(10 + rank)
    for step in range(2):
        x, c = torch.randn(T, D), torch.randn(T, D)
        out, want = compiled(x), eager(x)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"step {step} output: {m}")
        (out * c).sum().backward()
        (want * c).sum().backward()
        for (name, got), wanted in zip(layers[1].named_parameters(), layers[0].parameters()):
            torch.testing.assert_close(got.grad.full_tensor(), wanted.grad.full_tensor(), rtol=1e-5, atol=1e-6,
                                       msg=lambda m, name=name: f"step {step} {name}: {m}")
        for layer in layers:
            layer.zero_grad()
    # Compiled, around the break (3 graphs here with torch 2.13, 4 with expert parallelism), not run eagerly.
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 2, dict(torch._dynamo.utils.counters["stats"])


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["data-parallel", "expert-parallel"])
def test_compiled_layer_with_fsdp2_on_its_experts_equals_eager(expert_parallel):
    run_ranks(2, _compiled_with_fsdp_experts, expert_parallel)


# ------------------------------------------------------------------------------------ activation checkpointing


def _checkpointed_with_fsdp_experts(rank, world, expert_parallel):
    # torchtitan's activation checkpointing around the layer: the recompute in backward calls experts(...) again,
    # so FSDP gathers the weights a third time; outputs and every gradient must be those of the plain run.
    from torch.utils.checkpoint import checkpoint

    layers = _two_layers_with_fsdp_experts(world, expert_parallel, max_replicas=1)
    torch.manual_seed(10 + rank)
    x, c = torch.randn(T, D), torch.randn(T, D)
    results = []
    for checkpointed, layer in enumerate(layers):
        xi = x.clone().requires_grad_(True)
        out = checkpoint(layer, xi, use_reentrant=False) if checkpointed else layer(xi)
        (out * c).sum().backward()
        results.append([out.detach(), xi.grad] + [p.grad.full_tensor() for p in layer.parameters()])
    for got, want in zip(*results[::-1], strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["data-parallel", "expert-parallel"])
def test_activation_checkpointing_with_fsdp2_on_the_experts_is_exact(expert_parallel):
    run_ranks(2, _checkpointed_with_fsdp_experts, expert_parallel)
