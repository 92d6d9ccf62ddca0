"""The seam between the selective expert step and where its rows travel (docs/design.md, "Architecture").

The step (lrmoe.functional.expert_step) is the same on one device and under expert parallelism; only the
transport differs. A transport is a frozen object of Python values (the same on every rank, hashable, so
torch.compile treats it as a constant) implementing :class:`Transport`. What crosses the seam is frozen dataclasses
of tensors:

    forward:  dispatch(x_TD, ...) -> Dispatched   the rows the experts read, and where each GEMM row is
              combine(y_ND, ...)  -> Combined     the rows back at their sources, in dispatch order
    backward: exchange(BackwardRequest) -> Exchanged   the retained rows alpha * g / p at the instances (on one
                                                       device, on request, as TokenRows: g's rows by token)
              give_back(dx_RD, Exchanged) -> dx rows back at their sources
              probe_grad(mass_kept, Exchanged) -> the step's backward statistics

Shapes: T tokens, D model dim, I expert instances on this rank, K top-k, P = T * K pairs, N forward rows this
rank's instances compute (N = P on one device), R retained rows this rank selects, M retained rows its instances
receive (M = R on one device). :class:`IdentityTransport` is one device; lrmoe.nn._transport.AllToAllTransport is
expert parallelism over a process group.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

import torch

from lrmoe.functional.retained_rows import pad_to_blocks, retained_coefficients, retained_dy
from lrmoe.functional.routing import expert_loads
from lrmoe.functional.stats_probe import ProbeLayout

# One device's backward statistics (lrmoe.functional.stats_probe): the fraction of score mass kept and the retained
# pairs, each summed over the backward calls, and the calls.
BACKWARD_STATS = ProbeLayout(("score_mass_fraction_sum", "retained_pairs", "backward_calls"), torch.float32)
N_BACKWARD_STATS = BACKWARD_STATS.size


@dataclass(frozen=True)
class Dispatched:
    """The forward's rows at the instances. GEMM row i reads ``rows_ND[rows_N[i]]`` (``rows_N`` None: row i);
    instance j's rows end at ``offsets_I[j]`` (int32, cumulative)."""

    rows_ND: torch.Tensor
    rows_N: torch.Tensor | None
    offsets_I: torch.Tensor


@dataclass(frozen=True)
class Combined:
    """The experts' outputs back at their sources: ``y_PD`` and ``phi_sq_P`` in dispatch order (row j is the pair
    the dispatch put j-th), and ``h_of_row_P``, the row of the saved h that row j's pair was computed in (None: the
    same row)."""

    y_PD: torch.Tensor
    phi_sq_P: torch.Tensor
    h_of_row_P: torch.Tensor | None


@dataclass(frozen=True)
class ForwardRecord:
    """What the step's forward kept that a transport's backward reads: the instances' input rows, the output dtype,
    every pair's instance, each pair's row in dispatch order (``inv_P``), the instances' row offsets, and the plan's
    rows per (source, rank, instance) in forward and backward (expert parallelism; None on one device)."""

    x_ND: torch.Tensor
    dtype: torch.dtype
    dest_P: torch.Tensor
    inv_P: torch.Tensor
    offsets_I: torch.Tensor
    n_inst: int
    assign_SWI: torch.Tensor | None
    quotas_SWI: torch.Tensor | None
    h_of_row_P: torch.Tensor | None


@dataclass(frozen=True)
class BackwardRequest:
    """The source side's selection, to be sent to the instances: the incoming gradient and gates, the kept pairs
    (``pair_R``, -1 for padding) with their weights 1/p, the selection's group ends (None when every pair is kept,
    in dispatch order), and whether the instances need each row's index into the saved h (False: no h was saved, or
    the retained rows are h's own rows in order, so the backward reads h in place). ``token_rows``: hand the
    instances the rows as :class:`TokenRows` (one device only: ``selects_in_dispatch_order``) instead of dy rows;
    ``forward_tok_N``, with them, the token of every forward row, for the router gradient of all forward rows
    (``TokenRows.all_tok_N``), and ``forward_phi_N`` the forward rows' phi where the step saved it."""

    g_TD: torch.Tensor
    gates_TK: torch.Tensor
    pair_R: torch.Tensor
    weight_R: torch.Tensor
    ends_G: torch.Tensor | None
    forward: ForwardRecord
    dense: bool
    group_rows: int | None
    need_h_index: bool
    token_rows: bool = False
    forward_tok_N: torch.Tensor | None = None
    forward_phi_N: torch.Tensor | None = None


@dataclass(frozen=True)
class TokenRows:
    """The retained rows' output gradient left where it is: row r's is ``coef_R[r] * g_TD[tok_R[r]]`` (coef_R =
    alpha / p in fp32, fp64 for fp64 rows), in the step's compute dtype ``dtype``. A backend that computes the
    router gradient (``ExpertKernels.computes_router_gradient``) reads the token rows unscaled and applies the
    coefficients inside its SwiGLU backward. ``all_tok_N`` and ``all_offsets_I``, when the retained rows are a
    subset of the forward's: the token of every forward row (their order: the saved h's) and the instances' forward
    row offsets, for the router gradient of every forward row, dropped ones included; ``all_phi_N``, the forward
    rows' saved phi, where no h is saved on the device to take it from."""

    g_TD: torch.Tensor
    tok_R: torch.Tensor
    coef_R: torch.Tensor
    dtype: torch.dtype
    all_tok_N: torch.Tensor | None = None
    all_offsets_I: torch.Tensor | None = None
    all_phi_N: torch.Tensor | None = None


