"""lrmoe.nn.swap_experts: LRMoE's experts inside transformers' own MoE blocks (Qwen3-MoE, GLM-4.5, DeepSeek-V3) and
a whole Qwen3-MoE causal LM, against the unswapped model with the same weights."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from lrmoe.nn import SwiGLUExperts, swap_experts

transformers = pytest.importorskip("transformers")

T, D, FF, E, K = 24, 16, 12, 8, 2


def _block(name: str, **overrides):
    common = dict(hidden_size=D, moe_intermediate_size=FF, num_experts_per_tok=K, norm_topk_prob=True,
                  hidden_act="silu", num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, vocab_size=32)
    if name == "qwen3_moe":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
        block = Qwen3MoeSparseMoeBlock(transformers.Qwen3MoeConfig(num_experts=E, **common | overrides))
    else:
        common |= dict(n_routed_experts=E, n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5)
        if name == "glm4_moe":
            from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeMoE
            block = Glm4MoeMoE(transformers.Glm4MoeConfig(**common | overrides))
        else:
            from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
            block = DeepseekV3MoE(transformers.DeepseekV3Config(**common | overrides))
    torch.manual_seed(0)
    block = block.float()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
        if hasattr(block.gate, "e_score_correction_bias"):
            block.gate.e_score_correction_bias.normal_(0, 0.3)
    return block


def _assert_same_run(got, want, prefix="", grad_atol=5e-6):
    """got, want: _run's (output, x's gradient, parameter gradients); got's parameter names may carry a prefix
    (a compiled module's "_orig_mod."). fp32, weights of scale 0.3: the gradients are sums of terms of order 10,
    and at retain 1 lrmoe scales the rows by their gates after the down projection's input-gradient GEMM where
    autograd scales before it (the same value rounded in another order), so they agree to a few ulps of the terms,
    not of the sums. tests/functional/test_seams.py compares the two orders in fp64 to 1e-12."""
    (out, gx, gp), (ref, rx, rp) = got, want
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    # x's gradient takes the router's path, whose gradient lrmoe sums as <g W_down^T, phi> at retain 1 where
    # transformers sums <g, phi W_down>: the same value, reduced in another order (fp32: a few ulps of the terms).
    torch.testing.assert_close(gx, rx, rtol=1e-5, atol=2e-6)
    for n in rp:
        torch.testing.assert_close(gp[prefix + n], rp[n], rtol=1e-5, atol=grad_atol, msg=lambda m, n=n: f"{n}: {m}")


def _run(block, x, c):
    for p in block.parameters():
        p.grad = None
    x = x.clone().requires_grad_(True)
    out = block(x)
    (out * c).sum().backward()
    return out.detach(), x.grad, {n: p.grad for n, p in block.named_parameters()}


@pytest.mark.parametrize("name", ["qwen3_moe", "glm4_moe", "deepseek_v3"])
def test_swapped_block_equals_transformers_at_retain_1(name):
    hf = _block(name)
    ours = copy.deepcopy(hf)
    before = {n: p for n, p in ours.named_parameters()}
    assert swap_experts(ours) == ["experts"]
    assert isinstance(ours.experts, SwiGLUExperts) and not isinstance(hf.experts, SwiGLUExperts)
    # The same Parameter objects under the same names: a loaded checkpoint and an optimiser stay valid.
    assert all(before[n] is p for n, p in ours.named_parameters()) and before.keys() == dict(
        ours.named_parameters()).keys()
    x, c = torch.randn(2, T // 2, D), torch.randn(2, T // 2, D)
    _assert_same_run(_run(ours, x, c), _run(hf, x, c))


@pytest.mark.parametrize("name", ["qwen3_moe", "glm4_moe"])
def test_swapped_block_below_retain_1_keeps_the_router_gradient_exact(name):
    """The selective backward changes the expert-path gradients only: the forward and the router's gradient
    <g_t, y_u> stay exact, the experts' weight gradients do not."""
    hf = _block(name)
    ours = copy.deepcopy(hf)
    swap_experts(ours, retain=0.5, selection="top")
    x, c = torch.randn(2, T // 2, D), torch.randn(2, T // 2, D)
    out, _, gp = _run(ours, x, c)
    ref, _, rp = _run(hf, x, c)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gp["gate.weight"], rp["gate.weight"], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(gp["experts.down_proj"], rp["experts.down_proj"], rtol=1e-3, atol=1e-4)


def test_swapped_qwen3_causal_lm_trains_like_transformers():
    """A whole model: logits, the router's auxiliary loss (output_router_logits still sees transformers' router)
    and every gradient, at retain 1; its experts' repr shows the options."""
    config = transformers.Qwen3MoeConfig(
        hidden_size=D, intermediate_size=32, moe_intermediate_size=FF, num_experts=E, num_experts_per_tok=K,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, head_dim=8, vocab_size=32,
        output_router_logits=True, router_aux_loss_coef=0.01,
    )
    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(config).float()
    ours = copy.deepcopy(hf)
    assert swap_experts(ours, selection="top") == [f"model.layers.{i}.mlp.experts" for i in range(2)]
    assert "selection='top'" in repr(ours.model.layers[0].mlp.experts)
    ids = torch.randint(0, 32, (2, 10), generator=torch.Generator().manual_seed(1))
    results = []
    for model in (ours, hf):
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        results.append((out.logits.detach(), out.aux_loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (logits, aux, grads), (ref_logits, ref_aux, ref_grads) = results
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    assert ref_aux > 0
    torch.testing.assert_close(aux, ref_aux, rtol=1e-6, atol=0)
    for n, g in ref_grads.items():
        torch.testing.assert_close(grads[n], g, rtol=1e-4, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")


def test_swap_refuses_what_it_cannot_swap():
    with pytest.raises(ValueError, match=r"cannot swap experts \(Qwen3MoeExperts\): its activation is .*SiLU"):
        swap_experts(_block("qwen3_moe", hidden_act="gelu"))
    with pytest.raises(ValueError, match="holds no experts module"):
        swap_experts(torch.nn.Linear(4, 4))
    block = _block("qwen3_moe")
    with pytest.raises(TypeError, match=r"unknown expert options \['retian'\]"):
        swap_experts(block, retian=0.5)
    with pytest.raises(ValueError, match="retain must be in"):
        swap_experts(block, retain=1.5)
    with pytest.raises(ValueError, match="selection must be one of"):
        swap_experts(block, selection="best")
    assert not isinstance(block.experts, SwiGLUExperts)  # nothing changed by a refused call
    with pytest.raises(ValueError, match="model is itself an experts module"):
        swap_experts(block.experts)
    swap_experts(block)
    with pytest.raises(ValueError, match="SwiGLUExperts already"):
        swap_experts(block)


def test_swap_refuses_experts_that_compute_something_else():
    """Fused SiLU experts whose maths differs (a clamp in their gate function, a norm after them) would lose it."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    class Clamped(Qwen3MoeExperts):
        def _apply_gate(self, gate_up):
            gate, up = gate_up.chunk(2, dim=-1)
            return self.act_fn(gate.clamp(max=0.5)) * up

    block = _block("qwen3_moe")
    block.experts.__class__ = Clamped
    with pytest.raises(ValueError, match="_apply_gate overridden"):
        swap_experts(block)
    block = _block("qwen3_moe")
    block.experts.post_norm = torch.nn.LayerNorm(D)
    with pytest.raises(ValueError, match=r"holds parameters \['down_proj', 'gate_up_proj', 'post_norm.bias'"):
        swap_experts(block)
    del block.experts.post_norm
    block.experts.post_norm = torch.nn.Identity()
    with pytest.raises(ValueError, match="holds submodules"):
        swap_experts(block)


def test_evaluation_leaves_the_rng_untouched():
    """As LRMoE: eval() without grad draws no sampling uniforms (generate(do_sample=True) after a swap must give
    transformers' tokens); training mode draws, as dropout does. The output is exact either way."""
    torch.manual_seed(0)
    experts = SwiGLUExperts(E, D, FF, retain=0.5, selection="sample")
    x, ids, gates = torch.randn(T, D), torch.stack([torch.randperm(E)[:K] for _ in range(T)]), torch.rand(T, K)
    dense = SwiGLUExperts(E, D, FF)
    dense.load_state_dict(experts.state_dict())
    with torch.no_grad():
        want = dense(x, ids, gates)
        for training, draws in ((False, False), (True, True)):
            experts.train(training)
            state = torch.get_rng_state()
            experts.backward = replace(experts.backward, generator=torch.Generator().manual_seed(0))
            out = experts(x, ids, gates)
            assert torch.equal(torch.get_rng_state(), state), "the default draws never touch the global RNG"
            moved = not torch.equal(experts.backward.generator.get_state(),
                                    torch.Generator().manual_seed(0).get_state())
            assert moved == draws, f"training={training}"
            torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)


def test_swapped_experts_report_stats_as_lrmoe_does():
    """What the swap path kept, as LRMoE's stats(): the last step's loads (from the model's own router), quotas
    and kept pairs, and the backward statistics; an evaluation leaves the loads of the training step."""
    block = _block("qwen3_moe")
    swap_experts(block, retain=0.5)
    x = torch.randn(T, D)
    _, _, ids = block.gate(x)  # the block's own router: its [T, K] expert ids
    want_loads = torch.bincount(ids.flatten(), minlength=E)
    _run(block, x.view(2, T // 2, D), torch.randn(2, T // 2, D))
    stats = block.experts.stats()
    assert torch.equal(stats.loads, want_loads)
    assert int(stats.total_pairs) == T * K and int(stats.retained_pairs) == T * K // 2  # floor(retain * P)
    assert bool((stats.quotas <= stats.loads).all()) and int(stats.quotas.sum()) == T * K // 2
    assert float(stats.backward_calls) == 1.0 and 0 < float(stats.score_mass_fraction) < 1
    block.eval()
    with torch.no_grad():
        block(torch.randn(1, 1, D).expand(1, T, D))  # every token to the same K experts
    assert torch.equal(block.experts.stats().loads, want_loads)
    block.experts.reset_stats()
    assert float(block.experts.stats().backward_calls) == 0.0


def test_integer_gates_are_refused_not_cast():
    experts = SwiGLUExperts(E, D, FF)
    with pytest.raises((TypeError, ValueError), match="gates_TK"):
        experts(torch.randn(T, D), torch.zeros(T, K, dtype=torch.long), torch.ones(T, K, dtype=torch.long))


def test_under_autocast_the_experts_compute_in_its_dtype():
    """transformers' experts compute in autocast's dtype (their matmuls autocast); the swapped module computed in
    x's (the fp32 residual stream), a review found. Now: the bf16 computation exactly, fp32 weight gradients."""
    torch.manual_seed(0)
    experts = SwiGLUExperts(E, D, FF, retain=0.5, selection="top")
    x, gates = torch.randn(T, D, requires_grad=True), torch.rand(T, K, requires_grad=True)
    ids = torch.randint(0, E, (T, K))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = experts(x, ids, gates)
    out.float().pow(2).sum().backward()
    bf16 = copy.deepcopy(experts).bfloat16()
    want = bf16(x.detach().bfloat16(), ids, gates.detach().bfloat16())
    assert out.dtype == torch.bfloat16 and torch.equal(out, want)
    assert experts.gate_up_proj.grad.dtype == torch.float32 and x.grad.dtype == torch.float32
    assert gates.grad is not None and experts.down_proj.grad.abs().sum() > 0


def test_swapped_block_compiles_fullgraph():
    """transformers' router and our experts in one graph, equal to eager below retain 1."""
    ours = _block("glm4_moe")
    swap_experts(ours, retain=0.5, selection="top")
    compiled = torch.compile(ours, fullgraph=True)
    x, c = torch.randn(2, T // 2, D), torch.randn(2, T // 2, D)
    _assert_same_run(_run(compiled, x, c), _run(ours, x, c), prefix="_orig_mod.", grad_atol=1e-5)


def test_a_calls_options_override_the_modules():
    torch.manual_seed(0)
    selective, dense = SwiGLUExperts(E, D, FF, retain=0.5, selection="top"), SwiGLUExperts(E, D, FF)
    dense.load_state_dict(selective.state_dict())
    x, c = torch.randn(T, D), torch.randn(T, D)
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    gates = torch.rand(T, K).softmax(-1)

    def down_grad(experts, **options):
        experts.zero_grad()
        (experts(x, ids, gates, **options) * c).sum().backward()
        return experts.down_proj.grad.clone()

    want = down_grad(dense)
    torch.testing.assert_close(down_grad(selective, retain=1.0), want, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(down_grad(selective), want, rtol=1e-3, atol=1e-4)


# ------------------------------------------------------------------ whole blocks: from_transformers, replace_moe_blocks


@pytest.mark.parametrize("name", ["qwen3_moe", "glm4_moe", "deepseek_v3"])
def test_from_transformers_computes_the_block(name):
    from lrmoe.nn import LRMoE, from_transformers

    hf = _block(name)
    layer = from_transformers(copy.deepcopy(hf), retain=1.0)
    assert isinstance(layer, LRMoE) and layer.training
    assert not any(t.is_meta for t in list(layer.parameters()) + list(layer.buffers()))
    assert dict(layer.state_dict()).keys() == dict(hf.state_dict()).keys()  # a checkpoint of the block loads
    x, c = torch.randn(2, T // 2, D), torch.randn(2, T // 2, D)
    _assert_same_run(_run(layer, x, c), _run(hf, x, c))
    stats = layer.stats()
    assert int(stats.total_pairs) == T * K == int(stats.loads.sum())


def test_from_transformers_shares_the_blocks_tensors_and_takes_lrmoe_options():
    from lrmoe.nn import from_transformers

    hf = _block("glm4_moe")
    layer = from_transformers(hf, retain=0.5, selection="top")
    assert layer.retain == 0.5 and layer.backward.selection == "top" and layer.routing.score_func == "sigmoid"
    assert layer.experts.gate_up_proj is hf.experts.gate_up_proj and layer.gate is hf.gate
    assert layer.shared_experts.down_proj.weight is hf.shared_experts.down_proj.weight
    with pytest.raises(TypeError, match=r"takes its routing from the block; got \['top_k'\]"):
        from_transformers(hf, top_k=3)
    router = hf.gate.weight.clone()
    layer.reset_parameters()  # transformers' router module has no reset_parameters of its own
    assert not torch.equal(layer.gate.weight, router) and layer.gate.e_score_correction_bias.eq(0).all()
    with pytest.raises(ValueError, match="from_transformers takes a transformers"):
        from_transformers(torch.nn.Linear(2, 2))


def _qwen3_lm(**overrides):
    config = transformers.Qwen3MoeConfig(
        hidden_size=D, intermediate_size=32, moe_intermediate_size=FF, num_experts=E, num_experts_per_tok=K,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, head_dim=8, vocab_size=32,
        **overrides,
    )
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(config).float()


@pytest.mark.parametrize("router_logits", [False, True])
def test_replace_moe_blocks_in_a_causal_lm(router_logits):
    """Logits and every gradient of the converted model equal the original's at retain 1; with
    output_router_logits, transformers still records the (kept) router's logits, so the auxiliary loss is too."""
    from lrmoe.nn import LRMoE, replace_moe_blocks

    hf = _qwen3_lm(output_router_logits=router_logits, router_aux_loss_coef=0.01)
    ours = copy.deepcopy(hf)
    assert replace_moe_blocks(ours) == [f"model.layers.{i}.mlp" for i in range(2)]
    assert all(isinstance(ours.model.layers[i].mlp, LRMoE) for i in range(2))
    assert ours.state_dict().keys() == hf.state_dict().keys()
    ids = torch.randint(0, 32, (2, 10), generator=torch.Generator().manual_seed(1))
    results = []
    for model in (ours, hf):
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        results.append((out.logits.detach(), out.loss.detach(), out.aux_loss,
                        {n: p.grad for n, p in model.named_parameters()}))
    (logits, loss, aux, grads), (ref_logits, ref_loss, ref_aux, ref_grads) = results
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    if router_logits:
        assert ref_aux > 0
        torch.testing.assert_close(aux, ref_aux, rtol=1e-6, atol=0)
    for n, g in ref_grads.items():
        torch.testing.assert_close(grads[n], g, rtol=1e-4, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")
    with pytest.raises(ValueError, match="holds no transformers MoE block"):
        replace_moe_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def _expert_parallel_from_transformers(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from lrmoe.nn import ExpertParallel, from_transformers

    from torch.distributed.fsdp import fully_shard

    hf = _block("glm4_moe")
    mesh = init_device_mesh("cpu", (world,))
    layer = parallelize_module(from_transformers(copy.deepcopy(hf)), mesh, ExpertParallel())
    torch.manual_seed(10 + rank)
    x, c = torch.randn(2, T // 2, D), torch.randn(2, T // 2, D)
    (out, gx, _), (ref, rx, _) = _run(layer, x, c), _run(hf, x, c)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    # x's gradient takes the router's path, whose gradient lrmoe sums as <g W_down^T, phi> at retain 1 where
    # transformers sums <g, phi W_down>: the same value, reduced in another order (fp32: a few ulps of the terms).
    torch.testing.assert_close(gx, rx, rtol=1e-5, atol=2e-6)

    # Sharded first, converted or swapped after: refused (FSDP would keep gathering onto the old modules).
    sharded = _block("qwen3_moe")
    fully_shard(sharded, mesh=mesh)
    with pytest.raises(ValueError, match="call swap_experts before fully_shard"):
        swap_experts(sharded)
    with pytest.raises(ValueError, match="convert before fully_shard"):
        from_transformers(sharded)


def test_a_converted_block_runs_expert_parallel_and_a_sharded_one_is_refused():
    """The point of converting a whole block: ExpertParallel applies (2 gloo ranks, GLM-4.5's block, retain 1:
    each rank's output and input gradient are the block's on its own tokens). And the order: convert (or swap)
    before fully_shard."""
    from ep_harness import run_ranks

    run_ranks(2, _expert_parallel_from_transformers)


def test_a_converted_block_compiles_fullgraph_and_updates_its_selection_bias():
    from lrmoe.nn import from_transformers

    layer = from_transformers(_block("glm4_moe"), retain=0.5, selection="top")
    x, c = torch.randn(2, T // 2, D), torch.randn(2, T // 2, D)
    _assert_same_run(_run(torch.compile(layer, fullgraph=True), x, c), _run(layer, x, c), prefix="_orig_mod.",
                     grad_atol=1e-5)
    bias = layer.gate.e_score_correction_bias.clone()
    layer.update_selection_bias(1e-3)  # the transformers router's own buffer, stepped from the layer's loads
    moved = layer.gate.e_score_correction_bias - bias
    torch.testing.assert_close(moved.abs(), torch.full_like(moved, 1e-3).where(moved != 0, 0), rtol=1e-3, atol=0)
    assert moved.ne(0).any()


def _adam_step(model, ids, opt):
    opt.zero_grad()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()


@pytest.mark.parametrize("convert", ["replace_moe_blocks", "swap_experts"])
def test_an_optimizer_state_of_the_unswapped_model_loads_and_steps_identically(convert):
    """An optimizer's state_dict names parameters by position in named_parameters(). replace_moe_blocks put the
    router before the experts (transformers registers the experts first), so Adam state saved before the swap
    met the wrong tensors: a shape error at step(), or, where shapes matched, moments applied to other weights."""
    import lrmoe.nn

    hf = _qwen3_lm()
    ids = torch.randint(0, 32, (2, 10), generator=torch.Generator().manual_seed(1))
    opt = torch.optim.Adam(hf.parameters(), lr=1e-2)
    _adam_step(hf, ids, opt)  # moments of every parameter, as a checkpoint holds them
    ours = copy.deepcopy(hf)
    getattr(lrmoe.nn, convert)(ours)  # retain 1: the same gradients as transformers'
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in hf.named_parameters()]
    resumed = torch.optim.Adam(ours.parameters(), lr=1e-2)
    # A copy, as read from disk: load_state_dict keeps the tensors it is given, which opt's next step moves.
    resumed.load_state_dict(copy.deepcopy(opt.state_dict()))
    _adam_step(hf, ids, opt)
    _adam_step(ours, ids, resumed)
    want = dict(hf.named_parameters())
    for n, p in ours.named_parameters():
        torch.testing.assert_close(p, want[n], rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")
