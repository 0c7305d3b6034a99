"""Point-to-point messages: a send and a receive are matched per (group, source, destination, tag) in order.

The transfer starts when both sides have posted (a rendezvous, as NCCL does; so two ranks that both block in
``send`` towards each other deadlock here, and simdist reports it). Both works complete when the data has
arrived in the receiver's tensor.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from simdist.comm.plans import raw_flat
from simdist.comm.work import SimWork
from simdist.errors import CollectiveMismatchError
from simdist.trace.trace import Message, Span


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


class P2P:
    """Matching queues for every (group, src, dst, tag)."""

    def __init__(self, sim: Any) -> None:
        self.sim = sim
        self.sends: dict[tuple, deque[Post]] = {}
        self.recvs: dict[tuple, deque[Post]] = {}
        self.any_recvs: dict[tuple, deque[Post]] = {}
        self._order = 0

    def _next(self) -> int:
        self._order += 1
        return self._order

    def post_send(self, group: Any, src: int, dst: int, tag: int, tensor: torch.Tensor, work: SimWork, site: str) -> None:
        """Post a send on ``group`` (a GroupState; ranks are global); starts the transfer if a receive waits."""
        post = Post(group, src, dst, tag, tensor, work, site, self._next())
        key = (group.name, src, dst, tag)
        q = self.recvs.get(key)
        if q:
            self._match(post, q.popleft())
            return
        qa = self.any_recvs.get((group.name, dst, tag))
        if qa:
            self._match(post, qa.popleft())
            return
        self.sends.setdefault(key, deque()).append(post)

    def post_recv(self, group: Any, src: int | None, dst: int, tag: int, tensor: torch.Tensor, work: SimWork, site: str) -> None:
        """Post a receive (``src=None``: from any source); starts the transfer if a matching send waits."""
        post = Post(group, -1 if src is None else src, dst, tag, tensor, work, site, self._next())
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

    def _match(self, send: Post, recv: Post) -> None:
        if send.tensor.numel() != recv.tensor.numel() or send.tensor.dtype != recv.tensor.dtype:
            raise CollectiveMismatchError(
                f"send from rank {send.src} to rank {send.dst} (tag {send.tag}) of "
                f"{tuple(send.tensor.shape)} {send.tensor.dtype} at {send.site} matched a recv of "
                f"{tuple(recv.tensor.shape)} {recv.tensor.dtype} at {recv.site}; sizes and dtypes must agree"
            )
        sim = self.sim
        payload = raw_flat(send.tensor.detach()).clone()
        nbytes = payload.numel() * payload.element_size()
        recv.work.source_rank = recv.group.group_rank(send.src)  # torch maps it back through the group
        t0 = sim.env.now

        def arrive(ev: Any) -> None:
            start, end = ev.start, sim.env.now
            with torch.no_grad():
                raw_flat(recv.tensor).copy_(payload)
            trace = sim.trace
            trace.add(Span(send.src, "p2p", f"{sim.progress}:send", t0, end, {"dst": send.dst, "tag": send.tag, "bytes": nbytes}))
            trace.add(Span(send.dst, "p2p", f"{sim.progress}:recv", t0, end, {"src": send.src, "tag": send.tag, "bytes": nbytes}))
            if trace.record_messages:
                trace.message(Message(send.src, send.dst, "p2p", "p2p", start, end, nbytes, f"{sim.progress}:send"))
            send.work.complete()
            recv.work.complete()

        sim.network.send(send.src, send.dst, nbytes, arrive, None)

    def pending_descriptions(self) -> list[str]:
        """Unmatched posts, for deadlock reports."""
        out = []
        for q in list(self.sends.values()) + list(self.recvs.values()) + list(self.any_recvs.values()):
            for p in q:
                out.append(p.work.description)
        return out
