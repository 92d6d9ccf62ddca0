"""Argument checks shared by the functional primitives.

Every check looks only at Python values, shapes and dtypes, never at tensor contents, so none of them
synchronises with the device or breaks a compiled graph. Errors name the argument and what was expected.

Numbers: a count takes any integer that is not a bool (``numbers.Integral``: Python and NumPy integers), a fraction
or factor any real number that is not a bool (``numbers.Real``: Python and NumPy floats and integers). A check
returns the value as a Python int or float, so that what a caller stores and computes with is a Python number
(float32 arithmetic on a NumPy scalar could round ``retain * pairs`` differently from the planner's float64).

Checking mode (``with lrmoe.checks():``, or ``LRMOE_CHECK=1`` in the environment) adds the checks that do read
tensor contents: the data-dependent contracts (loads >= 0, ids in range, offsets nondecreasing, ...) that the fast
path leaves to the caller, since on a GPU each one waits for the device. Off by default. Each primitive asks
``checking()`` in a plain Python branch: off, or while torch.compile traces, nothing runs and nothing is traced
(the checks run in eager code only, so a compiled graph is the same with checking on or off).
"""

from __future__ import annotations

import contextvars
import math
import numbers
import os
from collections.abc import Iterable

import torch


def is_integer(value: object) -> bool:
    """A Python or NumPy integer, not a bool (a bool is an int in Python, never a count)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value: object) -> bool:
    """A Python or NumPy real number (float or integer), not a bool and not a tensor."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


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
    """An integer (Python or NumPy, not a bool) >= ``min_value``: counts such as ``num_experts``. Returns it as a
    Python int. ValueError either way (a float count, even 2.0, is a wrong value for a count)."""
    if not is_integer(value) or value < min_value:
        raise ValueError(f"{name} must be an int >= {min_value}, got {value!r}")
    return int(value)


def check_top_k(top_k: object, num_experts: int) -> int:
    """``top_k`` an int in [1, num_experts] (``route_topk``, ``LRMoE``); returned as a Python int."""
    if not is_integer(top_k) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be an int in [1, num_experts={num_experts}], got {top_k!r}")
    return int(top_k)


def check_choice(name: str, value: object, choices: Iterable[str]) -> str:
    choices = tuple(choices)
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(repr(c) for c in choices)}; got {value!r}")
    return value  # type: ignore[return-value]


def check_retain(retain: float, min_retain: float = 0.0) -> tuple[float, float]:
    """``retain`` a real number in (0, 1] and ``min_retain`` one in [0, retain]; returned as Python floats
    (``np.float32(0.7)`` is the float 0.699999988..., the value it holds). TypeError for a non-number (a tensor,
    a bool, a string), ValueError out of range (NaN included)."""
    if not is_real(retain):
        raise TypeError(f"retain must be a real number in (0, 1] (a Python or NumPy float), got "
                        f"{type(retain).__name__}")
    if not 0.0 < retain <= 1.0:
        raise ValueError(f"retain must be in (0, 1], got {retain}")
    if not is_real(min_retain):
        raise TypeError(f"min_retain must be a real number in [0, retain], got {type(min_retain).__name__}")
    if not 0.0 <= min_retain <= retain:
        raise ValueError(f"min_retain must be in [0, retain={retain}], got {min_retain}")
    return float(retain), float(min_retain)


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
    if (not (is_real(backward_capacity) or isinstance(backward_capacity, torch.SymFloat))
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


def check_group_routing(num_experts: int, top_k: int, n_group: int | None,
                        topk_group: int | None) -> tuple[int | None, int | None]:
    """Group-limited routing's options (``route_topk``, ``LRMoE``): both or neither; n_group a positive divisor of
    num_experts, topk_group in [1, n_group], and top_k experts reachable in topk_group groups. Returns them as
    Python ints (or both None)."""
    if (n_group is None) != (topk_group is None):
        raise ValueError("n_group and topk_group must be given together")
    if n_group is None:
        return None, None
    if not is_integer(n_group) or n_group < 1 or num_experts % n_group:
        raise ValueError(f"n_group must be a positive divisor of num_experts={num_experts}, got {n_group!r}")
    group_size = num_experts // n_group
    if not is_integer(topk_group) or not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group must be an int in [1, n_group={n_group}], got {topk_group!r}")
    if top_k > topk_group * group_size:
        raise ValueError(
            f"top_k={top_k} exceeds the experts reachable in topk_group={topk_group} groups of {group_size}"
        )
    return int(n_group), int(topk_group)


def check_float_dtype(name: str, dtype: object) -> None:
    """None or a floating-point torch.dtype: ``router_logits``' ``dtype``, ``LRMoE``'s ``router_dtype``."""
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"{name} must be a floating-point torch.dtype or None, got {dtype!r}")


