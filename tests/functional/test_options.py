"""Tests of lrmoe/functional/options.py: the two options objects, validated once, as the one declaration of every
option; LRMoE's flat keywords as a facade over them, held to their fields; the other entry points taking the
fields as ``**options``."""

from __future__ import annotations

import dataclasses
import inspect
import typing

import pytest
import torch

import lrmoe.functional._checks as checks
import lrmoe.functional.options as options_module
from lrmoe.functional import BackwardOptions, RoutingOptions, plan_experts, selective_swiglu_experts
from lrmoe.nn import LRMoE, SwiGLUExperts, from_transformers, replace_moe_blocks, swap_experts

D, FF, E, K, T = 8, 6, 4, 2, 24


@pytest.mark.parametrize("kwargs, exc, name", [
    ({"retain": 0.0}, ValueError, "retain"),
    ({"retain": torch.tensor(0.5)}, TypeError, "retain"),
    ({"retain": 0.5, "min_retain": 0.6}, ValueError, "min_retain"),
    ({"metric": "l2"}, ValueError, "metric"),
    ({"selection": "best"}, ValueError, "selection"),
    ({"policy": "even"}, ValueError, "policy"),
    ({"activations": "drop"}, ValueError, "activations"),
    ({"quota_align": 0}, ValueError, "quota_align"),
    ({"generator": 3}, TypeError, "generator"),
    ({"backward_capacity": 1.0}, ValueError, "backward_capacity needs retain < 1"),
    ({"retain": 0.5, "backward_capacity": 0.5}, ValueError, "backward_capacity"),
    ({"retain": 0.5, "backward_capacity": 1.0, "quota_align": 8}, ValueError, "quota_align"),
])
def test_backward_options_refuse_a_bad_field_naming_it(kwargs, exc, name):
    with pytest.raises(exc, match=name):
        BackwardOptions(**kwargs)


@pytest.mark.parametrize("kwargs, exc, name", [
    ({"score_func": "tanh"}, ValueError, "score_func"),
    ({"norm_topk_prob": 1}, TypeError, "norm_topk_prob"),
    ({"selection_bias": "yes"}, TypeError, "selection_bias"),
    ({"routed_scaling_factor": 0.0}, ValueError, "routed_scaling_factor"),
    ({"n_group": 2}, ValueError, "n_group and topk_group"),
    ({"router_dtype": torch.int32}, TypeError, "router_dtype"),
])
def test_routing_options_refuse_a_bad_field_naming_it(kwargs, exc, name):
    with pytest.raises(exc, match=name):
        RoutingOptions(**kwargs)


