"""LRMoE against a plain per-expert-loop reference, against transformers' Qwen3-MoE block, and its retain < 1
contract: exact forward and router gradient, expert gradients restricted to the selected pairs."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from lrmoe.functional import plan_quotas
from lrmoe.nn import LRMoE

T, D, FF, E, K = 24, 16, 12, 6, 2


def dense_reference(layer: LRMoE, x: torch.Tensor, kept=None) -> torch.Tensor:
    """Per-expert loop written from the math: softmax/sigmoid router, top-k, renormalise, SwiGLU experts.

    ``kept``: optional [T, K] bool; pairs outside it contribute their forward value but no expert-path gradient
    (their expert output is computed from detached inputs and weights), which is what selective backward with
    weight 1 means.
    """
    x_TD = x.reshape(-1, layer.dim)
    logits = x_TD @ layer.gate.weight.t()
    probs = logits.float().softmax(-1) if layer.routing.score_func == "softmax" else logits.float().sigmoid()
    top_w, top_i = probs.topk(layer.top_k, dim=-1)
    if layer.routing.norm_topk_prob:
        top_w = top_w / top_w.sum(-1, keepdim=True)
    out = torch.zeros_like(x_TD)
    w_gu, w_d = layer.experts.gate_up_proj, layer.experts.down_proj
    for e in range(layer.num_experts):
        tok, slot = torch.where(top_i == e)
        if tok.numel() == 0:
            continue
        for live in (True, False):
            sel = torch.ones_like(tok, dtype=torch.bool) if kept is None else kept[tok, slot] == live
            if kept is None and not live:
                continue
            t_, s_ = tok[sel], slot[sel]
            xs, wg, wd = x_TD[t_], w_gu[e], w_d[e]
            if not live:
                xs, wg, wd = xs.detach(), wg.detach(), wd.detach()
            gate, up = (xs @ wg.t()).chunk(2, dim=-1)
            y = (F.silu(gate) * up) @ wd.t()
            out = out.index_add(0, t_, y * top_w[t_, s_, None].to(y.dtype))
    return out.view(x.shape)


def grads(layer, x, fn, c):
    for p in layer.parameters():
        p.grad = None
    x = x.detach().clone().requires_grad_(True)
    out = fn(x)
    (out * c).sum().backward()
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in layer.named_parameters()}


def make(retain=1.0, seed=0, **kw):
    torch.manual_seed(seed)
    layer = LRMoE(D, FF, E, K, retain=retain, **kw)
    x = torch.randn(2, T // 2, D)
    c = torch.randn(2, T // 2, D)
    return layer, x, c


# fp64 must agree to fp64 rounding: a reference computing any part in fp32 (the SwiGLU backward once did) shows up
# as errors near 1e-8.
_DENSE_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.float64: dict(rtol=1e-12, atol=1e-14)}


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize("selection", ["sample", "top"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_retain_one_equals_dense_reference(score_func, norm_topk_prob, selection, dtype):
    layer, x, c = make(score_func=score_func, norm_topk_prob=norm_topk_prob, selection=selection)
    layer, x, c = layer.to(dtype), x.to(dtype), c.to(dtype)
    out, gx, gp = grads(layer, x, layer, c)
    ref, rx, rp = grads(layer, x, lambda x: dense_reference(layer, x), c)
    tol = _DENSE_TOL[dtype]
    torch.testing.assert_close(out, ref, **tol)
    torch.testing.assert_close(gx, rx, **tol)
    for name in rp:
        torch.testing.assert_close(gp[name], rp[name], **tol, msg=name)


def test_equals_transformers_qwen3_moe_block():
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = transformers.Qwen3MoeConfig(
        hidden_size=D, moe_intermediate_size=FF, num_experts=E, num_experts_per_tok=K, norm_topk_prob=True,
        hidden_act="silu", num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, vocab_size=32,
    )
    torch.manual_seed(0)
    hf = Qwen3MoeSparseMoeBlock(config).float()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
    layer = LRMoE(D, FF, E, K)
    layer.load_state_dict(hf.state_dict(), strict=True)
    hf.load_state_dict(layer.state_dict(), strict=True)  # and back: same names, same shapes

    x = torch.randn(2, T // 2, D)
    c = torch.randn(2, T // 2, D)
    out, gx, gp = grads(layer, x, layer, c)
    for p in hf.parameters():
        p.grad = None
    xh = x.clone().requires_grad_(True)
    ref = hf(xh)
    (ref * c).sum().backward()
    torch.testing.assert_close(out, ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gx, xh.grad, rtol=1e-5, atol=1e-6)
    for name, p in hf.named_parameters():
        torch.testing.assert_close(gp[name], p.grad, rtol=1e-5, atol=1e-6, msg=name)


def lrm_scores(layer, x, c):
    """alpha^2 ||g||^2 ||phi||^2 per pair, from the definitions (g = c for the loss sum(out * c))."""
    with torch.no_grad():
        x_TD = x.reshape(-1, D)
        probs = (x_TD @ layer.gate.weight.t()).softmax(-1)
        top_w, top_i = probs.topk(K, dim=-1)
        top_w = top_w / top_w.sum(-1, keepdim=True)
        gate, up = torch.einsum("td,tkfd->tkf", x_TD, layer.experts.gate_up_proj[top_i]).chunk(2, -1)
        phi_sq = (F.silu(gate) * up).square().sum(-1)
        g_sq = c.reshape(-1, D).square().sum(-1, keepdim=True)
        return top_w.square() * g_sq * phi_sq, top_i


@pytest.mark.parametrize("retain", [0.75, 0.5, 0.3])
@pytest.mark.parametrize("policy", ["waterfill", "proportional"])
@pytest.mark.parametrize("align", [1, 4])
def test_top_selection_restricts_expert_gradients_to_top_quota_pairs(retain, policy, align):
    layer, x, c = make(retain=retain, selection="top", policy=policy, quota_align=align)
    out, gx, gp = grads(layer, x, layer, c)
    dense_out, _, dense_gp = grads(layer, x, lambda x: dense_reference(layer, x), c)

    # Which pairs a correct implementation keeps: per expert, the quota highest LRM scores (ties to lower id).
    scores, top_i = lrm_scores(layer, x, c)
    loads = torch.zeros(E, dtype=torch.int64).scatter_add_(0, top_i.reshape(-1), torch.ones(T * K, dtype=torch.int64))
    quotas = plan_quotas(loads, retain, policy=policy, align=align)
    kept = torch.zeros(T * K, dtype=torch.bool)
    flat_s, flat_e = scores.reshape(-1).tolist(), top_i.reshape(-1).tolist()
    for e in range(E):
        members = sorted((p for p in range(T * K) if flat_e[p] == e), key=lambda p: (-flat_s[p], p))
        kept[members[: int(quotas[e])]] = True
    assert int(kept.sum()) == math.floor(retain * T * K) or policy == "proportional"
    assert int(kept.sum()) < T * K

    ref_out, ref_gx, ref_gp = grads(layer, x, lambda x: dense_reference(layer, x, kept.view(T, K)), c)
    torch.testing.assert_close(out, dense_out, rtol=1e-5, atol=1e-6)  # forward exact
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gp["gate.weight"], dense_gp["gate.weight"], rtol=1e-5, atol=1e-6)  # router exact
    torch.testing.assert_close(gx, ref_gx, rtol=1e-5, atol=1e-6)
    for name in ref_gp:
        torch.testing.assert_close(gp[name], ref_gp[name], rtol=1e-5, atol=1e-6, msg=name)
    # and the restriction matters: the expert gradients differ from the dense ones
    assert not torch.allclose(gp["experts.down_proj"], dense_gp["experts.down_proj"], rtol=1e-3, atol=1e-4)


def test_sample_selection_is_unbiased():
    layer, x, c = make(retain=0.5, selection="sample")
    _, dense_gx, dense_gp = grads(layer, x, lambda x: dense_reference(layer, x), c)
    n_draws = 400
    acc = {n: torch.zeros_like(p) for n, p in dense_gp.items()}
    acc_sq = {n: torch.zeros_like(p) for n, p in dense_gp.items()}
    acc_x = torch.zeros_like(dense_gx)
    # The default draws are a hash of the routing: the same for the same weights and batch. Unbiasedness is a
    # property over the draws, so take them from a generator here (a training run's routing changes every step).
    layer.backward = replace(layer.backward, generator=torch.Generator().manual_seed(123))
    for _ in range(n_draws):
        out, gx, gp = grads(layer, x, layer, c)
        acc_x += gx
        for n in acc:
            acc[n] += gp[n]
            acc_sq[n] += gp[n].square()
    for n in acc:
        mean = acc[n] / n_draws
        std_err = ((acc_sq[n] / n_draws - mean.square()).clamp(min=0) / n_draws).sqrt()
        # every coordinate within 6 standard errors (plus float slack) of the dense gradient
        assert ((mean - dense_gp[n]).abs() <= 6 * std_err + 1e-5).all(), n
    # a single draw is not the dense gradient (so the test above is not vacuous)
    assert not torch.allclose(gp["experts.down_proj"], dense_gp["experts.down_proj"], rtol=1e-3, atol=1e-4)
    assert (acc_x / n_draws - dense_gx).abs().max() < 0.1 * dense_gx.abs().max()


def test_forward_and_router_gradient_unchanged_by_retain():
    dense, x, c = make(retain=1.0)
    out1, _, gp1 = grads(dense, x, dense, c)
    for selection in ("sample", "top"):
        layer = LRMoE(D, FF, E, K, retain=0.6, selection=selection)
        layer.load_state_dict(dense.state_dict())
        out, _, gp = grads(layer, x, layer, c)
        torch.testing.assert_close(out, out1, rtol=0, atol=0)
        torch.testing.assert_close(gp["gate.weight"], gp1["gate.weight"], rtol=1e-6, atol=1e-7)


def test_backward_gemms_see_at_most_the_planned_rows():
    from torch.utils._python_dispatch import TorchDispatchMode

    class RecordGroupedOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.rows = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.lrmoe.gather_grouped_mm.default, torch.ops.lrmoe.grouped_outer.default):
                rows = args[2] if args[2] is not None else args[0]  # None: identity, the operand's own rows
                self.rows.append((str(func), rows.shape[0]))
            return func(*args, **(kwargs or {}))

    n_pairs = 64 * K
    bound = math.ceil(0.5 * n_pairs) + E
    for save_outputs in (True, False):
        torch.manual_seed(0)
        layer = LRMoE(D, FF, E, K, retain=0.5, save_outputs=save_outputs)
        x = torch.randn(64, D, requires_grad=True)
        out = layer(x)
        with RecordGroupedOps() as mode:
            out.square().sum().backward()
        assert len(mode.rows) == 4  # dphi, dW_down, dW_gate_up, dx
        # Without the saved y, the router gradient's g W_down^T (the first GEMM) runs over every forward row; the
        # retained rows take theirs from it.
        selective = mode.rows if save_outputs else mode.rows[1:]
        assert all(rows <= bound for _, rows in selective), mode.rows
        assert max(rows for _, rows in selective) < n_pairs
        assert save_outputs or mode.rows[0] == ("lrmoe.gather_grouped_mm.default", n_pairs)


def test_quota_align_reaches_the_plan():
    layer, x, c = make(retain=0.75, selection="top", quota_align=4)
    grads(layer, x, layer, c)
    aligned = plan_quotas(layer.last_loads, 0.75, align=4)
    assert torch.equal(layer.last_quotas, aligned)
    assert not torch.equal(aligned, plan_quotas(layer.last_loads, 0.75))  # here the two plans differ


def test_stats():
    layer, x, c = make(retain=0.75)
    grads(layer, x, layer, c)
    s = layer.stats()
    assert int(s.total_pairs) == T * K and int(s.loads.sum()) == T * K
    assert int(s.retained_pairs) == math.floor(0.75 * T * K)
    assert torch.equal(s.quotas, plan_quotas(s.loads, 0.75))
    assert 0.75 <= float(s.score_mass_fraction) <= 1.0  # the kept pairs carry at least their share of mass
    assert float(s.backward_calls) == 1.0
    grads(layer, x, layer, c)
    assert float(layer.stats().backward_calls) == 2.0
    layer.reset_stats()
    assert math.isnan(float(layer.stats().score_mass_fraction))

    dense, x, c = make(retain=1.0)
    grads(dense, x, dense, c)
    assert float(dense.stats().score_mass_fraction) == 1.0
    assert float(dense.stats().retained_fraction) == 1.0


@pytest.mark.parametrize("retain, selection", [(1.0, "sample"), (0.75, "top"), (0.5, "sample")])
def test_recompute_gives_the_same_gradients_and_saves_less(retain, selection):
    # Same seed -> same sampling uniforms, so both policies keep the same pairs; only where h comes from differs.
    saved = {}
    results = {}
    for activations in ("save", "recompute"):
        layer, x, c = make(retain=retain, selection=selection, activations=activations)
        storages = set()

        def pack(t):
            storages.add((t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()))
            return t

        torch.manual_seed(3)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            results[activations] = grads(layer, x, layer, c)
        saved[activations] = sum(n for _, n in storages)
    (out_s, dx_s, g_s), (out_r, dx_r, g_r) = results["save"], results["recompute"]
    assert torch.equal(out_s, out_r)
    torch.testing.assert_close(dx_r, dx_s, rtol=1e-6, atol=1e-7)
    for name in g_s:
        torch.testing.assert_close(g_r[name], g_s[name], rtol=1e-6, atol=1e-7)
    # "recompute" does not keep h = [T*K, 2F] (fp32 here); below retain 1 it keeps phi = [T*K, F] for the dropped
    # pairs' router gradient.
    assert saved["save"] - saved["recompute"] == T * K * 2 * FF * 4 - (T * K * FF * 4 if retain < 1 else 0)


@pytest.mark.parametrize("retain, selection", [(1.0, "sample"), (0.75, "sample"), (0.75, "top"), (0.5, "sample")])
def test_offload_gives_the_gradients_of_save_bit_for_bit(retain, selection):
    # Backward reads back the very h "save" keeps (from the host copy), so everything is bit-identical.
    results, saved = {}, {}
    for activations in ("save", "offload"):
        layer, x, c = make(retain=retain, selection=selection, activations=activations)
        shapes = []

        def pack(t, shapes=shapes):
            shapes.append((tuple(t.shape), t.untyped_storage().nbytes()))
            return t

        torch.manual_seed(3)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            results[activations] = grads(layer, x, layer, c)
        saved[activations] = shapes
    (out_s, dx_s, g_s), (out_o, dx_o, g_o) = results["save"], results["offload"]
    assert torch.equal(out_s, out_o) and torch.equal(dx_s, dx_o)
    for name in g_s:
        assert torch.equal(g_o[name], g_s[name]), name
    # On CPU the host copy is CPU memory too: the same tensors are saved, h as its copy ([T*K, 2F] fp32), and below
    # retain 1 phi ([T*K, F]) for the dropped pairs' router gradient.
    phi = ((T * K, FF), T * K * FF * 4)
    assert ((T * K, 2 * FF), T * K * 2 * FF * 4) in saved["offload"] and (phi in saved["offload"]) == (retain < 1)
    assert sorted(saved["offload"]) == sorted(saved["save"] + ([phi] if retain < 1 else []))


class _OpCalls(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def test_offload_copies_h_once_and_only_when_a_backward_will_run():
    layer, x, c = make(retain=0.75, activations="offload")
    for grad_enabled, copies, reads in ((True, 1, 1), (False, 0, 0)):
        calls = _OpCalls()
        with torch.set_grad_enabled(grad_enabled), calls:
            out = layer(x.requires_grad_(grad_enabled))
            if grad_enabled:
                (out * c).sum().backward()
        assert calls.names.count("lrmoe.offload_to_host.default") == copies
        assert calls.names.count("lrmoe.gather_host_rows.default") == reads
    # Without grad the layer computes the same output (nothing is kept: the "recompute" layout).
    with torch.no_grad():
        assert torch.equal(layer(x), make(retain=0.75)[0](x))


def test_bad_activation_policy_names_the_argument():
    with pytest.raises(ValueError, match="activations"):
        LRMoE(D, FF, E, K, activations="offload-to-disk")


def test_stats_probe_moves_with_the_module():
    # Moving the module moves the probe, so forward never creates it (that would break torch.compile's graph).
    layer, _, _ = make(retain=0.75)
    moved = layer.to("meta")
    probe = moved._stats_probe.tensor
    assert probe.device.type == "meta" and probe.requires_grad
    assert probe.is_leaf and probe.dtype == torch.float32


def test_sample_draws_are_a_function_of_the_model_and_batch_unless_a_generator_is_given():
    layer, x, c = make(retain=0.5, selection="sample")
    _, _, a = grads(layer, x, layer, c)
    torch.manual_seed(99)  # the global RNG plays no part
    _, _, b = grads(layer, x, layer, c)
    assert torch.equal(a["experts.down_proj"], b["experts.down_proj"])
    # (another routing draws anew: tests/functional/test_rng.py)

    layer.backward = replace(layer.backward, generator=torch.Generator().manual_seed(3))
    _, _, g1 = grads(layer, x, layer, c)
    _, _, g2 = grads(layer, x, layer, c)  # the generator has moved on
    layer.backward = replace(layer.backward, generator=torch.Generator().manual_seed(3))
    _, _, g3 = grads(layer, x, layer, c)
    assert torch.equal(g1["experts.down_proj"], g3["experts.down_proj"])
    assert not torch.equal(g1["experts.down_proj"], g2["experts.down_proj"])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(top_k=7), "top_k"),
        (dict(top_k=0), "top_k"),
        (dict(retain=0.0), "retain"),
        (dict(retain=1.5), "retain"),
        (dict(retain=0.5, min_retain=0.6), "min_retain"),
        (dict(metric="l3"), "metric"),
        (dict(policy="greedy"), "policy"),
        (dict(selection="best"), "selection"),
        (dict(score_func="relu"), "score_func"),
        (dict(num_experts=0, top_k=1), "num_experts"),
        (dict(quota_align=0), "quota_align"),
        (dict(quota_align=64.0), "quota_align"),
        (dict(quota_align=True), "quota_align"),  # a bool is an int in Python, not a size
        (dict(top_k=True), "top_k"),
        (dict(retain=True), "retain"),
        (dict(norm_topk_prob="x"), "norm_topk_prob"),
        (dict(generator=1), "generator"),
    ],
)
def test_bad_configuration_raises_naming_the_argument(kwargs, match):
    args = dict(dim=D, hidden_dim=FF, num_experts=E, top_k=K) | kwargs
    with pytest.raises((ValueError, TypeError), match=match):
        LRMoE(**args)


@pytest.mark.parametrize("sizes", [(0, D, FF), (E, 0, FF), (E, D, 0), (E, D, 2.0), (E, True, FF)])
def test_swiglu_experts_refuse_bad_sizes(sizes):
    from lrmoe.nn.lrmoe import SwiGLUExperts

    name = ("num_experts", "dim", "hidden_dim")[next(i for i, v in enumerate(sizes) if v != (E, D, FF)[i]
                                                      or type(v) is not int)]
    with pytest.raises(ValueError, match=name):
        SwiGLUExperts(*sizes)


def test_bad_input_raises():
    layer = LRMoE(D, FF, E, K)
    with pytest.raises(ValueError, match="dim"):
        layer(torch.randn(3, D + 1))
    with pytest.raises(TypeError, match="dtype"):
        layer(torch.randn(3, D, dtype=torch.float64))
    with pytest.raises(ValueError, match="x must be a tensor"):
        layer(torch.tensor(1.0))
    # Experts left on the meta device (a partial checkpoint load): a custom op would run its fake kernel and
    # return uninitialised memory, so the layer refuses before any op runs.
    layer.experts.to_empty(device="meta")
    with pytest.raises(ValueError, match="gate_up_proj on meta"):
        layer(torch.randn(3, D))


def test_selective_swiglu_experts_checks_its_plan_in_forward():
    """A plan made for another retain was used as is: one for retain 1 at retain 0.5 overflowed the backward buffer
    (an expert's weight gradient silently zero), one for 0.5 at retain 1 was ignored. A plan with float quotas,
    on another device, of another shape or not an ExpertPlan at all failed in backward, naming internal names."""
    import dataclasses

    from lrmoe.functional import plan_experts, selective_swiglu_experts

    torch.manual_seed(0)
    x, ids = torch.randn(16, 8), torch.randint(0, 4, (16, 2))
    gate_up, down, gates = torch.randn(4, 12, 8), torch.randn(4, 8, 6), torch.rand(16, 2)

    def call(plan, retain=0.5):
        return selective_swiglu_experts(x, gate_up, down, ids, gates, retain=retain, selection="sample", plan=plan)

    plan = plan_experts(ids, 4, retain=0.5, selection="sample")
    assert plan.retain == 0.5 and call(plan).shape == (16, 8)
    with pytest.raises(ValueError, match=r"plan was made for retain=1.0, the call has retain=0.5"):
        call(plan_experts(ids, 4, retain=1.0))
    with pytest.raises(ValueError, match=r"plan was made for retain=0.5, the call has retain=1.0"):
        call(plan, retain=1.0)
    bad = [(dataclasses.replace(plan, quotas=plan.quotas.float()), TypeError, "plan.quotas must be an integer"),
           (dataclasses.replace(plan, uniform=plan.uniform[:3]), ValueError, r"plan.uniform must be \[E=4\]"),
           (dataclasses.replace(plan, uniform=plan.uniform.long()), TypeError, "plan.uniform must be a floating"),
           (dataclasses.replace(plan, quotas=plan.quotas.to("meta")), ValueError, "plan_quotas on meta"),
           ((plan.loads, plan.quotas, plan.uniform), TypeError, "plan must be an ExpertPlan")]
    for wrong, exc, match in bad:
        with pytest.raises(exc, match=match):
            call(wrong)
    with pytest.raises(TypeError, match="generator must be a torch.Generator"):
        selective_swiglu_experts(x, gate_up, down, ids, gates, retain=0.5, generator=3)
    # A plan built by hand (retain None) is not checked against the call's retain.
    assert call(dataclasses.replace(plan, retain=None)).shape == (16, 8)


def test_a_hand_built_plan_keeping_every_pair_gives_the_dense_gradients():
    """A plan built by hand (ExpertPlan, retain not recorded) whose quotas keep more than floor(retain * P) + E
    rows: the backward buffer was sized from the call's retain, so rows past it were cut and the last experts' weight
    gradients came out zero, silently (a review's repro). It is now sized for every pair."""
    from lrmoe.functional import ExpertPlan, expert_loads, selective_swiglu_experts

    torch.manual_seed(0)
    T, E_, K_ = 8, 4, 2
    x = torch.randn(T, 4, dtype=torch.float64)
    gate_up, down = torch.randn(E_, 6, 4, dtype=torch.float64), torch.randn(E_, 4, 3, dtype=torch.float64)
    ids = torch.stack([torch.arange(T) % E_, (torch.arange(T) + 1) % E_], 1)
    gates = torch.rand(T, K_, dtype=torch.float64)
    loads = expert_loads(ids, E_)
    keep_all = ExpertPlan(loads=loads, quotas=loads.clone(), uniform=None)  # 16 pairs; the 0.5 buffer holds 12

    def grads(**options):
        w = [t.clone().requires_grad_(True) for t in (x, gate_up, down)]
        selective_swiglu_experts(*w, ids, gates, **options).pow(2).sum().backward()
        return [t.grad for t in w]

    for got, want in zip(grads(retain=0.5, selection="top", plan=keep_all), grads(retain=1.0), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_the_layer_leaves_the_global_rng_untouched_and_draws_from_a_generator_only_when_training():
    layer, x, _ = make(retain=0.5, selection="sample")
    for train, needs_grad in ((False, False), (True, False), (False, True), (True, True)):
        layer.train(train)
        torch.manual_seed(5)
        with torch.set_grad_enabled(needs_grad):
            layer(x.detach().requires_grad_(needs_grad))
        after = torch.rand(3)
        torch.manual_seed(5)
        assert torch.equal(torch.rand(3), after), (train, needs_grad)
    # With a generator: training mode draws (as dropout does, with or without grad); eval() does not, with grad
    # too: its backward is exact (selective_in_eval=False)
    for train, needs_grad, draws in ((False, False, False), (True, False, True), (False, True, False)):
        layer.train(train)
        layer.backward = replace(layer.backward, generator=torch.Generator().manual_seed(5))
        with torch.set_grad_enabled(needs_grad):
            layer(x.detach().requires_grad_(needs_grad))
        assert torch.equal(layer.backward.generator.get_state(), torch.Generator().manual_seed(5).get_state()) != draws


@pytest.mark.parametrize("retain, activations, backward_capacity",
                         [(1.0, "save", None), (0.5, "save", None), (0.5, "recompute", None), (0.5, "offload", None),
                          (0.5, "save", 1.0), (0.5, "recompute", 1.0)])
def test_a_batch_of_no_tokens_gives_empty_outputs_and_zero_gradients(retain, activations, backward_capacity):
    # A data loader's last, empty micro-batch: shapes follow, nothing is routed, every weight gradient is zero.
    layer = LRMoE(D, FF, E, K, retain=retain, selection="top", activations=activations,
                  backward_capacity=backward_capacity)
    x = torch.randn(2, 0, D, requires_grad=True)
    out = layer(x)
    assert out.shape == (2, 0, D)
    out.sum().backward()
    assert x.grad.shape == (2, 0, D)
    for name, p in layer.named_parameters():
        assert p.grad is None or not p.grad.any(), name
    stats = layer.stats()
    assert int(stats.total_pairs) == 0 and int(stats.retained_pairs) == 0


# ------------------------------------------------------------------------------------------------ training loops


def test_second_order_gradients_raise_instead_of_being_incomplete():
    # The expert backward's ops have no gradients of their own: a gradient penalty through the layer would get
    # silently wrong parameter gradients (a review measured errors of ~1 at retain 1), so it must raise.
    layer = LRMoE(D, FF, E, K).double()
    x = torch.randn(T, D, dtype=torch.float64, requires_grad=True)
    with pytest.raises(RuntimeError, match="create_graph=True"):
        torch.autograd.grad(layer(x).sin().sum(), x, create_graph=True)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpointed_micro_batches_keep_the_last_forwards_plan(use_reentrant):
    # Two checkpointed micro-batches, one backward: the recomputes (x2's, then x1's) must not overwrite the plan
    # stats() and update_selection_bias read, which is the last forward's (x2's).
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    layer = LRMoE(D, FF, E, K, retain=0.5)
    x1, x2 = torch.randn(T, D, requires_grad=True), torch.randn(T, D, requires_grad=True)  # reentrant needs it
    layer(x2 * 1)
    want_loads, want_quotas = layer.last_loads.clone(), layer.last_quotas.clone()
    loss = sum(checkpoint(layer, x, use_reentrant=use_reentrant).square().sum() for x in (x1, x2))
    assert torch.equal(layer.last_loads, want_loads)
    loss.backward()
    stats = layer.stats()
    assert torch.equal(stats.loads, want_loads) and torch.equal(stats.quotas, want_quotas)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpointed_sampling_step_leaves_the_rng_where_an_unchecked_one_does(use_reentrant):
    # A reentrant checkpoint runs the first forward without grad; the layer must draw its uniforms there too
    # (training mode), or every later random draw (dropout, the next step's uniforms) shifts by one.
    from torch.utils.checkpoint import checkpoint

    def step(ckpt):
        torch.manual_seed(1)
        layer = LRMoE(D, FF, E, K, retain=0.5, selection="sample")
        x = torch.randn(T, D, requires_grad=True)
        y = checkpoint(layer, x, use_reentrant=use_reentrant) if ckpt else layer(x)
        y.square().sum().backward()
        return torch.rand(4), x.grad, layer.experts.down_proj.grad

    after_plain, gx_plain, gw_plain = step(False)
    after_ckpt, gx_ckpt, gw_ckpt = step(True)
    assert torch.equal(after_plain, after_ckpt)
    torch.testing.assert_close(gx_ckpt, gx_plain, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(gw_ckpt, gw_plain, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kwargs", [dict(), dict(retain=0.5, selection="top", activations="recompute"),
                                    dict(score_func="sigmoid", selection_bias=True, shared_hidden_dim=8)])
def test_autocast_runs_the_experts_as_a_bf16_copy_would(kwargs):
    # fp32 parameters under torch.autocast(bf16): the router autocasts like any linear and the experts run in bf16
    # on casts of x and the weights, so output and gradients are a bf16 copy's, the gradients reaching the fp32
    # parameters in fp32 (before, a bf16 input was refused with advice to cast the layer).
    import copy

    torch.manual_seed(3)
    layer = LRMoE(D, FF, E, K, **kwargs)
    half = copy.deepcopy(layer).to(torch.bfloat16)
    x = torch.randn(T, D).to(torch.bfloat16)
    for x_in in (x, x.float()):  # a linear's bf16 output, or an fp32 residual stream
        layer.zero_grad(set_to_none=True)
        half.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = layer(x_in)
        out.float().square().sum().backward()
        out_h = half(x)
        out_h.float().square().sum().backward()
        assert out.dtype == torch.bfloat16 and torch.equal(out, out_h)
        for (name, p), q in zip(layer.named_parameters(), half.parameters()):
            assert p.grad.dtype == torch.float32, name
            torch.testing.assert_close(p.grad, q.grad.float(), rtol=0, atol=0, msg=name)


def test_reset_parameters_initialises_a_layer_materialised_from_meta():
    # torchtitan's pattern: build on the meta device, to_empty() on the real one, then initialise. Every parameter
    # and the selection bias must be set (to_empty leaves memory uninitialised).
    with torch.device("meta"):
        layer = LRMoE(D, FF, E, K, score_func="sigmoid", selection_bias=True, shared_hidden_dim=8)
    layer.to_empty(device="cpu")
    with torch.no_grad():
        for t in (*layer.parameters(), layer.gate.e_score_correction_bias):
            t.fill_(float("nan"))
    torch.manual_seed(0)
    layer.reset_parameters()
    assert torch.equal(layer.gate.e_score_correction_bias, torch.zeros(E))
    for name, p in layer.named_parameters():
        fan_in = p.shape[-1]
        assert torch.isfinite(p).all() and p.abs().max() <= 1 / math.sqrt(fan_in), name
        assert p.std() > 0.25 / math.sqrt(fan_in), name  # drawn, not left constant
    assert torch.isfinite(layer(torch.randn(T, D))).all()


def test_fp64_experts_at_retain_1_give_plain_autograds_gradients():
    """In fp64 the expert-path backward scaled g by the gates rounded to fp32: ~1e-8 relative from plain autograd
    for gates that fp32 cannot hold (a review's repro). The dense backward is plain autograd's up to reassociation."""
    import torch.nn.functional as F

    from lrmoe.functional import selective_swiglu_experts

    torch.manual_seed(0)
    T, D_, F_, E_, K_ = 6, 3, 2, 3, 2
    x = torch.randn(T, D_, dtype=torch.float64)
    gate_up, down = torch.randn(E_, 2 * F_, D_, dtype=torch.float64), torch.randn(E_, D_, F_, dtype=torch.float64)
    ids = torch.tensor([[0, 1], [1, 2], [2, 0], [0, 2], [1, 0], [2, 1]])
    gates = torch.rand(T, K_, dtype=torch.float64)
    assert not torch.equal(gates.float().double(), gates)
    c = torch.randn(T, D_, dtype=torch.float64)

    def plain(x, gu, dn, gates):  # every pair written out, per (token, slot)
        out = torch.zeros_like(x)
        for t in range(T):
            for k in range(K_):
                h = gu[ids[t, k]] @ x[t]
                out[t] = out[t] + gates[t, k] * (dn[ids[t, k]] @ (F.silu(h[:F_]) * h[F_:]))
        return out

    def grads(fn):
        w = [t.clone().requires_grad_(True) for t in (x, gate_up, down, gates)]
        return torch.autograd.grad((fn(*w) * c).sum(), w)

    got = grads(lambda x, gu, dn, g: selective_swiglu_experts(x, gu, dn, ids, g, retain=1.0))
    for name, a, b in zip(["x", "gate_up", "down", "gates"], got, grads(plain), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-14, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("activations", ["save", "recompute", "offload"])
@pytest.mark.parametrize("retain", [1.0, 0.75])
def test_save_outputs_changes_what_is_saved_not_the_gradients(activations, retain):
    """save_outputs=True keeps y for the router gradient below retain 1; the default computes it in the backward
    (<g W_down^T, phi>). The same pairs are kept (same seed) and the gradients agree to fp64 rounding, the
    router's included."""
    results = {}
    for save_outputs in (False, True):
        layer, x, c = make(retain=retain, selection="sample", activations=activations, save_outputs=save_outputs)
        layer = layer.double()
        torch.manual_seed(3)
        results[save_outputs] = grads(layer, x.double(), layer, c.double())
    (out_a, dx_a, g_a), (out_b, dx_b, g_b) = results[False], results[True]
    assert torch.equal(out_a, out_b)
    torch.testing.assert_close(dx_a, dx_b, rtol=1e-12, atol=1e-12)
    for name in g_a:
        torch.testing.assert_close(g_a[name], g_b[name], rtol=1e-12, atol=1e-12, msg=name)
    assert g_a["gate.weight"].abs().sum() > 0