def check_generator(generator: object) -> None:
    """None or a torch.Generator: the RNG of sampling uniforms and the "random" metric."""
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")


GENERATOR_UNDER_COMPILE = (
    "generator= cannot be used under torch.compile: Dynamo cannot pass a torch.Generator into a graph. Leave "
    "generator=None (the default): the sampling uniforms are then a hash of the step's routing "
    "(lrmoe.functional.rng), which compiles, and a resumed run or a recompute draws them again exactly; or run the "
    "layer eagerly. A functional caller can also pass a plan holding uniforms drawn outside the compiled region "
    "(plan_experts(..., draw_uniform=False), then dataclasses.replace(plan, uniform=...))"
)


@torch.compiler.disable(reason=GENERATOR_UNDER_COMPILE)
def _refuse_traced_generator() -> None:
    """Raises, outside the graph. Dynamo cannot trace this call: under fullgraph=True its error quotes the reason
    above; without, it breaks the graph here and the call raises this ValueError eagerly. A ``raise`` that Dynamo
    traces gives "Observed exception" under fullgraph and, without, marks the code objects on the stack
    (LRMoE.forward, selective_swiglu_experts, ...: shared by every instance) to be skipped for the rest of the
    process: a later torch.compile(fullgraph=True) of any other layer then splits into graphs or fails."""
    raise ValueError(GENERATOR_UNDER_COMPILE)


def check_generator_not_traced(generator: object) -> None:
    """A torch.Generator cannot enter a torch.compile graph (Dynamo cannot pass one to an op): refuse it while
    tracing, saying what works instead, rather than Dynamo's "Failed to convert args/kwargs to proxy" or a graph
    break that would run the step eagerly."""
    if generator is not None and torch.compiler.is_compiling():
        _refuse_traced_generator()


def check_keeps_pairs(retain: float, min_retain: float, n_pairs: int, where: str) -> None:
    """Refuse a retain whose budget floor(retain * P) rounds to zero rows while there are pairs to keep and no
    min_retain floor: every expert gradient would be zero, silently. Only for a step whose backward can run (grad
    mode on and something requiring grad): a forward alone is exact at any retain, so nothing is refused there.
    ``n_pairs`` is the P the step's quotas are planned from: T * K on one device (static; a SymInt under
    torch.compile(dynamic=True) only adds a guard), the sum over the EP ranks under expert parallelism (read from
    the all-gathered loads, so every rank checks the same P and raises together)."""
    if retain < 1.0 and min_retain == 0.0 and n_pairs > 0 and retain * n_pairs < 1:
        raise ValueError(
            f"{where}: retain={retain} keeps floor(retain * P) = 0 of the step's P = {n_pairs} routed pairs, so "
            f"every expert's weight gradient would be zero; use retain >= 1 / P = {1 / n_pairs:.3g}, or a "
            "min_retain floor"
        )


def check_scaling(scaling: float, name: str = "scaling") -> float:
    """A finite real number > 0 named ``name``: ``route_topk``'s ``scaling``, ``LRMoE``'s ``routed_scaling_factor``
    and ``update_selection_bias``' ``rate``; returned as a Python float (a SymFloat as it is). Comparisons, not
    math.isfinite: under torch.compile(dynamic=True) a module's float may arrive as a SymFloat."""
    if isinstance(scaling, torch.SymFloat):
        if not 0 < scaling < math.inf:
            raise ValueError(f"{name} must be a finite number > 0, got {scaling!r}")
        return scaling
    if not is_real(scaling) or not 0 < scaling < math.inf:
        raise ValueError(f"{name} must be a finite number > 0, got {scaling!r}")
    return float(scaling)


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


# ------------------------------------------------------------------------------------------------ checking mode