def test_options_are_frozen_and_replace_validates_again():
    opts = BackwardOptions(retain=0.5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.retain = 0.25
    assert dataclasses.replace(opts, retain=0.25).retain == 0.25
    with pytest.raises(ValueError, match="retain"):
        dataclasses.replace(opts, retain=1.5)


def _layer(seed=0, **kwargs):
    torch.manual_seed(seed)
    return LRMoE(D, FF, E, K, **kwargs)


def _step(layer, seed=1):
    torch.manual_seed(seed)
    x = torch.randn(T, D, requires_grad=True)
    c = torch.randn(T, D)
    out = layer(x)
    (out * c).sum().backward()
    return [out.detach(), x.grad] + [p.grad for p in layer.parameters()]


@pytest.mark.parametrize("flat", [
    {"retain": 0.75},
    {"retain": 0.5, "selection": "top", "metric": "grad_l2", "activations": "recompute"},
    {"retain": 0.5, "min_retain": 0.1, "policy": "proportional", "quota_align": 2},
    {"retain": 0.5, "backward_capacity": 1.25, "activations": "offload"},
])
def test_flat_keywords_and_the_options_object_give_equal_gradients(flat):
    """LRMoE(retain=0.75, ...) and LRMoE(backward=BackwardOptions(retain=0.75, ...)) are one layer: the same
    options object, and bit-identical outputs and gradients (sampling draws from the same seeded RNG)."""
    a, b = _layer(**flat), _layer(backward=BackwardOptions(**flat))
    assert a.backward == b.backward == BackwardOptions(**flat)
    got, want = _step(a), _step(b)
    assert len(got) == len(want) == 5  # out, x, gate, gate_up, down
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    dense = _step(_layer())  # and the options do something: the selective gradient differs from the dense one
    assert not torch.allclose(got[3], dense[3])


def test_routing_keywords_and_the_routing_object_give_equal_outputs():
    flat = {"score_func": "sigmoid", "norm_topk_prob": False, "routed_scaling_factor": 2.5, "n_group": 2,
            "topk_group": 1, "selection_bias": True, "router_dtype": torch.float32}
    a, b = _layer(**flat), _layer(routing=RoutingOptions(**flat))
    assert a.routing == b.routing and a.routing.score_func == "sigmoid" and b.routing.routed_scaling_factor == 2.5
    for g, w in zip(_step(a), _step(b), strict=True):
        assert torch.equal(g, w)


def test_the_options_object_is_validated_once_not_per_step(monkeypatch):
    """Built once (validated there), then read: a training step runs no option check."""
    opts = BackwardOptions(retain=0.5, selection="top")
    calls = []
    original = checks.check_retain
    monkeypatch.setattr(options_module, "check_retain", lambda *a: calls.append(a) or original(*a))
    layer = _layer(backward=opts)
    experts = SwiGLUExperts(E, D, FF, backward=opts)
    calls.clear()  # the modules are built (LRMoE builds its experts module, with default options, once)
    _step(layer)
    x = torch.randn(T, D)
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    experts(x, ids, torch.rand(T, K))
    selective_swiglu_experts(x, experts.gate_up_proj, experts.down_proj, ids, torch.rand(T, K), backward=opts)
    assert calls == []
    BackwardOptions(retain=0.5)  # the counter counts: building one checks it
    assert len(calls) == 1


def test_both_forms_at_once_are_refused_and_attributes_replace_the_object():
    with pytest.raises(TypeError, match=r"either as a BackwardOptions or as keywords, not both.*\['retain'\]"):
        LRMoE(D, FF, E, K, retain=0.5, backward=BackwardOptions())
    with pytest.raises(TypeError, match=r"either as a RoutingOptions or as keywords.*\['score_func'\]"):
        LRMoE(D, FF, E, K, score_func="sigmoid", routing=RoutingOptions())
    with pytest.raises(TypeError, match="expected a BackwardOptions"):
        LRMoE(D, FF, E, K, backward={"retain": 0.5})
    with pytest.raises(TypeError, match=r"unknown expert options \['retian'\]"):
        SwiGLUExperts(E, D, FF, retian=0.5)
    # Keywords at their defaults beside an object are no conflict.
    layer = LRMoE(D, FF, E, K, retain=1.0, backward=BackwardOptions(retain=0.5))
    assert layer.retain == 0.5
    layer.retain = 0.25  # a changed, validated copy
    assert layer.backward == BackwardOptions(retain=0.25)
    with pytest.raises(ValueError, match="retain must be in"):
        layer.retain = 1.5
    assert layer.retain == 0.25
    with pytest.raises(TypeError, match="either as a BackwardOptions or as keywords"):
        selective_swiglu_experts(torch.randn(T, D), torch.randn(E, 2 * FF, D), torch.randn(E, D, FF),
                                 torch.zeros(T, K, dtype=torch.long), torch.rand(T, K), retain=0.5,
                                 backward=BackwardOptions())


def test_swiglu_experts_takes_the_object_or_keywords_and_a_call_overrides_them():
    torch.manual_seed(0)
    a = SwiGLUExperts(E, D, FF, retain=0.5, selection="top")
    b = SwiGLUExperts(E, D, FF, backward=BackwardOptions(retain=0.5, selection="top"))
    b.load_state_dict(a.state_dict())
    assert a.backward == b.backward
    x, c = torch.randn(T, D), torch.randn(T, D)
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    gates = torch.rand(T, K)

    def down_grad(experts, **call):
        experts.zero_grad()
        (experts(x, ids, gates, **call) * c).sum().backward()
        return experts.down_proj.grad.clone()

    assert torch.equal(down_grad(a), down_grad(b))
    dense = down_grad(a, backward=BackwardOptions())  # a call's own object replaces the module's
    assert torch.equal(dense, down_grad(b, retain=1.0))  # as its keywords do
    assert not torch.allclose(dense, down_grad(a))
    assert "retain=0.5, selection='top'" in repr(a)


def test_a_layer_built_from_the_objects_compiles_fullgraph():
    # Dynamo and AOTAutograd trace it whole (fullgraph); Inductor's numerics are tests/nn/test_compile.py's.
    layer = _layer(backward=BackwardOptions(retain=0.5, selection="top"), routing=RoutingOptions(score_func="sigmoid"))
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    got, want = _step(compiled), _step(layer)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


# LRMoE's keyword-only arguments that are not options.
LAYER_ARGUMENTS = {"shared_hidden_dim", "backward", "routing"}


def _fields(cls) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def option_keyword_drift(function, classes, not_options) -> list[str]:
    """How ``function``'s option keywords (its keyword-only arguments outside ``not_options``) differ from the
    fields of the options ``classes``: missing or extra names, another default, another type (both resolved)."""
    params = {name: p for name, p in inspect.signature(function).parameters.items()
              if p.kind is p.KEYWORD_ONLY and name not in not_options}
    hints = typing.get_type_hints(function)
    fields = {name: (f, typing.get_type_hints(cls)[name]) for cls in classes for name, f in _fields(cls).items()}
    drift = [f"{name}: no keyword" for name in sorted(fields.keys() - params.keys())]
    drift += [f"{name}: not a field" for name in sorted(params.keys() - fields.keys())]
    for name in sorted(params.keys() & fields.keys()):
        field, field_type = fields[name]
        if not (params[name].default is field.default or params[name].default == field.default):
            drift.append(f"{name}: default {params[name].default!r}, field's {field.default!r}")
        if hints.get(name) != field_type:
            drift.append(f"{name}: type {hints.get(name)}, field's {field_type}")
    return drift


def test_lrmoe_keywords_are_the_options_fields_with_their_types_and_defaults():
    """LRMoE's flat keywords are a second spelling of BackwardOptions' and RoutingOptions' fields: the same names,
    types and defaults, none more, none missing (the next test plants drifts and sees each)."""
    assert not set(_fields(BackwardOptions)) & set(_fields(RoutingOptions))  # one flat namespace
    drift = option_keyword_drift(LRMoE.__init__, (BackwardOptions, RoutingOptions), LAYER_ARGUMENTS)
    assert drift == [], "LRMoE's keywords drifted from the options' fields: " + "; ".join(drift)


def _function_with_keywords(params: dict[str, tuple[object, object]]):
    """A function whose keyword-only arguments are ``params`` (name: (default, type))."""
    def fn(**kwargs): ...
    fn.__signature__ = inspect.Signature([
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=hint)
        for name, (default, hint) in params.items()])
    fn.__annotations__ = {name: hint for name, (_, hint) in params.items()}
    return fn


