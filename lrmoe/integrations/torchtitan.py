"""lrmoe's selective backward inside torchtitan (0.3.0) MoE models: ``convert_moe(model, retain=0.75)``.

torchtitan's MoE layer (``torchtitan.models.common.moe.MoE``, used by its Qwen3-MoE and DeepSeek-V3 families) runs
router -> token dispatcher -> ``GroupedExperts`` -> dispatcher's combine -> + shared experts. The dispatcher hands
the experts R rows, one per routed (token, expert) pair, sorted by expert (after its all-to-all under torchtitan's
expert parallelism), and the counts per local expert; the combine multiplies each returned row by its gate
(``topk_scores``, always after the experts in torchtitan 0.3.0) and scatter-adds rows into tokens.

``convert_moe`` changes only the experts' computation: each ``GroupedExperts`` module becomes a
:class:`SelectiveGroupedExperts`, the one subclass this module defines (a class swap, as FSDP2's ``fully_shard``
does: the same module object, with its parameters and hooks), whose forward runs
:func:`lrmoe.functional.selective_swiglu_experts` on those rows, each row a pair with gate 1 (K = 1). Everything else
is torchtitan's: router, expert bias (aux-loss-free balancing), shared experts, dispatcher, combine. So the pairs,
gates and forward are the ones torchtitan computes, the parameters stay the same ``w1_EFD`` [E, F, D] (gate),
``w2_EDF`` [E, D, F] (down), ``w3_EFD`` [E, F, D] (up) objects, and state_dict keys and shapes are unchanged: a
torchtitan checkpoint loads as it is. ``SelectiveBackwardConverter`` does the same through torchtitan's model
converters (a config rewrite before the build), for torchtitan's own trainer.

Only torchtitan's ``GroupedExperts`` itself converts. A subclass of it (a user's, or a low-precision converter's
experts with their own grouped GEMMs) is refused: the converted forward replaces ``GroupedExperts.forward``, so
whatever the subclass overrides would be dropped without a word.

The score. The gradient arriving at row u is dy_u = alpha_u * g_t (the combine's backward), so the LRM score
computed on the row with gate 1, ||dy_u||^2 * ||phi_u||^2, is alpha_u^2 ||g_t||^2 ||phi_u||^2: the pair's score of
docs/design.md, 'The metric'. ``grad_l2`` and ``grad_abs`` likewise read alpha_u^2 ||g_t||^2 and |alpha_u| ||g_t||_1.
The router gradient stays torchtitan's own (through the combine), exact.

The fused gate/up weight. lrmoe takes gate_up [E, 2F, D]; torchtitan keeps w1 and w3 as two parameters, and every
plan in torchtitan (FSDP2 sharding, expert parallelism's Shard(0), optimiser state, checkpoints) names them. A view
of one [E, 2F, D] storage would not survive FSDP2 or DTensor sharding, which give each parameter its own storage,
so the forward concatenates the two (in the compute dtype) per call: one extra write of 2/3 of the expert weights
per layer and step, and that copy is what the backward keeps (about as much as torchtitan's own bf16 casts keep
when the weights are fp32). docs/torchtitan.md says what this costs under FSDP2.

Expert parallelism: torchtitan's (``AllToAllTokenDispatcher``) carries this backward as it is: each rank runs the
selective backward of its local experts on the rows it received, with quotas planned from those rows. docs/
torchtitan.md says what it keeps and what it cannot (its backward all-to-alls stay dense).

Shapes: R rows the experts receive, D model dim, F expert hidden dim, E experts of this rank (all, or E/W under
expert parallelism over W ranks), B quota blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torchtitan.models.common.moe import GroupedExperts, MoE
from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher, LocalTokenDispatcher
from torchtitan.protocols.model import ModelConfigConverter

from lrmoe.functional import ExpertPlan, expert_loads, plan_quotas, selective_swiglu_experts
from lrmoe.functional._checks import check_keeps_pairs
from lrmoe.functional.options import BackwardOptions, option_names
from lrmoe.functional.rng import block_routing_keys, keyed_uniform
from lrmoe.functional.stats_probe import StatsProbe
from lrmoe.functional.transport import BACKWARD_STATS

__all__ = ["SelectiveBackwardConverter", "SelectiveGroupedExperts", "backward_stats", "convert_moe", "is_converted"]

# The options convert_moe takes besides retain: BackwardOptions' fields, as LRMoE takes them.
_OPTIONS = tuple(name for name in option_names(BackwardOptions) if name != "retain")

# The dispatchers whose rows reach the experts one per routed pair (R = sum of the counts, nothing padded), which
# is what the selective backward's quotas count. TorchAOTokenDispatcher pads every expert's rows, and the DeepEP,
# HybridEP and minimal-async dispatchers hand over other layouts: refused.
_DISPATCHERS = (LocalTokenDispatcher, AllToAllTokenDispatcher)

def convert_moe(model: nn.Module, *, retain: float, compute_dtype: torch.dtype | None = torch.bfloat16,
                quota_blocks: int = 1, **options) -> list[str]:
    """Give every torchtitan MoE layer of ``model`` lrmoe's selective expert backward, in place.

    Call it after building the model and before torchtitan parallelises it (``model.parallelize``, FSDP2's
    ``fully_shard``, ``apply_compile``): those then act on the converted experts as on torchtitan's.

    Args:
        model: a torchtitan model (or any module) holding ``torchtitan.models.common.moe.MoE`` layers.
        retain: fraction of each step's routed pairs whose expert-path gradient backward keeps, in (0, 1];
            1 reproduces torchtitan's gradients. A training step whose budget floor(retain * rows) is 0 (and no
            min_retain floor) is refused by that step: every expert gradient would be zero.
        compute_dtype: the experts' compute dtype. bfloat16 (default) is what torchtitan's GroupedExperts uses
            whatever the weights' dtype (it casts x and the weights to bf16); None computes in the input's dtype,
            or torch.autocast's where autocast is on (fp32 training checks the gradients tightly this way).
        quota_blocks: plan the backward quotas separately within this many equal blocks of experts, as
            torchtitan's expert parallelism over that many ranks does (each rank plans its own experts' quotas
            from the rows it received). 1 (default) on every rank; set it on a single device to reproduce a
            W-rank run's plan there (with selection "sample" and no generator, its sampling uniforms too: each
            block's are keyed on that block's rows, as each rank keys its own). Must divide the number of experts.
        **options: ``BackwardOptions``' other fields, as ``LRMoE`` takes them: metric, selection, policy,
            min_retain, generator, activations, quota_align, backward_capacity, and selective_in_eval (False, the
            default: in ``eval()`` mode the backward is exact, as at retain 1; True: selective in eval too).

    Returns: the names of the converted experts modules (``layers.0.moe.routed_experts.inner_experts``, ...),
    each now a :class:`SelectiveGroupedExperts` (the same module object and parameters).

    Raises: ValueError when the model holds no MoE layer, a layer is already converted, ``quota_blocks`` does not
    divide a layer's experts or is combined with ``backward_capacity``; TypeError for an unknown option, a layer
    whose experts are not exactly torchtitan's ``GroupedExperts`` (another module, or a subclass of it, whose
    overrides the converted forward would drop: a user's, or a low-precision converter's with its own grouped
    GEMMs), or whose token dispatcher is not ``LocalTokenDispatcher`` / ``AllToAllTokenDispatcher``; and
    ``BackwardOptions``' own errors for bad option values. Every layer is checked before any is converted: after
    an error the model is as it was.
    """
    backward = _checked_options(retain, compute_dtype, quota_blocks, options)
    moes = [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]
    if not moes:
        raise ValueError(f"convert_moe found no torchtitan MoE layer (torchtitan.models.common.moe.MoE) in this "
                         f"{type(model).__name__}")
    targets = []  # every layer checked before any is converted: an error leaves the model as it was
    for name, moe in moes:
        experts = moe.routed_experts.inner_experts
        where = f"{name}.routed_experts.inner_experts" if name else "routed_experts.inner_experts"
        _check_convertible(where, type(experts), type(moe.routed_experts.token_dispatcher), "is")
        if getattr(moe, "score_before_experts", False) or getattr(moe.routed_experts, "score_before_experts", False):
            # Gates applied to the rows before the experts (not a torchtitan 0.3.0 option) would put alpha inside
            # the SwiGLU, and the rows' gradients would no longer be alpha * g.
            raise TypeError(f"{where}: convert_moe needs the gates applied after the experts (torchtitan 0.3.0's "
                            "combine); this MoE applies them before (score_before_experts)")
        if experts.num_experts % quota_blocks:
            raise ValueError(f"quota_blocks={quota_blocks} does not divide {where}'s {experts.num_experts} experts")
        targets.append((where, experts))
    for _, experts in targets:
        experts.__class__ = SelectiveGroupedExperts
        _install(experts, backward, compute_dtype, quota_blocks)
    return [where for where, _ in targets]


class SelectiveBackwardConverter(ModelConfigConverter):
    """``convert_moe`` as a torchtitan model converter, for torchtitan's own trainer: it rewrites the model
    config before the build: every MoE layer's ``GroupedExperts.Config`` becomes a
    ``SelectiveGroupedExperts.Config`` with the same fields, which builds converted experts (the parameters, names
    and checkpoints of torchtitan's). A config that builds anything but ``GroupedExperts`` itself (its ``_owner``:
    a subclass, e.g. a low-precision converter's, run before this one) is refused, as ``convert_moe`` refuses such
    modules. Pass its Config where torchtitan takes converters, e.g.
    ``torchtitan.models.qwen3.model_registry("debugmodel_moe", converters=[SelectiveBackwardConverter.Config(
    retain=0.75)])``. Config fields: ``convert_moe``'s arguments, ``compute_dtype`` by name as torchtitan's configs
    name dtypes ("bfloat16", "float32", or None for the input's); ``options`` holds ``BackwardOptions``' other
    fields."""

    @dataclass(kw_only=True, slots=True)
    class Config(ModelConfigConverter.Config):
        retain: float = 1.0
        compute_dtype: str | None = "bfloat16"
        quota_blocks: int = 1
        options: dict = field(default_factory=dict)

    def __init__(self, config: Config):
        self.config = config
        name = config.compute_dtype
        self.compute_dtype = None if name is None else getattr(torch, name, None)
        if name is not None and not isinstance(self.compute_dtype, torch.dtype):
            raise TypeError(f"compute_dtype must name a torch dtype ('bfloat16', 'float32') or be None, got {name!r}")
        self.backward = _checked_options(config.retain, self.compute_dtype, config.quota_blocks, config.options)

    def convert(self, model_config):
        targets = []  # every layer checked before any is rewritten: an error leaves the config as it was
        for fqn, config, _, _ in model_config.traverse(MoE.Config):
            routed = config.routed_experts
            inner = routed.inner_experts
            where = f"{fqn}.routed_experts.inner_experts" if fqn else "routed_experts.inner_experts"
            _check_convertible(where, inner._owner, routed.token_dispatcher._owner, "builds")
            if type(inner) is not GroupedExperts.Config:  # a subclass's fields SelectiveGroupedExperts.Config lacks
                raise TypeError(f"{where} is a {_class_name(type(inner))}, not torchtitan's GroupedExperts.Config: "
                                "SelectiveBackwardConverter converts GroupedExperts' own configs")
            if inner.num_experts % self.config.quota_blocks:
                raise ValueError(f"quota_blocks={self.config.quota_blocks} does not divide {where}'s "
                                 f"{inner.num_experts} experts")
            targets.append(routed)
        if not targets:
            raise ValueError("SelectiveBackwardConverter found no torchtitan MoE layer config (MoE.Config)")
        for routed in targets:
            inner = routed.inner_experts
            routed.inner_experts = SelectiveGroupedExperts.Config(
                **{f.name: getattr(inner, f.name) for f in fields(inner)},
                lrmoe_backward=self.backward, lrmoe_compute_dtype=self.compute_dtype,
                lrmoe_quota_blocks=self.config.quota_blocks)
        return model_config


def _checked_options(retain: float, compute_dtype: torch.dtype | None, quota_blocks: int,
                     options: dict) -> BackwardOptions:
    """The backward options of ``retain`` and ``options``, checked with the module-independent arguments of
    convert_moe."""
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise TypeError(f"unknown options {unknown}; convert_moe takes retain, compute_dtype, quota_blocks and "
                        f"BackwardOptions' {', '.join(_OPTIONS)}")
    if compute_dtype is not None and not (isinstance(compute_dtype, torch.dtype) and compute_dtype.is_floating_point):
        raise TypeError(f"compute_dtype must be a floating-point torch.dtype or None, got {compute_dtype!r}")
    if isinstance(quota_blocks, bool) or not isinstance(quota_blocks, int) or quota_blocks < 1:
        raise ValueError(f"quota_blocks must be a Python int >= 1, got {quota_blocks!r}")
    if quota_blocks > 1 and options.get("backward_capacity") is not None:
        raise ValueError("quota_blocks > 1 plans the quotas itself and cannot apply backward_capacity; use one")
    # BackwardOptions checks every value, as LRMoE's do, and nothing that depends on a step's size: the training
    # steps check their own pair counts (a dummy step here would refuse a retain that a real step's rows allow).
    return BackwardOptions(retain=retain, **options)


def _install(experts: nn.Module, backward: BackwardOptions, compute_dtype: torch.dtype | None,
             quota_blocks: int) -> None:
    experts.lrmoe_backward = backward
    experts.lrmoe_compute_dtype = compute_dtype
    experts.lrmoe_quota_blocks = quota_blocks
    experts.lrmoe_stats_probe = _new_probe(experts.w1_EFD.device)


def is_converted(module: nn.Module) -> bool:
    """True for converted experts: a :class:`SelectiveGroupedExperts` (``convert_moe`` or the converter's build)."""
    return isinstance(module, SelectiveGroupedExperts)


def backward_stats(model: nn.Module, *, reset: bool = True) -> dict[str, dict[str, torch.Tensor]]:
    """Per converted experts module, what its backward passes since the last reset kept, as tensors (no sync until
    read): ``score_mass_fraction`` (mean over backward calls of the fraction of the rows' score mass the kept rows
    carry; 1 at retain 1; nan before a backward), ``retained_rows`` (rows kept, summed over calls; under expert
    parallelism this rank's experts' rows) and ``backward_calls``. ``reset`` zeroes the counts after reading."""
    out = {}
    for name, module in model.named_modules():
        if not is_converted(module):
            continue
        probe = module.lrmoe_stats_probe
        totals = probe.totals()
        out[name] = {"score_mass_fraction": totals["score_mass_fraction_sum"] / totals["backward_calls"],
                     "retained_rows": totals["retained_pairs"], "backward_calls": totals["backward_calls"]}
        if reset:
            probe.reset()
    return out


class SelectiveGroupedExperts(GroupedExperts):
    """torchtitan's ``GroupedExperts`` with lrmoe's selective backward: its parameters (``w1_EFD``, ``w2_EDF``,
    ``w3_EFD``) and its forward contract (rows sorted by expert and the count of each local expert's rows in, one
    output row per input row out), computed by selective_swiglu_experts. ``convert_moe`` makes a built
    ``GroupedExperts`` one by a class swap; ``SelectiveBackwardConverter``'s ``Config`` builds it.

    Attributes: ``lrmoe_backward`` (the BackwardOptions), ``lrmoe_compute_dtype``, ``lrmoe_quota_blocks`` (as
    ``convert_moe`` takes them) and ``lrmoe_stats_probe`` (what ``backward_stats`` reads)."""

    @dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        """GroupedExperts.Config's fields and the selective backward's settings."""

        lrmoe_backward: BackwardOptions = field(default_factory=BackwardOptions)
        lrmoe_compute_dtype: torch.dtype | None = torch.bfloat16
        lrmoe_quota_blocks: int = 1

    lrmoe_backward: BackwardOptions
    lrmoe_compute_dtype: torch.dtype | None
    lrmoe_quota_blocks: int
    lrmoe_stats_probe: StatsProbe

    def __init__(self, config: Config):
        super().__init__(config)
        _install(self, config.lrmoe_backward, config.lrmoe_compute_dtype, config.lrmoe_quota_blocks)

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        # Under torchtitan's expert parallelism (the weights DTensors sharded on the experts) these rows are this
        # rank's part of the step, and each rank plans its quotas from its own: one that keeps none of its few rows
        # is valid, and refusing there alone would leave the other ranks waiting in the combine's all-to-all.
        part_of_step = isinstance(self.w1_EFD, DTensor)
        w1_EFD, w2_EDF, w3_EFD = (_local_experts(name, getattr(self, name)) for name in ("w1_EFD", "w2_EDF", "w3_EFD"))
        n_exp, n_rows = w1_EFD.shape[0], x_RD.shape[0]
        device = x_RD.device.type
        dtype = self.lrmoe_compute_dtype
        if dtype is None:  # torch.autocast's where it is on, else x's
            dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x_RD.dtype
        # The expert of every row: rows arrive sorted by expert, num_tokens_per_expert_E[e] of expert e, R in all
        # (the dispatchers accepted by convert_moe pad nothing). output_size keeps this free of host syncs.
        expert_ids_R1 = torch.repeat_interleave(torch.arange(n_exp, device=x_RD.device), num_tokens_per_expert_E,
                                                output_size=n_rows).unsqueeze(1)
        gates_R1 = torch.ones(n_rows, 1, dtype=dtype, device=x_RD.device)  # torchtitan's combine applies the gates
        # One [E, 2F, D] gate/up weight per call, gate half first (module docstring: why not a view).
        gate_up_EFD = torch.cat([w1_EFD.to(dtype), w3_EFD.to(dtype)], dim=1)
        backward = torch.is_grad_enabled() and any(t.requires_grad for t in (x_RD, w1_EFD, w2_EDF, w3_EFD))
        opts, plan, probe = _EXACT, None, None
        if backward:  # without a backward the forward is the same at any retain: plan nothing, draw nothing
            opts = self.lrmoe_backward.for_mode(self.training)  # exact in eval() unless selective_in_eval, as LRMoE
            if self.lrmoe_quota_blocks > 1 and not opts.dense:
                plan = _block_plan(expert_ids_R1, n_exp, self.lrmoe_quota_blocks, opts, part_of_step)
            if self.lrmoe_stats_probe.tensor.device == x_RD.device:
                probe = self.lrmoe_stats_probe.tensor
        with torch.autocast(device, enabled=False):  # the experts run in ``dtype`` exactly
            y_RD = selective_swiglu_experts(x_RD.to(dtype), gate_up_EFD, w2_EDF.to(dtype), expert_ids_R1, gates_R1,
                                            plan=plan, stats_probe=probe, backward=opts, part_of_step=part_of_step)
        return y_RD.type_as(x_RD)

    def _apply(self, fn, recurse=True):
        # The probe (neither parameter nor buffer) follows .to()/.cuda()/to_empty() with the weights.
        module = super()._apply(fn, recurse)
        device = self.w1_EFD.device
        if device.type != "meta":
            self.lrmoe_stats_probe.follow(device)
        return module


_EXACT = BackwardOptions()  # the options of a forward without a backward: retain 1


def _new_probe(device: torch.device) -> StatsProbe:
    # The single-device layout (selective_swiglu_experts' stats_probe): fp32 counts are exact to 2**24 rows per
    # reset, far above what one layer keeps between logging steps. On the CPU for a model built on meta: a probe
    # there would hold no statistics, and to_empty moves it with the weights.
    return StatsProbe(BACKWARD_STATS, device if device.type != "meta" else "cpu")


def _check_convertible(where: str, experts_cls: type, dispatcher_cls: type, verb: str) -> None:
    """Refuse what the converted forward cannot run: ``experts_cls`` and ``dispatcher_cls`` are the modules'
    classes (``verb`` "is"), or the classes their configs build ("builds")."""
    if issubclass(experts_cls, SelectiveGroupedExperts):
        raise ValueError(f"{where} is already converted (convert_moe runs once per model)")
    if not issubclass(experts_cls, GroupedExperts):
        raise TypeError(f"{where} {verb} a {experts_cls.__name__}, not torchtitan's GroupedExperts (w1_EFD, w2_EDF, "
                        "w3_EFD SwiGLU experts): convert_moe cannot run its experts")
    if experts_cls is not GroupedExperts:
        # SelectiveGroupedExperts' forward replaces GroupedExperts.forward, and nothing the subclass overrides
        # (its forward, its grouped GEMMs, its init) would take part in it.
        below = experts_cls.__mro__[:experts_cls.__mro__.index(GroupedExperts)]
        overrides = sorted({name for klass in below for name, value in vars(klass).items()
                            if callable(value) and name != "Config" and hasattr(GroupedExperts, name)})
        which = f" (it overrides {', '.join(overrides)})" if overrides else ""
        low_precision = (" A low-precision converter's experts run their own grouped GEMMs: convert a model without "
                         "that converter." if "_grouped_mm" in overrides else "")
        raise TypeError(f"{where} {verb} a {_class_name(experts_cls)}, a subclass of torchtitan's GroupedExperts"
                        f"{which}: convert_moe converts GroupedExperts itself only, since the converted forward "
                        f"replaces GroupedExperts.forward and would drop what the subclass changes.{low_precision}")
    if dispatcher_cls not in _DISPATCHERS:
        raise TypeError(f"{where}'s token dispatcher is a {dispatcher_cls.__name__}; convert_moe needs one row per "
                        "routed pair, sorted by expert and unpadded: LocalTokenDispatcher or AllToAllTokenDispatcher "
                        "(torchtitan's 'standard' MoE comm backend)")


def _class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _local_experts(name: str, weight: torch.Tensor) -> torch.Tensor:
    """This rank's experts' weights: the local shard of a DTensor sharded on the expert dimension (torchtitan's
    expert parallelism), as GroupedExperts takes it. Tensor parallelism shards F or D instead; each rank would then
    score rows by its own shard's ||phi||^2 and keep different rows than its peers: refused."""
    if not isinstance(weight, DTensor):
        return weight
    if any(isinstance(p, Shard) and p.dim != 0 for p in weight.placements):
        raise RuntimeError(f"{name} is sharded on a dimension other than the experts' ({weight.placements}): tensor "
                           "parallelism of the experts splits ||phi||^2 over ranks, so their selections would "
                           "disagree; convert_moe supports expert parallelism and FSDP2, not expert TP")
    return weight.to_local()


def _block_plan(expert_ids_R1: torch.Tensor, n_exp: int, blocks: int, opts: BackwardOptions,
                part_of_step: bool = False) -> ExpertPlan:
    """Quotas planned within each of ``blocks`` equal blocks of experts from its own rows, as each rank of
    torchtitan's expert parallelism over ``blocks`` ranks plans its experts' (plan_quotas per block). Sampling
    uniforms, one per expert: from ``opts.generator`` when one is given, else each block's keyed on that block's
    rows (block_routing_keys), which is the draw plan_experts makes on the rank holding the block (rows sorted by
    expert, keyed on the rank's own rows with local expert ids): a function of the batch, no RNG state read."""
    # As selective_swiglu_experts refuses for the quota_blocks=1 plan: a budget of no row (R is static, no sync),
    # unless the rows are a rank's part of the step (``part_of_step``, see the forward).
    if not part_of_step:
        check_keeps_pairs(opts.retain, opts.min_retain, expert_ids_R1.shape[0], "convert_moe's experts")
    loads_E = expert_loads(expert_ids_R1, n_exp)
    quotas_E = torch.cat([
        plan_quotas(loads_L, opts.retain, min_retain=opts.min_retain, policy=opts.policy, align=opts.quota_align)
        for loads_L in loads_E.view(blocks, -1)
    ])
    uniform_E = None
    if opts.selection == "sample":
        if opts.generator is not None:
            uniform_E = torch.rand(n_exp, generator=opts.generator, device=expert_ids_R1.device)
        else:
            keys_B = block_routing_keys(expert_ids_R1, n_exp, blocks)
            uniform_E = torch.cat([keyed_uniform(keys_B[b], n_exp // blocks) for b in range(blocks)])
    return ExpertPlan(loads=loads_E, quotas=quotas_E, uniform=uniform_E, retain=opts.retain)
