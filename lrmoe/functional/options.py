"""The options of a selective MoE layer, as two frozen dataclasses, each validated once, when it is built.

:class:`BackwardOptions` is what the selective backward keeps and how (docs/design.md, "The method" and
"Selection rules");
:class:`RoutingOptions` is how the router picks experts and gates. Each option is declared, defaulted, checked and
documented here only. ``LRMoE`` takes the objects (``LRMoE(..., backward=BackwardOptions(retain=0.75))``) or their
fields as typed keywords of the same names and defaults (tests/functional/test_options.py holds its signature to
the fields); ``SwiGLUExperts``, ``swap_experts``, ``selective_swiglu_experts`` and ``plan_experts`` take
``backward=`` or ``BackwardOptions``' fields as ``**options``, turned into the object by :func:`resolve_options`;
``ExpertParallel`` and ``lrmoe.memory`` take the object. They hold Python values only (and a torch.Generator), so
torch.compile(fullgraph=True) traces code that reads them, and ``dataclasses.replace`` gives a changed copy,
validated again.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TypeVar

import torch

from lrmoe.functional._checks import (
    check_backward_capacity,
    check_choice,
    check_float_dtype,
    check_generator,
    check_int,
    check_retain,
    check_scaling,
)
from lrmoe.functional.quotas import POLICIES
from lrmoe.functional.scoring import METRICS
from lrmoe.functional.selection import MODES

__all__ = ["ACTIVATION_POLICIES", "KERNEL_CHOICES", "SCORE_FUNCS", "BackwardOptions", "RoutingOptions",
           "check_option_names", "option_names", "resolve_options"]

# What forward keeps of each pair's gate/up projection for backward (BackwardOptions.activations).
ACTIVATION_POLICIES = ("save", "recompute", "offload")
SCORE_FUNCS = ("softmax", "sigmoid")
KERNEL_CHOICES = ("auto", "portable", "hopper")


@dataclass(frozen=True)
class BackwardOptions:
    """How the selective backward keeps pairs: the one reference for these options. ``LRMoE`` takes each field as
    a keyword of the same name, type and default; ``SwiGLUExperts``, ``swap_experts``, ``selective_swiglu_experts``
    and ``plan_experts`` take them as ``**options`` (or this object as ``backward=``).

    retain: fraction of routed pairs whose expert-path gradient backward keeps, in (0, 1]; 1 = the dense backward
        (nothing scored or dropped: plain autograd's gradients).
    min_retain: per-expert floor, in [0, retain] (``plan_quotas``).
    metric: pair score, "lrm" (alpha^2 ||g||^2 ||phi||^2), "grad_l2", "grad_abs" or "random" (``score_pairs``).
    selection: "sample" (unbiased, default) or "top" (the paper's top-quota rule) (``select_within_quota``).
    policy: quota policy, "waterfill" or "proportional" (``plan_quotas``).
    activations: what forward keeps for backward. "save": every pair's gate/up projection h ([P, 2F]); backward
        gathers the retained rows. "recompute": not h; backward recomputes it for the retained rows only (one more
        grouped GEMM over them, from x, which is saved either way): P*2F fewer saved elements (P*F below retain 1 on
        one device, where phi [P, F] is saved for the dropped pairs' router gradient, see save_outputs), extra work
        that scales with retain. "offload": h goes to pinned host memory, copied on a side stream while forward goes
        on (lrmoe.ops.offload_to_host), and backward reads back the retained rows only (lrmoe.ops.gather_host_rows):
        the device memory of "recompute" without its GEMM, for P*2F elements over PCIe in forward and M*2F in
        backward. The same gradients for all three; "offload" reads back the very values "save" keeps, so its
        gradients are bit-identical to those of "save".
    save_outputs: below retain 1, keep the experts' outputs y ([P, D]) for the router gradient <g_t, y_u> of the
        pairs backward drops. False (default): not kept; backward computes every pair's router gradient as
        <g_t W_down^T, phi_u>, which for the dropped pairs costs their part of the down projection's
        input-gradient GEMM ((1 - retain) of one of the six dense backward GEMM units) and saves P*D elements per
        layer (with ``activations`` "recompute" or "offload", phi [P, F] is saved for it instead). True: that GEMM
        work saved, the memory spent. At retain 1 on one device no y is kept either way. Expert parallelism, and
        the "hopper" backend below retain 1, keep y whatever this says (their backward does not compute those
        router gradients).
    quota_align: trimmed experts' quotas in multiples of this many pairs, the same total (``plan_quotas``'
        ``align``); 128 fills torch._grouped_mm's 128-row tiles in backward. 1: the plain plan. Expert parallelism
        aligns each instance's quota (not with its capacity_factor).
    backward_capacity: None, or a factor >= 1: every expert keeps at most C = ``backward_capacity_rows(T, K, E,
        retain, factor)`` pairs (the balanced quota floor(retain * P) / E times the factor, rounded up to 8 rows),
        and the backward runs on E blocks of C rows (each expert's kept pairs, then zero padding) with batched GEMMs
        (torch.bmm) instead of grouped GEMMs. ``plan_experts`` plans within C (what a capped expert cannot keep
        goes to the experts below C); a given plan's quotas are clamped to C. The factor trades kept pairs for
        padding: 1.0 keeps the whole budget while the router stays balanced, 1.25 up to a heaviest expert of about
        2.5x the mean (docs/api.md; benchmarks/plans.py capacity for a router's skew); past that, fewer
        pairs than retain asks (``stats().retained_pairs`` says how many). A padding row reads the output gradient
        of one real token times 0: an inf or NaN there makes the padded experts' weight gradients NaN. Needs
        retain < 1, policy "waterfill", quota_align 1 and pairs grouped by expert; one device only (expert
        parallelism has ``ExpertParallel(capacity_factor=...)``).
    generator: RNG for the sampling uniforms and the "random" metric. None (default): the uniforms are a hash of
        the step's routing (lrmoe.functional.rng), a function of the model and the batch, so a run resumed from a
        checkpoint draws what the continued run draws, an activation-checkpoint recompute what its forward drew,
        and torch.compile traces it ("random" scores then come from the global RNG). A generator's state is not
        the model's, and a generator cannot be used under torch.compile: the call raises, naming it (docs/api.md,
        LRMoE's generator).
    kernels: the backend that computes the experts (lrmoe.functional.expert_kernels): "auto" (default: the one
        measured fastest, "portable" on every device measured so far), "portable" (lrmoe's own ops, every device) or
        "hopper" (quack's fused grouped GEMMs: an sm_90 GPU with quack-kernels installed, bf16 or fp16, D and F
        multiples of 8, no ``backward_capacity``; refused elsewhere).
    selective_in_eval: the modules' backward in eval() mode. False (default): exact, as if retain were 1, as
        eval() switches off dropout (input gradients for saliency or probing are then exact); True: the same
        selective backward as in training. Functional calls have no mode and ignore it.

    Every field is checked in ``__post_init__``: a bad value raises TypeError or ValueError naming it.
    """

    retain: float = 1.0
    min_retain: float = 0.0
    metric: str = "lrm"
    selection: str = "sample"
    policy: str = "waterfill"
    activations: str = "save"
    save_outputs: bool = False
    quota_align: int = 1
    backward_capacity: float | None = None
    generator: torch.Generator | None = None
    kernels: str = "auto"
    selective_in_eval: bool = False

    def __post_init__(self):
        # Numbers are stored as the Python values the checks return (a NumPy float would specialise, or break,
        # a compiled graph that reads it).
        retain, min_retain = check_retain(self.retain, self.min_retain)
        object.__setattr__(self, "retain", retain)
        object.__setattr__(self, "min_retain", min_retain)
        check_choice("metric", self.metric, METRICS)
        check_choice("selection", self.selection, MODES)
        check_choice("policy", self.policy, POLICIES)
        check_choice("activations", self.activations, ACTIVATION_POLICIES)
        check_choice("kernels", self.kernels, KERNEL_CHOICES)
        object.__setattr__(self, "quota_align", check_int("quota_align", self.quota_align))
        check_generator(self.generator)
        for name in ("save_outputs", "selective_in_eval"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {type(getattr(self, name)).__name__}")
        check_backward_capacity(self.backward_capacity, self.retain, self.quota_align, grouped_by_source=False,
                                policy=self.policy)

    def for_mode(self, training: bool) -> BackwardOptions:
        """The options a module runs with in training (``training=True``) or eval mode: in eval mode, unless
        ``selective_in_eval``, the exact backward (retain 1, every pair kept)."""
        if training or self.selective_in_eval or self.dense:
            return self
        # Only the fields that make a backward selective change: the rest (metric, activations, ...) stay.
        return dataclasses.replace(self, retain=1.0, min_retain=0.0, quota_align=1, backward_capacity=None)

    @property
    def dense(self) -> bool:
        """Whether backward keeps every pair (retain 1): no scores, no selection."""
        return self.retain >= 1.0


@dataclass(frozen=True)
class RoutingOptions:
    """How the router chooses each token's experts and gates (``route_topk``, ``router_logits``): the one
    reference for these options. ``LRMoE`` takes each field as a keyword of the same name, type and default (or
    this object as ``routing=``).

    score_func: "softmax" (Qwen3-MoE) or "sigmoid" (GLM-4.5, DeepSeek-V3).
    norm_topk_prob: renormalise the top-k gates to sum to 1 (Qwen3-MoE's default).
    routed_scaling_factor: the gates times this factor (> 0), as GLM-4.5 and DeepSeek-V3 scale them.
    n_group, topk_group: group-limited routing: experts chosen within the topk_group best of n_group equal groups
        (both or neither; checked against the layer's experts and top-k by the layer).
    selection_bias: a [E] fp32 buffer ``gate.e_score_correction_bias`` (zeros) added to the scores for the choice
        only, for aux-loss-free balancing (``LRMoE.update_selection_bias``).
    router_dtype: None (default): the logits in the parameters' dtype, as transformers' Qwen3-MoE computes them;
        torch.float32: the logits of fp32 copies of x and ``gate.weight``, as its GLM-4.5 and DeepSeek-V3 routers
        compute them (in bf16 the two choose differently for a few tokens in a thousand); for bf16 x and weights
        without the copies or fp32 GEMMs, ``router_logits``.
    """

    score_func: str = "softmax"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    n_group: int | None = None
    topk_group: int | None = None
    selection_bias: bool = False
    router_dtype: torch.dtype | None = None

    def __post_init__(self):
        check_choice("score_func", self.score_func, SCORE_FUNCS)
        object.__setattr__(self, "routed_scaling_factor",
                           check_scaling(self.routed_scaling_factor, "routed_scaling_factor"))
        check_float_dtype("router_dtype", self.router_dtype)
        for name in ("selection_bias", "norm_topk_prob"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {type(getattr(self, name)).__name__}")
        if (self.n_group is None) != (self.topk_group is None):
            raise ValueError("n_group and topk_group must be given together")


Options = TypeVar("Options", BackwardOptions, RoutingOptions)

# Each options class's field names and defaults, read from the dataclass once (torch.compile cannot trace
# dataclasses.fields; these are derived from the classes, not a second list of the names).
_FIELDS = {cls: {f.name: f.default for f in dataclasses.fields(cls)} for cls in (BackwardOptions, RoutingOptions)}


def option_names(cls: type[BackwardOptions | RoutingOptions]) -> tuple[str, ...]:
    """The field names of an options dataclass: the one list of its option names."""
    return tuple(_FIELDS[cls])


def check_option_names(cls: type[BackwardOptions | RoutingOptions], flat: dict, where: str) -> None:
    """Refuse a keyword in ``flat`` that is not a field of the options dataclass ``cls``, naming it."""
    names = option_names(cls)
    unknown = sorted(set(flat) - set(names))
    if unknown:
        kind = "expert" if cls is BackwardOptions else "routing"
        raise TypeError(f"{where}: unknown {kind} options {unknown}; expected some of {', '.join(names)} "
                        f"({cls.__name__}'s fields)")


def resolve_options(cls: type[Options], given: Options | None, where: str, **flat) -> Options:
    """The options object of a call or module: ``given`` (an instance of ``cls``, or None) or, when it is None, one
    built (and so validated) from the ``flat`` keywords (``cls``' fields; another name is refused, naming it). With
    ``given``, every flat keyword must be at its default: which of the two would win is not obvious, so both at once
    is refused."""
    check_option_names(cls, flat, where)
    if given is None:
        return cls(**flat)
    if not isinstance(given, cls):
        raise TypeError(f"{where}: expected a {cls.__name__} or None, got {type(given).__name__}")
    defaults = _FIELDS[cls]
    changed = sorted(k for k, v in flat.items() if not (v is defaults[k] or v == defaults[k]))
    if changed:
        raise TypeError(f"{where}: pass the options either as a {cls.__name__} or as keywords, not both (got a "
                        f"{cls.__name__} and {changed})")
    return given
