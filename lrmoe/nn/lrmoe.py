"""LRMoE: a drop-in MoE layer with the parameters of transformers' Qwen3MoeSparseMoeBlock.

Parameter names and shapes: ``gate.weight`` [E, D]; ``experts.gate_up_proj`` [E, 2F, D] (gate half first);
``experts.down_proj`` [E, D, F]. A Qwen3-MoE checkpoint's block state_dict loads with strict=True. With
``selection_bias=True`` and ``shared_hidden_dim`` it also holds ``gate.e_score_correction_bias`` [E] and
``shared_experts.{gate,up,down}_proj.weight``: the block of GLM-4.5's and DeepSeek-V3's MoE layers
(transformers' Glm4MoeMoE, DeepseekV3MoE), whose state_dicts then load the same way.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from lrmoe.functional._autocast import autocast_enabled, autocast_off
from lrmoe.functional._checks import (
    check_group_routing,
    check_int,
    check_same_device,
    check_scaling,
    check_top_k,
)
from lrmoe.functional.experts import ExpertPlan, plan_experts, selective_swiglu_experts
from lrmoe.functional.options import (
    BackwardOptions,
    RoutingOptions,
    check_option_names,
    option_names,
    resolve_options,
)
from lrmoe.functional.routing import Routing, route_topk, router_logits
from lrmoe.functional.stats_probe import StatsProbe
from lrmoe.functional.transport import BACKWARD_STATS
from lrmoe.ops._torch_internals import current_graph_task_id

__all__ = ["LRMoE", "LRMoEStats", "SwiGLUExperts", "SwiGLUMLP"]


# Both layers run their experts through experts(...), where FSDP2's fully_shard on layer.experts gathers the
# weights; still sharded there means some other sharding the layer cannot undo.
UNGATHERED_EXPERTS = ("they are sharded (not by an FSDP2 unit on layer.experts, which gathers them in experts' "
                      "forward) and the layer needs each rank's experts whole; gather them before the layer's "
                      "forward (docs/expert_parallel.md, FSDP2)")

@dataclass(frozen=True)
class LRMoEStats:
    """Per-step statistics, all tensors on the layer's device (reading them costs no sync until you print).

    loads [E] int64 and quotas [E] int64: pairs routed to / kept in backward by each expert, last forward (not
        counting evaluations: forwards in eval() mode with no backward to run).
    retained_pairs, total_pairs: 0-d int64, the same forward's.
    score_mass_fraction: 0-d fp32, mean over the backward passes since the last ``reset_stats()`` of the
        fraction of (finite) score mass carried by the kept pairs; 1 at retain = 1; nan before any backward.
    backward_calls: 0-d fp32, layer calls backpropagated since the last ``reset_stats()`` (two micro-batches and
        one backward count 2).
    """

    loads: torch.Tensor
    quotas: torch.Tensor
    retained_pairs: torch.Tensor
    total_pairs: torch.Tensor
    score_mass_fraction: torch.Tensor
    backward_calls: torch.Tensor

    @property
    def retained_fraction(self) -> torch.Tensor:
        return self.retained_pairs.float() / self.total_pairs.clamp(min=1).float()


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The routed experts' dtype: torch.autocast's for x's device when it is on there (x and the expert weights are
    cast to it, differentiably, so fp32 weights get fp32 gradients), else x's (the parameters' dtype)."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if autocast_enabled(device) else x.dtype


def recomputing() -> bool:
    """True while autograd recomputes a forward inside a backward (activation checkpointing, eagerly): the layers
    then keep their last forward's plan (``stats()``, ``update_selection_bias``) instead of the recomputed
    micro-batch's. A compiled graph's recompute never reruns the buffer writes, so it is False there."""
    return not torch.compiler.is_compiling() and current_graph_task_id() != -1


def _shown(options) -> str:
    """An options object's fields that differ from their defaults, as ``name=value`` for a module's repr."""
    default = type(options)()
    return ", ".join(f"{name}={getattr(options, name)!r}" for name in option_names(type(options))
                     if getattr(options, name) is not getattr(default, name)
                     and getattr(options, name) != getattr(default, name))


class _PlanRecords:
    """The last forward's plan and the backward statistics of a module that plans its steps: ``stats()`` and
    ``reset_stats()`` of LRMoE, and of a SwiGLUExperts called without a plan (``swap_experts``' modules). The
    module holds ``last_loads`` and ``last_quotas`` ([E] int64 buffers, not checkpointed) and ``_stats_probe``, a
    :class:`~lrmoe.functional.stats_probe.StatsProbe` whose leaf the backward adds its statistics to
    (selective_swiglu_experts' ``stats_probe``)."""

    def _init_records(self, num_experts: int, device: torch.device | None = None) -> None:
        """(Re)create the records, zero, on ``device`` (None: the default device, as at construction)."""
        # Non-persistent: for logging, not part of the checkpoint.
        for name in ("last_loads", "last_quotas"):
            self.register_buffer(name, torch.zeros(num_experts, dtype=torch.int64, device=device), persistent=False)
        self._stats_probe = StatsProbe(BACKWARD_STATS, self.last_loads.device)

    def _probe_for(self, x: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor | None:
        """The backward-statistics probe's leaf, or None when no backward will run through this call (from x, the
        other differentiable ``inputs`` of the call, or the parameters)."""
        needs_grad = any(t.requires_grad for t in (x, *inputs)) or any(p.requires_grad for p in self.parameters())
        if not (torch.is_grad_enabled() and needs_grad):
            return None
        return self._stats_probe.follow(x.device)  # a new probe only when x is not where the module is (eager use)

    def _draws_uniform(self, probe: torch.Tensor | None) -> bool:
        """Whether this forward draws the sampling uniforms: when a backward will run, and in training mode always,
        as dropout draws. A reentrant activation checkpoint runs the first forward without grad and recomputes it
        with the RNG state restored: drawing in both keeps the global RNG where an unchecked step leaves it.
        Evaluation (eval() without grad) leaves the RNG untouched."""
        return probe is not None or self.training

    def _records_plan(self, probe: torch.Tensor | None) -> bool:
        """Whether this forward's plan becomes the one ``stats()`` and ``update_selection_bias`` read: a forward a
        backward may follow (training mode, with or without grad, as a reentrant activation checkpoint runs its
        first forward; or a backward to run in eval()), not an evaluation (eval() with no backward to run: a
        validation batch's loads must not steer the balancing), and not a recompute inside a backward."""
        return self._draws_uniform(probe) and not recomputing()

    def _record_plan(self, plan: ExpertPlan, probe: torch.Tensor | None) -> None:
        """Keep ``plan``'s loads and quotas (an ExpertPlan's; summed over sources when grouped by (source, expert))
        for ``stats()``, when ``_records_plan``."""
        if not self._records_plan(probe):
            return
        loads, quotas = plan.loads, plan.quotas
        if loads.dim() == 2:  # [S, E]: per source
            loads, quotas = loads.sum(0), quotas.sum(0)
        with torch.no_grad():
            self.last_loads.copy_(loads)
            self.last_quotas.copy_(quotas)

    def _apply(self, fn, recurse=True):
        # The probe is neither parameter nor buffer (StatsProbe says why), so it follows .to()/.cuda() here.
        module = super()._apply(fn, recurse)
        self._stats_probe.follow(self.last_loads.device)
        return module

    def stats(self) -> LRMoEStats:
        """This step's statistics as tensors (see :class:`LRMoEStats`; expert-parallel: ExpertParallelStats)."""
        if self._dispatcher is not None:
            return self._dispatcher.stats(self._stats_probe)
        backward = self._stats_probe.totals()
        calls = backward["backward_calls"]
        return LRMoEStats(
            loads=self.last_loads.clone(),
            quotas=self.last_quotas.clone(),
            retained_pairs=self.last_quotas.sum(),
            total_pairs=self.last_loads.sum(),
            score_mass_fraction=backward["score_mass_fraction_sum"] / calls,
            backward_calls=calls,
        )

    def reset_stats(self) -> None:
        """Forget the accumulated backward statistics."""
        self._stats_probe.reset()


class SwiGLUExperts(_PlanRecords, nn.Module):
    """E SwiGLU experts stored as fused 3-D tensors, as transformers' Qwen3MoeExperts stores them, called as it is:
    ``experts(x_TD, expert_ids_TK, gates_TK)``.

    Args:
        num_experts, dim, hidden_dim: E, D, F.
        backward: the selective backward's options for every call (:class:`~lrmoe.functional.BackwardOptions`,
            which documents each); or its fields as keywords (``**options``: retain, selection, ...), not both.
            None: retain 1, the plain dense backward. ``lrmoe.nn.swap_experts`` puts these modules, with options,
            into a transformers model. Change them later with ``module.backward = replace(module.backward, ...)``.

    ``stats()`` and ``reset_stats()`` are LRMoE's (:class:`LRMoEStats`), for the calls the module plans (those
    without a ``plan``: a transformers model's calls after ``swap_experts``); an LRMoE's experts module leaves
    them to the layer.
    """

    backward: BackwardOptions

    def __init__(self, num_experts: int, dim: int, hidden_dim: int, *, backward: BackwardOptions | None = None,
                 **options):
        super().__init__()
        num_experts, dim, hidden_dim = (check_int(name, value) for name, value in
                                        (("num_experts", num_experts), ("dim", dim), ("hidden_dim", hidden_dim)))
        self.backward = resolve_options(BackwardOptions, backward, "SwiGLUExperts", **options)
        self.num_experts, self.dim, self.hidden_dim = num_experts, dim, hidden_dim
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * hidden_dim, dim))
        self.down_proj = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.reset_parameters()
        self._init_records(num_experts)  # the plans of the calls it plans, and their backward statistics
        self._dispatcher = None  # expert parallelism's, once ExpertParallel is applied to this module itself

    def extra_repr(self) -> str:
        shown = _shown(self.backward)
        return f"num_experts={self.num_experts}, dim={self.dim}, hidden_dim={self.hidden_dim}" + (
            f", {shown}" if shown else "")

    def forward(self, x_TD: torch.Tensor, expert_ids_TK: torch.Tensor, gates_TK: torch.Tensor, *,
                backward: BackwardOptions | None = None, plan: ExpertPlan | None = None,
                stats_probe: torch.Tensor | None = None, out_shape: tuple[int, ...] | torch.Size | None = None,
                step: Callable[..., torch.Tensor] | None = None, **options) -> torch.Tensor:
        """[T, D] tokens, their [T, K] experts and gates -> [T, D] gated sum of the experts' outputs:
        :func:`~lrmoe.functional.selective_swiglu_experts` with these weights and the gates in x's dtype, or
        under torch.autocast in its dtype (x, weights and gates cast to it, differentiably; the output in it), as
        transformers' experts compute there. The weights are cast as autocast would (LRMoE has checked the
        dtypes).

        The options of the call: the module's (``self.backward``; exact in eval() mode unless
        ``selective_in_eval``, as in LRMoE); or ``backward``, a BackwardOptions for this call instead (used as
        given); or ``**options``, BackwardOptions' fields changed from the module's for this call (``retain=1.0``);
        not both of the last two. The call's arguments, as selective_swiglu_experts takes them: ``plan``,
        ``stats_probe`` and ``out_shape``.

        A call without a ``plan`` is planned here and its plan kept for ``stats()`` as LRMoE keeps its own (not
        an evaluation's, not a recompute's), with its backward statistics unless the call brings a
        ``stats_probe``; in eval() with no backward to run (no grad, or nothing requiring it) no sampling uniforms
        are drawn, as in LRMoE. LRMoE runs its experts through this call, with its plan and probe, so a hook on
        this module (FSDP2's ``fully_shard(layer.experts)`` gathering the weights) sees them.

        ``step``: a caller's own computation on this module's weights, ``step(self, x_TD, expert_ids_TK,
        gates_TK)``, run here (no options or call arguments with it) so those hooks see it too: an expert-parallel
        LRMoE's dispatcher passes the rank's part of its step. An experts module made expert-parallel itself
        (``ExpertParallel`` applied to it) hands its calls to its dispatcher, which takes none either."""
        if step is not None or self._dispatcher is not None:
            given = {**options, **{name: value for name, value in (("backward", backward), ("plan", plan),
                                                                   ("stats_probe", stats_probe),
                                                                   ("out_shape", out_shape)) if value is not None}}
            if step is None:
                return self._dispatcher.experts_forward(self, x_TD, expert_ids_TK, gates_TK, given)
            if given:
                raise TypeError(f"a call with a step takes no options, got {sorted(given)}")
            return step(self, x_TD, expert_ids_TK, gates_TK)
        gate_up, down = self.gate_up_proj, self.down_proj
        if isinstance(gate_up, DTensor) or isinstance(down, DTensor):
            # The ops would refuse a mix of tensors and DTensors, naming none of this.
            raise RuntimeError(f"the experts' weights are DTensors: {UNGATHERED_EXPERTS}")
        if options:  # the call's own fields over the module's
            check_option_names(BackwardOptions, options, "SwiGLUExperts call")
            if backward is not None:
                raise TypeError(f"SwiGLUExperts call: pass the call's options either as a BackwardOptions "
                                f"(backward=) or as fields changing the module's, not both (got a BackwardOptions "
                                f"and {sorted(options)})")
            opts = replace(self.backward, **options)
        elif backward is not None:  # the call's own object, as given (checked to be one)
            opts = resolve_options(BackwardOptions, backward, "SwiGLUExperts call")
        else:  # the module's own options: exact in eval mode (BackwardOptions.for_mode)
            opts = self.backward.for_mode(self.training)
        plans_here = plan is None  # a caller with a plan (LRMoE) keeps the records itself
        if plans_here:
            if stats_probe is None:  # the backward statistics go to the module's probe, for stats()
                stats_probe = self._probe_for(x_TD, gates_TK)
            # Evaluation (eval() with no backward to run) draws no sampling uniforms, as LRMoE does.
            plan = plan_experts(expert_ids_TK, self.num_experts, backward=opts,
                                draw_uniform=self._draws_uniform(stats_probe))
        dtype = compute_dtype(x_TD)  # torch.autocast's (transformers' experts compute in it there), else x's
        if gates_TK.is_floating_point():  # others are refused, naming gates_TK, not cast
            gates_TK = gates_TK.to(dtype)
        with autocast_off(x_TD.device.type):  # the experts run in ``dtype`` exactly
            out = selective_swiglu_experts(x_TD.to(dtype), gate_up.to(dtype), down.to(dtype), expert_ids_TK,
                                           gates_TK, backward=opts, plan=plan, stats_probe=stats_probe,
                                           out_shape=out_shape)
        if plans_here:  # once the call's arguments have passed the checks
            self._record_plan(plan, stats_probe)
        return out

    def reset_parameters(self) -> None:
        # nn.Linear's default: uniform(+-1/sqrt(fan_in)) per expert matrix.
        nn.init.uniform_(self.gate_up_proj, -1 / math.sqrt(self.dim), 1 / math.sqrt(self.dim))
        nn.init.uniform_(self.down_proj, -1 / math.sqrt(self.hidden_dim), 1 / math.sqrt(self.hidden_dim))



class SwiGLUMLP(nn.Module):
    """One dense SwiGLU MLP, down(silu(gate(x)) * up(x)), with the parameter names of transformers' shared experts
    (``gate_proj``, ``up_proj``, ``down_proj``, no biases): LRMoE's ``shared_experts``."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class LRMoE(_PlanRecords, nn.Module):
    """Top-k MoE with SwiGLU experts, exact forward and quota-bounded selective backward.

    Args:
        dim, hidden_dim, num_experts, top_k: D, F, E, K.
        shared_hidden_dim: None, or the hidden width of a dense SwiGLU ``shared_experts`` (SwiGLUMLP) whose output
            is added to the routed experts' for every token (GLM-4.5, DeepSeek-V3: moe_intermediate_size *
            n_shared_experts). Its backward is the ordinary dense one; under expert parallelism it stays
            replicated like the router.
        retain, min_retain, metric, selection, policy, activations, save_outputs, quota_align, backward_capacity,
            generator, kernels, selective_in_eval: the selective backward's options, each the field of that name of
            :class:`~lrmoe.functional.BackwardOptions` (its type, its default, its check; documented there).
        score_func, norm_topk_prob, routed_scaling_factor, n_group, topk_group, selection_bias, router_dtype: the
            router's options, each the field of that name of :class:`~lrmoe.functional.RoutingOptions`, likewise.
            A selection bias is a [E] fp32 buffer ``gate.e_score_correction_bias`` (``update_selection_bias``).
        backward: the backward options as one BackwardOptions instead of their keywords (not both: an object
            together with a keyword changed from its default is a TypeError).
        routing: the routing options as one RoutingOptions, likewise.

    tests/functional/test_options.py holds these keywords to the two classes' fields (names, types, defaults).
    ``layer.backward`` and ``layer.routing`` hold the options (``layer.routing.score_func``); change them with
    ``layer.backward = dataclasses.replace(layer.backward, ...)`` (validated again). ``layer.retain`` reads and
    sets ``layer.backward.retain`` (the option a retain schedule changes). Input [..., dim] -> output of the same
    shape and dtype.
    """

    backward: BackwardOptions
    routing: RoutingOptions

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        num_experts: int,
        top_k: int,
        *,
        retain: float = 1.0,
        metric: str = "lrm",
        selection: str = "sample",
        policy: str = "waterfill",
        min_retain: float = 0.0,
        score_func: str = "softmax",
        norm_topk_prob: bool = True,
        generator: torch.Generator | None = None,
        activations: str = "save",
        save_outputs: bool = False,
        quota_align: int = 1,
        backward_capacity: float | None = None,
        selective_in_eval: bool = False,
        kernels: str = "auto",
        routed_scaling_factor: float = 1.0,
        n_group: int | None = None,
        topk_group: int | None = None,
        selection_bias: bool = False,
        shared_hidden_dim: int | None = None,
        router_dtype: torch.dtype | None = None,
        backward: BackwardOptions | None = None,
        routing: RoutingOptions | None = None,
    ):
        # The option keywords, read by the options classes' field names: no third list of them (a keyword the
        # signature lacks fails here, as in the signature test).
        given = locals()
        super().__init__()
        sizes = [("dim", dim), ("hidden_dim", hidden_dim), ("num_experts", num_experts)]
        if shared_hidden_dim is not None:
            sizes.append(("shared_hidden_dim", shared_hidden_dim))
        dim, hidden_dim, num_experts, *shared = (check_int(name, value) for name, value in sizes)
        if shared:
            shared_hidden_dim = shared[0]
        top_k = check_top_k(top_k, num_experts)
        # The flat keywords are a facade over the two options objects: each is validated once, when built.
        self.backward = resolve_options(BackwardOptions, backward, "LRMoE",
                                        **{name: given[name] for name in option_names(BackwardOptions)})
        self.routing = resolve_options(RoutingOptions, routing, "LRMoE",
                                       **{name: given[name] for name in option_names(RoutingOptions)})
        check_group_routing(num_experts, top_k, self.routing.n_group, self.routing.topk_group)
        self.dim, self.hidden_dim, self.num_experts, self.top_k = dim, hidden_dim, num_experts, top_k

        self.gate = nn.Linear(dim, num_experts, bias=False)
        if self.routing.selection_bias:  # on the gate, where transformers' GLM-4.5 / DeepSeek-V3 routers keep it
            self.gate.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))
        self.experts = SwiGLUExperts(num_experts, dim, hidden_dim)
        self.shared_experts = None if shared_hidden_dim is None else SwiGLUMLP(dim, shared_hidden_dim)
        self._init_records(num_experts)  # the last forward's plan and the backward statistics
        self._dispatcher = None  # expert parallelism's (lrmoe.nn.expert_parallel), once ExpertParallel is applied

    @property
    def retain(self) -> float:
        """``self.backward.retain``. Setting it replaces ``self.backward`` by a copy with that retain, validated
        again (a bad value raises, naming retain, and leaves the options as they were)."""
        return self.backward.retain

    @retain.setter
    def retain(self, value: float) -> None:
        self.backward = replace(self.backward, retain=value)

    def extra_repr(self) -> str:
        shown = ", ".join(part for part in (_shown(self.backward), _shown(self.routing)) if part)
        return (f"dim={self.dim}, hidden_dim={self.hidden_dim}, num_experts={self.num_experts}, top_k={self.top_k}"
                + (f", {shown}" if shown else ""))

    def _check_input(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            raise ValueError(f"x must be a tensor [..., dim={self.dim}], got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        if x.shape[-1] != self.dim:
            raise ValueError(f"x must have last dimension dim={self.dim}, got shape {tuple(x.shape)}")
        # Under FSDP2 on layer.experts the weights are gathered in its mixed-precision dtype only in experts(...),
        # which casts them to x's (or autocast's) dtype: FSDP's policy decides, as autocast would.
        fsdp_experts = isinstance(self.experts, FSDPModule)
        if (x.dtype != self.experts.gate_up_proj.dtype and not fsdp_experts
                and not autocast_enabled(x.device.type)):
            raise TypeError(
                f"x has dtype {x.dtype} but the layer's parameters are {self.experts.gate_up_proj.dtype}; "
                "cast one of them (e.g. layer.to(x.dtype)), or run the layer under torch.autocast"
            )
        check_same_device(x=x, gate_weight=self.gate.weight, gate_up_proj=self.experts.gate_up_proj,
                          down_proj=self.experts.down_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., dim] tokens -> [..., dim]: route every token to its top_k experts, run them (every pair, exactly),
        and return the gated sum, plus the shared expert's output when there is one.

        The output is a fresh tensor in x's shape (not a view), in x's dtype, or torch.autocast's under autocast.
        Its backward is the selective one in training mode (``retain``, ``selection``, ...; the router's gradient
        exact) and exact in eval() mode unless ``selective_in_eval``. No host synchronisation, no graph break
        under torch.compile(fullgraph=True). A graph through it cannot be differentiated twice
        (create_graph=True raises). The step's plan is kept for ``stats()`` and ``update_selection_bias``, except
        an evaluation's (eval() with no backward to run), which leaves the last training forward's."""
        self._check_input(x)
        x_TD = x.reshape(-1, self.dim)
        routing = self.route(x_TD)
        probe = self._probe_for(x)
        dtype = compute_dtype(x)
        gates_TK = routing.gates.to(dtype)
        if self._dispatcher is not None:  # expert parallelism: its dispatcher plans, the experts run its step
            with autocast_off(x.device.type):  # the experts run in ``dtype`` exactly
                x_in = x_TD.to(dtype)
                step = self._dispatcher.plan(self, self.experts, x_in, routing.expert_ids, probe, x.shape)
                out = self.experts(x_in, routing.expert_ids, gates_TK, step=step)
            return self.add_shared(x_TD, out)
        opts = self.backward.for_mode(self.training)
        plan = plan_experts(routing.expert_ids, self.num_experts, draw_uniform=self._draws_uniform(probe),
                            backward=opts)
        self._record_plan(plan, probe)
        with autocast_off(x.device.type):  # the experts run in ``dtype`` exactly
            out = self.experts(x_TD.to(dtype), routing.expert_ids, gates_TK, plan=plan, stats_probe=probe,
                               backward=opts, out_shape=x.shape)
        # In x's shape as the experts wrote it, not a view: an in-place op on it keeps FSDP2's hooks.
        return self.add_shared(x_TD, out)

    def route(self, x_TD: torch.Tensor) -> Routing:
        """[T, D] tokens -> their experts and gates: the gate's logits through route_topk with the layer's options
        (also the expert-parallel layer's routing)."""
        opts = self.routing
        logits_TE = router_logits(x_TD, self.gate.weight, opts.router_dtype)
        return route_topk(
            logits_TE, self.top_k, score_func=opts.score_func, norm_topk_prob=opts.norm_topk_prob,
            bias_E=self.gate.e_score_correction_bias if opts.selection_bias else None,
            scaling=opts.routed_scaling_factor, n_group=opts.n_group, topk_group=opts.topk_group,
        )

    def reset_parameters(self) -> None:
        """Initialise as at construction: the router and a shared expert as nn.Linear does, the experts as
        SwiGLUExperts does, a selection bias to zeros (for a layer built on the meta device, after ``to_empty``)."""
        # nn.Linear's init of a bias-free weight, written out: a router module of transformers' (from_transformers)
        # has no reset_parameters.
        nn.init.kaiming_uniform_(self.gate.weight, a=math.sqrt(5))
        self.experts.reset_parameters()
        if self.shared_experts is not None:
            for linear in (self.shared_experts.gate_proj, self.shared_experts.up_proj, self.shared_experts.down_proj):
                linear.reset_parameters()
        if self.routing.selection_bias:
            with torch.no_grad():
                self.gate.e_score_correction_bias.zero_()

    @torch.no_grad()
    def update_selection_bias(self, rate: float) -> None:
        """Aux-loss-free balancing (DeepSeek-V3): ``gate.e_score_correction_bias[e] += rate * sign(mean load -
        load[e])`` from the last forward's loads, so overloaded experts are chosen less in the next steps. Under
        expert parallelism the loads are the global ones, so every rank takes the same step and the biases stay
        equal. On the device, no sync; call it after the optimiser step (it changes a buffer, not a parameter).
        Evaluation forwards (eval() with no backward to run, e.g. under torch.no_grad()) leave the loads of the last
        training forward in place, so a validation pass between the step and this call does not steer it."""
        if not self.routing.selection_bias:
            raise ValueError("update_selection_bias needs a layer built with selection_bias=True")
        check_scaling(rate, "rate")
        loads_E = self.last_loads.float()
        self.gate.e_score_correction_bias.add_(torch.sign(loads_E.mean() - loads_E), alpha=rate)

    def add_shared(self, x_TD: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The routed experts' output (in x's shape) plus the shared experts' (if any) for every token: a new
        tensor of out's shape."""
        return out if self.shared_experts is None else out + self.shared_experts(x_TD).view(out.shape)

    def _apply(self, fn, recurse=True):
        module = super()._apply(fn, recurse)  # the probe follows (_PlanRecords)
        # The selection bias stays fp32 under .to(dtype), as transformers keeps it: its balancing updates are small
        # steps that bf16 would round away.
        if self.routing.selection_bias and self.gate.e_score_correction_bias.dtype != torch.float32:
            self.gate.e_score_correction_bias = self.gate.e_score_correction_bias.float()
        return module
