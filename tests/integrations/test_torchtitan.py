"""lrmoe.integrations.torchtitan on torchtitan's own Qwen3-MoE model (built by examples/train_torchtitan.py), CPU.

At retain 1 the converted model reproduces torchtitan's loss and every parameter's gradient: tightly against
torchtitan's MoE with its experts' math in fp32 (its GroupedExperts always computes in bf16), and to bf16 accuracy
against torchtitan's model as it is. A checkpoint of the unconverted model loads into the converted one. At retain
0.75 each layer keeps exactly floor(0.75 * rows) rows and the model trains, eagerly and under torchtitan's per-block
``torch.compile(fullgraph=True)``. Two gloo ranks with torchtitan's expert parallelism and FSDP2 match one device
planning the same quotas (``quota_blocks=2``).
"""

from __future__ import annotations

import copy
import importlib.util
import os
import pickle
import sys
import tempfile
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("torchtitan", reason="torchtitan is the optional extra lrmoe[torchtitan]")
# torchtitan's router asks for fp32 autocast around its gate, which CPU autocast declines with a warning per call.
pytestmark = pytest.mark.filterwarnings("ignore:In CPU autocast, but the target dtype is not supported:UserWarning")

import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torchtitan.models.common.moe import GroupedExperts, MoE  # noqa: E402

from lrmoe.functional.options import BackwardOptions  # noqa: E402
from lrmoe.integrations.torchtitan import (  # noqa: E402
    SelectiveBackwardConverter,
    SelectiveGroupedExperts,
    backward_stats,
    convert_moe,
    is_converted,
)

ROOT = Path(__file__).resolve().parents[2]


def _load_example():
    spec = importlib.util.spec_from_file_location("train_torchtitan", ROOT / "examples" / "train_torchtitan.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_torchtitan"] = module
    spec.loader.exec_module(module)
    return module


example = _load_example()


def small_args(*extra: str):
    return example.parse_args(["--dim", "32", "--layers", "2", "--experts", "8", "--top-k", "2", "--hidden-dim", "32",
                               "--vocab", "64", "--seq-len", "32", "--batch-size", "2", *extra])


def fp32_grouped_experts(self, x_RD, num_tokens_per_expert_E):
    """torchtitan's GroupedExperts.forward without its bf16 casts: the same grouped GEMMs, in x's dtype."""
    offsets_E = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
    h_RF = F.silu(torch._grouped_mm(x_RD, self.w1_EFD.transpose(-2, -1), offs=offsets_E))
    h_RF = h_RF * torch._grouped_mm(x_RD, self.w3_EFD.transpose(-2, -1), offs=offsets_E)
    return torch._grouped_mm(h_RF, self.w2_EDF.transpose(-2, -1), offs=offsets_E)


def randomise_expert_bias(model, seed):
    """A non-zero aux-loss-free bias in every layer, so routing depends on it (torchtitan starts it at zero)."""
    g = torch.Generator().manual_seed(seed)
    for module in model.modules():
        if isinstance(module, MoE):
            module.expert_bias_E.copy_(torch.randn(module.expert_bias_E.shape, generator=g) * 0.05)


def loss_and_grads(model, tokens):
    loss = example.loss_fn(model, tokens)
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def assert_grads_close(got, want, rtol):
    assert got.keys() == want.keys()
    for name in want:
        scale = want[name].abs().max().clamp(min=1e-12)
        err = (got[name] - want[name]).abs().max() / scale
        assert err <= rtol, f"{name}: max error {err:.2e} of the gradient's largest entry, want <= {rtol:.0e}"


