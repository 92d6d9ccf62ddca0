"""Put LRMoE into a transformers model, two ways.

``swap_experts(model, retain=0.75)``: transformers' MoE blocks (Qwen3-MoE's Qwen3MoeSparseMoeBlock, GLM-4.5's
Glm4MoeMoE, DeepSeek-V3's DeepseekV3MoE) route with their own router and call their experts module as
``experts(hidden_states, top_k_index, top_k_weights)`` on [T, D] tokens, the call :class:`~lrmoe.nn.SwiGLUExperts`
takes. Swapping only the experts keeps everything else of the model: its routing, its router logits
(``output_router_logits`` and the auxiliary loss), shared experts, checkpoint names and loading; the experts'
backward becomes the selective one.

``replace_moe_blocks(model, retain=0.75)``: each of those blocks becomes an :class:`~lrmoe.nn.LRMoE` with its
configuration, its Parameter objects and its router module (``from_transformers``), so LRMoE's statistics, expert
parallelism (``ExpertParallel``) and ``update_selection_bias`` apply, while transformers still records the router's
logits for its auxiliary loss.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lrmoe.functional.routing import Routing
from lrmoe.functional.options import BackwardOptions, resolve_options
from lrmoe.nn.lrmoe import LRMoE, SwiGLUExperts

__all__ = ["TransformersRoutedLRMoE", "from_transformers", "replace_moe_blocks", "swap_experts"]

# The transformers blocks whose forward LRMoE computes: router, gates, experts and shared expert alike.
BLOCKS = ("Qwen3MoeSparseMoeBlock", "Glm4MoeMoE", "DeepseekV3MoE")


def _fused_experts(module: nn.Module) -> bool:
    """Holds fused 3-D expert weights the way transformers' experts modules do."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter) and gate_up.dim() == 3
            and down.dim() == 3)


def _is_activation(module: nn.Module) -> bool:
    return isinstance(module, nn.SiLU) or type(module).__name__ == "SiLUActivation"


def _default_apply_gate():
    """transformers' plain gate * up combination of its experts integration (silu(gate) * up), or None."""
    try:
        from transformers.integrations.moe import _default_apply_gate as default
    except ImportError:  # an older transformers: no such hook, so an experts class cannot override it
        return None
    return default


def _why_not_swiglu(module: nn.Module) -> str | None:
    """None when the module is E SwiGLU experts with gate_up_proj [E, 2F, D] (gate half first) and down_proj
    [E, D, F] and nothing else; otherwise what differs."""
    held = sorted(name for name, _ in module.named_parameters())
    if held != ["down_proj", "gate_up_proj"]:
        return f"it holds parameters {held}, expected gate_up_proj and down_proj only (no biases, no norms)"
    act = getattr(module, "act_fn", None)
    if not _is_activation(act):
        return f"its activation is {type(act).__name__}, expected SiLU (SwiGLU experts)"
    others = [name for name, child in module.named_children() if child is not act]
    if others:
        return f"it holds submodules {others} (a norm?) beside its activation"
    if getattr(module, "is_transposed", False):
        return "its weights are stored transposed (is_transposed=True)"
    if getattr(module, "has_post_expert_norm", False):
        return "it normalises the experts' outputs (has_post_expert_norm=True)"
    apply_gate = getattr(type(module), "_apply_gate", None)
    if apply_gate is not None and apply_gate is not _default_apply_gate():
        return "it combines gate and up its own way (_apply_gate overridden: a clamp, a limit?)"
    (n_exp, two_f, dim), (n_exp_down, dim_down, hidden) = module.gate_up_proj.shape, module.down_proj.shape
    if n_exp_down != n_exp or dim_down != dim or two_f != 2 * hidden:
        return (f"gate_up_proj {tuple(module.gate_up_proj.shape)} and down_proj {tuple(module.down_proj.shape)} "
                "are not [E, 2F, D] and [E, D, F]")
    return None


