"""The options of a selective MoE layer, as two frozen dataclasses, each validated once, when it is built.

:class:`BackwardOptions` is what the selective backward keeps and how (docs/design.md, "The method" and
"Selection rules");
:class:`RoutingOptions` is how the router picks experts and gates. ``LRMoE`` takes them (``LRMoE(...,
backward=BackwardOptions(retain=0.75))``) or their fields as flat keywords, which it turns into these objects;
``SwiGLUExperts``, ``selective_swiglu_experts``, ``swap_experts``, ``ExpertParallel`` and ``lrmoe.memory`` take the
same objects. They hold Python values only (and a torch.Generator), so torch.compile(fullgraph=True) traces code
that reads them, and ``dataclasses.replace`` gives a changed copy, validated again.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

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

__all__ = ["ACTIVATION_POLICIES", "KERNEL_CHOICES", "SCORE_FUNCS", "BackwardOptions", "RoutingOptions", "option_names",
           "resolve_options", "split_options"]

# What forward keeps of each pair's gate/up projection for backward (BackwardOptions.activations).
ACTIVATION_POLICIES = ("save", "recompute", "offload")
SCORE_FUNCS = ("softmax", "sigmoid")
KERNEL_CHOICES = ("auto", "portable", "hopper")


@dataclass(frozen=True)
class BackwardOptions:
    """How the selective backward keeps pairs.

    retain: fraction of routed pairs whose expert-path gradient backward keeps, in (0, 1]; 1 = the dense backward.
    min_retain: per-expert floor, in [0, retain] (``plan_quotas``).
    metric: pair score, "lrm" (alpha^2 ||g||^2 ||phi||^2), "grad_l2", "grad_abs" or "random" (``score_pairs``).
    selection: "sample" (unbiased, default) or "top" (``select_within_quota``).
    policy: quota policy, "waterfill" or "proportional" (``plan_quotas``).
    activations: what forward keeps for backward: "save" (every pair's gate/up projection h), "recompute" (not
        h: backward recomputes it for the retained rows only) or "offload" (h in pinned host memory, the retained
        rows read back); the same gradients (``selective_swiglu_experts``).
    quota_align: trimmed experts' quotas in multiples of this many pairs, the same total (``plan_quotas``'
        ``align``); 128 fills torch._grouped_mm's row tiles. 1: the plain plan.
    backward_capacity: None, or a factor >= 1: every expert keeps at most C = ``backward_capacity_rows(T, K, E,
        retain, factor)`` pairs and the backward runs on E zero-padded blocks of C rows with batched GEMMs. Needs
        retain < 1, policy "waterfill" and quota_align 1; one device only (expert parallelism has
        ``ExpertParallel(capacity_factor=...)``).
    generator: RNG for the sampling uniforms and the "random" metric. None (default): the uniforms are a hash of
        the step's routing (lrmoe.functional.rng), a function of the model and the batch, so a checkpoint resumes
        exactly and torch.compile traces it ("random" scores then come from the global RNG). A generator cannot be
        used under torch.compile: the call raises, naming it (docs/api.md, LRMoE's generator).
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
        if not isinstance(self.selective_in_eval, bool):
            raise TypeError(f"selective_in_eval must be a bool, got {type(self.selective_in_eval).__name__}")
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
    """How the router chooses each token's experts and gates (``route_topk``, ``router_logits``).

    score_func: "softmax" (Qwen3-MoE) or "sigmoid" (GLM-4.5, DeepSeek-V3).
    norm_topk_prob: renormalise the top-k gates to sum to 1.
    routed_scaling_factor: the gates times this factor (> 0).
    n_group, topk_group: group-limited routing: experts chosen within the topk_group best of n_group equal groups
        (both or neither; checked against the layer's experts and top-k by the layer).
    selection_bias: a [E] fp32 buffer ``gate.e_score_correction_bias`` added to the scores for the choice only
        (aux-loss-free balancing).
    router_dtype: None (the logits in the parameters' dtype) or torch.float32 (the logits of fp32 copies).
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


# Each options class's field names and defaults, read from the dataclass once (torch.compile cannot trace
# dataclasses.fields; these are derived from the classes, not a second list of the names).
_FIELDS = {cls: {f.name: f.default for f in dataclasses.fields(cls)} for cls in (BackwardOptions, RoutingOptions)}


def option_names(cls: type) -> tuple[str, ...]:
    """The field names of an options dataclass: the one list of its option names."""
    return tuple(_FIELDS[cls])


def split_options(cls: type, kwargs: dict) -> tuple[dict, dict]:
    """(the entries of ``kwargs`` that are fields of the options dataclass ``cls``, the others)."""
    names = option_names(cls)
    return ({k: v for k, v in kwargs.items() if k in names}, {k: v for k, v in kwargs.items() if k not in names})


def resolve_options(cls: type, given, where: str, **flat):
    """The options object of a call or module: ``given`` (an instance of ``cls``, or None) or, when it is None, one
    built (and so validated) from the ``flat`` keywords. With ``given``, every flat keyword must be at its default:
    which of the two would win is not obvious, so both at once is refused."""
    names = option_names(cls)
    unknown = sorted(set(flat) - set(names))
    if unknown:
        kind = "expert" if cls is BackwardOptions else "routing"
        raise TypeError(f"{where}: unknown {kind} options {unknown}; expected some of {', '.join(names)} "
                        f"({cls.__name__}'s fields)")
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
