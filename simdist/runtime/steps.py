"""How the worker's logic waits, kept apart from the logic: steps it yields, and two drivers that carry them out.

The worker's command handling and its compile stream are generators that yield :class:`Sleep` (spend time),
:class:`Wait` (until a batch signals it is done) and :class:`NextJob` (take the stream's next job). The
:class:`SimDriver` turns them into simpy events (simulated time); the :class:`ThreadDriver` runs them on real
threads, the main loop in one and the compile stream in another, with one lock held between steps so the
worker's state changes exactly as under simpy: one step at a time.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from typing import Any

import simpy


@dataclass(frozen=True)
class Sleep:
    """Spend ``seconds``. ``modelled`` time stands for work that has no real counterpart here (tracing,
    compiling): a real run sleeps it; the rest (computing) a real run spends by actually computing."""

    seconds: float
    modelled: bool = False


@dataclass(frozen=True)
class Wait:
    """Wait until ``signal`` (from :meth:`SimDriver.signal` / :meth:`ThreadDriver.signal`) has fired."""

    signal: Any


class NextJob:
    """Take the compile stream's next job (waits while there is none)."""


Steps = Generator[Any, Any, None]


class SimDriver:
    """Steps in simulated time on a simpy environment."""

    def __init__(self, env: simpy.Environment) -> None:
        self.env = env
        self._jobs = simpy.Store(env)

    def now(self) -> float:
        """Simulated seconds."""
        return self.env.now

    def signal(self) -> simpy.Event:
        """A new done signal."""
        return self.env.event()

    def fire(self, signal: simpy.Event) -> None:
        """Fire ``signal``."""
        signal.succeed()

    def submit(self, job: Any) -> None:
        """Queue a job for the compile stream."""
        self._jobs.put(job)

    def start_stream(self, steps: Steps) -> None:
        """Run the compile stream as a simpy process."""
        self.env.process(self.run(steps))

    def run(self, steps: Steps) -> Iterator[simpy.Event]:
        """A simpy process body that carries out ``steps``."""
        value = None
        while True:
            try:
                step = steps.send(value)
            except StopIteration:
                return
            if isinstance(step, Sleep):
                value = yield self.env.timeout(step.seconds)
            elif isinstance(step, Wait):
                value = yield step.signal
            else:
                value = yield self._jobs.get()


class ThreadDriver:
    """Steps on real threads: modelled sleeps are real sleeps, waits block the thread, one lock between steps."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._jobs: queue.Queue = queue.Queue()
        self._start = time.perf_counter()

    def now(self) -> float:
        """Seconds since the driver was made."""
        return time.perf_counter() - self._start

    def signal(self) -> threading.Event:
        """A new done signal."""
        return threading.Event()

    def fire(self, signal: threading.Event) -> None:
        """Fire ``signal``."""
        signal.set()

    def submit(self, job: Any) -> None:
        """Queue a job for the compile stream."""
        self._jobs.put(job)

    def start_stream(self, steps: Steps) -> None:
        """Run the compile stream on its own daemon thread."""

        def body() -> None:
            with self.lock:
                self.run(steps)

        threading.Thread(target=body, name="compile-stream", daemon=True).start()

    def run(self, steps: Steps) -> None:
        """Carry out ``steps`` in the calling thread, which holds :attr:`lock` except while it waits."""
        value = None
        while True:
            try:
                step = steps.send(value)
            except StopIteration:
                return
            value = None
            self.lock.release()
            try:
                if isinstance(step, Sleep):
                    if step.modelled:
                        time.sleep(step.seconds)
                elif isinstance(step, Wait):
                    step.signal.wait()
                else:
                    value = self._jobs.get()
            finally:
                self.lock.acquire()
