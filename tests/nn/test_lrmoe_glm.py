"""LRMoE as the MoE block of GLM-4.5 and DeepSeek-V3: sigmoid scores, a selection bias, group-limited routing,
scaled gates and a shared expert. Against transformers' Glm4MoeMoE / DeepseekV3MoE with the same weights (retain 1),
what the options change below retain 1, compile, dtype handling and errors."""

from __future__ import annotations

import pytest
import torch

from lrmoe.nn import LRMoE
from test_lrmoe import grads  # tests/nn is on sys.path, as for ep_harness

T, D, FF, E, K = 24, 16, 12, 8, 2
GLM = dict(score_func="sigmoid", routed_scaling_factor=2.5, n_group=4, topk_group=2, selection_bias=True,
           shared_hidden_dim=2 * FF)


def _hf_block(name: str):
    transformers = pytest.importorskip("transformers")
    common = dict(hidden_size=D, moe_intermediate_size=FF, n_routed_experts=E, num_experts_per_tok=K, n_group=4,
                  topk_group=2, n_shared_experts=2, routed_scaling_factor=2.5, norm_topk_prob=True,
                  hidden_act="silu", num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, vocab_size=32)
    if name == "glm4_moe":
        from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeMoE
        return Glm4MoeMoE(transformers.Glm4MoeConfig(**common))
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    return DeepseekV3MoE(transformers.DeepseekV3Config(**common))


@pytest.mark.parametrize("name", ["glm4_moe", "deepseek_v3"])
def test_equals_transformers_block_with_bias_groups_scaling_and_shared_experts(name):
    torch.manual_seed(0)
    hf = _hf_block(name).float()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
        # A bias large enough to change choices: without it (or with it on the gates) the outputs differ.
        hf.gate.e_score_correction_bias.copy_(torch.randn(E) * 0.3)
    layer = LRMoE(D, FF, E, K, **GLM)
    layer.load_state_dict(hf.state_dict(), strict=True)
    hf.load_state_dict(layer.state_dict(), strict=True)  # and back: same names, same shapes

    x, c = torch.randn(2, T // 2, D), torch.randn(2, T // 2, D)
    out, gx, gp = grads(layer, x, layer, c)
    ref, rx, rp = grads(hf, x, hf, c)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gx, rx, rtol=1e-5, atol=1e-5)
    assert gp.keys() == rp.keys()
    for n in rp:
        torch.testing.assert_close(gp[n], rp[n], rtol=1e-5, atol=1e-5, msg=n)

    # The bias steered the choice in this case: with it zeroed, LRMoE chooses other experts.
    loads = layer.stats().loads.clone()
    with torch.no_grad():
        layer.gate.e_score_correction_bias.zero_()
    layer(x)
    assert not torch.equal(layer.stats().loads, loads)


def test_bias_steers_the_choice_not_the_gates():
    torch.manual_seed(0)
    layer = LRMoE(D, FF, E, K, score_func="sigmoid", selection_bias=True, norm_topk_prob=False)
    x = torch.randn(T, D)
    with torch.no_grad():
        layer.gate.e_score_correction_bias[3] = 10.0  # every token's first choice
    routing = layer.route(x)
    assert (routing.expert_ids == 3).any(-1).all()
    # Gates are the unbiased sigmoid scores of the chosen experts (no renormalisation here).
    scores = (x @ layer.gate.weight.t()).sigmoid()
    torch.testing.assert_close(routing.gates, scores.gather(1, routing.expert_ids))
    assert (routing.gates < 1).all()