@pytest.mark.parametrize("model_name, router", [("qwen3", "qwen3"), ("qwen3", "deepseek"), ("deepseek_v3", "deepseek")])
def test_retain_one_reproduces_torchtitan_and_loads_its_checkpoint(model_name, router):
    # A torchtitan checkpoint (another seed, a non-zero expert bias) loads into the converted model unchanged; then
    # its loss and every gradient equal torchtitan's own model's (experts in fp32 on both sides). Qwen3-MoE with its
    # softmax router or DeepSeek-V3's (sigmoid, groups, scaling, a shared expert); torchtitan's DeepSeek-V3 (MLA,
    # a dense first layer, two shared experts).
    args = small_args("--model", model_name, "--router", router)
    titan = example.build_model(args, torch.device("cpu"))
    randomise_expert_bias(titan, 1)
    for module in titan.modules():
        if isinstance(module, GroupedExperts):
            module.forward = fp32_grouped_experts.__get__(module)
    args.seed = 7
    model = example.build_model(args, torch.device("cpu"))
    params_before = dict(model.named_parameters())
    shapes_before = {k: v.shape for k, v in model.state_dict().items()}

    names = convert_moe(model, retain=1.0, compute_dtype=None)

    moes = [name for name, m in model.named_modules() if isinstance(m, MoE)]
    assert len(moes) == (5 if model_name == "deepseek_v3" else 2)
    assert names == [f"{name}.routed_experts.inner_experts" for name in moes]
    assert all(is_converted(model.get_submodule(n)) for n in names)
    assert dict(model.named_parameters()) == params_before  # the same Parameter objects, same names
    assert {k: v.shape for k, v in model.state_dict().items()} == shapes_before
    model.load_state_dict(titan.state_dict(), strict=True)
    if router == "deepseek":
        assert all(model.get_submodule(name).shared_experts is not None for name in moes)

    tokens = example.batch(args.vocab, 4, args.seq_len, step=0, rank=0, device=torch.device("cpu"))
    want_loss, want = loss_and_grads(titan, tokens)
    got_loss, got = loss_and_grads(model, tokens)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-6, atol=0)
    assert_grads_close(got, want, rtol=1e-5)
    for name in moes:  # the routers saw the same loads (torchtitan's expert-bias counter)
        torch.testing.assert_close(model.get_submodule(name).tokens_per_expert_E,
                                   titan.get_submodule(name).tokens_per_expert_E)


def test_convert_moe_swaps_the_class_of_the_same_modules():
    # Each layer's experts stay the same module object, with the same Parameter objects and hooks, and become the
    # one class lrmoe.integrations.torchtitan defines; nothing else in the model changes.
    model = example.build_model(small_args(), torch.device("cpu"))
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    types = {name: type(m) for name, m in modules.items()}
    calls = []
    hooks = [m.register_forward_hook(lambda module, args, out, name=name: calls.append(name))
             for name, m in modules.items() if type(m) is GroupedExperts]

    names = convert_moe(model, retain=0.5)

    assert len(names) == 2
    assert all(type(model.get_submodule(n)) is SelectiveGroupedExperts for n in names)
    after = dict(model.named_modules())
    assert list(after) == list(modules) and all(after[n] is modules[n] for n in modules)
    after = dict(model.named_parameters())
    assert list(after) == list(params) and all(after[n] is params[n] for n in params)
    assert {name: type(m) for name, m in model.named_modules()} == {
        **types, **{n: SelectiveGroupedExperts for n in names}}
    args = small_args()
    example.loss_fn(model, example.batch(args.vocab, 2, args.seq_len, 0, 0, torch.device("cpu"))).backward()
    assert calls == names  # the hooks registered before the swap run on the converted forward
    # The class is found by its name in the module, so a converted experts module pickles (torch.save of it).
    for hook in hooks:
        hook.remove()
    experts = pickle.loads(pickle.dumps(model.get_submodule(names[0])))
    assert type(experts) is SelectiveGroupedExperts and experts.lrmoe_backward.retain == 0.5


def test_retain_one_in_bf16_matches_torchtitan_as_it_is():
    # The default compute dtype is bf16, as torchtitan's GroupedExperts computes: against the untouched model the
    # loss and gradients agree to bf16 accuracy (the two round the SwiGLU differently).
    args = small_args()
    titan = example.build_model(args, torch.device("cpu"))
    model = copy.deepcopy(titan)
    convert_moe(model, retain=1.0)
    tokens = example.batch(args.vocab, 4, args.seq_len, step=0, rank=0, device=torch.device("cpu"))
    want_loss, want = loss_and_grads(titan, tokens)
    got_loss, got = loss_and_grads(model, tokens)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-3, atol=0)
    assert_grads_close(got, want, rtol=3e-2)


