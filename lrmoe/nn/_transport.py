"""The all-to-all transport of the selective expert step, and every other collective of expert parallelism
(docs/design.md, "Expert parallelism"): the load matrix's all-gather, the host split sizes, the replica weights'
fetch, and :class:`AllToAllTransport`, which moves a step's rows between the EP ranks for
lrmoe.functional.expert_step's one autograd Function.

Shapes: T local tokens, D model dim, W EP ranks, S source ranks (S == W), L owned experts per rank, R replica
slots, I = L + R instance slots per rank, P = T * K local pairs, N rows this rank's instances receive in the
forward dispatch, R retained rows this rank sends in backward, M retained rows its instances receive.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.fx.experimental.symbolic_shapes import guard_or_false

from lrmoe.functional.expert_parallel import ExpertParallelPlan, block_rows, expert_major_order
from lrmoe.functional.retained_rows import block_slots, pad_to_blocks, retained_dy, take_rows
from lrmoe.functional.stats_probe import ProbeLayout
from lrmoe.functional.transport import Combined, Dispatched, Exchanged, Transport
from lrmoe.ops import gather_scale_rows
from lrmoe.ops._torch_internals import functional_collectives, torch_check

funcol = functional_collectives()

# Expert parallelism's backward statistics (lrmoe.functional.stats_probe), each summed over the backward calls: the
# fraction of this rank's score mass kept, the retained pairs it sent, the bytes it sent to its peers in the
# backward dispatch and in the input-gradient return; and the calls. float64: byte counts stay exact past 2**24.
EP_BACKWARD_STATS = ProbeLayout(("score_mass_fraction_sum", "retained_pairs", "backward_dispatch_bytes",
                                 "backward_combine_bytes", "backward_calls"), torch.float64)
# torch 2.13 renamed funcol.all_gather_tensor (deprecated there, a FutureWarning every step); 2.11 has only it.
_all_gather = getattr(funcol, "all_gather_single", funcol.all_gather_tensor)
EXTRA_BYTES = 4  # per row: fp32 ||phi||^2 in the combine, int32 row index in the backward dispatch (retain < 1)


@dataclass(frozen=True)
class EPGroup:
    """The EP process group and this rank's place in it (Python values, fixed at parallelisation)."""

    group: dist.ProcessGroup
    rank: int
    size: int


@dataclass(frozen=True)
class Splits:
    """Host-side row counts per peer of the all-to-alls of one step, read from the plan in one sync.

    fwd_send[w]: this rank's pairs that run on rank w (dispatch rows sent; combine rows received).
    fwd_recv[s]: source s's pairs that run on this rank (dispatch rows received; combine rows sent).
    bwd_send[w], bwd_recv[s]: the same for the retained pairs (instance quotas instead of the assignment).
    rep_send[w]: replica weights this rank sends to rank w (w's replicas of experts this rank owns);
    rep_recv[v]: replica weights this rank receives from owner v. Empty lists without replicas.
    pairs[s]: the pairs source s routed this step (to experts in range; their sum is the step's P).
    misrouted[s]: source s's pairs whose expert id is outside [0, E) (``pair_counts``).
    block_rows: with ExpertParallel(backward_blocks=True), the rows of every local instance's block in the
    blocked backward: the most retained rows any instance of this rank receives, rounded up to 8; else 0.

    pairs and misrouted are the same on every rank (read from the all-gathered counts): the step's checks of its
    data read them, so every rank reaches the same verdict.
    """

    fwd_send: list[int]
    fwd_recv: list[int]
    bwd_send: list[int]
    bwd_recv: list[int]
    rep_send: list[int]
    rep_recv: list[int]
    pairs: list[int]
    misrouted: list[int]
    block_rows: int = 0



