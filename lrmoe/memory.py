"""Bytes per MoE layer and rank, and a planner that fits replicas and backward capacity into a byte budget.

Notation (docs/design.md, "Notation"): T tokens per rank, D model dim, F expert hidden dim, E experts, K top-k,
P = T * K pairs this rank routes, W EP ranks, L = E / W experts this rank owns, N forward rows its expert
instances compute (its received dispatch rows; N = P on one device), R retained rows it sends in backward, M
retained rows its experts receive in backward (R = M on one device). b: bytes per element of the parameter and
activation dtype (LRMoE requires x.dtype == parameter dtype), g: of the gradient dtype, o: optimiser-state bytes
per parameter.

The model follows the code as it is (``selective_swiglu_experts`` on one device, ``ExpertParallel`` for W > 1),
buffer by buffer, so that a change there shows up as a failing test here (tests/test_memory.py measures the
one-device path on CPU). Components, per layer and rank:

static, held at the end of the step:
    expert_weights    L * 3FD * b     (gate_up_proj [L, 2F, D] + down_proj [L, D, F])
    expert_grads      L * 3FD * g
    expert_optimizer  L * 3FD * o     (AdamW: 8 = fp32 m + v; 12 with an fp32 master copy)
    router            E * D * (b + g + o)   (gate.weight, replicated on every rank)
    replica_weights   r * 3FD * b
    replica_grads     r * 3FD * g
    Replicas carry no optimiser state: a replica's gradient is summed into its owner's (docs/design.md, "Expert
    parallelism") and only the owner steps; the replica is fetched again from the owner's weights.
resident, held through the whole step: static less the gradients, unless ``grads_preallocated``. Gradients that
    start as None (PyTorch's default zero_grad) are the backward's weight-gradient outputs, counted in the
    backward phases from the GEMM that makes them; preallocated ones are resident, and the same outputs are
    transients added into them once the expert function returns.

saved activations (forward to backward), "save" = what the code keeps today:
    router:  x T*D*b (the layer input, also saved by the experts on one device), scores T*E*4 (softmax/sigmoid
             output, fp32), expert ids P*8, and with norm_topk_prob the un-normalised gates P*4 and their sums T*4.
    W = 1:   gates P*b, h P*2F*b, sort order and inverse 2*P*8, quotas E*8, offsets E*4; below retain 1 also
             ||phi||^2 P*4 and the sampling uniforms E*4 (selection "sample"), and with ``save_outputs`` y P*D*b
             (otherwise the backward computes the router gradient from its own operands:
             lrmoe.functional.expert_step).
    W > 1:   gates P*b, y P*D*b, ||phi||^2 P*4, order and inverse 2*P*8, received rows x_recv N*D*b,
             h N*2F*b, their expert-major permutation N*8, loads and quotas 2*W*E*8, uniforms E*4 (as above);
             with replicas, the instance weights torch.cat(owned, replicas) hold a copy of the owned shard,
             L*3FD*b (the replicas' part is replica_weights).
    "recompute" (LRMoE(activations="recompute"), one device or expert-parallel): the same without h, which is
        a forward transient instead (one device below retain 1 without ``save_outputs``: phi P*F*b saved for the
        dropped pairs' router gradient); backward recomputes h for the retained rows only from x, a buffer of M*2F*b
        until the SwiGLU backward ("save" reads the saved h in place there).
    "offload" (LRMoE(activations="offload"), one device or expert-parallel): the same without h on the device: forward
        copies h to pinned host memory (``offloaded``, not device bytes; the pinned allocator rounds a block up to a
        power of two, so the host may hold up to twice that) and h is a forward transient, as under "recompute" (phi
        saved likewise); backward reads the retained rows back from the host, with the row index "save" uses, into a
        buffer of M*2F*b held until the SwiGLU backward.

transients: ``forward_phases`` and ``backward_phases`` follow the code line by line (``_Timeline``): a local stays
alive until its function returns (nothing in these functions frees a buffer early), a line's temporaries live
only on that line, and a phase is a point where a line allocates, with everything live there. The transient is
the largest phase. Forward: the grouped GEMMs, the SwiGLU with ||phi||^2 (lrmoe::swiglu_sqnorm: phi N*F*b and
N*4, no SiLU temporary) and the combine, with the router's fp32 gates P*4 (16-bit weights: the experts take a cast
copy) and the plan's loads E*8 live throughout.
Backward (one device; W > 1 adds the payloads and the received and returned rows):
    dy           alpha * g / p per retained row, R*D*b (lrmoe::gather_scale_rows: no gathered or fp32 copy); at
                 retain 1 on one device the tokens' rows of g unscaled, R*D*b
    router_gradient  the gates' gradient P*b (with its fp32 form P*4 on that line): first, from the saved y; on
                 one device without it, after dx, from the rows' dots (written by the SwiGLU backward at retain 1;
                 below it by the phases router_dphi_gemm (g W_down^T at every forward row, P*F*b, with g's rows
                 gathered where the GEMM gathers, P*D*b), router_dots (P*4) and dphi_rows (the retained rows'
                 rows of it, M*F*b), before dy)
    h_rows       "recompute" and "offload": h of the retained rows, M*2F*b (recomputed from x or read back from the
                 host copy); "save" keeps only their row index and reads the saved h in place
    dphi_gemm    dphi M*F*b
    swiglu_backward  lrmoe::swiglu_backward's outputs, phi M*F*b and dh M*2F*b (one kernel on CUDA: no working
                 set), with dy and dphi still live
    grad_down_gemm     the down projection's weight-gradient output, I*DF*b (I = L + r instances)
    grad_gate_up_gemm  the gate/up projection's weight-gradient output, I*2FD*b: the peak at the Qwen3 shape
    dx_gemm      dx M*D*b
    input_grad   each pair's buffer row ((P + 1)*8, the K-row sum reads the rows in place) and the input
                 gradient T*D*b, with every buffer above still live: the peak wherever the gradients dominate
    router_backward  after the expert function returns: gradients, router gradient, two T*D*b input gradients
                 (autograd adds the second into the first in place)
On CUDA, a bf16 grouped GEMM with 8-aligned feature widths first gathers its input rows into a buffer (``device_type``):
the phase of that GEMM counts it. LRMoE's ``backward_capacity`` (``layer_memory(backward_capacity=...)``): R = M =
E*C rows, the padded pair ids and weights, and the rows of x gathered once (M*D*b, on every device) and held from
before the first GEMM to the gate/up weight gradient. Not modelled: other buffers inside one custom op (the
selection's sort, GEMM workspaces), the allocator's rounding and fragmentation, the compiled path (Inductor plans
its own buffers) and, with replicas, the buffers of the replica-gradient path back to the owners.

peak = resident + saved + max(forward transient, backward transient); token_buffers = peak - static.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from lrmoe._memory_phases import backward_phases, forward_phases, saved_activations
from lrmoe.functional._checks import check_choice, check_replica_slots, check_retain, is_real
from lrmoe.functional.expert_parallel import backward_capacity
from lrmoe.functional.experts import backward_capacity_rows, retained_rows_bound
from lrmoe.functional.options import ACTIVATION_POLICIES, BackwardOptions

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
    "expert_parallel_kwargs",
    "layer_memory",
    "plan_memory",
    "rows_from_plan",
]

ADAMW_FP32 = 8  # fp32 first and second moments
ADAMW_FP32_MASTER = 12  # the same plus an fp32 master copy of bf16 weights
# Dyadic, so retain * P is exact in floating point.
DEFAULT_RETAIN_CHOICES = (1.0, 0.875, 0.75, 0.625, 0.5, 0.375, 0.25)


@dataclass(frozen=True)
class MemoryConfig:
    """One MoE layer as one rank sees it.

    dim, hidden_dim, num_experts, top_k: D, F, E, K (as :class:`lrmoe.nn.LRMoE`).
    tokens: T, tokens per rank per step. world_size: W EP ranks (num_experts % W == 0).
    param_dtype: weights and activations. grad_dtype: gradients (None: param_dtype).
    optimizer_bytes_per_param: optimiser state per owned parameter (ADAMW_FP32, ADAMW_FP32_MASTER, 0 for SGD).
    norm_topk_prob: router renormalises the top-k gates (saves two more small tensors).
    selection: "sample" saves one fp32 uniform per expert when retain < 1; "top" does not.
    grads_preallocated: False (default, PyTorch's ``zero_grad(set_to_none=True)``): the gradients start the step
        as None, and the backward's weight-gradient outputs become them, live from the GEMM that makes them.
        True (``zero_grad(set_to_none=False)``, gradient accumulation, fp32 main gradients of bf16 weights): the
        gradients are held all step and the weight-gradient outputs are transients added into them. Gradients in
        a dtype other than ``param_dtype`` exist only outside autograd, so they need True.
    device_type: "cuda" (default) or "cpu", the grouped-GEMM kernels modelled: on CUDA, bf16 grouped GEMMs with
        8-aligned feature widths (torch._grouped_mm) first gather their input rows into a buffer; the Triton kernels
        (other dtypes) and the CPU reference do not.
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
    grads_preallocated: bool = False
    device_type: str = "cuda"

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
        check_choice("device_type", self.device_type, ("cuda", "cpu"))
        if not isinstance(self.grads_preallocated, bool):
            raise TypeError(f"grads_preallocated must be a bool, got {self.grads_preallocated!r}")
        if not self.grads_preallocated and self.grad_dtype not in (None, self.param_dtype):
            raise ValueError(
                f"grad_dtype={self.grad_dtype} differs from param_dtype={self.param_dtype}: autograd makes "
                f"{self.param_dtype} gradients, so {self.grad_dtype} ones are buffers kept outside it, allocated "
                "before the step; pass grads_preallocated=True"
            )

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


def balanced_rows(config: MemoryConfig, retain: float, recv: int | None = None,
                  backward_capacity: float | None = None) -> Rows:
    """Rows under the static bounds the code uses: N = ``recv`` (default P, a balanced dispatch),
    R = min(P, floor(retain P) + E) and M = min(N, floor(retain N) + L) (``retained_rows_bound``; on one device
    R = M is exactly the backward buffer's size). ``backward_capacity`` (one device, LRMoE's): R = M = E * C,
    the padded blocks (``backward_capacity_rows``)."""
    check_retain(retain)
    n_pairs = config.pairs
    if config.world_size == 1:
        if recv is not None and recv != n_pairs:
            raise ValueError(f"on one device the forward rows are the pairs P={n_pairs}, got recv={recv}")
        rows = retained_rows_bound(n_pairs, config.num_experts, retain)
        if backward_capacity is not None:
            BackwardOptions(retain=retain, backward_capacity=backward_capacity)  # the layer's own checks
            rows = config.num_experts * backward_capacity_rows(config.tokens, config.top_k, config.num_experts,
                                                               retain, backward_capacity)
            if rows > n_pairs:
                raise ValueError(f"backward_capacity={backward_capacity} gives E * C = {rows} backward rows, more "
                                 f"than the P = {n_pairs} pairs; the model does not cover blocks larger than P")
        return Rows(pairs=n_pairs, recv=n_pairs, sent_retained=rows, recv_retained=rows)
    recv = n_pairs if recv is None else recv
    return Rows(
        pairs=n_pairs,
        recv=recv,
        sent_retained=retained_rows_bound(n_pairs, config.num_experts, retain),
        recv_retained=retained_rows_bound(recv, config.local_experts, retain),
    )


def rows_from_plan(plan, rank: int) -> Rows:
    """Exact rows of rank ``rank`` in one expert-parallel step, read on the host.

    ``plan``: an ``ExpertParallelPlan`` (``plan_expert_parallel``) or the ``ExpertParallelStats`` of the layer's
    last step (``layer.stats()``): anything with [S, W, I] ``assignment`` (forward rows) and ``instance_quotas``
    (retained rows) per (source, rank, instance slot). Exact with replicas: N and M are the rows of this rank's I
    instances, its L owned experts and its replica slots (``stats().rank_loads[rank]`` and
    ``rank_backward_loads[rank]``); P and R are the pairs this rank routes and the retained ones it sends, wherever
    they run. (The [W, E] loads and quotas cannot say this: with replicas they count a replica's rows on the
    expert's owner.)
    """
    assign_SWI = getattr(plan, "assignment", None)
    quotas_SWI = getattr(plan, "instance_quotas", None)
    if not isinstance(assign_SWI, torch.Tensor) or not isinstance(quotas_SWI, torch.Tensor):
        raise TypeError(f"plan must be an ExpertParallelPlan or ExpertParallelStats (tensors assignment and "
                        f"instance_quotas; [W, E] loads and quotas cannot place a replica's rows), got "
                        f"{type(plan).__name__}")
    shape = tuple(assign_SWI.shape)
    if len(shape) != 3 or shape[0] != shape[1] or tuple(quotas_SWI.shape) != shape:
        raise ValueError(f"plan.assignment and plan.instance_quotas must both be [S, W, I] with S == W, got "
                         f"{shape} and {tuple(quotas_SWI.shape)}")
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < shape[1]:
        raise ValueError(f"rank must be an int in [0, W={shape[1]}), got {rank!r}")
    return Rows(
        pairs=int(assign_SWI[rank].sum()),  # every pair of source ``rank`` runs on exactly one instance
        recv=int(assign_SWI[:, rank].sum()),
        sent_retained=int(quotas_SWI[rank].sum()),
        recv_retained=int(quotas_SWI[:, rank].sum()),
    )


@dataclass(frozen=True)
class LayerMemory:
    """Modelled bytes of one MoE layer on one rank (formulas in the module docstring).

    The ``*_phases`` mappings give, per phase, the buffers live in it beyond the resident bytes and the saved
    activations (name -> bytes; backward phases include the weight-gradient outputs made so far); the transient
    is the largest phase total. ``saved`` gives the saved activations tensor by tensor.
    """

    expert_weights: int
    expert_grads: int
    expert_optimizer: int
    router: int  # weight, gradient and optimiser state of gate.weight
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
    router_grad: int = 0
    grads_preallocated: bool = False

    @property
    def base_experts(self) -> int:
        return self.expert_weights + self.expert_grads + self.expert_optimizer

    @property
    def replica_bytes(self) -> int:
        return self.replica_weights + self.replica_grads

    @property
    def static(self) -> int:
        """Bytes held at the end of the step (weights, gradients, optimiser state, replicas)."""
        return self.base_experts + self.router + self.replica_bytes

    @property
    def gradients(self) -> int:
        return self.expert_grads + self.replica_grads + self.router_grad

    @property
    def resident(self) -> int:
        """Bytes held through the whole step: ``static`` less the gradients unless they are preallocated."""
        return self.static - (0 if self.grads_preallocated else self.gradients)

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
    def peak(self) -> int:
        """resident + saved activations + the larger transient."""
        return self.resident + self.saved_activations + max(self.forward_transient, self.backward_transient)

    @property
    def token_buffers(self) -> int:
        """peak - static: what the peak adds to the bytes held at the end of the step, the "token buffers" bar of
        the paper's Figure 7 (base experts + replicas + router + token buffers = peak). With gradients that start
        as None this is the saved activations plus the largest transient less the gradients it includes."""
        return self.peak - self.static


def layer_memory(
    config: MemoryConfig,
    *,
    retain: float = 1.0,
    replicas: int = 0,
    policy: str = "save",
    rows: Rows | None = None,
    backward_capacity: float | None = None,
    backward: BackwardOptions | None = None,
    save_outputs: bool = False,
) -> LayerMemory:
    """Model the bytes of one layer step on one rank.

    Args:
        config: the layer and rank (:class:`MemoryConfig`).
        retain: backward retention target in (0, 1]; sizes the retained-row buffers when ``rows`` is None.
        replicas: replica slots this rank holds (W > 1 only), ``ExpertParallel``'s ``max_replicas`` (every slot
            holds weights, zeros where the step placed none); at most the E - E/W experts the rank does not own.
        policy: activation policy, "save", "recompute" or "offload" (LRMoE's ``activations``).
        rows: row counts, e.g. from :func:`rows_from_plan`; default :func:`balanced_rows`.
        backward_capacity: LRMoE's (one device): the backward on E blocks of C rows with batched GEMMs; the
            default rows are then E * C.
        backward: the layer's :class:`~lrmoe.functional.BackwardOptions` instead of ``retain``, ``policy`` (its
            ``activations``), ``backward_capacity`` and ``save_outputs`` (not both); its ``selection`` replaces
            ``config.selection``.
        save_outputs: ``BackwardOptions.save_outputs``: below retain 1 on one device, the experts' outputs y are
            saved for the dropped pairs' router gradient (else that gradient's GEMM runs over every forward row).
    """
    if backward is not None:
        if not isinstance(backward, BackwardOptions):
            raise TypeError(f"backward must be a BackwardOptions or None, got {type(backward).__name__}")
        if (retain, policy, backward_capacity, save_outputs) != (1.0, "save", None, False):
            raise TypeError("layer_memory: pass either backward (a BackwardOptions) or retain, policy, "
                            "backward_capacity and save_outputs, not both")
        retain, policy, backward_capacity = backward.retain, backward.activations, backward.backward_capacity
        save_outputs = backward.save_outputs
        if backward.selection != config.selection:
            config = dataclasses.replace(config, selection=backward.selection)
    check_retain(retain)
    check_choice("policy", policy, ACTIVATION_POLICIES)
    if not isinstance(save_outputs, bool):
        raise TypeError(f"save_outputs must be a bool, got {type(save_outputs).__name__}")
    if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
        raise ValueError(f"replicas must be a non-negative int, got {replicas!r}")
    if replicas and config.world_size == 1:
        raise ValueError("replicas need expert parallelism (world_size > 1): on one device every expert is local")
    check_replica_slots("replicas", replicas, config.num_experts, config.world_size)
    if backward_capacity is not None and config.world_size > 1:
        raise ValueError("backward_capacity is the single-device layer's (world_size 1)")
    rows = balanced_rows(config, retain, backward_capacity=backward_capacity) if rows is None else rows
    if rows.pairs != config.pairs:
        raise ValueError(f"rows.pairs={rows.pairs} must equal tokens * top_k = {config.pairs}")
    if config.world_size == 1 and not (rows.recv == rows.pairs and rows.sent_retained == rows.recv_retained):
        raise ValueError(f"on one device N = P and R = M, got {rows}")

    b = config.param_dtype.itemsize
    g = (config.grad_dtype or config.param_dtype).itemsize
    o = config.optimizer_bytes_per_param
    numel = config.expert_numel
    blocked = backward_capacity is not None
    saved = saved_activations(config, rows, retain, b, replicas, policy, blocked, save_outputs)
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
        forward_phases=forward_phases(config, rows, b, policy, saved),
        backward_phases=backward_phases(config, rows, retain, b, policy, replicas, blocked, save_outputs),
        rows=rows,
        replicas=replicas,
        retain=retain,
        policy=policy,
        router_grad=config.num_experts * config.dim * g,
        grads_preallocated=config.grads_preallocated,
    )