def test_the_keyword_check_sees_a_drift():
    """option_keyword_drift on signatures one drift away from BackwardOptions' fields: the check above can fail."""
    hints = typing.get_type_hints(BackwardOptions)
    exact = {f.name: (f.default, hints[f.name]) for f in dataclasses.fields(BackwardOptions)}

    def drift(params):
        return option_keyword_drift(_function_with_keywords(params), (BackwardOptions,), set())

    assert drift(exact) == []
    assert drift(exact | {"retain": (0.75, float)}) == ["retain: default 0.75, field's 1.0"]
    assert drift(exact | {"quota_align": (1, float)}) == ["quota_align: type <class 'float'>, field's <class 'int'>"]
    assert drift(exact | {"retian": (1.0, float)}) == ["retian: not a field"]
    assert drift({name: value for name, value in exact.items() if name != "kernels"}) == ["kernels: no keyword"]


def test_every_lrmoe_keyword_reaches_its_field():
    """Each keyword, changed from its default, lands in the options object (between them the two layers change
    every field: a new field must be added here)."""
    gen = torch.Generator().manual_seed(0)
    changed = [
        dict(retain=0.5, min_retain=0.1, metric="grad_l2", selection="top", activations="recompute",
             backward_capacity=1.25, generator=gen, kernels="portable", selective_in_eval=True, score_func="sigmoid",
             norm_topk_prob=False, routed_scaling_factor=2.5, n_group=2, topk_group=1, selection_bias=True,
             router_dtype=torch.float32),
        dict(retain=0.5, policy="proportional", quota_align=2, save_outputs=True),
    ]
    defaults = {name: f.default for cls in (BackwardOptions, RoutingOptions) for name, f in _fields(cls).items()}
    covered = {name for kwargs in changed for name, value in kwargs.items() if value != defaults[name]}
    assert covered == set(defaults)
    for kwargs in changed:
        layer = LRMoE(D, FF, E, K, **kwargs)
        for name, value in kwargs.items():
            opts = layer.backward if name in _fields(BackwardOptions) else layer.routing
            assert getattr(opts, name) is value or getattr(opts, name) == value, name