def test_groups_limit_the_choice_and_scaling_scales_the_gates():
    torch.manual_seed(0)
    plain = LRMoE(D, FF, E, 4, score_func="sigmoid")
    grouped = LRMoE(D, FF, E, 4, score_func="sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.5)
    grouped.load_state_dict(plain.state_dict())
    x = torch.randn(T, D)
    ids = grouped.route(x).expert_ids
    assert torch.tensor([len(set((row // 2).tolist())) <= 2 for row in ids]).all()  # at most 2 groups of 2
    assert not torch.equal(ids.sort(-1).values, plain.route(x).expert_ids.sort(-1).values)
    torch.testing.assert_close(grouped.route(x).gates.sum(-1), torch.full((T,), 2.5))


def test_shared_experts_gradient_is_dense_below_retain_one():
    # The shared expert sees every token in backward whatever the routed experts keep: its gradients at retain 0.5
    # equal the dense layer's, while the routed experts' do not.
    torch.manual_seed(0)
    dense = LRMoE(D, FF, E, K, **GLM)
    sparse = LRMoE(D, FF, E, K, retain=0.5, selection="top", **GLM)
    with torch.no_grad():
        dense.gate.e_score_correction_bias.normal_(0, 0.3)
    sparse.load_state_dict(dense.state_dict())
    x, c = torch.randn(T, D), torch.randn(T, D)
    out_d, _, g_d = grads(dense, x, dense, c)
    out_s, _, g_s = grads(sparse, x, sparse, c)
    torch.testing.assert_close(out_s, out_d)
    for n in ("shared_experts.gate_proj.weight", "shared_experts.up_proj.weight", "shared_experts.down_proj.weight"):
        torch.testing.assert_close(g_s[n], g_d[n], msg=n)
    assert not torch.allclose(g_s["experts.down_proj"], g_d["experts.down_proj"])
    assert int(sparse.stats().retained_pairs) == T * K // 2


def test_compiled_equals_eager(fwd_bwd):
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = LRMoE(32, 24, 8, 2, retain=0.75, selection="top", **(GLM | dict(shared_hidden_dim=16)))
    with torch.no_grad():
        layer.gate.e_score_correction_bias.normal_(0, 0.3)
    x, c = torch.randn(4, 16, 32), torch.randn(4, 16, 32)
    got = fwd_bwd(torch.compile(layer, fullgraph=True), x, c)
    want = fwd_bwd(layer, x, c)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_selection_bias_stays_fp32_and_in_the_state_dict():
    layer = LRMoE(D, FF, E, K, **GLM).to(torch.bfloat16)
    assert layer.gate.e_score_correction_bias.dtype == torch.float32
    assert layer.gate.weight.dtype == torch.bfloat16 and layer.shared_experts.up_proj.weight.dtype == torch.bfloat16
    assert "gate.e_score_correction_bias" in layer.state_dict()
    out = layer(torch.randn(T, D, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16
    # Without the options the state_dict is Qwen3's: nothing added.
    assert set(LRMoE(D, FF, E, K).state_dict()) == {"gate.weight", "experts.gate_up_proj", "experts.down_proj"}


def test_update_selection_bias_moves_load_off_the_busiest_experts():
    torch.manual_seed(0)
    layer = LRMoE(D, FF, E, K, score_func="sigmoid", selection_bias=True)
    x = torch.randn(64, D)
    with torch.no_grad():
        layer.gate.e_score_correction_bias[5] = 0.5  # expert 5 in (nearly) every token's choice
    layer(x)
    loads = torch.bincount(layer.route(x).expert_ids.flatten(), minlength=E).float()  # from the routing itself
    before = layer.gate.e_score_correction_bias.clone()
    layer.update_selection_bias(0.01)
    step = layer.gate.e_score_correction_bias - before
    torch.testing.assert_close(step, 0.01 * torch.sign(loads.mean() - loads))
    assert step[5] < 0 and loads[5] == loads.max()
    # Repeated steps take load off expert 5.
    for _ in range(60):
        layer(x)
        layer.update_selection_bias(0.01)
    assert int(layer.stats().loads[5]) < int(loads[5])


def test_update_selection_bias_errors():
    with pytest.raises(ValueError, match="selection_bias"):
        LRMoE(D, FF, E, K).update_selection_bias(0.01)
    layer = LRMoE(D, FF, E, K, selection_bias=True)
    for bad in (0.0, -1.0, float("inf"), True):
        with pytest.raises(ValueError, match="rate"):
            layer.update_selection_bias(bad)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(routed_scaling_factor=0.0), "routed_scaling_factor"),
        (dict(routed_scaling_factor=float("nan")), "routed_scaling_factor"),
        (dict(n_group=4), "topk_group"),
        (dict(n_group=3, topk_group=1), "n_group"),
        (dict(n_group=4, topk_group=5), "topk_group"),
        (dict(n_group=8, topk_group=1), "top_k"),
        (dict(selection_bias=1), "selection_bias"),
        (dict(shared_hidden_dim=0), "shared_hidden_dim"),
        (dict(shared_hidden_dim=8.0), "shared_hidden_dim"),
        (dict(router_dtype=torch.int32), "router_dtype"),
        (dict(router_dtype="float32"), "router_dtype"),
    ],
)
def test_bad_routing_options_raise_naming_the_argument(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        LRMoE(D, FF, E, K, **kwargs)


def test_fp32_router_chooses_what_transformers_does_in_bf16():
    """transformers' GLM-4.5 router computes its logits in fp32 even in a bf16 model; router_dtype=torch.float32
    does the same, so a bf16 LRMoE loaded from its weights chooses the same experts with the same gates, where the
    bf16 logits of the default choose differently for some tokens."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeMoE

    dim, hidden, n_exp, k = 64, 32, 64, 8
    config = transformers.Glm4MoeConfig(hidden_size=dim, moe_intermediate_size=hidden, n_routed_experts=n_exp,
                                        num_experts_per_tok=k, n_shared_experts=1, n_group=8, topk_group=4,
                                        routed_scaling_factor=2.5, norm_topk_prob=True)
    torch.manual_seed(0)
    hf = Glm4MoeMoE(config)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
        hf.gate.e_score_correction_bias.normal_(0, 0.1)
    hf = hf.bfloat16()
    x = torch.randn(2048, dim).bfloat16()
    _, hf_gates, hf_ids = hf.gate(x)
    hf_ids, order = hf_ids.sort(-1)
    options = dict(score_func="sigmoid", selection_bias=True, n_group=8, topk_group=4, routed_scaling_factor=2.5,
                   shared_hidden_dim=hidden)
    differing = {}
    for router_dtype in (None, torch.float32):
        layer = LRMoE(dim, hidden, n_exp, k, router_dtype=router_dtype, **options).bfloat16()
        layer.load_state_dict(hf.state_dict(), strict=True)
        routing = layer.route(x)
        ids, ours = routing.expert_ids.sort(-1)
        differing[router_dtype] = int((ids != hf_ids).any(-1).sum())
        if router_dtype is torch.float32:
            torch.testing.assert_close(routing.gates.gather(1, ours), hf_gates.gather(1, order).float())
    assert differing[torch.float32] == 0
    assert differing[None] > 0  # the case can tell the two apart
