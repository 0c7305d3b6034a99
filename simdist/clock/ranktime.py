"""Each rank's simulated time: a host timeline, and the compute stream its ops are queued on.

Two models, chosen per run:

- *host-synchronous* (CPU processes, gloo-like progress): an op adds its seconds to the rank's pending time
  and the rank sleeps them off at its next synchronisation point (issuing or waiting on communication,
  polling, finishing), so a run of ops costs one baton hand-off instead of one per op. The host is always
  where its compute is.
- *host runs ahead* (GPU devices under NCCL-like progress, as CUDA does): the host enqueues each op on the
  rank's compute stream and goes on once it has launched it (the device's host overhead, host time settled at
  the next synchronisation point). The stream runs its ops back to back, each starting at max(the stream's
  end, the host time its launch ended): launches overlap with the kernels running before them. Communication issued by the host starts on its own
  stream once the compute stream reaches the issue point (``issue_time``). The host waits for the device
  only where it must: waiting on communication, reading a value to the host, or synchronising. The last two
  hand nothing on: the wait is host time settled at the next synchronisation point (``wait_for_device``).

A rank whose host runs ahead may have side streams besides its compute stream (CUDA's ``torch.cuda.Stream``):
each thread queues on its current stream (``RankState.stream``), streams run beside each other, and one waits
for another only through :meth:`RankTime.stream_wait` (an event or ``wait_stream``). On a host-synchronous rank
every stream is the host's own time, so side streams change nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import simpy

from simdist.clock.baton import Baton, RankState, current_rank_state


class RankTime:
    """Per-rank host and compute-stream time on one simpy clock, with the waits that advance them."""

    def __init__(self, env: simpy.Environment, baton: Baton, host_runs_ahead: bool = False) -> None:
        self.env = env
        self.baton = baton
        #: whether hosts enqueue compute and go on (GPU under NCCL-like progress), or wait for it
        self.host_runs_ahead = host_runs_ahead
        #: ``slowdown(rank, start)``: the factor a straggler's op starting at ``start`` (seconds) takes longer by;
        #: None when no rank straggles
        self.slowdown: Callable[[int, float], float] | None = None

    def charge(self, seconds: float, launch: float = 0.0) -> tuple[int, float, float, int] | None:
        """Queue ``seconds`` of compute on the calling thread's current stream: (rank, start, end, stream), or
        None outside a rank. ``launch``: host seconds spent launching it first (as :meth:`launch`; one call
        instead of two for each op of a rank)."""
        state = current_rank_state()
        if state is None:
            return None
        if launch > 0 and self.host_runs_ahead:
            state.pending += launch
        if seconds <= 0:
            return None
        if self.host_runs_ahead:
            owner = state.owner
            stream = state.stream
            at = state.at
            now = self.env.now
            host = max(now, at) + state.pending  # a kernel starts no earlier than the host launched it
            if stream == 0:
                start = max(host, owner.stream_end)
                if self.slowdown is not None:
                    seconds *= self.slowdown(state.rank, start)
                owner.stream_end = start + seconds
            else:
                start = max(host, owner.side_ends.get(stream, 0.0))
                if self.slowdown is not None:
                    seconds *= self.slowdown(state.rank, start)
                owner.side_ends[stream] = start + seconds
            return state.rank, start, start + seconds, stream
        start = self.env.now + state.pending
        if self.slowdown is not None:
            seconds *= self.slowdown(state.rank, start)
        state.pending += seconds
        return state.rank, start, start + seconds, 0

    def launch(self, seconds: float) -> None:
        """The calling rank's host, which runs ahead of its device, spends ``seconds`` launching a kernel: host
        time, settled at its next synchronisation point, while the device works. A host-synchronous rank waits
        for each kernel, which is charged whole: its launch is not added again."""
        state = current_rank_state()
        if state is not None and seconds > 0 and self.host_runs_ahead:
            state.pending += seconds

    def stream_end(self, stream: int | None = None) -> float:
        """Where the calling rank's ``stream`` (its current stream for None) has run everything queued on it:
        when work queued on it now starts (seconds; the host time on a host-synchronous rank)."""
        state = current_rank_state()
        if state is None:
            return self.env.now
        host = self.host(state)
        if not self.host_runs_ahead:
            return host
        stream = state.stream if stream is None else stream
        owner = state.owner
        end = owner.stream_end if stream == 0 else owner.side_ends.get(stream, 0.0)
        return max(host, end)

    def stream_wait(self, stream: int, until: float) -> None:
        """Work queued on the calling rank's ``stream`` from now on starts no earlier than ``until`` (seconds): the
        stream waits for an event (``cudaStreamWaitEvent``). Nothing to do on a host-synchronous rank."""
        state = current_rank_state()
        if state is None or not self.host_runs_ahead:
            return
        owner = state.owner
        if stream == 0:
            owner.stream_end = max(owner.stream_end, until)
        else:
            owner.side_ends[stream] = max(owner.side_ends.get(stream, 0.0), until)

    def synchronize_stream(self, stream: int | None = None) -> None:
        """Wait on the calling rank's host until its ``stream`` (the current one for None) has run everything queued
        on it (``cudaStreamSynchronize``: a blocking copy, a value read to the host; see :meth:`wait_for_device`)."""
        self._synchronize(stream, every=False)

    def synchronize(self) -> None:
        """Wait on the calling rank's host until every stream of its device has run everything queued on it (see
        :meth:`wait_for_device`)."""
        self._synchronize(None, every=True)

    def _synchronize(self, stream: int | None, every: bool) -> None:
        """The calling rank's host waits for its ``stream`` (the thread's current one for None), or for ``every``
        stream of its device."""
        state = current_rank_state()
        if state is None or not self.host_runs_ahead:
            self.settle()
            return
        owner = state.owner
        if every:
            until = max(owner.stream_end, *owner.side_ends.values()) if owner.side_ends else owner.stream_end
        else:
            stream = state.stream if stream is None else stream
            until = owner.stream_end if stream == 0 else owner.side_ends.get(stream, 0.0)
        self.wait_for_device(until)

    def wait_for_device(self, until: float) -> None:
        """The calling rank's host waits until its device reaches ``until`` (seconds): a stream's or an event's
        synchronisation, a value read.

        It does so without handing the baton on. Where its device will be is known when the host asks (a stream
        waits only for events already recorded and collectives already waited for), and the host observes nothing
        of the other ranks until its next synchronisation point (issuing, waiting, polling, recording an event,
        finishing), which first sleeps its host time off (:meth:`settle`). So until then the wait is host time to
        come, as its launches are, and each of a program's value reads costs no hand-off (DDP's construction reads
        every rank's parameter count with ``item()``). The simulated times are those of sleeping at once, to the
        bit: the host's time is kept as the time it waited until (``RankState.at``) plus what it spent since.

        A host-synchronous rank (CPU devices), whose device is its host, settles its compute instead: there a
        synchronisation is a point where the ranks' order may change, which exploration enumerates.
        """
        state = current_rank_state()
        if state is None or not self.host_runs_ahead:
            self.settle()
            return
        # the same arithmetic as sleeping the pending time off, then sleeping until ``until``
        now = self.env.now
        at = max(now, state.at)
        if state.pending > 0:
            at += state.pending
            state.pending = 0.0
        if until - at > 0:
            at += until - at
        state.at = at

    def settle(self) -> None:
        """Bring the calling rank's host up to date: sleep off compute it has charged but not waited out.

        A host that runs ahead has only its kernels' launches to settle: their compute is on the device.
        """
        state = current_rank_state()
        if state is None:
            return
        if state.at > self.env.now:  # it waited for its device without handing the baton on: sleep until then
            until = state.at + state.pending if state.pending > 0 else state.at
            state.at = state.pending = 0.0
            # simpy's clock reaches now + (until - now), which is ``until`` exactly (0 <= now < until)
            self.baton.sleep(until - self.env.now, f"rank {state.rank} computing")
        elif state.pending > 0:
            pending, state.pending = state.pending, 0.0
            state.at = 0.0
            self.baton.sleep(pending, f"rank {state.rank} computing")

    def issue_time(self) -> float:
        """The simulated time at which an operation the calling rank issues now may start on its stream.

        Host-synchronous: the host settles its compute first, so now. Host ahead: when the calling thread's
        current stream (the compute stream, unless a side stream is current) reaches this point (the event a CUDA
        collective waits on), never before the host issued it.
        """
        state = current_rank_state()
        self.settle()  # the host issues it once its launches before it are done
        if not self.host_runs_ahead or state is None:
            return self.env.now
        return self.stream_end()

    def now(self) -> float:
        """The calling rank's current host time (seconds), compute it has charged but not slept off included."""
        state = current_rank_state()
        return self.env.now if state is None else self.host(state)

    def host(self, state: RankState) -> float:
        """Rank thread ``state``'s host time (seconds): where the simulator is, or where the host waited for its
        device until if later, plus what it has spent since and not slept off."""
        at = state.at
        now = self.env.now
        return max(now, at) + state.pending

    def device_now(self) -> float:
        """Where the calling thread's current stream is (seconds): when an op enqueued now starts on the device
        (the host time on a host-synchronous rank)."""
        return self.stream_end()

    def finish_time(self, state: RankState) -> float:
        """When thread ``state`` is done: its host time, or the end of its rank's busiest stream if later."""
        owner = state.owner
        device = max(owner.stream_end, *owner.side_ends.values()) if owner.side_ends else owner.stream_end
        return max(self.host(state), device if self.host_runs_ahead else 0.0)

    def let_time_pass(self, event: Any, description: str) -> None:
        """A rank polled an operation that is not done: move it on to the next simulated time at which
        something is scheduled (whatever is due earlier, other ranks' polls included, runs first).

        If nothing is scheduled after now, the operation can only complete by waiting, so the rank waits for
        it (and the run reports a deadlock if it never can) instead of polling forever.
        """
        now = self.env.now
        later = min((item[0] for item in self.env._queue if item[0] > now), default=float("inf"))
        for lane in getattr(self.env, "lanes", ()):  # events queued apart from simpy's (simdist.comm.lane)
            later = min(later, lane.next_after(now))
        if later == float("inf"):
            self.baton.block(event, description)
        else:
            self.baton.block(self.env.timeout(later - now), description)