def test_retain_keeps_the_planned_rows_of_every_layer():
    args = small_args()
    model = example.build_model(args, torch.device("cpu"))
    convert_moe(model, retain=0.75, selection="top")
    tokens = example.batch(args.vocab, 4, args.seq_len, step=0, rank=0, device=torch.device("cpu"))
    example.loss_fn(model, tokens).backward()
    rows = 4 * args.seq_len * args.top_k
    stats = backward_stats(model)
    assert len(stats) == 2
    for s in stats.values():
        assert s["retained_rows"].item() == int(0.75 * rows)  # waterfill uses the whole budget
        assert s["backward_calls"].item() == 1
        assert 0.75 < s["score_mass_fraction"].item() < 1  # top selection keeps more than its share of the mass
    assert all(s["backward_calls"].item() == 0 for s in backward_stats(model).values())  # read and reset
    # No backward: no plan, no RNG draw, the same output as at retain 1.
    state = torch.get_rng_state()
    with torch.no_grad():
        out = model(tokens[:, :-1])
    assert torch.equal(torch.get_rng_state(), state)
    dense = copy.deepcopy(model)
    for module in dense.modules():
        if is_converted(module):
            module.lrmoe_backward = BackwardOptions(retain=1.0)
    with torch.no_grad():
        torch.testing.assert_close(out, dense(tokens[:, :-1]), rtol=0, atol=0)


def test_any_retain_a_step_allows_converts_and_trains():
    # Conversion checks the options, not a step size: a retain keeping floor(retain * rows) >= 1 of a real step's
    # rows converts (here 128 rows a layer: 0.01 keeps one), by convert_moe and by the converter, and trains.
    args = small_args()
    tokens = example.batch(args.vocab, 2, args.seq_len, step=0, rank=0, device=torch.device("cpu"))
    rows = 2 * args.seq_len * args.top_k
    for retain in (0.3, 0.01):
        model = example.build_model(args, torch.device("cpu"))
        convert_moe(model, retain=retain)
        SelectiveBackwardConverter(SelectiveBackwardConverter.Config(retain=retain))
        example.loss_fn(model, tokens).backward()
        assert [s["retained_rows"].item() for s in backward_stats(model).values()] == [int(retain * rows)] * 2
    # A step with no row to keep (one sequence: 64 rows, floor(0.64) = 0) is refused by that step, with quota
    # blocks too.
    with pytest.raises(ValueError, match=r"retain=0.01 keeps floor\(retain \* P\) = 0 of the step's P = 64"):
        example.loss_fn(model, tokens[:1]).backward()
    blocks = example.build_model(args, torch.device("cpu"))
    convert_moe(blocks, retain=0.01, quota_blocks=2)
    with pytest.raises(ValueError, match=r"retain=0.01 keeps floor\(retain \* P\) = 0 of the step's P = 64"):
        example.loss_fn(blocks, tokens[:1]).backward()


def test_example_trains_at_retain_03(capsys):
    example.main(["--dim", "32", "--experts", "8", "--hidden-dim", "32", "--vocab", "64", "--seq-len", "32",
                  "--steps", "2", "--retain", "0.3"])
    out = capsys.readouterr().out
    rows = 4 * 32 * 2  # the example's 4 sequences of 32 tokens, top-2, per layer
    assert "converted 2 MoE layers' experts: retain 0.3" in out
    assert f"kept rows {int(0.3 * rows) / rows:.3f}" in out


