"""Point-to-point messages: a send and a receive are matched per (group, source, destination, tag) in order.

The first transfer between two ranks (on a group, in one direction) starts when both sides have posted: a
rendezvous, as NCCL connects a pair lazily on its first send/recv, so two ranks that both block in ``send``
towards each other deadlock here, and simdist reports it. Both works complete when the data has arrived.

Later transfers on a connected pair, where hosts run ahead of their devices (GPU under NCCL-like progress),
follow NCCL's eager protocol for messages that fit the receiver's staging buffer (``EAGER_BYTES``): the data
leaves once the sender's stream reaches the send, whether or not the receive is posted yet, and waits in the
staging buffer; the send completes when the data has arrived, the receive when its stream reaches it and the
data is there. Larger messages and host-synchronous runs keep the rendezvous.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

#: the largest message (bytes) sent eagerly on a connected pair: NCCL's default staging buffer per
#: connection, NCCL_BUFFSIZE = 4 MiB
EAGER_BYTES = 4 * 2**20

import torch

from simdist.comm.plans import raw_flat
from simdist.comm.work import SimWork
from simdist.errors import CollectiveMismatchError, SymmetryError
from simdist.ranks import format_ranks
from simdist.trace.trace import Message, Span

if TYPE_CHECKING:  # annotations only: the run's context imports the machinery, not the other way
    from simdist.comm.context import RunContext


@dataclass
class Post:
    """One posted send or receive."""

    group: Any  # the GroupState
    src: int  # global rank, -1 for "any source"
    dst: int
    tag: int
    tensor: torch.Tensor
    work: SimWork
    site: str
    order: int
    #: simulated time (seconds) from which the poster's stream may run it (see ``RankTime.issue_time``)
    ready_at: float = 0.0
    #: an eager send: its data (cloned when posted), when it started to move and arrived (None until then),
    #: and the receive it was matched with (None until then)
    payload: torch.Tensor | None = None
    left_at: float = 0.0
    arrived_at: float | None = None
    matched: Post | None = None


class P2P:
    """Matching queues for every (group, src, dst, tag)."""

    def __init__(self, sim: RunContext) -> None:
        self.sim = sim
        self.sends: dict[tuple, deque[Post]] = {}
        self.recvs: dict[tuple, deque[Post]] = {}
        self.any_recvs: dict[tuple, deque[Post]] = {}
        self._order = 0
        #: (group name, src, dst) pairs that have completed a rendezvous: later small sends go eagerly
        self._connected: set[tuple[str, int, int]] = set()

    def _next(self) -> int:
        self._order += 1
        return self._order

    def post_send(
        self, group: Any, src: int, dst: int, tag: int, tensor: torch.Tensor, work: SimWork, site: str, ready_at: float = 0.0
    ) -> None:
        """Post a send on ``group`` (a GroupState; ranks are global); starts the transfer if a receive waits."""
        self._check_simulated("send to", dst, src, site)
        post = Post(group, src, dst, tag, tensor, work, site, self._next(), ready_at)
        key = (group.name, src, dst, tag)
        if self._eager(post):
            self._send_eagerly(post)
        q = self.recvs.get(key)
        if q:
            self._match(post, q.popleft())
            return
        qa = self.any_recvs.get((group.name, dst, tag))
        if qa:
            self._match(post, qa.popleft())
            return
        self.sends.setdefault(key, deque()).append(post)

    def post_recv(
        self,
        group: Any,
        src: int | None,
        dst: int,
        tag: int,
        tensor: torch.Tensor,
        work: SimWork,
        site: str,
        ready_at: float = 0.0,
    ) -> None:
        """Post a receive (``src=None``: from any source); starts the transfer if a matching send waits."""
        if src is not None:
            self._check_simulated("receive from", src, dst, site)
        post = Post(group, -1 if src is None else src, dst, tag, tensor, work, site, self._next(), ready_at)
        name = group.name
        if src is None:
            candidates = [
                (q[0].order, k) for k, q in self.sends.items() if q and k[0] == name and k[2] == dst and k[3] == tag
            ]
            if candidates:
                _, key = min(candidates)
                self._match(self.sends[key].popleft(), post)
                return
            self.any_recvs.setdefault((name, dst, tag), deque()).append(post)
            return
        key = (name, src, dst, tag)
        q = self.sends.get(key)
        if q:
            self._match(q.popleft(), post)
            return
        self.recvs.setdefault(key, deque()).append(post)

    def _check_simulated(self, what: str, peer: int, rank: int, site: str) -> None:
        """Refuse a transfer with a rank a symmetric run does not simulate: it would wait forever."""
        simulated = self.sim.simulated
        if simulated is not None and peer not in simulated:
            raise SymmetryError(
                f"rank {rank} tries to {what} rank {peer} at {site}, but this run was made with symmetric=True and "
                f"simulates only {format_ranks(sorted(simulated))}: a symmetric run reduces collectives, not "
                "point-to-point traffic between particular ranks; run it without symmetric=True"
            )

    def _eager(self, send: Post) -> bool:
        """Whether ``send`` goes out without waiting for its receive (see the module's docstring)."""
        return (
            self.sim.time.host_runs_ahead
            and (send.group.name, send.src, send.dst) in self._connected
            and _nbytes(send.tensor) <= EAGER_BYTES
        )

    def _send_eagerly(self, send: Post) -> None:
        """Start moving ``send``'s data once its stream reaches it, into the receiver's staging buffer."""
        sim = self.sim
        send.payload = raw_flat(send.tensor.detach()).clone()
        send.left_at = max(sim.env.now, send.ready_at)

        def arrive(_ev: Any) -> None:
            send.arrived_at = sim.env.now
            self._span(send.src, "send", send.left_at, {"dst": send.dst, "tag": send.tag, "bytes": _nbytes(send.tensor)},
                       send.site)
            send.work.complete()
            if send.matched is not None:
                self._deliver(send, send.matched)

        self._at(send.left_at, lambda: self._network_send(send, arrive))

    def _network_send(self, send: Post, arrive: Any) -> None:
        sim = self.sim
        nbytes = _nbytes(send.tensor)

        def arrived(ev: Any) -> None:
            if sim.trace.record_messages:
                sim.trace.message(Message(send.src, send.dst, "p2p", "p2p", ev.start, sim.env.now, nbytes, f"{sim.progress}:send"))
            arrive(ev)

        sim.network.send(send.src, send.dst, nbytes, arrived, None)

    def _deliver(self, send: Post, recv: Post) -> None:
        """Copy an eager send's data from the staging buffer into ``recv``'s tensor once its stream reaches it."""
        sim = self.sim

        def copy() -> None:
            with torch.no_grad():
                raw_flat(recv.tensor).copy_(send.payload)
            self._span(recv.dst, "recv", max(send.left_at, recv.ready_at),
                       {"src": send.src, "tag": send.tag, "bytes": _nbytes(send.tensor)}, recv.site)
            recv.work.complete()

        self._at(max(sim.env.now, recv.ready_at), copy)

    def _span(self, rank: int, op: str, start: float, args: dict[str, Any], site: str) -> None:
        """Trace ``rank``'s send or receive from ``start`` until now, and keep its call site for reports (beside
        the trace, keyed by rank, span name and times, as :attr:`RunContext.p2p_sites` says)."""
        sim = self.sim
        name = f"{sim.progress}:{op}"
        sim.trace.add(Span(rank, "p2p", name, start, sim.env.now, args))
        sim.p2p_sites[(rank, name, start, sim.env.now)] = str(site)

    def _at(self, when: float, action: Any) -> None:
        """Run ``action()`` at simulated time ``when`` (now, or later)."""
        env = self.sim.env
        if when > env.now:
            env.timeout(when - env.now).callbacks.append(lambda _ev: action())
        else:
            action()

    def _match(self, send: Post, recv: Post) -> None:
        if send.tensor.numel() != recv.tensor.numel() or send.tensor.dtype != recv.tensor.dtype:
            raise CollectiveMismatchError(
                f"send from rank {send.src} to rank {send.dst} (tag {send.tag}) of "
                f"{tuple(send.tensor.shape)} {send.tensor.dtype} at {send.site} matched a recv of "
                f"{tuple(recv.tensor.shape)} {recv.tensor.dtype} at {recv.site}; sizes and dtypes must agree"
            )
        sim = self.sim
        if send.payload is not None:  # eager: the data is on its way, or already in the staging buffer
            recv.work.source_rank = recv.group.group_rank(send.src)
            send.matched = recv
            if send.arrived_at is not None:
                self._deliver(send, recv)
            return
        self._connected.add((send.group.name, send.src, send.dst))
        payload = raw_flat(send.tensor.detach()).clone()
        nbytes = payload.numel() * payload.element_size()
        recv.work.source_rank = recv.group.group_rank(send.src)  # torch maps it back through the group
        # the transfer runs once both sides' streams have reached it
        t0 = max(sim.env.now, send.ready_at, recv.ready_at)

        def arrive(ev: Any) -> None:
            start, end = ev.start, sim.env.now
            with torch.no_grad():
                raw_flat(recv.tensor).copy_(payload)
            trace = sim.trace
            self._span(send.src, "send", t0, {"dst": send.dst, "tag": send.tag, "bytes": nbytes}, send.site)
            self._span(send.dst, "recv", t0, {"src": send.src, "tag": send.tag, "bytes": nbytes}, recv.site)
            if trace.record_messages:
                trace.message(Message(send.src, send.dst, "p2p", "p2p", start, end, nbytes, f"{sim.progress}:send"))
            send.work.complete()
            recv.work.complete()

        self._at(t0, lambda: sim.network.send(send.src, send.dst, nbytes, arrive, None))

    def pending_descriptions(self) -> list[str]:
        """Unmatched posts, for deadlock reports."""
        out = []
        for q in list(self.sends.values()) + list(self.recvs.values()) + list(self.any_recvs.values()):
            for p in q:
                out.append(p.work.description)
        return out


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