@dataclass(frozen=True)
class Exchanged:
    """The retained rows at the instances, as the expert backward takes them. ``dy`` = [dy_RD] (a list: the expert
    backward pops it, so the buffer is freed after its last use), or :class:`TokenRows` when the request asked for
    them; row i's input is ``x_ND[rows_R[i]]``; instance j's
    rows end at ``offsets_I[j]``; ``h_index_R`` their rows of the saved h; ``pair_R`` the pair each of the source's
    rows holds (for the per-token sum of the returned dx rows); ``state`` the transport's own record for
    give_back and probe_grad."""

    dy: list[torch.Tensor] | TokenRows
    rows_R: torch.Tensor
    offsets_I: torch.Tensor
    h_index_R: torch.Tensor | None
    pair_R: torch.Tensor
    state: Any


class Transport(abc.ABC):
    """Where the selective step's rows travel. Implementations are frozen dataclasses of Python values."""

    @property
    @abc.abstractmethod
    def selects_in_dispatch_order(self) -> bool:
        """True when the instances run the pairs where the dispatch put them (one device), so the selection can
        take the forward's instance offsets as its group ends, and the instances can read the retained rows'
        gradients as the source's own token rows (``BackwardRequest.token_rows``)."""

    @property
    @abc.abstractmethod
    def always_needs_dx(self) -> bool:
        """True when every rank must compute its dx rows, whether or not x needs a gradient (the return is a
        collective every rank joins)."""

    @property
    @abc.abstractmethod
    def probe_layout(self) -> ProbeLayout:
        """The backward statistics ``probe_grad`` returns, by name: the layout of the stats probe the step takes."""

    @abc.abstractmethod
    def dispatch(self, x_TD: torch.Tensor, tok_P: torch.Tensor, dest_P: torch.Tensor, n_inst: int,
                 assign_SWI: torch.Tensor | None) -> Dispatched:
        """Send each pair's token row (pairs sorted by destination: pair j of that order is token ``tok_P[j]``)
        to its instance."""

    @abc.abstractmethod
    def combine(self, y_ND: torch.Tensor, phi_sq_N: torch.Tensor, dispatched: Dispatched,
                assign_SWI: torch.Tensor | None) -> Combined:
        """Return the experts' output rows and their ||phi||^2 to the pairs' sources."""

    @abc.abstractmethod
    def exchange(self, request: BackwardRequest) -> Exchanged:
        """Send the retained rows alpha * g / p to the instances that ran their forward."""

    @abc.abstractmethod
    def give_back(self, dx_RD: torch.Tensor, exchanged: Exchanged) -> torch.Tensor:
        """Return the input-gradient rows to the sources, in the order of ``exchanged.pair_R``."""

    @abc.abstractmethod
    def probe_grad(self, mass_kept: torch.Tensor, exchanged: Exchanged) -> torch.Tensor:
        """The step's backward statistics, as the stats probe's gradient: packed by the transport's
        ``probe_layout`` (a :class:`~lrmoe.functional.stats_probe.ProbeLayout`, a class attribute)."""


@dataclass(frozen=True)
class IdentityTransport(Transport):
    """One device: the pairs' rows are already where their instances run. Dispatch reads x by token inside the
    first GEMM, combine reads y where the GEMM wrote it, and backward's retained rows are the selection's own
    buffer (padded to blocks of ``group_rows`` first, when set): no copy and no kernel beyond the step's own."""

    selects_in_dispatch_order = True
    always_needs_dx = False
    probe_layout = BACKWARD_STATS

    def dispatch(self, x_TD, tok_P, dest_P, n_inst, assign_SWI):
        return Dispatched(x_TD, tok_P, torch.cumsum(expert_loads(dest_P, n_inst), 0).int())

    def combine(self, y_ND, phi_sq_N, dispatched, assign_SWI):
        return Combined(y_ND, phi_sq_N, None)

    def exchange(self, request):
        fwd = request.forward
        pair_R, weight_R = request.pair_R, request.weight_R
        # Each expert's last group's end; contiguous: with (source, expert) groups this column is strided, and the
        # CUDA GEMMs read offsets as a flat array (they would take every S-th group end, a wrong gradient).
        off_I = fwd.offsets_I if request.dense else request.ends_G.view(fwd.n_inst, -1)[:, -1].contiguous()
        n_kept = off_I[-1]
        if request.group_rows is not None:
            pair_R, weight_R, off_I = pad_to_blocks(pair_R, weight_R, off_I, request.group_rows)
        if request.token_rows:
            coef_R, tok_R, safe_R = retained_coefficients(request.gates_TK, pair_R, weight_R, fwd.dtype)
            all_offsets = None if request.forward_tok_N is None else fwd.offsets_I
            dy = TokenRows(request.g_TD, tok_R, coef_R, fwd.dtype, request.forward_tok_N, all_offsets,
                           request.forward_phi_N)
        else:
            dy_RD, tok_R, safe_R = retained_dy(request.g_TD, request.gates_TK, pair_R, weight_R, fwd.dtype)
            dy = [dy_RD]
            del dy_RD  # the expert backward releases it after its last use
        h_index_R = fwd.inv_P.index_select(0, safe_R) if request.need_h_index else None
        return Exchanged(dy, tok_R, off_I, h_index_R, pair_R, n_kept)

    def give_back(self, dx_RD, exchanged):
        return dx_RD

    def probe_grad(self, mass_kept, exchanged):
        return BACKWARD_STATS.pack(score_mass_fraction_sum=mass_kept, retained_pairs=exchanged.state,
                                   backward_calls=1.0)
