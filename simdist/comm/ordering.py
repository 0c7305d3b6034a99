"""A reduction's result in gloo's order, apart from the message schedule that times it.

A collective's messages run the algorithm the cluster chose (ring, tree, rhd, direct) and reduce into the
user's buffers at their simulated times whatever the presented backend: its timing, the partial values an
access during it sees, and the race detector stay what they are. The order only decides the last bits of
each result, and those are put right when a rank's part completes: its result elements are reduced again
from the ranks' contributions, in gloo's order (:mod:`simdist.algorithms.gloo_order`), over what the
schedule left. A rank's contribution to an element is what the schedule read there: its buffer's value when
a reduce message first took it (sent from it, or reduced into it). So a program whose operations race on one
buffer still mixes their values as the messages do, and a program without races gets gloo's bits.
"""

from __future__ import annotations

import bisect

import torch

from simdist.algorithms import Reduction
from simdist.algorithms.gloo_order import Span, Step, ring_reduce


def backend_for(backend_name: str, device_type: str) -> str:
    """The backend a group presented as ``backend_name`` runs tensors on ``device_type`` with: the name itself,
    or for a per-device name such as ``"cpu:gloo,cuda:nccl"`` the part for that device."""
    parts = [p.strip().rpartition(":") for p in backend_name.lower().split(",")]
    chosen = next((name for device, _, name in parts if device == device_type), None)
    if chosen is None:  # no part for this device: a plain name serves every device
        chosen = next((name for device, _, name in parts if not device), parts[0][2])
    return chosen


def reduces_as_gloo(backend_name: str, device_type: str) -> bool:
    """Whether a group presented as ``backend_name`` reduces tensors on ``device_type`` in gloo's order.

    ``"gloo"`` and the ``"simdist"`` backend (whose results follow gloo's) do; ``"nccl"`` keeps the order of
    the algorithm that runs (simdist's ring adds as NCCL's ring kernel does, see docs/algorithms.md). A
    per-device name such as ``"cpu:gloo,cuda:nccl"`` is read for the tensor's device.
    """
    return backend_for(backend_name, device_type) != "nccl"


def order_matters(reduction: Reduction, dtype: torch.dtype, n: int) -> bool:
    """Whether gloo's order can give other bits than the schedule's for ``reduction`` of ``dtype`` on ``n`` ranks.

    Integer and bool reductions are exact in any order. On two ranks every schedule combines the same two
    values once; when gloo's step is the schedule's own operation (add, multiply: commutative, bit for bit)
    the result is already gloo's. MIN and MAX are not: gloo's keeps one operand of a NaN or signed-zero pair.
    """
    if not (dtype.is_floating_point or dtype.is_complex) or n < 2:
        return False
    return n > 2 or reduction.gloo_step is not reduction.combine


class _Covered:
    """Sorted disjoint element ranges ``[lo, hi)`` of one buffer whose contribution has been taken."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []

    def take(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """Mark ``[lo, hi)`` taken; return its parts that were not."""
        starts, ends = self.starts, self.ends
        i = bisect.bisect_left(ends, lo)  # the first range ending at or after lo (touching ones merge)
        j, pos, gaps = i, lo, []
        while j < len(starts) and starts[j] <= hi:
            if starts[j] > pos:
                gaps.append((pos, starts[j]))
            pos = max(pos, ends[j])
            j += 1
        if pos < hi:
            gaps.append((pos, hi))
        new_lo = min(lo, starts[i]) if j > i else lo
        new_hi = max(hi, ends[j - 1]) if j > i else hi
        starts[i:j], ends[i:j] = [new_lo], [new_hi]
        return gaps

    def covers(self, lo: int, hi: int) -> bool:
        """Whether all of ``[lo, hi)`` has been taken."""
        if lo >= hi:
            return True
        i = bisect.bisect_right(self.ends, lo)
        return i < len(self.starts) and self.starts[i] <= lo and self.ends[i] >= hi


class GlooResult:
    """Each rank's contributions to one reducing collective, and its result in gloo's order.

    ``spans[r]`` are rank r's result elements (real elements: a complex buffer's real view) and where gloo's
    ring puts them; ``bufs[r]`` its flat buffer, which the schedule reduces into; ``step`` gloo's step of the
    reduce op (``Reduction.gloo_step``).
    """

    def __init__(self, spans: list[list[Span]], bufs: list[torch.Tensor], step: Step) -> None:
        self.spans = spans
        self.step = step
        self.n = len(bufs)
        self.real = [torch.view_as_real(b).view(-1) if b.is_complex() else b for b in bufs]
        #: a message's element range is in the buffer's elements; this many real elements make one
        self.scale = 2 if bufs[0].is_complex() else 1
        self.rows: torch.Tensor | None = torch.empty((self.n, self.real[0].numel()), dtype=self.real[0].dtype)
        self.row = list(self.rows.unbind())  # rank q's contribution, a view of rows[q]
        self.covered = [_Covered() for _ in range(self.n)]
        self.results: dict[Span, torch.Tensor] = {}
        self.pending = self.n

    def capture(self, r: int, lo: int, hi: int) -> None:
        """Rank r's buffer elements ``[lo, hi)`` enter a reduction: keep the ones not taken before."""
        s = self.scale
        row, buf = self.row[r], self.real[r]
        assert self.rows is not None, "a message reduced after every rank's part had completed"
        for a, b in self.covered[r].take(lo * s, hi * s):
            row[a:b].copy_(buf[a:b])

    def write(self, r: int) -> None:
        """Rank r's part has completed: write its result elements in gloo's order into its buffer."""
        rows = self.rows
        assert rows is not None, f"rank {r}'s part completed twice"
        for span in self.spans[r]:
            out = self.results.get(span)
            if out is None:
                missing = [q for q in range(self.n) if not self.covered[q].covers(span.lo, span.hi)]
                # every value in a rank's result was read by a message before the result could arrive there
                assert not missing, (
                    f"ranks {missing} never contributed elements [{span.lo}, {span.hi}) to rank {r}"
                )
                out = self.results[span] = ring_reduce(rows, span, self.step)
            self.real[r][span.lo : span.hi].copy_(out)
        self.pending -= 1
        if self.pending == 0:  # the work may outlive the collective: free the copies now
            self.rows, self.row, self.results = None, [], {}
