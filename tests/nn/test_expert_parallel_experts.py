"""ExpertParallel applied to an experts module on its own (``parallelize_module(experts, mesh, ExpertParallel())``),
as torchtitan places expert parallelism: the experts module of a model whose router is not LRMoE's (a transformers
model after swap_experts), called as transformers calls it, experts(x_TD, expert_ids_TK, gates_TK). 2 gloo ranks.

Checked against: the expert-parallel LRMoE layer, which runs the same steps after its own routing (outputs,
gradients and statistics equal, retain 0.5 and 0.75 with a replica and a binding capacity); a whole transformers
Qwen3-MoE causal LM with its experts swapped and sharded, against the unswapped model on each rank's tokens (logits,
loss, the router's and every gradient; expert shards against the sum over ranks of the full gradients' slices) and
GLM-4.5's block; the same module compiled with fullgraph=True; FSDP2 over it; and the refusals.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from ep_harness import run_ranks
from layer_step import forward_backward
from lrmoe.functional import route_topk, router_logits
from lrmoe.nn import ExpertParallel, LRMoE, SwiGLUExperts

D, FF, E, K = 8, 6, 8, 2


class RoutedBlock(nn.Module):
    """A model's own MoE block: its router (as LRMoE's, softmax top-k renormalised) and an experts module it calls
    with the routed experts and gates."""

    def __init__(self, layer: LRMoE, **options):
        super().__init__()
        self.gate = copy.deepcopy(layer.gate)
        self.experts = SwiGLUExperts(E, D, FF, **options)
        self.experts.load_state_dict(layer.experts.state_dict())

    def forward(self, x):
        routing = route_topk(router_logits(x, self.gate.weight, None), K)
        return self.experts(x, routing.expert_ids, routing.gates)


def _equals_the_layer(rank, world, device="cpu"):
    # device "cuda": rank r on GPU r (tests/nn/test_cuda_ep.py, NCCL), fp32 as here.
    mesh = init_device_mesh(device, (world,))
    for options, style in (({"retain": 0.5}, {}),
                           ({"retain": 0.75, "selection": "top"}, {"max_replicas": 1, "capacity_factor": 1.0})):
        torch.manual_seed(0)
        ref = LRMoE(D, FF, E, K, **options).to(device)
        with torch.no_grad():
            ref.gate.weight[:2] += 1.5  # experts 0 and 1 (rank 0's) hot: a replica is placed, the capacity binds
        block = RoutedBlock(ref, **options).to(device)
        block.experts = parallelize_module(block.experts, mesh, ExpertParallel(**style))
        layer = parallelize_module(ref, mesh, ExpertParallel(**style))
        for module in (block.experts, layer):  # what to_empty may leave after a build on meta: overwritten each step
            for name in ("dispatch_bytes", "combine_bytes", "replica_bytes", "replica_grad_bytes"):
                getattr(module._dispatcher, name).fill_(7)
        torch.manual_seed(10 + rank)
        x, c = torch.randn(12 + 3 * rank, D).to(device) + 0.5, torch.randn(12 + 3 * rank, D).to(device)
        torch.manual_seed(5)  # the sampling uniforms: the same draw for both
        got = forward_backward(block, x, c)
        torch.manual_seed(5)
        want = forward_backward(layer, x, c)
        for name, g, w in zip(["output", "x grad", "router grad", "gate_up_proj grad", "down_proj grad"], got, want,
                              strict=True):
            assert torch.equal(g, w), f"rank {rank} {options} {name}"
        s_got, s_want = block.experts.stats(), layer.stats()
        for field in ("loads", "quotas", "instances", "instance_quotas", "capacity", "dispatch_bytes",
                      "combine_bytes", "replica_bytes", "backward_dispatch_bytes", "local_retained_pairs",
                      "backward_calls", "score_mass_fraction"):
            assert torch.equal(getattr(s_got, field), getattr(s_want, field)), (rank, options, field)
        assert int(s_got.total_pairs) == K * sum(12 + 3 * r for r in range(world))
        assert 0 < int(s_got.retained_pairs) < int(s_got.total_pairs)
        if style:
            assert (s_got.instances[:, E // world:] >= 0).any()  # a replica was placed
        assert torch.equal(block.experts.last_loads, s_got.loads.sum(0))
        if not style:
            assert int(s_got.replica_bytes) == int(s_got.replica_grad_bytes) == 0

        # Under autocast (bf16) both compute and send in bf16: the same values and bytes (the experts used x's
        # fp32 and sent twice the layer's bytes, a review found).
        with torch.autocast(device, dtype=torch.bfloat16):
            torch.manual_seed(5)
            got = forward_backward(block, x, c)
            torch.manual_seed(5)
            want = forward_backward(layer, x, c)
        assert got[0].dtype == torch.bfloat16
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w), (rank, options, "autocast")
        assert int(block.experts.stats().dispatch_bytes) == int(layer.stats().dispatch_bytes)


def _swapped_causal_lm(rank, world):
    transformers = pytest.importorskip("transformers")
    from lrmoe.nn import swap_experts

    config = transformers.Qwen3MoeConfig(
        # 16 and 12 wide: transformers' grouped_mm needs rows of a multiple of 16 bytes.
        hidden_size=16, intermediate_size=16, moe_intermediate_size=12, num_experts=E, num_experts_per_tok=K,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, head_dim=8, vocab_size=32,
    )
    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(config).float()
    ours = copy.deepcopy(hf)
    assert swap_experts(ours) == [f"model.layers.{i}.mlp.experts" for i in range(2)]
    mesh = init_device_mesh("cpu", (world,))
    parallelize_module(ours, mesh, {"model.layers.*.mlp.experts": ExpertParallel()})
    assert isinstance(ours.model.layers[1].mlp.experts.down_proj, DTensor)
    ids = torch.randint(0, 32, (2, 5 + rank), generator=torch.Generator().manual_seed(rank))
    results = []
    for model in (ours, hf):
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        results.append((out.logits.detach(), out.loss.detach(), dict(model.named_parameters())))
    (logits, loss, params), (ref_logits, ref_loss, ref_params) = results
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    n_local = E // world
    for name, p in ref_params.items():
        got, want = params[name].grad, p.grad
        if isinstance(got, DTensor):  # this rank's experts: the gradient of every rank's tokens routed to them
            want = want.clone()
            torch.distributed.all_reduce(want)
            got, want = got.to_local(), want[rank * n_local:(rank + 1) * n_local]
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"rank {rank} {n}: {m}")

    # GLM-4.5's block (fp32 sigmoid router with its selection bias, groups, scaled gates, a shared expert), with
    # its experts swapped and sharded: each rank's output and input gradient are the block's.
    from test_swap_experts import T as T_BLOCK
    from test_swap_experts import _block, _run

    hf_block = _block("glm4_moe")
    block = copy.deepcopy(hf_block)
    swap_experts(block, retain=1.0)
    parallelize_module(block, mesh, {"experts": ExpertParallel()})
    torch.manual_seed(10 + rank)
    x, c = torch.randn(2, T_BLOCK // 2, 16), torch.randn(2, T_BLOCK // 2, 16)
    (out, gx, _), (ref, rx, _) = _run(block, x, c), _run(hf_block, x, c)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gx, rx, rtol=1e-5, atol=1e-6)


def _compiled_and_refused(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    ref = LRMoE(D, FF, E, K)
    block = RoutedBlock(ref, retain=0.5, selection="top")
    block.experts = parallelize_module(block.experts, mesh, ExpertParallel())  # replicas compile: the layer's tests
    assert type(block.experts) is SwiGLUExperts and block.experts._dispatcher is not None  # no class swap
    with torch._dynamo.config.patch(capture_scalar_outputs=True, error_on_recompile=True):
        # Dynamo and AOTAutograd trace it whole (what this checks); Inductor's code for an expert-parallel layer
        # is tests/nn/test_expert_parallel_compile.py's.
        compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
        for step in range(2):  # other loads in step 2: the unbacked split sizes serve it without recompiling
            torch.manual_seed(100 * step + rank)
            x, c = torch.randn(10 + 3 * rank, D), torch.randn(10 + 3 * rank, D)
            got = forward_backward(compiled, x, c)
            want = forward_backward(block, x, c)
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)

    # Refused: options per call (an LRMoE's experts made expert-parallel instead of the layer), twice, a layer's
    # single-device capacity, an indivisible E, and other modules.
    layer = LRMoE(D, FF, E, K)
    parallelize_module(layer, mesh, {"experts": ExpertParallel()})
    with pytest.raises(TypeError, match="takes no per-call options.*apply ExpertParallel to the layer"):
        layer(torch.randn(4, D))
    with pytest.raises(ValueError, match="already expert-parallel"):
        parallelize_module(block.experts, mesh, ExpertParallel())
    options = block.experts.backward
    # set after parallelize_module, which refused it: still refused
    block.experts.backward = dataclasses.replace(options, retain=0.5, backward_capacity=1.0)
    with pytest.raises(ValueError, match="backward_capacity=1.0 is the single-device"):
        block(torch.randn(4, D))
    block.experts.backward = options
    with pytest.raises(ValueError, match="backward_capacity=1.0 is the single-device"):
        parallelize_module(SwiGLUExperts(E, D, FF, retain=0.5, backward_capacity=1.0), mesh, ExpertParallel())
    with pytest.raises(ValueError, match="num_experts=3 is not divisible"):
        parallelize_module(SwiGLUExperts(3, D, FF), mesh, ExpertParallel())
    with pytest.raises(TypeError, match="to lrmoe.nn.LRMoE layers and to lrmoe.nn.SwiGLUExperts modules .*got Linear"):
        parallelize_module(nn.Linear(2, 2), mesh, ExpertParallel())
    with pytest.raises(ValueError, match=r"x_TD must be \[T, dim=8\]"):
        block.experts(torch.randn(4, D + 1), torch.zeros(4, K, dtype=torch.long), torch.ones(4, K))
    with pytest.raises(TypeError, match="gates_TK must be a floating-point tensor"):
        block.experts(torch.randn(4, D), torch.zeros(4, K, dtype=torch.long), torch.ones(4, K, dtype=torch.long))


def _fsdp2_over_the_experts(rank, world):
    """torchtitan's layout for a model's own experts module: ExpertParallel on the ep dimension, then FSDP2 on dp
    (here (dp, ep) = (2, 1)): each rank holds half its shard until experts(...) gathers it; the output is the
    unsharded module's and the expert gradients the mean over dp of the ranks' gradients."""
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "ep"))
    torch.manual_seed(0)
    ref = LRMoE(D, FF, E, K)
    plain = RoutedBlock(ref, retain=0.5, selection="top")
    block = copy.deepcopy(plain)
    block.experts = parallelize_module(block.experts, mesh, ExpertParallel(mesh_dim_name="ep"))
    fully_shard(block.experts, mesh=mesh["dp"])
    assert block.experts.gate_up_proj.to_local().shape[0] == E // world
    torch.manual_seed(10 + rank)
    x, c = torch.randn(12, D), torch.randn(12, D)
    got, want = forward_backward(block, x, c), forward_backward(plain, x, c)
    for name, g, w in zip(["output", "x grad", "router grad"], got, want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7, msg=lambda m, name=name: f"{name}: {m}")
    assert block.experts.gate_up_proj.to_local().shape[0] == E // world, "the gathered experts were not freed"
    for name in ("gate_up_proj", "down_proj"):
        summed = getattr(plain.experts, name).grad.clone()
        torch.distributed.all_reduce(summed)
        got = getattr(block.experts, name).grad.full_tensor()
        torch.testing.assert_close(got, summed / world, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def test_experts_alone_compute_what_the_expert_parallel_layer_computes():
    run_ranks(2, _equals_the_layer)


def test_a_swapped_transformers_model_with_its_experts_sharded_trains_like_transformers():
    pytest.importorskip("transformers")
    run_ranks(2, _swapped_causal_lm)


def test_expert_parallel_experts_compile_fullgraph_and_refuse_what_they_cannot_run():
    run_ranks(2, _compiled_and_refused)


def test_fsdp2_over_expert_parallel_experts_gathers_them():
    run_ranks(2, _fsdp2_over_the_experts)
