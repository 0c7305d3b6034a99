"""The runtime in simulated time: client and worker joined by a link with latency, bandwidth and seeded jitter.

The client function runs in its own thread under simdist's baton (so it can block on a fetch inside the
autograd engine); the worker is a simpy process that takes commands from its inbox in arrival order and
spends simulated time on each. Every message delivery is recorded as a :class:`Delivery`. A run is a pure
function of (client function, seed, options).
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import simpy
import torch
from simpy.events import NORMAL

from simdist.autograd.executor import use_executor
from simdist.clock.baton import Baton, RankAbort
from simdist.clock.perturbation import Perturbation
from simdist.clock.schedule import PerturbedEnvironment
from simdist.errors import RankError
from simdist.runtime.client import Client
from simdist.runtime.commands import Command, Response
from simdist.runtime.errors import RuntimeConfigError
from simdist.runtime.steps import SimDriver
from simdist.runtime.worker import Worker, WorkerStats


@dataclass(frozen=True)
class LinkSpec:
    """One direction of the client-worker channel: seconds, bytes/s, and the upper bound of a uniform extra
    delay drawn per message from the run's seeded generator (messages still arrive in order, as on TCP)."""

    latency: float = 20e-6
    bandwidth: float = 10e9
    jitter: float = 0.0

    def __post_init__(self) -> None:
        for name in ("latency", "bandwidth", "jitter"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and np.isfinite(value) and value >= 0):
                raise RuntimeConfigError(f"LinkSpec.{name} must be a finite number >= 0, got {value!r}")
        if self.bandwidth == 0:
            raise RuntimeConfigError("LinkSpec.bandwidth must be > 0 bytes/s, got 0")


@dataclass(frozen=True)
class Delivery:
    """A message that crossed the link: direction, what it was, when it left and arrived (seconds)."""

    direction: str  # "client->worker" or "worker->client"
    what: str
    sent: float
    arrived: float


class SimLink:
    """One direction of the channel: FIFO delivery after latency + size / bandwidth + jitter."""

    #: the agent a perturbed run files each direction's deliveries under: one per direction, so that a perturbation
    #: never reorders deliveries due at the same time on one direction (TCP keeps their order)
    AGENTS: ClassVar[dict[str, int]] = {"client->worker": -1000, "worker->client": -1001}

    def __init__(self, env: simpy.Environment, spec: LinkSpec, rng: np.random.Generator, direction: str, log: list[Delivery]) -> None:
        self.env = env
        self.spec = spec
        self.rng = rng
        self.direction = direction
        self.log = log
        self._last = 0.0

    def send(self, message: Any, deliver: Callable[[Any], None], delay: float = 0.0) -> None:
        """Deliver ``message`` (after ``delay`` seconds of the sender's own time) by calling ``deliver`` on arrival."""
        spec = self.spec
        sent = self.env.now + delay
        extra = self.rng.uniform(0.0, spec.jitter) if spec.jitter else 0.0
        arrive = max(sent + spec.latency + message.nbytes / spec.bandwidth + extra, self._last)
        self._last = arrive
        what = message.describe() if hasattr(message, "describe") else f"response to #{message.seq}"
        self.log.append(Delivery(self.direction, what, sent, arrive))
        ev = simpy.Event(self.env)  # a timeout, made by hand to carry its agent before it is scheduled
        ev._ok, ev._value = True, None
        ev.owner_rank = self.AGENTS.get(self.direction)  # type: ignore[attr-defined]
        ev.callbacks.append(lambda _ev: deliver(message))
        self.env.schedule(ev, NORMAL, arrive - self.env.now)


@dataclass
class SimRuntimeResult:
    """What a simulated session produced."""

    value: Any
    sim_time: float
    deliveries: list[Delivery]
    stats: WorkerStats
    sent: dict[str, int]
    worker: Worker = field(repr=False)
    #: SHA-256 of the link's record (:func:`trace_hash`): equal for runs that sent the same at the same times
    trace_hash: str = ""


def trace_hash(deliveries: list[Delivery]) -> str:
    """SHA-256 of a session's deliveries (direction, what, times sent and arrived): the session's trace, as
    ``simdist.explore`` compares runs by it."""
    h = hashlib.sha256()
    for d in deliveries:
        h.update(f"{d.direction}|{d.what}|{d.sent!r}|{d.arrived!r}\n".encode())
    return h.hexdigest()


