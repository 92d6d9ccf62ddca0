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
(lrmoe.nn._transport): dispatch, grouped GEMMs on the local instances, combine. Steps 5-9 run in
``layer.experts(...)`` (the experts' class is swapped for an expert-parallel subclass, as the layer's is), so hooks
on that module see the weights used: FSDP2's ``fully_shard(layer.experts, mesh["dp"])`` gathers them there. Applied
to a ``SwiGLUExperts`` of its own (a transformers model's experts after ``swap_experts``), steps 2-9 run in that
call with the module's options.

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

__all__ = ["ExpertParallel", "ExpertParallelPlan", "ExpertParallelStats", "backward_capacity", "plan_expert_parallel"]


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
    keeps its own slice. The layer's forward becomes the EP forward described in this module's docstring, and
    ``layer.stats()`` returns :class:`ExpertParallelStats`.

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
        if isinstance(module, (_ExpertParallelMixin, _ExpertParallelExpertsMixin)):
            raise ValueError(f"this {type(module).__name__} is already expert-parallel")
        standalone = isinstance(module, SwiGLUExperts)  # experts called as experts(x, ids, gates) by their model
        if not standalone and not isinstance(module, LRMoE):
            raise TypeError("ExpertParallel applies to lrmoe.nn.LRMoE layers and to lrmoe.nn.SwiGLUExperts modules "
                            f"(swap_experts puts them into transformers models), got {type(module).__name__}")
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
        rep = self.replication
        check_replica_slots("max_replicas", rep.max_replicas, experts.num_experts, n_ranks)
        n_local = experts.num_experts // n_ranks
        device = experts.gate_up_proj.device if standalone else module.last_loads.device
        for name in ("gate_up_proj", "down_proj"):
            param = getattr(experts, name)
            if isinstance(param, DTensor):
                raise ValueError(f"experts.{name} is already a DTensor; ExpertParallel shards plain parameters")
            sharded = distribute_tensor(param.detach(), ep_mesh, [Shard(0)], src_data_rank=self.src_data_rank)
            experts.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        module.backward = opts

        if standalone:
            module.__class__ = _ep_class(type(module), _ExpertParallelStandaloneMixin)
        else:
            module.__class__ = _ep_class(type(module), _ExpertParallelMixin)
            module.experts.__class__ = _ep_class(type(module.experts), _ExpertParallelExpertsMixin)
        module.ep_mesh = ep_mesh
        module._ep = EPGroup(group=ep_mesh.get_group(), rank=ep_mesh.get_local_rank(), size=n_ranks)
        module._replication = rep
        n_exp, n_inst = experts.num_experts, n_local + rep.max_replicas

        def buffer(name, *shape):
            module.register_buffer(name, torch.zeros(*shape, dtype=torch.int64, device=device), persistent=False)

        if standalone:  # the layer has them: the last forward's loads and quotas, summed over ranks
            buffer("last_loads", n_exp)
            buffer("last_quotas", n_exp)
        buffer("ep_loads", n_ranks, n_exp)
        buffer("ep_quotas", n_ranks, n_exp)
        buffer("ep_instances", n_ranks, n_inst)
        buffer("ep_assignment", n_ranks, n_ranks, n_inst)
        buffer("ep_instance_quotas", n_ranks, n_ranks, n_inst)
        buffer("ep_capacity", n_ranks)
        buffer("ep_forward_bytes", 4)  # dispatch, combine, replica weights, replica weight gradients
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


# One expert-parallel subclass per (class, mixin), made once and reused, as FSDP2's fully_shard does for its
# FSDP<cls> classes: every layer of a class gets the same subclass (isinstance, pickling and torch.compile's
# guards on the class see one class, not one per module).
_EP_CLASSES: dict[tuple[type, type], type] = {}


def _ep_class(cls: type, mixin: type) -> type:
    """The expert-parallel subclass of an LRMoE class or of its experts', so the module stays an instance of its
    own class, with the EP forward."""
    if (cls, mixin) not in _EP_CLASSES:
        _EP_CLASSES[cls, mixin] = type(f"ExpertParallel{cls.__name__}", (mixin, cls), {})
    return _EP_CLASSES[cls, mixin]


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


def _ep_step(module: nn.Module, experts: nn.Module, run_experts: Callable[..., torch.Tensor], x_TD: torch.Tensor,
             expert_ids_TK: torch.Tensor, gates_TK: torch.Tensor, probe: torch.Tensor | None,
             out_shape: torch.Size | None = None) -> torch.Tensor:
    """Steps 2-9 of the module docstring for one forward: the load matrix, the plan, this rank's pair destinations
    and the step's records on ``module`` (ep_* buffers, last_loads, last_quotas), then ``run_experts(x_TD, gates_TK,
    group_P, plan, probe, cfg, transport)`` with ``module.backward``'s options (exact in eval mode, capacity too,
    unless selective_in_eval) and ``experts``' sizes; x and the gates in the experts' compute dtype; the output in
    ``out_shape`` (StepConfig.out_shape; None: [T, D])."""
    ep, opts, n_exp = module._ep, module.backward.for_mode(module.training), experts.num_experts
    rep = module._replication if opts is module.backward else replace(module._replication, capacity_factor=None)
    check_generator_not_traced(opts.generator)  # an option: the same on every rank
    # The tiny [W, E] load matrix, all-gathered (no host sync) with each rank's misrouted pairs as a last column,
    # then the same plan on every rank.
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
    weight_bytes = 3 * dim * hidden_dim * dtype.itemsize  # one instance's two matrices
    row_bytes = dim * dtype.itemsize
    if module._records_plan(probe):  # the last training forward's plan and bytes (not evaluation nor a recompute)
        with torch.no_grad():
            module.ep_loads.copy_(loads_WE)
            module.ep_quotas.copy_(plan.quotas)
            module.ep_instances.copy_(plan.instances)
            module.ep_assignment.copy_(plan.assignment)
            module.ep_instance_quotas.copy_(plan.instance_quotas)
            if plan.capacity is None:
                module.ep_capacity.fill_(-1)
            else:
                module.ep_capacity.copy_(plan.capacity)
            module.last_loads.copy_(loads_WE.sum(0))
            module.last_quotas.copy_(plan.quotas.sum(0))
            module.ep_forward_bytes[0].fill_(peer_bytes(splits.fwd_send, row_bytes, ep.rank))
            module.ep_forward_bytes[1].fill_(peer_bytes(splits.fwd_recv, row_bytes + EXTRA_BYTES, ep.rank))
            if rep.max_replicas:
                module.ep_forward_bytes[2].fill_(peer_bytes(splits.rep_send, weight_bytes, ep.rank))
                module.ep_forward_bytes[3].fill_(peer_bytes(splits.rep_recv, weight_bytes, ep.rank))
            else:  # written every step: after a build on the meta device and to_empty they held garbage
                module.ep_forward_bytes[2:].zero_()

    # No backward will run without a probe: then "offload" would copy h to the host for nothing.
    activations = "recompute" if opts.activations == "offload" and probe is None else opts.activations
    # The selection keeps exactly sum(quotas[rank]) rows (every group keeps min(quota, load) = quota), grouped by
    # instance ascending, so by destination rank: its per-rank blocks are exactly splits.bwd_send.
    kernels = choose_kernels(opts.kernels, x_TD, x_TD.shape[-1], experts.down_proj.shape[-1],
                             blocked=rep.backward_blocks)
    cfg = StepConfig(dense=dense, metric=opts.metric, selection=opts.selection, generator=opts.generator,
                     activations=activations, max_rows=sum(splits.bwd_send), out_shape=out_shape and tuple(out_shape),
                     group_rows=splits.block_rows if rep.backward_blocks else None, kernels=kernels)
    return run_experts(x_TD, gates_TK, group_P, plan, probe, cfg, AllToAllTransport(ep, splits))


class _ExpertParallelExpertsMixin:
    """Forward of an expert-parallel layer's experts (steps 5-9 of the module docstring): the rank's instances,
    replicas fetched from their owners, on the rows its pairs dispatch. The layer runs its experts through this
    call, so hooks on ``layer.experts`` see it: FSDP2's ``fully_shard(layer.experts, mesh["dp"])`` gathers the
    weights before it, frees them after, and reduce-scatters their gradients once x's gradient is done."""

    def forward(self, x_TD: torch.Tensor, gates_TK: torch.Tensor, group_P: torch.Tensor, plan: ExpertParallelPlan,
                probe: torch.Tensor | None, cfg: StepConfig, transport: AllToAllTransport) -> torch.Tensor:
        ep = transport.ep
        n_local = self.num_experts // ep.size
        gate_up_LFD = self.gate_up_proj.to_local().to(x_TD.dtype)
        down_LDF = self.down_proj.to_local().to(x_TD.dtype)
        if gate_up_LFD.shape[0] != n_local or down_LDF.shape[0] != n_local:
            # Sharded further and not gathered: the kernels would index past a shard (an IndexError on CPU,
            # garbage on CUDA).
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


class _ExpertParallelMixin:
    """Forward and statistics of an expert-parallel LRMoE (see the module docstring)."""

    ep_mesh: DeviceMesh
    _ep: EPGroup
    _replication: _Replication

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        x_TD = x.reshape(-1, self.dim)
        routing, probe, dtype = self.route(x_TD), self._probe_for(x), compute_dtype(x)  # autocast's dtype, else x's
        with torch.autocast(x.device.type, enabled=False):  # the experts run in ``dtype`` exactly
            out = _ep_step(self, self.experts, self.experts, x_TD.to(dtype), routing.expert_ids,
                           routing.gates.to(dtype), probe, x.shape)
        return self.add_shared(x_TD, out)  # in x's shape as the experts wrote it, not a view (see LRMoE.forward)

    def stats(self) -> ExpertParallelStats:
        """This step's statistics as tensors (see :class:`ExpertParallelStats`)."""
        return ExpertParallelStats.from_records(self.ep_loads, self.ep_quotas, self.ep_instances, self.ep_assignment,
                                                self.ep_instance_quotas, self.ep_capacity, self.ep_forward_bytes,
                                                self._stats_probe.totals())


class _ExpertParallelStandaloneMixin(_ExpertParallelExpertsMixin):
    """Forward and statistics of a :class:`SwiGLUExperts` made expert-parallel on its own
    (``parallelize_module(experts, mesh, ExpertParallel())``; e.g. a transformers model's experts after
    ``swap_experts``), called as transformers calls its experts: ``experts(x_TD, expert_ids_TK, gates_TK)``. Steps
    2-9 of the module docstring, with the module's options (retain, selection, ...); the caller's router chose the
    experts and gates (step 1), and its gradient, like the router's, comes from this rank's tokens only."""

    ep_mesh: DeviceMesh
    _ep: EPGroup
    _replication: _Replication
    stats = _ExpertParallelMixin.stats

    def forward(self, x_TD: torch.Tensor, expert_ids_TK: torch.Tensor, gates_TK: torch.Tensor,
                **options) -> torch.Tensor:
        if options:
            raise TypeError(
                f"this experts module is expert-parallel on its own (ExpertParallel applied to it) and plans every "
                f"step itself: it takes no per-call options, got {sorted(options)}. Set options when building it "
                "(SwiGLUExperts(..., retain=...), swap_experts(model, retain=...)); for an LRMoE layer apply "
                "ExpertParallel to the layer, not to layer.experts"
            )
        _refuse_backward_capacity(self.backward.backward_capacity)  # set after parallelize_module refused it
        check_tensor("x_TD", x_TD, ndim=2, kind="float")
        check_tensor("expert_ids_TK", expert_ids_TK, ndim=2, kind="int")
        check_tensor("gates_TK", gates_TK, ndim=2, kind="float")  # integer gates refused, not cast
        if x_TD.shape[1] != self.dim:
            raise ValueError(f"x_TD must be [T, dim={self.dim}], got shape {tuple(x_TD.shape)}")
        check_same_size("expert_ids_TK", expert_ids_TK, 0, "x_TD", x_TD, 0)
        if gates_TK.shape != expert_ids_TK.shape:
            raise ValueError(f"gates_TK must have expert_ids_TK's shape {tuple(expert_ids_TK.shape)}, got "
                             f"{tuple(gates_TK.shape)}")
        check_same_device(x_TD=x_TD, expert_ids_TK=expert_ids_TK, gates_TK=gates_TK,
                          gate_up_proj=self.gate_up_proj.to_local())
        probe = self._probe_for(x_TD, gates_TK)
        run = partial(_ExpertParallelExpertsMixin.forward, self)
        dtype = compute_dtype(x_TD)  # torch.autocast's, else x's: computed and sent in it, as the layer does
        with torch.autocast(x_TD.device.type, enabled=False):
            return _ep_step(self, self, run, x_TD.to(dtype), expert_ids_TK, gates_TK.to(dtype), probe)