# ---------------------------------------------------------------------------------------------------- planner


@dataclass(frozen=True)
class MemoryPlan:
    """The planner's choice: ``replicas`` per rank, ``retain``, the backward capacity ``backward_rows`` (M, the
    retained rows this rank's experts process in backward) and the modelled ``memory`` (peak <= budget), for
    ``config``. :func:`expert_parallel_kwargs` turns it into ``ExpertParallel`` arguments."""

    replicas: int
    retain: float
    backward_rows: int
    memory: LayerMemory
    budget_bytes: int
    config: MemoryConfig | None = None

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
    save_outputs: bool = False,
) -> MemoryPlan:
    """Choose replicas per rank and the backward capacity so that the modelled peak fits ``budget_bytes``.

    Candidates are every (retain, replicas) with retain in ``retain_choices`` and replicas in 0..max_replicas
    (``max_replicas`` at most E - E/W, the experts a rank does not own, as ``ExpertParallel`` requires; more
    raises ValueError), with rows from :func:`balanced_rows` (``recv_rows``: the forward rows N this rank
    computes, default P).
    The first candidate that fits, in the preference order, is chosen:
        prefer="retain" (default): highest retain first, then most replicas. Gradient fidelity before speed:
            replicas are given up before any backward row is.
        prefer="replicas": most replicas first, then highest retain.
    Since a larger budget only adds fitting candidates, a larger budget never gives a plan later in that order.
    ``policy`` and ``save_outputs``: the layer's ``activations`` and ``save_outputs`` (``layer_memory``).

    ``budget_bytes``: an int, or any real number (a float such as 6e9, a NumPy number), rounded down to whole bytes.

    Raises ValueError, naming ``budget_bytes`` and the exact shortfall in bytes, when no candidate fits: the
    shortfall is the cheapest candidate's peak minus the budget (the cheapest is the smallest retain with no
    replicas, except where a smaller retain needs more index buffers than retain = 1).
    """
    if not is_real(budget_bytes):
        raise TypeError(f"budget_bytes must be a number of bytes (an int, or a float such as 6e9), got "
                        f"{type(budget_bytes).__name__}")
    if not math.isfinite(budget_bytes):
        raise ValueError(f"budget_bytes must be finite, got {budget_bytes}")
    budget_bytes = math.floor(budget_bytes)  # whole bytes, rounded down: the plan never exceeds what was given
    if not isinstance(max_replicas, int) or isinstance(max_replicas, bool) or max_replicas < 0:
        raise ValueError(f"max_replicas must be a non-negative int, got {max_replicas!r}")
    if max_replicas and config.world_size == 1:
        raise ValueError("max_replicas > 0 needs world_size > 1: on one device every expert is local")
    check_replica_slots("max_replicas", max_replicas, config.num_experts, config.world_size)
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
        memory = layer_memory(config, retain=retain, replicas=replicas, policy=policy, rows=rows,
                              save_outputs=save_outputs)
        if memory.peak <= budget_bytes:
            return MemoryPlan(replicas=replicas, retain=retain, backward_rows=rows.recv_retained, memory=memory,
                              budget_bytes=budget_bytes, config=config)
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