#: simulated seconds the client spends issuing one command (Python and autograd bookkeeping)
CLIENT_SECONDS_PER_COMMAND = 2e-6


def simulate(
    fn: Callable[..., Any],
    *args: Any,
    seed: int = 0,
    link: LinkSpec | None = None,
    worker: Worker | None = None,
    client_seconds: float = CLIENT_SECONDS_PER_COMMAND,
    perturbation: Perturbation | None = None,
) -> SimRuntimeResult:
    """Run ``fn(*args)`` as the client of a simulated worker; autograd tensors inside it live on the worker.

    ``fn`` creates tensors with ``simdist.autograd`` as usual: the client is the current executor while it runs.
    Raises :class:`RankError` (rank 0 is the client) if ``fn`` raised, e.g. a ``RemoteError`` from the worker,
    and the worker's own exception if its code raised; either has a ``deliveries`` attribute, the link's
    record up to then, and its ``trace_hash``.
    ``perturbation`` (a :class:`simdist.Perturbation`) draws the link's delivery jitter from its own seed instead of
    ``seed`` and breaks ties between events due at the same time as it says (see ``docs/explore.md``); None keeps
    the run as it was.
    """
    link = link or LinkSpec()
    if perturbation is None:
        env = simpy.Environment()
        rng = np.random.default_rng(seed)
    else:
        env = PerturbedEnvironment(perturbation)
        rng = np.random.default_rng(perturbation.rng("delivery").getrandbits(64))
    deliveries: list[Delivery] = []
    to_worker = SimLink(env, link, rng, "client->worker", deliveries)
    to_client = SimLink(env, link, rng, "worker->client", deliveries)
    worker = worker or Worker()
    inbox: simpy.Store = simpy.Store(env)
    waiting: dict[int, simpy.Event] = {}
    clock = _ClientClock()

    def reply(response: Response) -> None:
        to_client.send(response, lambda r: waiting.pop(r.seq).succeed(r))

    driver = SimDriver(env)
    worker.attach(driver)

    def worker_loop() -> Iterator[simpy.Event]:
        while True:
            cmd = yield inbox.get()
            yield from driver.run(worker.process(cmd, reply))

    def send(cmd: Command) -> None:
        if threading.current_thread() is clock.thread:  # a free from a finalizer elsewhere costs the client nothing
            clock.pending += client_seconds
        to_worker.send(cmd, inbox.put, clock.pending if threading.current_thread() is clock.thread else 0.0)

    def request(cmd: Command) -> Response:
        ev = env.event()
        waiting[cmd.seq] = ev
        send(cmd)  # leaves after the client's pending time; the answer comes later still
        clock.pending = 0.0
        return baton.block(ev, f"client waits for {cmd.describe()}")

    client = Client(send, request)

    def target(rank: int) -> Any:
        clock.thread = threading.current_thread()
        try:
            with use_executor(client):
                result = fn(*args)
                # the client's own time up to the end (sending is not waiting: settle it)
                if clock.pending:
                    baton.block(env.timeout(clock.pending), "client computing")
                    clock.pending = 0.0
                clock.finished_at = env.now
                return result
        finally:
            client.close()

    env.process(worker_loop())
    start_rng = torch.get_rng_state()  # the client continues the caller's generator, as an in-process call would
    baton = Baton(env, 1, target, initial_rng_state=lambda _rank: start_rng)
    baton.run()
    state = baton.ranks[0]
    if baton.failure is not None:
        # The client raised (e.g. a RemoteError), or the worker's own code did and the client was unwound.
        client_raised = state.exc is not None and not isinstance(state.exc, RankAbort)
        error = RankError(0, state.exc, state.traceback_text) if client_raised else baton.failure
        error.deliveries = deliveries  # type: ignore[union-attr]  # what crossed the link before it failed
        error.trace_hash = trace_hash(deliveries)  # type: ignore[union-attr]
        if client_raised:
            raise error from state.exc
        raise error
    return SimRuntimeResult(
        state.result,
        clock.finished_at,
        deliveries,
        worker.stats,
        dict(client.sent),
        worker,
        trace_hash(deliveries),
    )


class _ClientClock:
    """The client's own time not yet spent in simulated time (it is spent when the client waits)."""

    def __init__(self) -> None:
        self.pending = 0.0
        self.thread: threading.Thread | None = None
        self.finished_at = 0.0