@pytest.mark.parametrize("selection", ["sample", "top"])
@pytest.mark.parametrize("quota_blocks", [1, 2])
def test_same_batch_same_gradients_and_no_global_rng(selection, quota_blocks):
    # The plan is a function of the model and the batch: the same batch twice gives the same gradients, and the
    # global RNG is neither read nor moved (selection "sample" draws keyed uniforms, per block with quota_blocks).
    args = small_args()
    model = example.build_model(args, torch.device("cpu"))
    convert_moe(model, retain=0.5, selection=selection, quota_blocks=quota_blocks, compute_dtype=None)
    tokens = example.batch(args.vocab, 2, args.seq_len, step=0, rank=0, device=torch.device("cpu"))
    grads = []
    for seed in (1, 2):  # a different global RNG state each time: it must not matter
        torch.manual_seed(seed)
        state = torch.get_rng_state()
        grads.append(loss_and_grads(model, tokens)[1])
        assert torch.equal(torch.get_rng_state(), state)
        model.zero_grad(set_to_none=True)
    assert_grads_close(grads[1], grads[0], rtol=0)


def test_eval_mode_backward_is_exact_unless_selective_in_eval():
    # As LRMoE: in eval() the converted experts' backward keeps every row (the gradients of retain 1), unless
    # selective_in_eval=True; train() makes it selective again.
    args = small_args()
    tokens = example.batch(args.vocab, 2, args.seq_len, step=0, rank=0, device=torch.device("cpu"))
    rows = 2 * args.seq_len * args.top_k
    dense = example.build_model(args, torch.device("cpu"))
    selective, in_eval = copy.deepcopy(dense), copy.deepcopy(dense)
    convert_moe(dense, retain=1.0, compute_dtype=None)
    convert_moe(selective, retain=0.5, compute_dtype=None)
    _, want = loss_and_grads(dense.eval(), tokens)
    _, got = loss_and_grads(selective.eval(), tokens)
    assert_grads_close(got, want, rtol=1e-6)
    assert [s["retained_rows"].item() for s in backward_stats(selective).values()] == [rows] * 2
    loss_and_grads(selective.train(), tokens)
    assert [s["retained_rows"].item() for s in backward_stats(selective).values()] == [rows // 2] * 2
    convert_moe(in_eval, retain=0.5, compute_dtype=None, selective_in_eval=True)
    loss_and_grads(in_eval.eval(), tokens)
    assert [s["retained_rows"].item() for s in backward_stats(in_eval).values()] == [rows // 2] * 2
    # The converter takes it too, and BackwardOptions checks its value.
    SelectiveBackwardConverter(SelectiveBackwardConverter.Config(retain=0.5, options={"selective_in_eval": True}))
    with pytest.raises(TypeError, match="selective_in_eval must be a bool"):
        convert_moe(example.build_model(args, torch.device("cpu")), retain=0.5, selective_in_eval="yes")


@pytest.fixture
def dynamo_config_restored():
    """torchtitan's apply_compile sets two global dynamo options; later tests get them back as they were."""
    keys = ("capture_scalar_outputs", "skip_fwd_side_effects_in_bwd_under_checkpoint")
    with torch._dynamo.config.patch({k: getattr(torch._dynamo.config, k) for k in keys}):
        yield
    torch._dynamo.reset()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_retain_075_trains(compiled, capsys, dynamo_config_restored):
    # examples/train_torchtitan.py as the README runs it: torchtitan's step order, its expert-bias hook; compiled
    # with torchtitan's apply_compile (every block fullgraph=True; aot_eager keeps the test fast, the graph
    # breaks it would find are the same as inductor's).
    extra = ["--steps", "12", "--retain", "0.75", "--lr", "1e-2"]
    if compiled:
        extra += ["--compile", "--compile-backend", "aot_eager"]
        torch._dynamo.reset()
    losses = example.main(["--dim", "32", "--experts", "8", "--hidden-dim", "32", "--vocab", "64", "--seq-len", "32",
                           *extra])
    out = capsys.readouterr().out
    assert "converted 2 MoE layers' experts: retain 0.75" in out
    assert "kept rows 0.750" in out
    assert losses[-1] < losses[0] - 0.5, losses  # from about log(64) = 4.16


def test_converter_builds_what_convert_moe_makes():
    # SelectiveBackwardConverter rewrites the config before the build (torchtitan's converters, for its trainer):
    # the built model has converted experts with the same parameter names, and the same gradients as a model
    # converted after its build.
    args = small_args()
    cfg = example.model_config(dim=args.dim, layers=args.layers, experts=args.experts, top_k=args.top_k,
                               hidden_dim=args.hidden_dim, vocab=args.vocab, seq_len=args.seq_len)
    converter = SelectiveBackwardConverter(SelectiveBackwardConverter.Config(
        retain=0.75, compute_dtype=None, options={"selection": "top"}))
    cfg = converter.convert(cfg)
    assert [type(layer.moe.routed_experts.inner_experts) for layer in cfg.layers] == [
        SelectiveGroupedExperts.Config] * args.layers
    torch.manual_seed(args.seed)
    built = cfg.build()
    assert [type(layer.moe.routed_experts.inner_experts) for layer in built.layers.values()] == [
        SelectiveGroupedExperts] * args.layers
    built.init_states(buffer_device=torch.device("cpu"))
    swapped = example.build_model(args, torch.device("cpu"))
    convert_moe(swapped, retain=0.75, compute_dtype=None, selection="top")
    assert [n for n, m in built.named_modules() if is_converted(m)] == [
        n for n, m in swapped.named_modules() if is_converted(m)] != []
    assert built.state_dict().keys() == swapped.state_dict().keys()
    tokens = example.batch(args.vocab, 4, args.seq_len, step=0, rank=0, device=torch.device("cpu"))
    _, want = loss_and_grads(swapped, tokens)
    _, got = loss_and_grads(built, tokens)
    assert_grads_close(got, want, rtol=0)
    with pytest.raises(ValueError, match="already converted"):
        converter.convert(cfg)
    with pytest.raises(TypeError, match="compute_dtype must name a torch dtype"):
        SelectiveBackwardConverter(SelectiveBackwardConverter.Config(retain=0.5, compute_dtype="bf16"))


def test_converts_a_model_built_on_meta():
    # torchtitan's trainer builds on the meta device, then to_empty and init_states: the statistics probe follows.
    args = small_args()
    cfg = example.model_config(dim=args.dim, layers=args.layers, experts=args.experts, top_k=args.top_k,
                               hidden_dim=args.hidden_dim, vocab=args.vocab, seq_len=args.seq_len)
    with torch.device("meta"):
        model = cfg.build()
    names = convert_moe(model, retain=0.5)
    model.to_empty(device="cpu")
    model.init_states(buffer_device=torch.device("cpu"))
    assert all(model.get_submodule(n).lrmoe_stats_probe.tensor.device.type == "cpu" for n in names)
    example.loss_fn(model, example.batch(args.vocab, 2, args.seq_len, 0, 0, torch.device("cpu"))).backward()
    rows = 2 * args.seq_len * args.top_k
    assert [s["retained_rows"].item() for s in backward_stats(model).values()] == [rows // 2] * 2


def test_refusals():
    args = small_args()
    model = example.build_model(args, torch.device("cpu"))
    with pytest.raises(TypeError, match="unknown options.*'retian'"):
        convert_moe(model, retain=0.5, retian=0.5)
    with pytest.raises(ValueError, match="retain"):
        convert_moe(model, retain=1.5)
    with pytest.raises(ValueError, match="selection"):
        convert_moe(model, retain=0.5, selection="best")
    with pytest.raises(ValueError, match="quota_blocks=3 does not divide"):
        convert_moe(model, retain=0.5, quota_blocks=3)
    with pytest.raises(ValueError, match="no torchtitan MoE layer"):
        convert_moe(torch.nn.Linear(2, 2), retain=0.5)
    assert not any(is_converted(m) for m in model.modules())  # refused calls converted nothing
    other = copy.deepcopy(model)  # a second layer that cannot be converted: the first stays torchtitan's too
    other.layers["1"].moe.routed_experts.inner_experts = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match=r"layers\.1\.moe\.routed_experts\.inner_experts is a Linear"):
        convert_moe(other, retain=0.5)
    assert not any(is_converted(m) for m in other.modules())
    convert_moe(model, retain=0.5)
    with pytest.raises(ValueError, match="already converted"):
        convert_moe(model, retain=0.5)


class ForwardExperts(GroupedExperts):
    """A user's GroupedExperts with its own forward: the converted forward would replace it."""

    def forward(self, x_RD, num_tokens_per_expert_E):
        return 2 * super().forward(x_RD, num_tokens_per_expert_E)


class InitExperts(GroupedExperts):
    """A user's GroupedExperts with its own parameter init and its own Config (so its configs build it)."""

    @dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        scale: float = 0.5

    def _init_self_parameters(self):
        super()._init_self_parameters()
        with torch.no_grad():
            self.w2_EDF.mul_(0.5)


@pytest.mark.parametrize("subclass", [ForwardExperts, InitExperts])
def test_subclasses_of_grouped_experts_are_refused(subclass):
    # The converted forward replaces GroupedExperts.forward, so a subclass's overrides would be dropped without a
    # word: convert_moe refuses the layer, naming it and its class, before converting any layer.
    model = example.build_model(small_args(), torch.device("cpu"))
    layers = [model.layers[i].moe.routed_experts.inner_experts for i in ("0", "1")]
    layers[1].__class__ = subclass
    with pytest.raises(TypeError, match=rf"layers\.1\.moe\.routed_experts\.inner_experts is a .*{subclass.__name__}, "
                                        r"a subclass of torchtitan's GroupedExperts"):
        convert_moe(model, retain=0.5)
    assert [type(m) for m in layers] == [GroupedExperts, subclass]
    assert not any(is_converted(m) for m in model.modules())
    assert not any(hasattr(m, "lrmoe_backward") for m in layers)


def test_converter_refuses_configs_of_subclasses():
    # The converter builds torchtitan's GroupedExperts' configs only: a config whose class builds a subclass (its
    # _owner) is refused, naming where it is, and the model config is left as it was.
    args = small_args()
    cfg = example.model_config(dim=args.dim, layers=args.layers, experts=args.experts, top_k=args.top_k,
                               hidden_dim=args.hidden_dim, vocab=args.vocab, seq_len=args.seq_len)
    inner = cfg.layers[1].moe.routed_experts.inner_experts
    custom = InitExperts.Config(dim=inner.dim, hidden_dim=inner.hidden_dim, num_experts=inner.num_experts)
    cfg.layers[1].moe.routed_experts.inner_experts = custom
    converter = SelectiveBackwardConverter(SelectiveBackwardConverter.Config(retain=0.5))
    with pytest.raises(TypeError, match=r"layers\.1\.moe\.routed_experts\.inner_experts builds a .*InitExperts, "
                                        r"a subclass of torchtitan's GroupedExperts"):
        converter.convert(cfg)
    assert type(cfg.layers[0].moe.routed_experts.inner_experts) is GroupedExperts.Config
    assert cfg.layers[1].moe.routed_experts.inner_experts is custom


def test_no_class_is_made_at_run_time():
    # The integration's classes are the ones its source defines: no type(name, bases, namespace) call, no class
    # statement inside a function (each call of such a function would make a new class), no dataclasses.make_dataclass
    # or types.new_class.
    import ast

    source = (ROOT / "lrmoe" / "integrations" / "torchtitan.py").read_text()
    found = []

    def visit(node, in_function):
        if isinstance(node, ast.ClassDef) and in_function:
            found.append(f"line {node.lineno}: class {node.name} inside a function")
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
            if name == "type" and len(node.args) + len(node.keywords) >= 2:
                found.append(f"line {node.lineno}: type() with {len(node.args)} arguments")
            if name in ("make_dataclass", "new_class", "prepare_class"):
                found.append(f"line {node.lineno}: {name}()")
        inside = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inside)

    visit(ast.parse(source), False)
    assert found == []


# ---------------------------------------------------------------- expert parallelism, 2 gloo ranks

EP_STEPS = 3
SELECTIONS = ("top", "sample")


def _ep_worker(rank, world_size, store, results):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=120))
    try:
        cpu = torch.device("cpu")
        args = small_args("--ep", str(world_size))
        dims = example.parallel_dims(world_size, world_size, cpu)
        out = {}
        for selection in SELECTIONS:
            model = example.build_model(args, cpu)
            convert_moe(model, retain=0.75, selection=selection, compute_dtype=None)
            example.parallelize(model, dims)
            w1 = model.layers["0"].moe.routed_experts.inner_experts.w1_EFD
            assert isinstance(w1, DTensor) and w1.to_local().shape[0] == args.experts // world_size
            opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
            losses, grads = [], None
            for step in range(EP_STEPS):
                tokens = example.batch(args.vocab, 2, args.seq_len, step, rank, cpu)
                loss = example.train_step(model, tokens, world_size)
                dist.all_reduce(loss)
                losses.append(loss.item() / world_size)
                if step == 0:
                    grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
                             for n, p in model.named_parameters()}
                opt.step()
                opt.zero_grad()
            out[selection] = {"losses": losses, "grads": grads}
        if rank == 0:
            torch.save(out, results)
    finally:
        dist.barrier()
        dist.destroy_process_group()