def expert_parallel_kwargs(plan: MemoryPlan) -> dict[str, int | float]:
    """``ExpertParallel`` keyword arguments that enforce ``plan`` (a :func:`plan_memory` result with
    world_size > 1): ``max_replicas`` = ``plan.replicas``, and the largest ``capacity_factor`` whose per-rank
    backward capacity, ceil(capacity_factor * floor(retain * W * P) / W) as ``ExpertParallel`` computes it in
    float64 (``backward_capacity``), is at most ``plan.backward_rows`` (M): the capacity is M itself when the
    budget is not empty. Build the layer with ``LRMoE(..., retain=plan.retain)``.

    The capacity bounds the backward rows whatever the routing does, so the modelled backward buffers hold; it
    assumes every rank routes ``config.tokens`` tokens (the capacity scales with the step's actual pairs). At
    retain = 1 it is P, which makes the backward selective on a rank whose forward rows exceed P (see
    docs/expert_parallel.md); pass ``capacity_factor=None`` instead to keep the dense backward unbounded. The
    forward rows N are not bounded by it: the plan takes them as given (``recv_rows``).

    Raises ValueError when the plan has no config or one device, when ``plan.replicas`` exceeds the E - E/W
    experts a rank does not own, or when M is below the balanced share floor(retain * W * P) / W (possible only
    with ``recv_rows`` < P), which ``ExpertParallel`` cannot express (capacity_factor >= 1).
    """
    config = plan.config
    if config is None or config.world_size == 1:
        raise ValueError("expert_parallel_kwargs needs a plan_memory plan of an expert-parallel config "
                         "(world_size > 1)")
    n_ranks, rows = config.world_size, plan.backward_rows
    if plan.replicas > config.num_experts - config.local_experts:
        raise ValueError(f"plan.replicas={plan.replicas} exceeds the {config.num_experts - config.local_experts} "
                         "experts a rank does not own (ExpertParallel's limit on max_replicas)")
    budget = math.floor(float(n_ranks * config.pairs) * plan.retain)  # plan_quotas' budget, in float64
    loads_WE = torch.full((n_ranks, 1), config.pairs, dtype=torch.int64)  # every rank routes config.tokens tokens

    def capacity(factor: float) -> int:  # what ExpertParallel plans: backward_capacity itself
        return int(backward_capacity(loads_WE, plan.retain, factor)[0])

    if budget == 0:
        return {"max_replicas": plan.replicas, "capacity_factor": 1.0}
    factor = rows * n_ranks / budget
    while capacity(factor) > rows:  # at most a few ulps
        factor = math.nextafter(factor, 0.0)
    if factor < 1.0:
        raise ValueError(
            f"plan.backward_rows={rows} is below the balanced share {budget}/{n_ranks} of the backward budget "
            f"floor(retain={plan.retain} * W * P) = {budget}: ExpertParallel's capacity_factor must be >= 1; "
            "plan with recv_rows >= tokens * top_k"
        )
    return {"max_replicas": plan.replicas, "capacity_factor": factor}


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"