def pair_counts(expert_ids_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[E + 1] int64: this rank's pairs per expert, then its pairs whose expert id is outside [0, E). An id out of
    range is counted, not refused here: refused on this rank alone (as ``expert_loads`` does on CPU), it would leave
    the other ranks waiting in the load all-gather; counted, it reaches every rank with the loads, and every rank
    refuses the step together (``Splits.misrouted``)."""
    flat = expert_ids_TK.reshape(-1).long()
    bin_P = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)
    return torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device).scatter_add_(
        0, bin_P, torch.ones_like(bin_P))


def all_gather_loads(counts_X: torch.Tensor, ep: EPGroup) -> torch.Tensor:
    """[W, X]: every rank's counts (``pair_counts``: X = E + 1), all-gathered (no host sync)."""
    return funcol.wait_tensor(_all_gather(counts_X, 0, ep.group)).view(ep.size, -1)


def host_splits(plan: ExpertParallelPlan, ep: EPGroup, n_local: int, misrouted_W: torch.Tensor,
                blocked: bool = False) -> Splits:
    # HOST SYNC (plan on the device; with plan_on="host" the plan is already on the host): the one host read of the
    # EP layer step. The split sizes of every all-to-all of the step (forward dispatch and combine, backward
    # dispatch and input-gradient return, replica weights and their gradients) follow from the plan, so one
    # .tolist() here serves all of them; backward reads nothing from the device. The same read brings the step's
    # global counts (pairs and misrouted pairs per source; misrouted_W on the plan's device) for its checks.
    rows = [
        plan.assignment[ep.rank].sum(-1), plan.assignment[:, ep.rank].sum(-1),
        plan.instance_quotas[ep.rank].sum(-1), plan.instance_quotas[:, ep.rank].sum(-1),
        plan.loads.sum(-1), misrouted_W,
    ]
    replicas_WR = plan.instances[:, n_local:]
    n_rep = replicas_WR.shape[1]
    if n_rep:
        owner_WR = torch.where(replicas_WR >= 0, torch.div(replicas_WR, n_local, rounding_mode="floor"), -1)
        rows.append((owner_WR == ep.rank).sum(1))  # rank w's replicas of experts this rank owns
        rows.append(torch.nn.functional.one_hot(owner_WR[ep.rank] + 1, ep.size + 1)[:, 1:].sum(0))
    if blocked:  # the rows of this rank's blocks, repeated to a row's length: the same one read
        rows.append(block_rows(plan.instance_quotas[:, ep.rank].sum(0)).expand(ep.size))
    host = torch.stack(rows).tolist()
    # Under torch.compile this .tolist() gives unbacked SymInts (unknown at trace time): tell the compiler they are
    # row counts (>= 0), else checks such as select_within_quota's `max_rows < 0` cannot be decided while tracing
    # ("Could not guard on data-dependent expression"). In eager they are plain ints and the checks are no-ops.
    for counts in host:
        for n in counts:
            torch_check(n >= 0)
    n_block = host.pop()[0] if blocked else 0
    fwd_send, fwd_recv, bwd_send, bwd_recv, pairs, misrouted = host[:6]
    rep_send, rep_recv = host[6:] if n_rep else ([], [])
    return Splits(fwd_send, fwd_recv, bwd_send, bwd_recv, rep_send, rep_recv, pairs, misrouted, block_rows=n_block)



def peer_bytes(rows_W: list[int], row_bytes: int, rank: int) -> int:
    """Bytes an all-to-all moves between this rank and its peers (the chunk to itself is a local copy)."""
    return row_bytes * (sum(rows_W) - rows_W[rank])



def _all_to_all(rows_N: torch.Tensor, recv: list[int], send: list[int], ep: EPGroup) -> torch.Tensor:
    """Uneven all-to-all of rows (split sizes on the host, from :func:`host_splits`)."""
    out = funcol.all_to_all_single(rows_N.contiguous(), recv, send, ep.group)
    return funcol.wait_tensor(out)


def _all_to_all_with_scalars(rows_ND: torch.Tensor, extra_N: torch.Tensor, recv: list[int], send: list[int],
                             ep: EPGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows and a 4-byte scalar per row (fp32 ||phi||^2 or an int32 index) with the same split sizes: two
    all-to-alls, both issued before either is waited on. One byte payload (each row with its scalar appended) would
    save a collective but needs a byte-wise copy of every row to pack it and another to unpack it, which cost more
    than the second collective on two H200s (docs/performance.md)."""
    rows = funcol.all_to_all_single(rows_ND.contiguous(), recv, send, ep.group)
    extra = funcol.all_to_all_single(extra_N.contiguous(), recv, send, ep.group)
    return funcol.wait_tensor(rows), funcol.wait_tensor(extra)


def fetch_replicas(flat_LX: torch.Tensor, plan: ExpertParallelPlan, splits: Splits, ep: EPGroup) -> torch.Tensor:
    """[R, X] weights of this rank's replica slots (zeros in empty slots), fetched from their owners.

    ``flat_LX`` is this rank's owned experts, both weights flattened into one row each, so one all-to-all moves
    them. The all-to-all is funcol's autograd-aware one: its backward sends each replica's weight gradient back to
    the owner, and the backward of the owner's index_select sums every replica's gradient into the owned row, so
    the shard's gradient is the sum over all instances of its experts.
    """
    n_local = flat_LX.shape[0]
    replicas_WR = plan.instances[:, n_local:]
    n_ranks, n_rep = replicas_WR.shape
    device = flat_LX.device
    owner_WR = torch.where(replicas_WR >= 0, torch.div(replicas_WR, n_local, rounding_mode="floor"), n_ranks)
    # Owner side: the experts others replicate, in (rank, slot) order: the order each receiver expects.
    slot_WR = torch.arange(n_ranks * n_rep, device=device).view(n_ranks, n_rep)
    key_WR = torch.where(owner_WR == ep.rank, slot_WR, n_ranks * n_rep)
    send_slots = torch.argsort(key_WR.reshape(-1), stable=True)[: sum(splits.rep_send)]
    local_ids = replicas_WR.reshape(-1).index_select(0, send_slots) - ep.rank * n_local
    send = flat_LX.index_select(0, local_ids)
    recv = funcol.all_to_all_single(send, splits.rep_recv, splits.rep_send, ep.group)
    # Receiver side: rows come owner-major, then by slot; put them in their slots.
    mine_R = owner_WR[ep.rank]
    key_R = mine_R * n_rep + torch.arange(n_rep, device=device)
    recv_slots = torch.argsort(key_R, stable=True)[: sum(splits.rep_recv)]
    return torch.zeros(n_rep, flat_LX.shape[1], dtype=flat_LX.dtype, device=device).index_copy(0, recv_slots, recv)


@dataclass(frozen=True)
class AllToAllState:
    """What give_back and probe_grad need of an exchange: the arrival order of the retained rows
    (``perm_M``: instance-major position j -> arrived row), their block slots (blocked backward, else None), the
    bytes of a dispatched and of a returned row, and the received rows (held until the backward returns)."""

    perm_M: torch.Tensor
    slot_M: torch.Tensor | None
    row_bytes: int
    dx_row_bytes: int
    dy_MD: torch.Tensor


@dataclass(frozen=True)
class AllToAllTransport(Transport):
    """Expert parallelism's transport for the selective step (lrmoe.functional.expert_step): uneven all-to-alls
    over the EP group with this step's host split sizes.

    Forward: the pairs' x rows go to the ranks of their instances (dispatch; they arrive source-major and the first
    GEMM reads them instance-major through a permutation), and the y rows with their ||phi||^2 come back in the
    order they were sent (combine). Backward: each retained row alpha * g / p goes, with a 4-byte index to its
    forward row, to the instance that ran its forward (which holds its saved activations: only this row travels),
    and its input-gradient row comes back (give_back). A slot "sample" skipped (pair -1) sends a zero row: it keeps
    the planned split sizes, and a zero dy contributes nothing to any gradient.
    """

    ep: EPGroup
    splits: Splits

    selects_in_dispatch_order = False
    always_needs_dx = True  # the return is an all-to-all every rank joins
    probe_layout = EP_BACKWARD_STATS

    def dispatch(self, x_TD, tok_P, dest_P, n_inst, assign_SWI):
        splits, ep = self.splits, self.ep
        x_recv_ND = _all_to_all(x_TD.index_select(0, tok_P), splits.fwd_recv, splits.fwd_send, ep)
        # Received rows are source-major; the grouped GEMMs want them instance-major. The gather is fused into the
        # first GEMM (rows = the permutation), so x_recv is never copied.
        counts_SI = assign_SWI[:, ep.rank]
        perm_N = expert_major_order(counts_SI, x_recv_ND.shape[0])
        return Dispatched(x_recv_ND, perm_N, torch.cumsum(counts_SI.sum(0), 0).int())

    def combine(self, y_ND, phi_sq_N, dispatched, assign_SWI):
        # y rows and ||phi||^2 go back in the order they came (source-major).
        perm_N = dispatched.rows_N
        ident_N = torch.arange(perm_N.shape[0], device=perm_N.device)
        inv_perm_N = torch.empty_like(perm_N).scatter_(0, perm_N, ident_N)
        y_PD, phi_sq_P = _all_to_all_with_scalars(
            y_ND.index_select(0, inv_perm_N), phi_sq_N.index_select(0, inv_perm_N), self.splits.fwd_send,
            self.splits.fwd_recv, self.ep)
        return Combined(y_PD, phi_sq_P, inv_perm_N)

    def exchange(self, request):
        if request.token_rows:  # the rows cross ranks: there is no source row to read in place
            raise ValueError("AllToAllTransport sends dy rows; token_rows needs selects_in_dispatch_order")
        splits, ep, fwd = self.splits, self.ep, request.forward
        g_TD, pair_R = request.g_TD, request.pair_R
        assign_SWI, quotas_SWI = fwd.assign_SWI, fwd.quotas_SWI
        device = g_TD.device
        dy_RD, _, safe_R = retained_dy(g_TD, request.gates_TK, pair_R, request.weight_R, fwd.dtype)
        tie = None
        if guard_or_false(g_TD.shape[0] == 0):
            # A rank without tokens (T = 0, a static size under torch.compile): the CUDA ops, inlined, return its
            # empty results without reading g, so nothing this backward sends depended on the incoming gradient and
            # AOTAutograd's partitioner moved the backward all-to-alls into this rank's forward graph, out of step
            # with the other ranks' collectives (two GPUs: garbage row indices, a device-side assert). The sum of
            # the empty g, added to what is sent, ties the sends to it.
            tie = g_TD.sum()
            dy_RD = dy_RD + tie.to(dy_RD.dtype)
        fwd_recv_W = assign_SWI[:, ep.rank].sum(-1)  # on device: no host-to-device copy
        dx_row_bytes = dy_RD.shape[1] * dy_RD.element_size()
        row_bytes = dx_row_bytes
        if request.dense:
            dy_MD = _all_to_all(dy_RD, splits.bwd_recv, splits.bwd_send, ep)
        else:
            # The instance must find each row's saved forward activations: send the pair's position in the forward
            # message to its rank (its position in the sorted dispatch buffer minus that rank's block start).
            fwd_send_W = assign_SWI[ep.rank].sum(-1)
            start_W = torch.cumsum(fwd_send_W, 0) - fwd_send_W
            dest_R = torch.div(take_rows(fwd.dest_P, safe_R), fwd.n_inst, rounding_mode="floor")
            index_R = take_rows(fwd.inv_P, safe_R) - start_W.index_select(0, dest_R)
            index_R = torch.where(pair_R >= 0, index_R, 0).int()
            if tie is not None:
                index_R = index_R + tie.int()
            dy_MD, index_M = _all_to_all_with_scalars(dy_RD, index_R, splits.bwd_recv, splits.bwd_send, ep)
            row_bytes += EXTRA_BYTES
        del dy_RD

        # The instance side: the M retained rows this rank's instances received, instance-major.
        n_kept = dy_MD.shape[0]
        if request.dense:
            fwd_row_M = torch.arange(n_kept, device=device)  # the same layout as the forward dispatch
        else:
            bwd_recv_W = quotas_SWI[:, ep.rank].sum(-1)
            src_M = torch.repeat_interleave(torch.arange(ep.size, device=device), bwd_recv_W, output_size=n_kept)
            fwd_row_M = (torch.cumsum(fwd_recv_W, 0) - fwd_recv_W).index_select(0, src_M) + index_M.long()
        quota_SI = quotas_SWI[:, ep.rank]
        perm_M = expert_major_order(quota_SI, n_kept)  # instance-major position j -> arrived row perm_M[j]
        offsets_I = torch.cumsum(quota_SI.sum(0), 0).int()
        slot_M = None
        if request.group_rows is not None:
            # Each instance's rows first in a block of splits.block_rows (the largest instance's count, from the
            # plan already on the host: no pair dropped, no sync), zero rows after them; the GEMMs as torch.bmm.
            slot_M = block_slots(offsets_I, n_kept, request.group_rows)  # also maps the input-gradient rows back
            # The arrived row in each slot (-1 for padding), weight 1 (0 for padding), the blocks' offsets.
            arrived_B, keep_B, offsets_I = pad_to_blocks(perm_M, torch.ones(n_kept, device=device), offsets_I,
                                                         request.group_rows, slot_M)
            safe_B = arrived_B.clamp(min=0)
            dy = [gather_scale_rows(dy_MD, safe_B, keep_B)]  # padding: zero rows
            rows_R = fwd_row_M.index_select(0, safe_B)
        else:
            dy = [dy_MD.index_select(0, perm_M)]
            rows_R = fwd_row_M.index_select(0, perm_M)  # instance-major retained rows -> source-major forward rows
        # "recompute" (no h saved): h from the received x rows, which this rank keeps for the weight gradient
        # anyway; "save" and "offload": the retained rows' index into the saved h (or its host copy).
        h_index_R = fwd.h_of_row_P.index_select(0, rows_R) if request.need_h_index else None
        return Exchanged(dy, rows_R, offsets_I, h_index_R, pair_R,
                         AllToAllState(perm_M, slot_M, row_bytes, dx_row_bytes, dy_MD))

    def give_back(self, dx_RD, exchanged):
        """The input-gradient rows, back to their sources in the order they arrived (the reverse of exchange)."""
        perm_M, slot_M = exchanged.state.perm_M, exchanged.state.slot_M
        if slot_M is not None:
            dx_MD = dx_RD.index_select(0, torch.empty_like(slot_M).index_copy_(0, perm_M, slot_M))
        else:
            dx_MD = torch.empty_like(dx_RD).index_copy_(0, perm_M, dx_RD)
        return _all_to_all(dx_MD, self.splits.bwd_send, self.splits.bwd_recv, self.ep)

    def probe_grad(self, mass_kept, exchanged):
        row_bytes, dx_row_bytes = exchanged.state.row_bytes, exchanged.state.dx_row_bytes
        splits, rank = self.splits, self.ep.rank
        # Host values written by fills (kernel arguments), not copied from host memory.
        return EP_BACKWARD_STATS.pack(
            score_mass_fraction_sum=mass_kept, retained_pairs=float(sum(splits.bwd_send)),
            backward_dispatch_bytes=float(peer_bytes(splits.bwd_send, row_bytes, rank)),
            backward_combine_bytes=float(peer_bytes(splits.bwd_recv, dx_row_bytes, rank)), backward_calls=1.0)

