"""Bytes per MoE layer and rank, and a planner that fits replicas and backward capacity into a byte budget.

Notation (DESIGN.md §2): T tokens per rank, D model dim, F expert hidden dim, E experts, K top-k, P = T * K pairs
this rank routes, W EP ranks, L = E / W experts this rank owns, N forward rows its expert instances compute (its
received dispatch rows; N = P on one device), R retained rows it sends in backward, M retained rows its experts
receive in backward (R = M on one device). b: bytes per element of the parameter and activation dtype (LRMoE
requires x.dtype == parameter dtype), g: of the gradient dtype, o: optimiser-state bytes per parameter,
u: 4 when b is not fp32 (an fp32 upcast copy is made), else 0.

The model follows the code as it is (``selective_swiglu_experts`` on one device, ``ExpertParallel`` for W > 1),
buffer by buffer, so that a change there shows up as a failing test here (tests/test_memory.py measures the
one-device path on CPU). Components, per layer and rank:

static, for the whole step:
    expert_weights    L * 3FD * b     (gate_up_proj [L, 2F, D] + down_proj [L, D, F])
    expert_grads      L * 3FD * g
    expert_optimizer  L * 3FD * o     (AdamW: 8 = fp32 m + v; 12 with an fp32 master copy)
    router            E * D * (b + g + o)   (gate.weight, replicated on every rank)
    replica_weights   r * 3FD * b
    replica_grads     r * 3FD * g
    Replicas carry no optimiser state: a replica's gradient is summed into its owner's (DESIGN.md §5) and only
    the owner steps; the replica is fetched again from the owner's weights. Gradients are counted as static
    (allocated for the whole step), which over-counts by at most their size before the first backward.

saved activations (forward to backward), "save" = what the code keeps today:
    router:  x T*D*b (the layer input, also saved by the experts on one device), scores T*E*4 (softmax/sigmoid
             output, fp32), expert ids P*8, and with norm_topk_prob the un-normalised gates P*4 and their sums T*4.
    W = 1:   gates P*b, h P*2F*b, y P*D*b, ||phi||^2 P*4, sort order and inverse 2*P*8, quotas E*8, offsets E*4,
             sampling uniforms E*4 (retain < 1, selection "sample").
    W > 1:   gates P*b, y P*D*b, ||phi||^2 P*4, order and inverse 2*P*8, received rows x_recv N*D*b,
             h N*2F*b, their expert-major permutation N*8, loads and quotas 2*W*E*8, uniforms E*4 (as above).
    "recompute" (LRMoE(activations="recompute"), one device): the same without h; backward recomputes h for
        the retained rows only from x, into the buffer "save" fills by gathering, so the backward buffers are
        unchanged.
    "offload" (not implemented yet): h parked in pinned host memory (``offloaded``, not device bytes), retained
        rows brought back into the same buffer.

transients (buffers live only inside this layer's forward or backward), each the largest of a few phases
(``forward_phases`` / ``backward_phases`` name them and their buffers), on top of the saved activations:
    forward:  the SwiGLU output phi N*F*b, y before reordering N*D*b, the fp32 ||phi||^2 working set
              N*F*(u + 4), index buffers, the combine product P*D*b and the output T*D*b; with W > 1 the
              dispatch send buffer P*D*b and the combine payloads N*(D*b + 4) sent and P*(D*b + 4) received.
    backward: the incoming gradient T*D*b, gate gradients P*b, the router gradient's output P*b (with W > 1
              its fp32 copies T*D*u + P*D*u), the retained-row buffers (dy M*D*b, h M*2F*b, phi and dphi M*F*b each), the fp32
              SwiGLU-backward working set M*F*(3u + 20) (+ M*2F*b for its cast when u > 0), dh M*2F*b,
              dx M*D*b, its pair slots (P+1)*D*b and the input gradient T*D*b; with W > 1 the backward payloads
              R*(D*b + 4) sent (no index when retain = 1) and M*(D*b + 4) received, and the returned dx R*D*b.
    Not modelled: buffers inside one custom op (the selection sort, a grouped GEMM's workspace) and the
    allocator's rounding and fragmentation; the GPU measurement (a later increment) says how much they add.

peak = static + saved + max(forward transient, backward transient).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from lrmoe.functional._checks import check_choice, check_retain
from lrmoe.functional.experts import retained_rows_bound

__all__ = [
    "ACTIVATION_POLICIES",
    "ADAMW_FP32",
    "ADAMW_FP32_MASTER",
    "DEFAULT_RETAIN_CHOICES",
    "LayerMemory",
    "MemoryConfig",
    "MemoryPlan",
    "Rows",
    "balanced_rows",
    "layer_memory",
    "plan_memory",
    "rows_from_plan",
]

ADAMW_FP32 = 8  # fp32 first and second moments
ADAMW_FP32_MASTER = 12  # the same plus an fp32 master copy of bf16 weights
ACTIVATION_POLICIES = ("save", "recompute", "offload")
# Dyadic, so retain * P is exact in floating point.
DEFAULT_RETAIN_CHOICES = (1.0, 0.875, 0.75, 0.625, 0.5, 0.375, 0.25)
_FP32 = 4
_INT64 = 8
_INT32 = 4


@dataclass(frozen=True)
class MemoryConfig:
    """One MoE layer as one rank sees it.

    dim, hidden_dim, num_experts, top_k: D, F, E, K (as :class:`lrmoe.nn.LRMoE`).
    tokens: T, tokens per rank per step. world_size: W EP ranks (num_experts % W == 0).
    param_dtype: weights and activations. grad_dtype: gradients (None: param_dtype).
    optimizer_bytes_per_param: optimiser state per owned parameter (ADAMW_FP32, ADAMW_FP32_MASTER, 0 for SGD).
    norm_topk_prob: router renormalises the top-k gates (saves two more small tensors).
    selection: "sample" saves one fp32 uniform per expert when retain < 1; "top" does not.
    """

    dim: int
    hidden_dim: int
    num_experts: int
    top_k: int
    tokens: int
    world_size: int = 1
    param_dtype: torch.dtype = torch.bfloat16
    grad_dtype: torch.dtype | None = None
    optimizer_bytes_per_param: int = ADAMW_FP32
    norm_topk_prob: bool = True
    selection: str = "sample"

    def __post_init__(self):
        for name in ("dim", "hidden_dim", "num_experts", "top_k", "tokens", "world_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={self.num_experts}], got {self.top_k}")
        if self.num_experts % self.world_size:
            raise ValueError(f"num_experts={self.num_experts} must be divisible by world_size={self.world_size}")
        if not isinstance(self.optimizer_bytes_per_param, int) or self.optimizer_bytes_per_param < 0:
            raise ValueError(f"optimizer_bytes_per_param must be a non-negative int, got "
                             f"{self.optimizer_bytes_per_param!r}")
        for name in ("param_dtype", "grad_dtype"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, torch.dtype) or not value.is_floating_point):
                raise TypeError(f"{name} must be a floating-point torch.dtype, got {value!r}")
        check_choice("selection", self.selection, ("sample", "top"))

    @property
    def pairs(self) -> int:
        """P = T * K."""
        return self.tokens * self.top_k

    @property
    def local_experts(self) -> int:
        """L = E / W."""
        return self.num_experts // self.world_size

    @property
    def expert_numel(self) -> int:
        """Parameters of one expert: 3FD (gate_up [2F, D] + down [D, F])."""
        return 3 * self.hidden_dim * self.dim


@dataclass(frozen=True)
class Rows:
    """Row counts of one rank's layer step (see the module notation): pairs P, forward rows N, retained rows
    sent R and received M."""

    pairs: int
    recv: int
    sent_retained: int
    recv_retained: int

    def __post_init__(self):
        for name in ("pairs", "recv", "sent_retained", "recv_retained"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"Rows.{name} must be a non-negative int, got {value!r}")
        if self.sent_retained > self.pairs or self.recv_retained > self.recv:
            raise ValueError(f"retained rows cannot exceed routed rows: {self}")


def balanced_rows(config: MemoryConfig, retain: float, recv: int | None = None) -> Rows:
    """Rows under the static bounds the code uses: N = ``recv`` (default P, a balanced dispatch),
    R = min(P, floor(retain P) + E) and M = min(N, floor(retain N) + L) (``retained_rows_bound``; on one device
    R = M is exactly the backward buffer's size)."""
    check_retain(retain)
    n_pairs = config.pairs
    if config.world_size == 1:
        if recv is not None and recv != n_pairs:
            raise ValueError(f"on one device the forward rows are the pairs P={n_pairs}, got recv={recv}")
        rows = retained_rows_bound(n_pairs, config.num_experts, retain)
        return Rows(pairs=n_pairs, recv=n_pairs, sent_retained=rows, recv_retained=rows)
    recv = n_pairs if recv is None else recv
    return Rows(
        pairs=n_pairs,
        recv=recv,
        sent_retained=retained_rows_bound(n_pairs, config.num_experts, retain),
        recv_retained=retained_rows_bound(recv, config.local_experts, retain),
    )


def rows_from_plan(loads_WE: torch.Tensor, quotas_WE: torch.Tensor, rank: int) -> Rows:
    """Exact rows of rank ``rank`` from an expert-parallel plan ([W, E] loads and quotas, experts in contiguous
    blocks of L = E / W per rank, as ``ExpertParallel`` lays them out). Reads the tensors on the host."""
    if loads_WE.dim() != 2 or loads_WE.shape != quotas_WE.shape:
        raise ValueError(f"loads_WE and quotas_WE must both be [W, E], got {tuple(loads_WE.shape)} and "
                         f"{tuple(quotas_WE.shape)}")
    n_ranks, n_exp = loads_WE.shape
    if n_exp % n_ranks or not 0 <= rank < n_ranks:
        raise ValueError(f"need E % W == 0 and 0 <= rank < W, got E={n_exp}, W={n_ranks}, rank={rank}")
    lo, hi = rank * (n_exp // n_ranks), (rank + 1) * (n_exp // n_ranks)
    return Rows(
        pairs=int(loads_WE[rank].sum()),
        recv=int(loads_WE[:, lo:hi].sum()),
        sent_retained=int(quotas_WE[rank].sum()),
        recv_retained=int(quotas_WE[:, lo:hi].sum()),
    )


@dataclass(frozen=True)
class LayerMemory:
    """Modelled bytes of one MoE layer on one rank (formulas in the module docstring).

    The ``*_phases`` mappings give, per phase, the buffers live in it (name -> bytes); the transient is the
    largest phase total. ``saved`` gives the saved activations tensor by tensor.
    """

    expert_weights: int
    expert_grads: int
    expert_optimizer: int
    router: int
    replica_weights: int
    replica_grads: int
    saved: Mapping[str, int]
    offloaded: int
    forward_phases: Mapping[str, Mapping[str, int]]
    backward_phases: Mapping[str, Mapping[str, int]]
    rows: Rows
    replicas: int
    retain: float
    policy: str

    @property
    def base_experts(self) -> int:
        return self.expert_weights + self.expert_grads + self.expert_optimizer

    @property
    def replica_bytes(self) -> int:
        return self.replica_weights + self.replica_grads

    @property
    def static(self) -> int:
        return self.base_experts + self.router + self.replica_bytes

    @property
    def saved_activations(self) -> int:
        return sum(self.saved.values())

    @property
    def forward_transient(self) -> int:
        return max(sum(p.values()) for p in self.forward_phases.values())

    @property
    def backward_transient(self) -> int:
        return max(sum(p.values()) for p in self.backward_phases.values())

    @property
    def token_buffers(self) -> int:
        """Saved activations plus the larger transient: the "token buffers" bar of the paper's Figure 7."""
        return self.saved_activations + max(self.forward_transient, self.backward_transient)

    @property
    def peak(self) -> int:
        return self.static + self.token_buffers


def layer_memory(
    config: MemoryConfig,
    *,
    retain: float = 1.0,
    replicas: int = 0,
    policy: str = "save",
    rows: Rows | None = None,
) -> LayerMemory:
    """Model the bytes of one layer step on one rank.

    Args:
        config: the layer and rank (:class:`MemoryConfig`).
        retain: backward retention target in (0, 1]; sizes the retained-row buffers when ``rows`` is None.
        replicas: extra expert instances this rank holds (W > 1 only).
        policy: activation policy, "save" or "recompute" (LRMoE's ``activations``), or "offload" (planned;
            modelled as the module docstring says).
        rows: row counts, e.g. from :func:`rows_from_plan`; default :func:`balanced_rows`.
    """
    check_retain(retain)
    check_choice("policy", policy, ACTIVATION_POLICIES)
    if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
        raise ValueError(f"replicas must be a non-negative int, got {replicas!r}")
    if replicas and config.world_size == 1:
        raise ValueError("replicas need expert parallelism (world_size > 1): on one device every expert is local")
    rows = balanced_rows(config, retain) if rows is None else rows
    if rows.pairs != config.pairs:
        raise ValueError(f"rows.pairs={rows.pairs} must equal tokens * top_k = {config.pairs}")
    if config.world_size == 1 and not (rows.recv == rows.pairs and rows.sent_retained == rows.recv_retained):
        raise ValueError(f"on one device N = P and R = M, got {rows}")

    b = config.param_dtype.itemsize
    g = (config.grad_dtype or config.param_dtype).itemsize
    o = config.optimizer_bytes_per_param
    numel = config.expert_numel
    saved = _saved(config, rows, retain, b)
    offloaded = 0
    if policy != "save":
        h_bytes = saved.pop("h")
        offloaded = h_bytes if policy == "offload" else 0
    return LayerMemory(
        expert_weights=config.local_experts * numel * b,
        expert_grads=config.local_experts * numel * g,
        expert_optimizer=config.local_experts * numel * o,
        router=config.num_experts * config.dim * (b + g + o),
        replica_weights=replicas * numel * b,
        replica_grads=replicas * numel * g,
        saved=saved,
        offloaded=offloaded,
        forward_phases=_forward_phases(config, rows, b),
        backward_phases=_backward_phases(config, rows, retain, b),
        rows=rows,
        replicas=replicas,
        retain=retain,
        policy=policy,
    )


def _upcast(b_dtype: torch.dtype) -> int:
    """Bytes per element of an fp32 copy made by ``.float()``: 0 when the tensor already is fp32."""
    return 0 if b_dtype == torch.float32 else _FP32


def _saved(config: MemoryConfig, rows: Rows, retain: float, b: int) -> dict[str, int]:
    T, D, F, E, P, N = config.tokens, config.dim, config.hidden_dim, config.num_experts, rows.pairs, rows.recv
    saved = {
        "x": T * D * b,
        "router_scores": T * E * _FP32,
        "expert_ids": P * _INT64,
    }
    if config.norm_topk_prob:
        saved["raw_gates"] = P * _FP32
        saved["gate_sums"] = T * _FP32
    saved["gates"] = P * b
    saved["h"] = N * 2 * F * b
    saved["y"] = P * D * b
    saved["phi_sq"] = P * _FP32
    saved["order_and_inverse"] = 2 * P * _INT64
    if config.world_size == 1:
        saved["quotas"] = E * _INT64
        saved["offsets"] = E * _INT32
    else:
        saved["x_recv"] = N * D * b
        saved["recv_permutation"] = N * _INT64
        saved["loads_and_quotas"] = 2 * config.world_size * E * _INT64
    if retain < 1.0 and config.selection == "sample":
        saved["uniforms"] = E * _FP32
    return saved


def _forward_phases(config: MemoryConfig, rows: Rows, b: int) -> dict[str, dict[str, int]]:
    T, D, F, P, N = config.tokens, config.dim, config.hidden_dim, rows.pairs, rows.recv
    u = _upcast(config.param_dtype)
    # Live from the expert GEMMs to the end of the forward.
    expert = {
        "token_index": P * _INT64,
        "row_index": N * _INT64,
        "phi": N * F * b,
        "y_rows": N * D * b,
    }
    if config.world_size > 1:
        expert["recv_permutation_tmp"] = N * _INT64
    phases = {"phi_sq": {**expert, "phi_fp32": N * F * u, "phi_fp32_squared": N * F * _FP32}}
    combine = {**expert, "weighted_y": P * D * b, "out": T * D * b}
    if config.world_size > 1:
        phases["dispatch"] = {"token_index": P * _INT64, "dispatch_send": P * D * b}
        combine.update({
            "phi_sq_rows": N * _FP32,
            "combine_send": N * (D * b + _FP32),
            "combine_recv": P * (D * b + _FP32),
            "y_unpacked": P * D * b,
            "phi_sq_unpacked": P * _FP32,
            "pair_index": P * _INT64,
        })
    phases["combine"] = combine
    return phases


def _swiglu_backward_workspace(M: int, F: int, b: int, u: int) -> dict[str, int]:
    """``_swiglu_backward`` at its largest: fp32 h and dphi copies (when not fp32), sigmoid, dgate and dup, their
    concatenation, and its cast back (when not fp32)."""
    return {
        "h_fp32": M * 2 * F * u,
        "dphi_fp32": M * F * u,
        "sig_dgate_dup": 3 * M * F * _FP32,
        "dh_fp32": M * 2 * F * _FP32,
        "dh_cast": M * 2 * F * b if u else 0,
    }


def _backward_phases(config: MemoryConfig, rows: Rows, retain: float, b: int) -> dict[str, dict[str, int]]:
    T, D, F, P = config.tokens, config.dim, config.hidden_dim, rows.pairs
    R, M = rows.sent_retained, rows.recv_retained
    u = _upcast(config.param_dtype)
    dense = retain >= 1.0
    grad_in = {"grad_out": T * D * b, "grad_gates": P * b}
    if config.world_size == 1:  # one batched GEMV in the activation dtype, fp32 accumulation inside
        router = {**grad_in, "grad_gates_bmm": P * b}
    else:  # the expert-parallel backward still upcasts g and y
        router = {**grad_in, "grad_out_fp32": T * D * u, "y_fp32": P * D * u, "grad_gates_fp32": P * _FP32}
    # Source side, live to the end of backward: scores and selection (retain < 1), row indices and weights,
    # dy = alpha * g / p per retained row.
    source = dict(grad_in)
    if not dense:
        source["scores_and_finite"] = 2 * P * _FP32
    source["row_index"] = 3 * R * _INT64
    source["row_weights"] = 2 * R * _FP32
    source["dy"] = R * D * b
    if config.world_size > 1:
        source["backward_send"] = R * (D * b + (0 if dense else _INT32))
        source["backward_recv"] = M * (D * b + (0 if dense else _INT32))
        if not dense:
            source["dy_unpacked"] = M * D * b
            source["recv_row_index"] = 4 * M * _INT64 + M * _INT32
        source["dy_expert_major"] = M * D * b
    # Owner side: retained rows of h, phi and dphi.
    owner = {**source, "h_rows": M * 2 * F * b, "phi_rows": M * F * b, "dphi_rows": M * F * b}
    # One device: every kept row lands in its own pair's slot (P + 1 rows), then the K slots of a token are summed.
    end = {**owner, "dh_rows": M * 2 * F * b, "dx_rows": M * D * b, "dx_pair_slots": (P + 1) * D * b,
           "dx_dest_index": M * _INT64, "grad_x": T * D * b}
    if config.world_size > 1:
        end["dx_rows_source_major"] = M * D * b
        end["dx_returned"] = R * D * b
        del end["dx_pair_slots"], end["dx_dest_index"]
        end["grad_x"] = T * D * b  # index_add_ in place
    return {
        "router_grad": router,
        "swiglu_backward": {**owner, **_swiglu_backward_workspace(M, F, b, u)},
        "input_grad": end,
    }


# ---------------------------------------------------------------------------------------------------- planner


@dataclass(frozen=True)
class MemoryPlan:
    """The planner's choice: ``replicas`` per rank, ``retain``, the backward capacity ``backward_rows`` (M, the
    retained rows this rank's experts process in backward) and the modelled ``memory`` (peak <= budget)."""

    replicas: int
    retain: float
    backward_rows: int
    memory: LayerMemory
    budget_bytes: int

    @property
    def headroom(self) -> int:
        return self.budget_bytes - self.memory.peak


PREFERENCES = ("retain", "replicas")


def plan_memory(
    config: MemoryConfig,
    budget_bytes: int,
    *,
    max_replicas: int = 0,
    retain_choices: Sequence[float] = DEFAULT_RETAIN_CHOICES,
    prefer: str = "retain",
    policy: str = "save",
    recv_rows: int | None = None,
) -> MemoryPlan:
    """Choose replicas per rank and the backward capacity so that the modelled peak fits ``budget_bytes``.

    Candidates are every (retain, replicas) with retain in ``retain_choices`` and replicas in 0..max_replicas,
    with rows from :func:`balanced_rows` (``recv_rows``: the forward rows N this rank computes, default P).
    The first candidate that fits, in the preference order, is chosen:
        prefer="retain" (default): highest retain first, then most replicas. Gradient fidelity before speed:
            replicas are given up before any backward row is.
        prefer="replicas": most replicas first, then highest retain.
    Since a larger budget only adds fitting candidates, a larger budget never gives a plan later in that order.

    Raises ValueError, naming ``budget_bytes`` and the exact shortfall in bytes, when no candidate fits: the
    shortfall is the cheapest candidate's peak minus the budget (the cheapest is the smallest retain with no
    replicas, except where a smaller retain needs more index buffers than retain = 1).
    """
    if not isinstance(budget_bytes, int) or isinstance(budget_bytes, bool):
        raise TypeError(f"budget_bytes must be an int, got {type(budget_bytes).__name__}")
    if not isinstance(max_replicas, int) or isinstance(max_replicas, bool) or max_replicas < 0:
        raise ValueError(f"max_replicas must be a non-negative int, got {max_replicas!r}")
    if max_replicas and config.world_size == 1:
        raise ValueError("max_replicas > 0 needs world_size > 1: on one device every expert is local")
    check_choice("prefer", prefer, PREFERENCES)
    choices = sorted(set(retain_choices), reverse=True)
    if not choices:
        raise ValueError("retain_choices must not be empty")
    for r in choices:
        check_retain(r)

    def key(candidate: tuple[float, int]) -> tuple:
        retain, replicas = candidate
        return (-retain, -replicas) if prefer == "retain" else (-replicas, -retain)

    candidates = sorted(((r, n) for r in choices for n in range(max_replicas + 1)), key=key)
    cheapest: LayerMemory | None = None
    for retain, replicas in candidates:
        rows = balanced_rows(config, retain, recv_rows)
        memory = layer_memory(config, retain=retain, replicas=replicas, policy=policy, rows=rows)
        if memory.peak <= budget_bytes:
            return MemoryPlan(replicas=replicas, retain=retain, backward_rows=rows.recv_retained, memory=memory,
                              budget_bytes=budget_bytes)
        # Among equal peaks, name the smallest retain (what the user would lower next).
        if cheapest is None or (memory.peak, retain, replicas) < (cheapest.peak, cheapest.retain, cheapest.replicas):
            cheapest = memory
    short = cheapest.peak - budget_bytes
    raise ValueError(
        f"budget_bytes={budget_bytes} is {short} bytes short: the cheapest configuration (retain="
        f"{cheapest.retain}, replicas={cheapest.replicas}, policy={policy!r}) needs a modelled peak of "
        f"{cheapest.peak} bytes ({_mib(cheapest.peak)}); raise budget_bytes by {short}, or lower tokens or "
        "min(retain_choices)"
    )


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"