# The setting of the current context (a thread, an asyncio task); outside every block, LRMOE_CHECK.
_CHECKING: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "lrmoe_checking", default=os.environ.get("LRMOE_CHECK", "") not in ("", "0"))
# The tokens of the context's open blocks, innermost last: a block leaves by the token its own entry made, so one
# checks object may be entered again inside its block, or in several threads at once.
_BLOCKS: contextvars.ContextVar[tuple[contextvars.Token, ...]] = contextvars.ContextVar("lrmoe_checks_blocks",
                                                                                       default=())


class checks:
    """Checking mode on (default) or off for a block::

        with lrmoe.checks():
            loss = model(x).sum()   # every lrmoe primitive validates its data-dependent contracts
        loss.backward()             # and so does the backward of that forward

    Only the block: ``lrmoe.checks()`` without ``with`` changes nothing. The setting belongs to the current context
    (a ``contextvars`` variable): the thread, or the asyncio task, that runs the block. Another thread keeps its own
    (a thread started inside the block has the setting outside every block, unless its Python passes the context
    to new threads), and the previous setting comes back when the block ends; outside every block it is
    ``LRMOE_CHECK`` from the environment (``1``: on; unset, empty or ``0``: off).

    A backward checks as its forward did: the selective expert step records the setting its forward ran with and
    runs its backward's checks (the selection's) under it, wherever and on whatever thread the backward runs
    (autograd runs the backward of CUDA tensors on threads of its own). A forward inside the block has its backward
    checked, even one called after the block ends; a forward outside every block (checking off) has none checked,
    even when ``backward()`` is called inside a block. A forward that autograd recomputes during the backward
    (activation checkpointing) checks by the setting of the thread the backward runs on.

    Under checking, a primitive given out-of-contract values (negative loads, ids out of range, decreasing offsets,
    ...) raises ValueError naming the argument, where the fast path would compute something wrong or fail with a
    raw index error. Each check reads tensor values: a host sync on a GPU. Checks run in eager code only;
    torch.compile traces none of them.
    """

    def __init__(self, enabled: bool = True):
        if not isinstance(enabled, bool):
            raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
        self._enabled = enabled

    def __enter__(self) -> checks:
        token = _CHECKING.set(self._enabled)
        _BLOCKS.set((*_BLOCKS.get(), token))
        return self

    def __exit__(self, *exc_info) -> None:
        *outer, token = _BLOCKS.get()
        _BLOCKS.set(tuple(outer))
        _CHECKING.reset(token)


def checking() -> bool:
    """Whether the data-dependent checks run now: no compiler is tracing and checking mode is on in the current
    context. The compiler test comes first, so that torch.compile never traces the context variable's read."""
    if torch.compiler.is_compiling():
        return False
    return _CHECKING.get()


def _readable(t: torch.Tensor) -> bool:
    """A tensor with values to read (not on the meta device) and any entries at all."""
    return t.device.type != "meta" and t.numel() > 0


def check_at_least(name: str, t: torch.Tensor | None, low: int, what: str) -> None:
    """Checking mode: every entry of ``t`` is >= ``low`` (``what`` says what the entries are)."""
    if t is not None and _readable(t):
        smallest = t.min().item()
        if smallest < low:
            raise ValueError(f"{name} must be >= {low} ({what}), got {smallest} at index "
                             f"{_first_index(t < low)}")


def check_in_range(name: str, t: torch.Tensor | None, low: int, high: int, what: str) -> None:
    """Checking mode: every entry of ``t`` in [low, high) (``what`` says what the entries are)."""
    if t is not None and _readable(t):
        lo, hi = t.min().item(), t.max().item()
        if lo < low or hi >= high:
            raise ValueError(f"{name} must be in [{low}, {high}) ({what}), got values from {lo} to {hi} (first "
                             f"outside at index {_first_index((t < low) | (t >= high))})")


def check_nondecreasing(name: str, t: torch.Tensor, what: str) -> None:
    """Checking mode: a 1-D ``t`` that never decreases."""
    if _readable(t) and t.shape[0] > 1:
        drops = t[1:] < t[:-1]
        if drops.any():
            i = int(_first_index(drops)[0])
            raise ValueError(f"{name} must be nondecreasing ({what}), got {t[i].item()} then {t[i + 1].item()} at "
                             f"indices {i}, {i + 1}")


def _first_index(mask: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(i) for i in mask.nonzero()[0])