def test_expert_parallel_matches_single_device():
    # Both selections: "sample" draws each rank's uniforms keyed on the rows it received, and quota_blocks=2
    # keys each block's on that block's rows, so the two draw the same.
    os.environ["OMP_NUM_THREADS"] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        results = os.path.join(tmp, "results.pt")
        mp.spawn(_ep_worker, args=(2, os.path.join(tmp, "store"), results), nprocs=2, join=True)
        ep = torch.load(results)

    # One device, both ranks' sequences in rank order, quotas planned per block of 4 experts as each rank plans.
    cpu = torch.device("cpu")
    args = small_args()
    for selection in SELECTIONS:
        model = example.build_model(args, cpu)
        convert_moe(model, retain=0.75, selection=selection, compute_dtype=None, quota_blocks=2)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        losses = []
        for step in range(EP_STEPS):
            tokens = torch.cat([example.batch(args.vocab, 2, args.seq_len, step, r, cpu) for r in range(2)])
            loss, grads = loss_and_grads(model, tokens)
            losses.append(loss.item())
            if step == 0:
                assert_grads_close(ep[selection]["grads"], grads, rtol=1e-4)
            opt.step()
            opt.zero_grad()
        torch.testing.assert_close(torch.tensor(ep[selection]["losses"]), torch.tensor(losses), rtol=1e-5, atol=0)
        assert losses[-1] < losses[0]


