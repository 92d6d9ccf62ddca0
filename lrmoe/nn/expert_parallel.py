"""Expert parallelism for :class:`lrmoe.nn.LRMoE` and for a model's own :class:`lrmoe.nn.SwiGLUExperts` module: a
``ParallelStyle`` for ``parallelize_module`` (docs/design.md, "Expert parallelism"), and its glue.

Shapes: T local tokens, D model dim, F expert hidden dim, E experts, L = E / W owned experts per rank, R replica
slots per rank (``max_replicas``), I = L + R instance slots per rank, G = W * I instances, K top-k, P = T * K local
pairs, W EP ranks, S source ranks (S == W: source s is rank s).

Rank w owns experts [w * L, (w + 1) * L): ``experts.gate_up_proj`` and ``experts.down_proj`` become DTensors
``Shard(0)`` over the EP mesh; the router (``gate.weight``) stays a plain tensor, identical on every rank, whose
gradient comes from the rank's own tokens only (a data-parallel wrapper over the same ranks reduces it). With
``max_replicas`` R > 0, rank w also holds up to R replicas of hot experts it does not own, chosen every step.

Forward, on every rank: (1) route the local tokens and count loads_E (and pairs with an expert id out of range);
(2) all-gather them into the tiny [W, E] load matrix (and a [W] column of those); (3) plan
(``plan_expert_parallel`` in lrmoe.functional.expert_parallel, through the op lrmoe::ep_plan), the same on every
rank: placement, each (source, expert) pair block's instances, backward quotas per (source, instance), so a source
knows its quotas without backward communication; (4) read the plan's split sizes on the host, the step's one host
synchronisation (``plan_on="host"``: the load matrix is read instead and the plan runs on CPU tensors), with the
step's global counts, on which every rank checks the step's data alike (``_check_step``); (5) replica weights (R >
0) from their owners through one differentiable all-to-all, whose backward returns the replicas' weight gradients
to the owners' shards; (6-9) the selective expert step (lrmoe.functional.expert_step) with the all-to-all transport
(lrmoe.nn._transport): dispatch, grouped GEMMs on the local instances, combine.

By composition, as torchtitan's token dispatcher sits beside its experts: ``ExpertParallel`` installs an
:class:`ExpertParallelDispatcher` as the module's ``_dispatcher``, and the module keeps its class. The layer's
forward routes (step 1) and hands its tokens to the dispatcher, which runs steps 2-4 and returns steps 5-9 as a
``step`` that ``layer.experts(..., step=step)`` runs in its own forward, so hooks on that module see the weights
used: FSDP2's ``fully_shard(layer.experts, mesh["dp"])`` gathers them there. Applied to a ``SwiGLUExperts`` of its
own (a transformers model's experts after ``swap_experts``), the module's forward hands its call to the dispatcher,
and steps 2-9 run in that call with the module's options.

Backward: the source scores and selects its own pairs; only the retained rows travel, to the instances that ran
them, which run the compact backward and return the input-gradient rows. The router gradient is exact and local.

Checkpoints: the sharded experts save and load with torch.distributed.checkpoint; replicas are per-step copies,
never saved. torch.compile: the layer compiles with ``fullgraph=True``, forward and backward (with
``capture_scalar_outputs``); the split sizes become unbacked SymInts, so one graph serves every step's loads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from lrmoe.functional._autocast import autocast_off
from lrmoe.functional._checks import (check_generator_not_traced, check_keeps_pairs, check_replica_slots,
                                     check_same_device, check_same_size, check_tensor)
from lrmoe.functional.expert_parallel import (  # noqa: F401  (backward_capacity: re-exported)
    PLACEMENT_POLICIES,
    ExpertParallelPlan,
    ExpertParallelStats,
    PlacementPolicy,
    backward_capacity,
    check_placement,
    check_replication,
    instance_slots,
    pair_destinations,
    placement_policy_name,
    plan_expert_parallel,
    plan_to,
)
from lrmoe.functional.expert_kernels import choose_kernels
from lrmoe.functional.ep_plan import plan_step
from lrmoe.functional.expert_step import StepConfig, selective_step
from lrmoe.functional.options import BackwardOptions
from lrmoe.functional.replicas import place_hot_replicas
from lrmoe.functional.rng import sampling_uniforms
from lrmoe.functional.stats_probe import StatsProbe
from lrmoe.nn._transport import (
    EXTRA_BYTES,
    EP_BACKWARD_STATS,
    AllToAllTransport,
    EPGroup,
    Splits,
    all_gather_loads,
    fetch_replicas,
    host_splits,
    pair_counts,
    peer_bytes,
)
from lrmoe.nn.lrmoe import UNGATHERED_EXPERTS, LRMoE, SwiGLUExperts, compute_dtype

__all__ = ["ExpertParallel", "ExpertParallelDispatcher", "ExpertParallelPlan", "ExpertParallelStats", "backward_capacity",
           "plan_expert_parallel"]


@dataclass(frozen=True)
class _Replication:
    """Replica and capacity settings of an expert-parallel layer (Python values, fixed at parallelisation)."""

    max_replicas: int
    capacity_factor: float | None
    placement_policy: PlacementPolicy
    placement: str | None  # the policy's registered name (it runs inside the plan's op), or None (it runs before)
    plan_on: str = "host"  # "host" or "device": where plan_expert_parallel runs (see ExpertParallel)
    backward_blocks: bool = False  # the instance-side backward as batched GEMMs on equal blocks (see ExpertParallel)


class ExpertParallel(ParallelStyle):
    """Shard an :class:`LRMoE` layer's experts over an EP mesh: ``parallelize_module(layer, mesh, ExpertParallel())``;
    or a model's own :class:`SwiGLUExperts` module, called by the model's block as ``experts(x_TD, expert_ids_TK,
    gates_TK)`` (a transformers model after ``swap_experts``: ``parallelize_module(model, mesh,
    {"model.layers.*.mlp.experts": ExpertParallel()})``), which then plans, dispatches and combines in that call
    with the module's options (retain, selection, ...; per-call options are refused) and has ``stats()``.

    Args:
        mesh_dim_name: the EP dimension of a multi-dimensional mesh (e.g. ``"ep"``); None for a 1-D mesh.
        max_replicas: replica slots per rank (R): every step, the placement policy may put up to R replicas of hot
            experts on each rank; 0 (default) = owners only. At most E - E/W (the experts a rank does not own).
        capacity_factor: backward capacity per rank, as a multiple of the balanced share: each rank's instances
            take at most ceil(capacity_factor * floor(retain * pairs) / W) rows in backward; None = no limit.
            Must be >= 1: with less, the ranks together could not hold the budget. Capacity is a hard limit: a
            rank whose min_retain floors exceed it keeps a waterfilled share of them (``plan_quotas``).
        placement_policy: ``(loads_WE, max_replicas) -> replicas_WR`` (see lrmoe.functional.replicas), or the name
            of one registered with ``lrmoe.functional.expert_parallel.register_placement_policy``; must be
            deterministic. Default :func:`~lrmoe.functional.place_hot_replicas` (registered as "hot"). A registered
            policy runs inside the plan's op (lrmoe.functional.ep_plan: the same eager kernels on every rank, compiled
            or not); a callable that is not registered runs before it, in the layer's (compiled) graph. Its output
            is checked at every plan (values only on the host: see ``plan_expert_parallel``).
        plan_on: where the per-step plan (``plan_expert_parallel`` on the [W, E] load matrix: ~20 tiny integer
            ops for the dense backward without replicas, ~170-480 with a capacity or replicas at W = 2) runs.
            "host" (default): one device-to-host copy of the load matrix (the step's one host synchronisation),
            the plan on CPU tensors, one host-to-device copy of the plan. "device": on the layer's device, then
            one host read of the split sizes. On a GPU "host" trades each op's kernel launch for a CPU op, which
            pays wherever the plan has more than a few ops (docs/performance.md). The same plan either way on
            every rank (all ranks plan on the same kind of device); on a CPU mesh the two are the same.
        backward_blocks: False (default) or True: each rank's expert backward lays every local instance's
            retained rows out as a block of C rows, C = the most any instance of the rank received this step
            (rounded up to 8; read with the split sizes, so no further sync), zero rows after them, and runs its
            four GEMMs as torch.bmm over the blocks instead of grouped GEMMs. Exact (the same kept pairs and
            gradients); the cost is the padding, which an uneven plan makes large: it pays with balanced loads,
            and under a skewed router pads most rows (``ExpertParallelStats.block_padding``; docs/performance.md):
            for routers that keep loads near even.
        backward: a :class:`~lrmoe.functional.BackwardOptions` to give the module (its ``backward``), or None to
            keep the module's own.

    Expert parameters become DTensors ``Shard(0)`` (rank w holds experts [w*E/W, (w+1)*E/W)); the router stays a
    plain replicated tensor. Parameters are replaced, so build the optimiser afterwards. With
    ``src_data_rank=0`` (parallelize_module's default) rank 0's expert weights are scattered; with None every rank
    keeps its own slice. The module keeps its class: its forward hands its step to the
    :class:`ExpertParallelDispatcher` the style installs (``module._dispatcher``), which runs the EP forward
    described in this module's docstring, and ``layer.stats()`` returns :class:`ExpertParallelStats`.

    Errors: a module that is not an LRMoE or a SwiGLUExperts, or is already expert-parallel, a mesh of more than
    one dimension without ``mesh_dim_name``, an unknown ``mesh_dim_name``, ``num_experts % W != 0``, and bad
    ``max_replicas``, ``capacity_factor``, ``placement_policy``, ``plan_on`` or ``backward_blocks``.
    """

    def __init__(
        self,
        *,
        mesh_dim_name: str | None = None,
        max_replicas: int = 0,
        capacity_factor: float | None = None,
        placement_policy: str | PlacementPolicy = place_hot_replicas,
        plan_on: str = "host",
        backward_blocks: bool = False,
        backward: BackwardOptions | None = None,
    ):
        super().__init__()
        if plan_on not in ("device", "host"):
            raise ValueError(f'plan_on must be "device" or "host", got {plan_on!r}')
        if not isinstance(backward_blocks, bool):
            raise TypeError(f"backward_blocks must be a bool, got {type(backward_blocks).__name__}")
        check_replication(max_replicas, capacity_factor, placement_policy)
        if backward is not None and not isinstance(backward, BackwardOptions):
            raise TypeError(f"backward must be a BackwardOptions or None, got {type(backward).__name__}")
        self.mesh_dim_name, self.backward = mesh_dim_name, backward
        name = placement_policy_name(placement_policy)
        policy = PLACEMENT_POLICIES[name] if name is not None else placement_policy
        self.replication = _Replication(max_replicas, capacity_factor, policy, name, plan_on, backward_blocks)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        standalone = isinstance(module, SwiGLUExperts)  # experts called as experts(x, ids, gates) by their model
        if not standalone and not isinstance(module, LRMoE):
            raise TypeError("ExpertParallel applies to lrmoe.nn.LRMoE layers and to lrmoe.nn.SwiGLUExperts modules "
                            f"(swap_experts puts them into transformers models), got {type(module).__name__}")
        if module._dispatcher is not None:
            raise ValueError(f"this {type(module).__name__} is already expert-parallel")
        experts = module if standalone else module.experts
        opts = self.backward if self.backward is not None else module.backward
        _refuse_backward_capacity(opts.backward_capacity)
        if opts.quota_align != 1 and self.replication.capacity_factor is not None:
            raise ValueError(f"quota_align={opts.quota_align} with capacity_factor={self.replication.capacity_factor}: "
                             "aligned quota steps could pass a rank's backward capacity; use quota_align=1 or "
                             "capacity_factor=None")
        ep_mesh = self._ep_mesh(device_mesh)
        n_ranks = ep_mesh.size()
        if experts.num_experts % n_ranks:
            raise ValueError(
                f"num_experts={experts.num_experts} is not divisible by the EP mesh size W={n_ranks}; every rank "
                "must own the same number of experts (E % W == 0)"
            )
        check_replica_slots("max_replicas", self.replication.max_replicas, experts.num_experts, n_ranks)
        device = experts.gate_up_proj.device if standalone else module.last_loads.device
        for name in ("gate_up_proj", "down_proj"):
            param = getattr(experts, name)
            if isinstance(param, DTensor):
                raise ValueError(f"experts.{name} is already a DTensor; ExpertParallel shards plain parameters")
            sharded = distribute_tensor(param.detach(), ep_mesh, [Shard(0)], src_data_rank=self.src_data_rank)
            experts.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        module.backward = opts
        if standalone:  # its records (the last forward's loads and quotas, summed over ranks) with its weights
            module._init_records(experts.num_experts, device)
        module._dispatcher = ExpertParallelDispatcher(ep_mesh, self.replication, experts.num_experts, device)
        module._stats_probe = StatsProbe(EP_BACKWARD_STATS, device)
        return module

    def _ep_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        if self.mesh_dim_name is None:
            if mesh.ndim != 1:
                raise ValueError(f"ExpertParallel needs a 1-D EP mesh, got a {mesh.ndim}-D mesh (dims "
                                 f"{mesh.mesh_dim_names}); pass ExpertParallel(mesh_dim_name=...) to pick the EP "
                                 "dimension")
            return mesh
        names = mesh.mesh_dim_names or ()
        if self.mesh_dim_name not in names:
            raise ValueError(f"mesh_dim_name={self.mesh_dim_name!r} is not a dimension of the mesh (dims {names})")
        return mesh if mesh.ndim == 1 else mesh[self.mesh_dim_name]


def _refuse_backward_capacity(capacity: float | None) -> None:
    if capacity is not None:
        raise ValueError(f"backward_capacity={capacity} is the single-device layer's per-expert capacity; expert "
                         "parallelism bounds each rank's backward rows with ExpertParallel(capacity_factor=...)")


def _plan(loads_WE: torch.Tensor, opts: BackwardOptions, rep: _Replication) -> ExpertParallelPlan:
    """This step's ``plan_expert_parallel`` through the op lrmoe::ep_plan (uniform None). A placement policy that
    is not registered runs here, before the op, and the op takes its output."""
    replicas_WR = None
    if rep.max_replicas and rep.placement is None:
        replicas_WR = check_placement(rep.placement_policy(loads_WE.long(), rep.max_replicas), loads_WE,
                                      rep.max_replicas)
    return plan_step(loads_WE, replicas_WR, opts.retain, opts.min_retain, opts.policy, rep.max_replicas,
                     rep.capacity_factor, rep.placement or "hot", opts.quota_align)


def _check_step(splits: Splits, opts: BackwardOptions, n_exp: int, runs_backward: bool) -> None:
    """The checks of a step's data, on the step's global counts in ``splits`` (read from the all-gathered loads,
    the same host values on every rank): every rank reaches the same verdict, so a valid step runs on every rank
    and an invalid one raises the same error on every rank, after the load all-gather and before the first
    all-to-all. A check of a rank's own data alone (its T, its ids) could raise on that rank only, and its peers
    would wait in the next collective until the process group's timeout.

    Eager only: compiled, the counts are unbacked SymInts, and a check on them would branch on data (a graph break;
    an error under fullgraph=True). The compiled layer trusts its step, as it trusts a placement policy."""
    if torch.compiler.is_compiling():
        return
    if any(splits.misrouted):
        per_rank = {w: n for w, n in enumerate(splits.misrouted) if n}
        raise ValueError(f"expert_ids_TK must be in [0, num_experts={n_exp}), got {sum(per_rank.values())} pairs "
                         f"outside it (pairs per EP rank: {per_rank}); every EP rank refuses this step")
    if runs_backward:  # quotas come from the all-gathered loads: P is the step's, summed over the ranks
        check_keeps_pairs(opts.retain, opts.min_retain, sum(splits.pairs), "ExpertParallel (P over all EP ranks)")


# What an expert-parallel forward records of its plan (buffer name -> shape, for W ranks, E experts, I instance
# slots per rank), and the bytes this rank sent to its peers in its all-to-alls (0-d): ExpertParallelStats' fields.
def _plan_records(n_ranks: int, n_exp: int, n_inst: int) -> dict[str, tuple[int, ...]]:
    return {"loads": (n_ranks, n_exp), "quotas": (n_ranks, n_exp), "instances": (n_ranks, n_inst),
            "assignment": (n_ranks, n_ranks, n_inst), "instance_quotas": (n_ranks, n_ranks, n_inst),
            "capacity": (n_ranks,)}


_FORWARD_BYTES = ("dispatch_bytes", "combine_bytes", "replica_bytes", "replica_grad_bytes")


class ExpertParallelDispatcher(nn.Module):
    """The expert-parallel step of one module, which ``ExpertParallel`` installs as its ``_dispatcher``: an LRMoE
    layer, whose forward routes and then hands its tokens here, or a SwiGLUExperts module of a model's own, whose
    forward hands it its call. The module keeps its class and its state_dict; this object holds the EP group, the
    replica settings (Python values, fixed at parallelisation) and the last forward's records, which ``stats()``
    reads: non-persistent int64 buffers named as :class:`ExpertParallelStats`' fields (not checkpointed; they follow
    ``.to()`` and ``to_empty``, and every recorded forward writes all of them).

    The experts know nothing of it: ``plan`` returns the step over the rank's instances, which the experts module
    runs in its own forward (``experts(x_TD, expert_ids_TK, gates_TK, step=...)``) on its weights, so hooks on that
    module see the weights used: FSDP2's ``fully_shard(layer.experts, mesh["dp"])`` gathers them there."""

    def __init__(self, ep_mesh: DeviceMesh, replication: _Replication, num_experts: int,
                 device: torch.device | None = None):
        super().__init__()
        n_ranks = ep_mesh.size()
        self.ep_mesh, self.replication = ep_mesh, replication
        self.group = EPGroup(group=ep_mesh.get_group(), rank=ep_mesh.get_local_rank(), size=n_ranks)
        n_inst = num_experts // n_ranks + replication.max_replicas
        shapes = {**_plan_records(n_ranks, num_experts, n_inst), **dict.fromkeys(_FORWARD_BYTES, ())}
        for name, shape in shapes.items():
            self.register_buffer(name, torch.zeros(shape, dtype=torch.int64, device=device), persistent=False)

    def extra_repr(self) -> str:
        rep = self.replication
        return (f"ranks={self.group.size}, max_replicas={rep.max_replicas}, capacity_factor={rep.capacity_factor}, "
                f"placement={rep.placement or rep.placement_policy!r}, plan_on={rep.plan_on!r}, "
                f"backward_blocks={rep.backward_blocks}")

    def plan(self, module: nn.Module, experts: nn.Module, x_TD: torch.Tensor, expert_ids_TK: torch.Tensor,
             probe: torch.Tensor | None, out_shape: torch.Size | None = None) -> Callable[..., torch.Tensor]:
        """Steps 2-4 of the module docstring for one forward of ``module`` (the layer, or the experts module on its
        own): the load matrix, the plan, this rank's pair destinations and the step's records (here, and
        ``module``'s last_loads and last_quotas), with ``module.backward``'s options (exact in eval mode, capacity
        too, unless selective_in_eval) and ``experts``' sizes. Returns the rest of the step, ``step(experts, x_TD,
        expert_ids_TK, gates_TK)`` (x and the gates in the experts' compute dtype; the output in ``out_shape``:
        StepConfig.out_shape, None: [T, D]), for the experts' forward to run."""
        ep, opts, n_exp = self.group, module.backward.for_mode(module.training), experts.num_experts
        rep = self.replication if opts is module.backward else replace(self.replication, capacity_factor=None)
        check_generator_not_traced(opts.generator)  # an option: the same on every rank
        # The tiny [W, E] load matrix, all-gathered (no host sync) with each rank's misrouted pairs as a last
        # column, then the same plan on every rank.
        counts_WX = all_gather_loads(pair_counts(expert_ids_TK, n_exp), ep)
        loads_WE = counts_WX[:, :n_exp].contiguous()
        n_local = n_exp // ep.size
        if rep.plan_on == "host":
            # HOST SYNC: the counts to the host (the one host read of this step, see ExpertParallel's plan_on); the
            # split sizes below then read CPU tensors, and the plan goes to the device in one copy.
            counts_host = counts_WX.cpu()
            plan_host = _plan(counts_host[:, :n_exp].contiguous(), opts, rep)
            splits = host_splits(plan_host, ep, n_local, counts_host[:, n_exp], rep.backward_blocks)
            plan = plan_to(plan_host, loads_WE)
        else:
            plan = _plan(loads_WE, opts, rep)  # opaque to the compiler (lrmoe.functional.ep_plan says why)
            # the step's one host synchronisation
            splits = host_splits(plan, ep, n_local, counts_WX[:, n_exp], rep.backward_blocks)
        _check_step(splits, opts, n_exp, runs_backward=probe is not None)
        n_inst = plan.instances.shape[1]
        dense = opts.retain >= 1.0 and rep.capacity_factor is None
        if module._draws_uniform(probe) and opts.selection == "sample" and not dense:
            uniform_G = sampling_uniforms(expert_ids_TK, ep.size * n_inst, stream=ep.rank,  # one per instance: the
                                          generator=opts.generator)  # generator's, or a hash of this rank's routing
            plan = replace(plan, uniform=uniform_G)

        # Which instance runs each of this rank's pairs: g = w * I + i.
        slots_EW = instance_slots(plan.instances, n_exp)
        rank_P, slot_P = pair_destinations(expert_ids_TK, plan.routes[ep.rank], slots_EW)
        group_P = rank_P * n_inst + slot_P

        dtype = x_TD.dtype
        dim, hidden_dim = x_TD.shape[1], experts.hidden_dim
        if module._records_plan(probe):  # the last training forward's plan and bytes (not evaluation nor a recompute)
            module._record_plan(plan, probe)  # its last_loads and last_quotas: the loads and quotas summed over ranks
            weight_bytes = 3 * dim * hidden_dim * dtype.itemsize  # one instance's two matrices
            row_bytes = dim * dtype.itemsize
            self._record(plan, loads_WE, {
                "dispatch_bytes": peer_bytes(splits.fwd_send, row_bytes, ep.rank),
                "combine_bytes": peer_bytes(splits.fwd_recv, row_bytes + EXTRA_BYTES, ep.rank),
                "replica_bytes": peer_bytes(splits.rep_send, weight_bytes, ep.rank) if rep.max_replicas else 0,
                "replica_grad_bytes": peer_bytes(splits.rep_recv, weight_bytes, ep.rank) if rep.max_replicas else 0,
            })

        # No backward will run without a probe: then "offload" would copy h to the host for nothing.
        activations = "recompute" if opts.activations == "offload" and probe is None else opts.activations
        # The selection keeps exactly sum(quotas[rank]) rows (every group keeps min(quota, load) = quota), grouped by
        # instance ascending, so by destination rank: its per-rank blocks are exactly splits.bwd_send.
        kernels = choose_kernels(opts.kernels, x_TD, dim, hidden_dim, blocked=rep.backward_blocks)
        cfg = StepConfig(dense=dense, metric=opts.metric, selection=opts.selection, generator=opts.generator,
                         activations=activations, max_rows=sum(splits.bwd_send),
                         out_shape=out_shape and tuple(out_shape),
                         group_rows=splits.block_rows if rep.backward_blocks else None, kernels=kernels,
                         save_outputs=opts.save_outputs)
        return partial(_run_instances, group_P=group_P, plan=plan, probe=probe, cfg=cfg,
                       transport=AllToAllTransport(ep, splits))

    @torch.no_grad()
    def _record(self, plan: ExpertParallelPlan, loads_WE: torch.Tensor, forward_bytes: dict[str, int]) -> None:
        """Keep this forward's plan and this rank's forward bytes (host values, written by fills) for ``stats()``.
        Every record is written every time: after a build on the meta device and to_empty they held garbage."""
        self.loads.copy_(loads_WE)
        for name in ("quotas", "instances", "assignment", "instance_quotas"):
            getattr(self, name).copy_(getattr(plan, name))
        if plan.capacity is None:
            self.capacity.fill_(-1)
        else:
            self.capacity.copy_(plan.capacity)
        for name in _FORWARD_BYTES:
            getattr(self, name).fill_(forward_bytes[name])

    def stats(self, probe: StatsProbe) -> ExpertParallelStats:
        """The last recorded forward's statistics, and the backward statistics summed in ``probe`` since its last
        reset (see :class:`ExpertParallelStats`)."""
        backward = probe.totals()
        calls = backward["backward_calls"]
        return ExpertParallelStats(
            loads=self.loads.clone(), quotas=self.quotas.clone(), instances=self.instances.clone(),
            assignment=self.assignment.clone(), instance_quotas=self.instance_quotas.clone(),
            capacity=self.capacity.clone(), rank_loads=self.assignment.sum((0, 2)),
            rank_backward_loads=self.instance_quotas.sum((0, 2)), total_pairs=self.loads.sum(),
            retained_pairs=self.quotas.sum(), **{name: getattr(self, name).clone() for name in _FORWARD_BYTES},
            backward_dispatch_bytes=backward["backward_dispatch_bytes"],
            backward_combine_bytes=backward["backward_combine_bytes"],
            local_retained_pairs=backward["retained_pairs"],
            score_mass_fraction=backward["score_mass_fraction_sum"] / calls, backward_calls=calls,
        )

    def experts_forward(self, experts: SwiGLUExperts, x_TD: torch.Tensor, expert_ids_TK: torch.Tensor,
                        gates_TK: torch.Tensor, options: dict) -> torch.Tensor:
        """Forward of a :class:`SwiGLUExperts` made expert-parallel on its own (``parallelize_module(experts, mesh,
        ExpertParallel())``; e.g. a transformers model's experts after ``swap_experts``), called as transformers
        calls its experts: ``experts(x_TD, expert_ids_TK, gates_TK)``. Steps 2-9 of the module docstring, with the
        module's options (retain, selection, ...); the caller's router chose the experts and gates (step 1), and
        its gradient, like the router's, comes from this rank's tokens only."""
        if options:
            raise TypeError(
                f"this experts module is expert-parallel on its own (ExpertParallel applied to it) and plans every "
                f"step itself: it takes no per-call options, got {sorted(options)}. Set options when building it "
                "(SwiGLUExperts(..., retain=...), swap_experts(model, retain=...)); for an LRMoE layer apply "
                "ExpertParallel to the layer, not to layer.experts"
            )
        _refuse_backward_capacity(experts.backward.backward_capacity)  # set after parallelize_module refused it
        check_tensor("x_TD", x_TD, ndim=2, kind="float")
        check_tensor("expert_ids_TK", expert_ids_TK, ndim=2, kind="int")
        check_tensor("gates_TK", gates_TK, ndim=2, kind="float")  # integer gates refused, not cast
        if x_TD.shape[1] != experts.dim:
            raise ValueError(f"x_TD must be [T, dim={experts.dim}], got shape {tuple(x_TD.shape)}")
        check_same_size("expert_ids_TK", expert_ids_TK, 0, "x_TD", x_TD, 0)
        if gates_TK.shape != expert_ids_TK.shape:
            raise ValueError(f"gates_TK must have expert_ids_TK's shape {tuple(expert_ids_TK.shape)}, got "
                             f"{tuple(gates_TK.shape)}")
        check_same_device(x_TD=x_TD, expert_ids_TK=expert_ids_TK, gates_TK=gates_TK,
                          gate_up_proj=experts.gate_up_proj.to_local())
        probe = experts._probe_for(x_TD, gates_TK)
        dtype = compute_dtype(x_TD)  # torch.autocast's, else x's: computed and sent in it, as the layer does
        with autocast_off(x_TD.device.type):
            x_TD, gates_TK = x_TD.to(dtype), gates_TK.to(dtype)
            step = self.plan(experts, experts, x_TD, expert_ids_TK, probe)
            return step(experts, x_TD, expert_ids_TK, gates_TK)  # already inside the experts' forward


def _run_instances(experts: SwiGLUExperts, x_TD: torch.Tensor, expert_ids_TK: torch.Tensor, gates_TK: torch.Tensor,
                   *, group_P: torch.Tensor, plan: ExpertParallelPlan, probe: torch.Tensor | None, cfg: StepConfig,
                   transport: AllToAllTransport) -> torch.Tensor:
    """Steps 5-9 of the module docstring, run by ``experts``' forward (``ExpertParallelDispatcher.plan`` binds the
    keywords): the rank's instances, replicas fetched from their owners, on the rows its pairs dispatch, with
    ``experts``' weights as its forward sees them (gathered there by an FSDP2 unit on the module). The expert ids are
    already in ``group_P``."""
    ep = transport.ep
    n_local = experts.num_experts // ep.size
    gate_up_LFD = experts.gate_up_proj.to_local().to(x_TD.dtype)
    down_LDF = experts.down_proj.to_local().to(x_TD.dtype)
    if gate_up_LFD.shape[0] != n_local or down_LDF.shape[0] != n_local:
        # Sharded further and not gathered: the kernels would index past a shard (an IndexError on CPU, garbage
        # on CUDA).
        raise RuntimeError(f"this rank holds {gate_up_LFD.shape[0]} experts' weights, expected E/W = {n_local}: "
                           f"{UNGATHERED_EXPERTS}")
    if plan.instances.shape[1] > n_local:
        # Replica weights from their owners, differentiably: their gradients return and sum into the shards.
        flat_LX = torch.cat([gate_up_LFD.reshape(n_local, -1), down_LDF.reshape(n_local, -1)], dim=1)
        flat_RX = fetch_replicas(flat_LX, plan, transport.splits, ep)
        n_gu = gate_up_LFD[0].numel()
        gate_up_IFD = torch.cat([gate_up_LFD, flat_RX[:, :n_gu].view(-1, *gate_up_LFD.shape[1:])])
        down_IDF = torch.cat([down_LDF, flat_RX[:, n_gu:].view(-1, *down_LDF.shape[1:])])
    else:
        gate_up_IFD, down_IDF = gate_up_LFD, down_LDF
    return selective_step(x_TD, gate_up_IFD, down_IDF, gates_TK, group_P, plan.instance_quotas[ep.rank].reshape(-1),
                          plan.uniform, probe, cfg, transport, assign_SWI=plan.assignment,
                          quotas_SWI=plan.instance_quotas)