def swap_experts(model: nn.Module, *, backward: BackwardOptions | None = None, **options) -> list[str]:
    """Replace every experts module of a transformers model (fused 3-D ``gate_up_proj`` [E, 2F, D] and
    ``down_proj`` [E, D, F], SiLU) by a :class:`~lrmoe.nn.SwiGLUExperts` that holds the same Parameter objects and
    runs :func:`~lrmoe.functional.selective_swiglu_experts` with ``backward`` (a
    :class:`~lrmoe.functional.BackwardOptions`) or ``options`` (its fields as keywords: retain, selection,
    metric, ...; not both) on every call.

    The parameters are the same objects, so state_dict names, loaded weights and an optimiser built before stay
    valid. At retain 1 the model's outputs and gradients are those of transformers' experts (up to summation
    order). The new modules are built on the meta device and take the old parameters: no copy, no allocation.
    Each module's ``stats()`` gives the last step's loads and kept pairs and the backward statistics, as
    LRMoE's does (``reset_stats()`` once per optimiser step).

    Call it before sharding (``fully_shard``, ``parallelize_module``): FSDP would keep gathering onto the old
    modules. Expert ids are used as given: transformers' own expert-parallel marker (id E for a token's expert held
    elsewhere) is not supported.

    Returns the qualified names of the replaced modules, in ``named_modules`` order. Raises ValueError when
    ``model`` holds no such module (or only SwiGLUExperts already), or one whose fused 3-D weights are not plain
    SwiGLU experts (biases, another activation, a norm, transposed storage, a gate function of its own) or are
    sharded DTensors, naming it; TypeError / ValueError for bad options. All before any change.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    found = [(name, module) for name, module in model.named_modules() if _fused_experts(module)
             and not isinstance(module, SwiGLUExperts)]
    if not found:
        if any(isinstance(module, SwiGLUExperts) for module in model.modules()):
            raise ValueError("model's experts are SwiGLUExperts already (swapped before?); set their .backward "
                             "(a BackwardOptions) to change the options")
        raise ValueError("model holds no experts module with fused 3-D gate_up_proj and down_proj parameters")
    backward = resolve_options(BackwardOptions, backward, "swap_experts", **options)
    for name, module in found:
        if not name:
            raise ValueError("model is itself an experts module; swap it in its parent (or build SwiGLUExperts)")
        if isinstance(module.gate_up_proj, DTensor) or isinstance(module.down_proj, DTensor):
            raise ValueError(f"cannot swap {name}: its weights are DTensors (sharded by fully_shard or a parallel "
                             "style); call swap_experts before fully_shard / parallelize_module")
        why = _why_not_swiglu(module)
        if why is not None:
            raise ValueError(f"cannot swap {name} ({type(module).__name__}): {why}")
    swapped = []
    for name, module in found:
        n_exp, two_f, dim = module.gate_up_proj.shape
        with torch.device("meta"):
            experts = SwiGLUExperts(n_exp, dim, two_f // 2, backward=backward)
        experts.gate_up_proj, experts.down_proj = module.gate_up_proj, module.down_proj
        experts._init_records(n_exp, module.gate_up_proj.device)  # stats() on the weights' device
        experts.train(module.training)
        model.set_submodule(name, experts)
        swapped.append(name)
    return swapped


def _block_kind(module: nn.Module) -> str | None:
    """Which of BLOCKS the module is (or subclasses, as FSDP's and other wrappers' swapped classes do), or None."""
    return next((cls.__name__ for cls in type(module).__mro__ if cls.__name__ in BLOCKS), None)


class TransformersRoutedLRMoE(LRMoE):
    """An LRMoE whose router (``gate``) is a transformers block's own router module, called as the block calls it:
    ``gate(x_TD) -> (router_logits, gates, expert_ids)``. transformers' recording of router logits
    (``output_router_logits``, the auxiliary loss) sees it; the rest is LRMoE's, expert parallelism included.
    Built by :func:`from_transformers`."""

    def route(self, x_TD: torch.Tensor) -> Routing:
        logits_TE, gates_TK, expert_ids_TK = self.gate(x_TD)
        scores_TE = (logits_TE.float().sigmoid() if self.routing.score_func == "sigmoid"
                     else logits_TE.float().softmax(-1))
        return Routing(expert_ids=expert_ids_TK, gates=gates_TK, scores=scores_TE)


def from_transformers(block: nn.Module, **options) -> LRMoE:
    """A :class:`TransformersRoutedLRMoE` (an :class:`~lrmoe.nn.LRMoE`) computing what a transformers MoE block
    computes (``BLOCKS``: Qwen3-MoE's softmax router; GLM-4.5's and DeepSeek-V3's sigmoid router with its selection
    bias, groups and scaled gates, and their shared expert). It holds the block's router module, as ``gate``, and
    its expert and shared-expert Parameter objects (no copy; the layer's own tensors are built on the meta device,
    then placed on the block's), so state_dict names are the block's. ``options``: LRMoE's backward options
    (``backward=BackwardOptions(...)``, or its fields as keywords: retain, selection, ...); the routing comes from
    the block. At retain 1 the layer's outputs and gradients are the block's (up to summation order).

    Raises ValueError for another block class or experts that are not plain SwiGLU experts, TypeError for an
    option that is not LRMoE's or that the block fixes, naming it.
    """
    name = _block_kind(block)
    if name is None:
        raise ValueError(f"from_transformers takes a transformers {', '.join(BLOCKS)}, got {type(block).__name__}")
    if any(isinstance(p, DTensor) for p in block.parameters()):
        raise ValueError(f"cannot convert {name}: its weights are DTensors (sharded by fully_shard or a parallel "
                         "style); convert before fully_shard / parallelize_module")
    why = _why_not_swiglu(block.experts)
    if why is not None:
        raise ValueError(f"cannot convert {name}: its experts ({type(block.experts).__name__}): {why}")
    fixed = {"dim", "hidden_dim", "num_experts", "top_k", "score_func", "norm_topk_prob", "routed_scaling_factor",
             "n_group", "topk_group", "selection_bias", "router_dtype", "shared_hidden_dim", "routing"}
    if fixed & set(options):
        raise TypeError(f"from_transformers takes its routing from the block; got {sorted(fixed & set(options))}")
    gate, experts, shared = block.gate, block.experts, getattr(block, "shared_experts", None)
    n_exp, two_f, dim = experts.gate_up_proj.shape
    config = dict(dim=dim, hidden_dim=two_f // 2, num_experts=n_exp, top_k=gate.top_k,
                  norm_topk_prob=gate.norm_topk_prob)
    if name != "Qwen3MoeSparseMoeBlock":
        config |= dict(score_func="sigmoid", selection_bias=True, n_group=gate.num_group, topk_group=gate.topk_group,
                       routed_scaling_factor=gate.routed_scaling_factor, router_dtype=torch.float32,
                       shared_hidden_dim=shared.gate_proj.out_features)
    with torch.device("meta"):
        layer = TransformersRoutedLRMoE(**config, **options)
    layer.gate = gate
    layer.experts.gate_up_proj, layer.experts.down_proj = experts.gate_up_proj, experts.down_proj
    if shared is not None:
        for proj in ("gate_proj", "up_proj", "down_proj"):
            getattr(layer.shared_experts, proj).weight = getattr(shared, proj).weight
    # The layer's own state (statistics, the backward probe), and its experts', on the block's device.
    layer._init_records(n_exp, gate.weight.device)
    layer.experts._init_records(n_exp, gate.weight.device)
    # The block's submodule order (transformers registers its experts before its router), so named_parameters()
    # and state_dict() list the tensors as the block did: an optimizer's state, saved by position, still fits.
    order = [name for name in block._modules if name in layer._modules]
    modules = {name: layer._modules[name] for name in order + [n for n in layer._modules if n not in order]}
    layer._modules.clear()
    layer._modules.update(modules)
    layer.train(block.training)
    return layer


def replace_moe_blocks(model: nn.Module, **options) -> list[str]:
    """Replace every transformers MoE block of ``model`` (``BLOCKS``) by ``from_transformers(block, **options)``:
    the same weights and router (the same modules and Parameter objects in the block's order, so state_dict names,
    loaded checkpoints, an optimizer's state and ``output_router_logits`` stay valid), LRMoE's selective backward,
    statistics and expert parallelism. Call it before sharding.

    Returns the replaced blocks' names. Raises ValueError when ``model`` holds none, and as ``from_transformers``
    does; all before any change.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    found = [(name, block) for name, block in model.named_modules() if _block_kind(block) and name]
    if not found:
        raise ValueError(f"model holds no transformers MoE block ({', '.join(BLOCKS)})")
    layers = [(name, from_transformers(block, **options)) for name, block in found]  # every check first
    for name, layer in layers:
        model.set_submodule(name, layer)
    return [name for name, _ in layers]