@pytest.mark.parametrize("quota_blocks", [1, 2])
def test_a_rank_of_expert_parallelism_that_keeps_no_row_runs(quota_blocks, tmp_path):
    """Under torchtitan's expert parallelism (the experts' weights DTensors sharded on the experts) a rank's rows
    are its part of the step, planned apart from the others': a rank that keeps none of its few rows is valid, and
    a refusal there alone would leave the other ranks waiting in the combine's all-to-all. One process, a 1-rank
    mesh: 1 row at retain 0.3 keeps none and runs (the output is the dense one); the same experts with plain
    weights are the whole step and refuse it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    model = example.build_model(small_args(), torch.device("cpu"))
    convert_moe(model, retain=0.3, compute_dtype=None, quota_blocks=quota_blocks)
    experts = model.layers["0"].moe.routed_experts.inner_experts
    x_RD = torch.randn(1, experts.w1_EFD.shape[2], requires_grad=True)
    counts_E = torch.zeros(experts.w1_EFD.shape[0], dtype=torch.long)
    counts_E[3] = 1
    with pytest.raises(ValueError, match=r"retain=0\.3 keeps floor\(retain \* P\) = 0"):
        experts(x_RD, counts_E)
    with torch.no_grad():  # no backward: exact at any retain, the reference
        dense = experts(x_RD, counts_E)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        for name in ("w1_EFD", "w2_EDF", "w3_EFD"):
            weight = getattr(experts, name)
            setattr(experts, name, torch.nn.Parameter(distribute_tensor(weight.detach(), mesh, [Shard(0)])))
        out = experts(x_RD, counts_E)
        torch.testing.assert_close(out, dense, rtol=0, atol=0)
        out.sum().backward()
        assert experts.w1_EFD.grad.to_local().abs().sum() == 0  # no row kept: no expert gradient
    finally:
        dist.destroy_process_group()