@pytest.mark.parametrize("function", [plan_experts, selective_swiglu_experts, SwiGLUExperts.__init__,
                                      SwiGLUExperts.forward, swap_experts, from_transformers, replace_moe_blocks])
def test_the_other_entry_points_take_the_fields_as_options_and_declare_none_again(function):
    params = inspect.signature(function).parameters
    declared = set(params) & (set(_fields(BackwardOptions)) | set(_fields(RoutingOptions)))
    assert declared == set()
    assert [p.name for p in params.values() if p.kind is p.VAR_KEYWORD] == ["options"]


def test_the_functions_take_every_backward_field_as_a_keyword():
    """plan_experts and selective_swiglu_experts take each BackwardOptions field as a keyword (kernels and
    selective_in_eval included), as the object does, and refuse another name, naming it."""
    torch.manual_seed(0)
    x, w_gu, w_d = torch.randn(T, D), torch.randn(E, 2 * FF, D), torch.randn(E, D, FF)
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    gates, c = torch.rand(T, K), torch.randn(T, D)
    flat = dict(retain=0.5, min_retain=0.1, metric="grad_l2", selection="sample", policy="proportional",
                activations="recompute", quota_align=2, kernels="portable", selective_in_eval=True,
                generator=None, backward_capacity=None, save_outputs=True)
    assert set(flat) == set(_fields(BackwardOptions))
    a, b = plan_experts(ids, E, **flat), plan_experts(ids, E, backward=BackwardOptions(**flat))
    assert torch.equal(a.quotas, b.quotas) and torch.equal(a.uniform, b.uniform)
    assert not torch.equal(a.quotas, plan_experts(ids, E, retain=0.5).quotas)  # proportional, aligned: others

    def down_grad(**kwargs):
        w = w_d.clone().requires_grad_(True)
        (selective_swiglu_experts(x, w_gu, w, ids, gates, **kwargs) * c).sum().backward()
        return w.grad

    assert torch.equal(down_grad(**flat), down_grad(backward=BackwardOptions(**flat)))
    for call in (lambda: plan_experts(ids, E, retian=0.5),
                 lambda: selective_swiglu_experts(x, w_gu, w_d, ids, gates, retian=0.5)):
        with pytest.raises(TypeError, match=r"unknown expert options \['retian'\]"):
            call()


def test_the_layer_has_one_typed_option_property_retain_and_no_generated_ones():
    """``layer.retain`` is a property written out in the class (a type checker sees it); every other option is
    read through ``layer.backward`` / ``layer.routing``, which hold them."""
    options = set(_fields(BackwardOptions)) | set(_fields(RoutingOptions))
    properties = {name for name in options if isinstance(inspect.getattr_static(LRMoE, name, None), property)}
    assert properties == {"retain"}
    assert typing.get_type_hints(LRMoE.retain.fget)["return"] is float
    layer = _layer(selection="top", score_func="sigmoid")
    assert (layer.backward.selection, layer.routing.score_func) == ("top", "sigmoid")
    with pytest.raises(AttributeError, match="selection"):
        layer.selection  # noqa: B018


def test_a_swiglu_experts_call_takes_its_arguments_explicitly_and_options_apart():
    torch.manual_seed(0)
    experts = SwiGLUExperts(E, D, FF, retain=0.5)
    params = inspect.signature(SwiGLUExperts.forward).parameters
    assert {name for name, p in params.items() if p.kind is p.KEYWORD_ONLY} == {
        "backward", "plan", "stats_probe", "out_shape", "step"}
    x = torch.randn(T, D)
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    gates = torch.rand(T, K)
    assert experts(x, ids, gates, out_shape=(2, T // 2, D)).shape == (2, T // 2, D)
    with pytest.raises(TypeError, match=r"SwiGLUExperts call: unknown expert options \['out_shap'\]"):
        experts(x, ids, gates, out_shap=(2, T // 2, D))
    with pytest.raises(TypeError, match=r"either as a BackwardOptions \(backward=\) or as fields.*\['retain'\]"):
        experts(x, ids, gates, backward=BackwardOptions(), retain=1.0)
    with pytest.raises(TypeError, match=r"a call with a step takes no options, got \['plan'\]"):
        experts(x, ids, gates, plan=plan_experts(ids, E), step=lambda *args: None)
