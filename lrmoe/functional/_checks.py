"""Argument checks shared by the functional primitives.

Every check looks only at Python values, shapes and dtypes, never at tensor contents, so none of them
synchronises with the device or breaks a compiled graph. Errors name the argument and what was expected.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch


def check_tensor(
    name: str,
    t: object,
    *,
    ndim: int | Iterable[int] | None = None,
    kind: str | None = None,
) -> torch.Tensor:
    """Check that ``t`` is a tensor of the given rank(s) and dtype kind ("float" or "int")."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if t.dim() not in allowed:
            want = " or ".join(str(a) for a in allowed)
            raise ValueError(f"{name} must have {want} dimensions, got shape {tuple(t.shape)}")
    if kind == "float" and not t.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    if kind == "int" and (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool):
        raise TypeError(f"{name} must be an integer tensor, got dtype {t.dtype}")
    return t


def check_same_device(**tensors: torch.Tensor | None) -> None:
    """Every given tensor on one device (None skipped). Meta tensors among real ones must be refused here: a custom
    op would dispatch to its fake kernel and return uninitialised memory."""
    named = [(name, t) for name, t in tensors.items() if t is not None]
    if len({t.device for _, t in named}) > 1:
        where = ", ".join(f"{name} on {t.device}" for name, t in named)
        raise ValueError(f"tensors must be on one device, got {where}")


def check_int(name: str, value: object, min_value: int = 1) -> int:
    """A Python int (not a bool) >= ``min_value``: counts such as ``num_experts``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < min_value:
        raise ValueError(f"{name} must be a Python int >= {min_value}, got {value!r}")
    return value


def check_choice(name: str, value: object, choices: Iterable[str]) -> str:
    choices = tuple(choices)
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(repr(c) for c in choices)}; got {value!r}")
    return value  # type: ignore[return-value]


def check_retain(retain: float, min_retain: float = 0.0) -> None:
    if isinstance(retain, (torch.Tensor, bool)) or not isinstance(retain, (int, float)):
        raise TypeError(f"retain must be a Python float in (0, 1], got {type(retain).__name__}")
    if not 0.0 < retain <= 1.0:
        raise ValueError(f"retain must be in (0, 1], got {retain}")
    if isinstance(min_retain, (torch.Tensor, bool)) or not isinstance(min_retain, (int, float)):
        raise TypeError(f"min_retain must be a Python float in [0, retain], got {type(min_retain).__name__}")
    if not 0.0 <= min_retain <= retain:
        raise ValueError(f"min_retain must be in [0, retain={retain}], got {min_retain}")


def check_same_size(name_a: str, a: torch.Tensor, dim_a: int, name_b: str, b: torch.Tensor, dim_b: int) -> None:
    if a.shape[dim_a] != b.shape[dim_b]:
        raise ValueError(
            f"{name_a} has size {a.shape[dim_a]} in dimension {dim_a} but {name_b} has size "
            f"{b.shape[dim_b]} in dimension {dim_b}; they must match "
            f"(shapes {tuple(a.shape)} and {tuple(b.shape)})"
        )


def check_backward_capacity(backward_capacity: float | None, retain: float, quota_align: int,
                             grouped_by_source: bool, policy: str) -> None:
    """LRMoE's ``backward_capacity`` (a factor >= 1 or None) against the options it needs: retain < 1, the
    waterfill policy, quota_align 1, pairs grouped by expert."""
    if backward_capacity is None:
        return
    # >= 1, as ExpertParallel's capacity_factor: the E capacities together hold the budget, and (min_retain <=
    # retain) a balanced expert's min_retain floor fits its capacity. SymFloat: torch.compile(dynamic=True) may
    # pass a module's float attribute symbolically (math.isfinite would break the graph; comparisons are guards).
    if (isinstance(backward_capacity, bool) or not isinstance(backward_capacity, (int, float, torch.SymFloat))
            or not 1 <= backward_capacity < math.inf):
        raise ValueError(f"backward_capacity must be a finite float >= 1 (times the balanced quota) or None, got "
                         f"{backward_capacity!r}: E capacities of C rows must together hold the retain budget")
    if retain >= 1.0:
        raise ValueError("backward_capacity needs retain < 1: at retain 1 the backward keeps every pair, in groups "
                         "of the routed loads")
    if policy != "waterfill":
        raise ValueError(f"backward_capacity needs policy='waterfill', got {policy!r}: the proportional plan under "
                         "one capacity per expert takes E + 1 rounds")
    if quota_align != 1:
        raise ValueError(f"backward_capacity cannot be combined with quota_align={quota_align}: the capacity "
                         "already gives every expert a whole block of rows; use quota_align=1")
    if grouped_by_source:
        raise ValueError("backward_capacity is per expert on one device: not with pairs grouped by (source, expert) "
                         "(source_ids_T, or a plan with group_ids); expert parallelism has its own capacity_factor")


def check_group_routing(num_experts: int, top_k: int, n_group: int | None, topk_group: int | None) -> None:
    """Group-limited routing's options (``route_topk``, ``LRMoE``): both or neither; n_group a positive divisor of
    num_experts, topk_group in [1, n_group], and top_k experts reachable in topk_group groups."""
    if (n_group is None) != (topk_group is None):
        raise ValueError("n_group and topk_group must be given together")
    if n_group is None:
        return
    if isinstance(n_group, bool) or not isinstance(n_group, int) or n_group < 1 or num_experts % n_group:
        raise ValueError(f"n_group must be a positive divisor of num_experts={num_experts}, got {n_group!r}")
    group_size = num_experts // n_group
    if isinstance(topk_group, bool) or not isinstance(topk_group, int) or not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group must be an int in [1, n_group={n_group}], got {topk_group!r}")
    if top_k > topk_group * group_size:
        raise ValueError(
            f"top_k={top_k} exceeds the experts reachable in topk_group={topk_group} groups of {group_size}"
        )


def check_float_dtype(name: str, dtype: object) -> None:
    """None or a floating-point torch.dtype: ``router_logits``' ``dtype``, ``LRMoE``'s ``router_dtype``."""
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"{name} must be a floating-point torch.dtype or None, got {dtype!r}")


def check_generator(generator: object) -> None:
    """None or a torch.Generator: the RNG of sampling uniforms and the "random" metric."""
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")


def check_scaling(scaling: float, name: str = "scaling") -> None:
    """A finite number > 0 named ``name``: ``route_topk``'s ``scaling``, ``LRMoE``'s ``routed_scaling_factor`` and
    ``update_selection_bias``' ``rate``. Comparisons, not math.isfinite: under torch.compile(dynamic=True) a
    module's float may arrive as a SymFloat."""
    if isinstance(scaling, bool) or not isinstance(scaling, (int, float, torch.SymFloat)) or not 0 < scaling < math.inf:
        raise ValueError(f"{name} must be a finite number > 0, got {scaling!r}")


def check_replica_slots(name: str, replicas: int, num_experts: int, world_size: int) -> None:
    """At most E - E/W replica slots per rank (E % W == 0 checked before): a rank holds at most one instance of an
    expert, and its own E/W experts are not replicated on it. ``ExpertParallel``'s, ``plan_expert_parallel``'s and
    the memory planner's limit."""
    n_other = num_experts - num_experts // world_size
    if replicas > n_other:
        raise ValueError(
            f"{name}={replicas} exceeds the {n_other} experts a rank does not own (E - E/W with E={num_experts}, "
            f"W={world_size}); a rank holds at most one instance of an expert"
        )
