"""Hot-path buffering on the worker: ops of a hot path run as one compiled batch on a compile stream.

The worker's main loop takes commands in arrival order. Once a hot path is known (per phase: forward and
backward ops are detected apart), the ops of a new instance go to the compile stream instead of running: the
stream traces each op (capturing the input arrays that exist at that moment; inputs a pending batch has still
to produce are looked up when the batch runs), compiles the batch once the instance is complete (a signature
compiled before is cached), runs it and stores its outputs at the end. Meanwhile the main loop keeps taking
commands. That is where the three races come from:

- (A) an eager op reads an output of a batch the stream is still tracing (the forward buffer still filling);
- (B) a batch runs while an input it looks up at run time was freed or never materialised (its producing
  batch skipped an output the client had already freed);
- (C) an eager op reads an output of a batch that is compiling or running (not yet stored).

The buffer policy (:mod:`simdist.runtime.policies`) decides how commands that touch pending tensors are
handled; the worker asks it and carries out the answer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from simdist.runtime.commands import Command, Fetch, Free, Op, Put, Response
from simdist.runtime.errors import BufferPolicyError
from simdist.runtime.hotpath import OpRecord, PathMatcher, SegmentDetector, signature
from simdist.runtime.policies import BufferPolicy, FreePlacement, OpPlacement, buffer_policy
from simdist.runtime.steps import NextJob, Sleep, Steps, Wait
from simdist.runtime.worker import Worker


@dataclass(frozen=True)
class StreamTimes:
    """Simulated seconds the compile stream spends: per traced op, per compile (new / cached signature),
    and the share of the eager time a compiled batch takes."""

    trace_per_op: float = 3e-6
    compile_base: float = 150e-6
    compile_per_op: float = 10e-6
    cached_compile: float = 10e-6
    batch_speedup: float = 0.4


@dataclass
class Batch:
    """One buffered instance of a hot path (or the ops a policy appended to it)."""

    index: int
    phase: str
    ops: list[Op] = field(default_factory=list)
    #: input arrays captured when each op was traced: tid -> array (the others are looked up at run time)
    captured: dict[int, Any] = field(default_factory=dict)
    #: every tensor id its ops read
    reads: set[int] = field(default_factory=set)
    #: outputs of its ops that have run, until the batch stores them: tid -> array
    local: dict[int, Any] = field(default_factory=dict)
    #: "filling" (tracing), "compiling", "running", "done"
    state: str = "filling"
    complete: bool = False
    done: Any = None  # the driver's done signal

    def produces(self) -> set[int]:
        """Every tensor id its ops write."""
        return {t for op in self.ops for t in op.outputs}

    def external_inputs(self) -> list[int]:
        """Inputs its ops read that no op of the batch produces, in order."""
        made, out = set(), []
        for op in self.ops:
            out += [t for t in op.inputs if t not in made and t not in out]
            made.update(op.outputs)
        return out


class BufferingWorker(Worker):
    """A worker that detects hot paths and runs their instances as compiled batches on a compile stream.

    ``policy`` is a :class:`~simdist.runtime.policies.BufferPolicy` or the name of one in
    :data:`~simdist.runtime.policies.POLICIES`.
    """

    def __init__(
        self,
        policy: str | BufferPolicy = "fallback",
        *,
        times: StreamTimes | None = None,
        window: int = 512,
        threshold: int = 2,
        min_length: int = 4,
        max_length: int = 128,
    ) -> None:
        super().__init__()
        self.policy = buffer_policy(policy)
        self.times = times or StreamTimes()
        self._detector = SegmentDetector(window, threshold, min_length, max_length)
        self._matchers = {p: PathMatcher() for p in ("forward", "backward")}
        self._segment_start = True  # the next op begins a phase segment (an instance may start only there)
        self._current: dict[str, Batch | None] = {"forward": None, "backward": None}
        self.pending: dict[int, Batch] = {}  # output tid -> the batch that will store it
        self.dead: set[int] = set()  # freed before their batch stored them
        self._deferred: dict[int, list[int]] = {}  # batch index -> frees waiting for it
        self._free_after: dict[int, int] = {}  # tid -> how many batches its free still waits for
        self._compiled: set[tuple] = set()
        self._phase = "forward"
        self._batches = 0
        self.driver: Any = None
        #: (kind, command text, simulated time) of every failure, kind "A", "B", "C" or "other"
        self.failures_by_kind: list[tuple[str, str, float]] = []
        #: (simulated time, what the worker did): batches, eager ops, frees, failures, in order
        self.events: list[tuple[float, str]] = []

    def _event(self, what: str) -> None:
        self.events.append((self.driver.now(), what))

    # ------------------------------------------------------------------ the main loop
    def attach(self, driver: Any) -> None:
        """Run on ``driver`` (a :mod:`simdist.runtime.steps` driver): it carries out the steps and the stream."""
        self.driver = driver
        driver.start_stream(self._stream_loop())

    def process(self, cmd: Command, reply: Callable[[Response], None]) -> Steps:
        """Handle one arriving command: the steps it takes (see :mod:`simdist.runtime.steps`)."""
        if isinstance(cmd, Put):
            self.store[cmd.tid] = cmd.value
        elif isinstance(cmd, Fetch):
            yield from self._wait_for([cmd.tid])
            reply(self.run(cmd))
        elif isinstance(cmd, Free):
            yield from self._free(cmd.tid)
        else:
            yield from self._op(cmd)

    def _op(self, cmd: Op) -> Steps:
        phase = cmd.phase
        record = OpRecord(cmd.op, cmd.inputs, cmd.outputs, cmd.attrs)
        path = self._detector.observe(record, phase)
        if phase != self._phase:
            previous, self._phase = self._phase, phase
            if path is not None:
                self._matchers[previous].add(path)
            if self._current[previous] is not None:  # an instance never spans a phase change
                self._abandon(previous)
                self._matchers[previous].flush()
            self._segment_start = True
            if self.policy.drains_on_entering(phase):
                yield from self._drain()
        at_start, self._segment_start = self._segment_start, False
        matcher = self._matchers[phase]
        if self.policy.buffers(phase) and matcher.paths and (at_start or matcher.pending):
            match = matcher.feed(record)
            if match.kind in ("start", "continue", "complete"):
                self._append(phase, cmd)
                if match.kind == "complete":
                    self._flush(phase)
                return
            # The instance broke off: what was buffered runs eagerly on the stream; this op runs unbuffered.
            self._abandon(phase)
            matcher.flush()
        yield from self._unbuffered(cmd)

    def _unbuffered(self, cmd: Op) -> Steps:
        """An op outside any buffer: where and when it runs is the policy's choice."""
        current = self._current[cmd.phase]
        reads_filling = current is not None and any(self.pending.get(t) is current for t in cmd.inputs)
        reads_pending = any(t in self.pending for t in cmd.inputs)
        placement = self.policy.place_op(cmd, reads_pending=reads_pending, reads_filling=reads_filling)
        if placement is OpPlacement.ON_STREAM:
            self._serial(cmd)
            return
        if placement is OpPlacement.JOIN_FILLING:
            if not reads_filling:
                raise BufferPolicyError(
                    f"buffer policy {self.policy!r} placed {cmd.describe()} in the filling {cmd.phase} "
                    "buffer, but the op reads nothing that buffer produces; answer JOIN_FILLING only when "
                    "reads_filling is true"
                )
            self._append(cmd.phase, cmd)
            return
        if placement is OpPlacement.AFTER_INPUTS:
            yield from self._wait_for(cmd.inputs)
        elif placement is OpPlacement.AFTER_DRAIN:
            yield from self._drain()
        elif placement is not OpPlacement.EAGER:
            raise BufferPolicyError(
                f"buffer policy {self.policy!r} answered {placement!r} for {cmd.describe()}; place_op must "
                "return an OpPlacement"
            )
        yield from self._eager(cmd)

    def _eager(self, cmd: Op) -> Steps:
        yield Sleep(self.seconds(cmd))
        self._classify_and_run(cmd)

    def _classify_and_run(self, cmd: Op) -> None:
        missing = self.missing_inputs(cmd)
        if missing:
            batch = self.pending.get(missing[0])
            if batch is None:
                kind = "other"
            else:
                kind = "A" if batch.state == "filling" else "C"
            self.failures_by_kind.append((kind, cmd.describe(), self.driver.now()))
            self._event(f"FAILED ({kind}) eager {cmd.describe()}: t{missing[0]} not in the store")
        else:
            self._event(f"eager {cmd.describe()}")
        self.run_eager(cmd)

    def _free(self, tid: int) -> Steps:
        # Only batches that will look ``tid`` up when they run care: captured arrays are the batch's own, and a
        # pending producer just skips storing it (its own readers use the batch-local value).
        holders = [
            b for b in self._open_batches() if tid in b.reads and tid not in b.captured and tid not in b.produces()
        ]
        placement = self.policy.place_free(read_by_pending=bool(holders), phase=self._phase)
        if placement is FreePlacement.AFTER_READERS and holders:
            # applied once the last batch that reads it has run, whichever order they finish in
            self._free_after[tid] = len(holders)
            for b in holders:
                self._deferred.setdefault(b.index, []).append(tid)
            return
        if placement is FreePlacement.ON_STREAM:
            self.driver.submit(("free", tid))
            return
        if placement is FreePlacement.AFTER_DRAIN:
            yield from self._drain()
        elif placement not in (FreePlacement.NOW, FreePlacement.AFTER_READERS):
            raise BufferPolicyError(
                f"buffer policy {self.policy!r} answered {placement!r} for the free of t{tid}; place_free must "
                "return a FreePlacement"
            )
        self._apply_free(tid)

    def _apply_free(self, tid: int) -> None:
        self._event(f"free t{tid}" + (" (pending: will not be stored)" if tid in self.pending else ""))
        self.store.pop(tid, None)
        if tid in self.pending:
            self.dead.add(tid)  # the batch will not materialise it

    def _wait_for(self, tids: Any) -> Steps:
        for batch in {id(b): b for t in tids if (b := self.pending.get(t)) is not None}.values():
            if not batch.complete:
                self._abandon_or_flush(batch.phase)
            yield Wait(batch.done)

    def _drain(self) -> Steps:
        for phase in ("forward", "backward"):
            if self._current[phase] is not None:
                self._abandon_or_flush(phase)
        for batch in list(self._open_batches()):
            yield Wait(batch.done)

    def _open_batches(self) -> list[Batch]:
        return list({id(b): b for b in self.pending.values()}.values())

    # ------------------------------------------------------------------ buffers
    def _append(self, phase: str, cmd: Op) -> None:
        batch = self._current[phase]
        if batch is None:
            batch = self._current[phase] = Batch(self._batches, phase, done=self.driver.signal())
            self._batches += 1
        self._register(batch, cmd)
        self.driver.submit(("trace", batch, cmd))

    def _serial(self, cmd: Op) -> None:
        """Queue ``cmd`` on the stream as a batch of its own, run eagerly there in order."""
        batch = Batch(self._batches, cmd.phase, done=self.driver.signal(), complete=True)
        self._batches += 1
        self._register(batch, cmd)
        self.driver.submit(("serial", batch))

    def _register(self, batch: Batch, cmd: Op) -> None:
        batch.ops.append(cmd)
        batch.reads.update(cmd.inputs)
        for t in cmd.outputs:
            self.pending[t] = batch

    def _flush(self, phase: str) -> None:
        batch = self._current[phase]
        if batch is None:
            return
        self._event(f"batch {batch.index} ({phase}) complete: flushed to the compile stream")
        self._current[phase] = None
        batch.complete = True
        self.driver.submit(("run", batch))

    def _abandon(self, phase: str) -> None:
        batch = self._current[phase]
        if batch is not None:
            self._current[phase] = None
            batch.complete = True
            self.driver.submit(("eager", batch))

    def _abandon_or_flush(self, phase: str) -> None:
        matcher = self._matchers[phase]
        if matcher.pending:
            self._abandon(phase)
            matcher.flush()
        else:
            self._flush(phase)

    # ------------------------------------------------------------------ the compile stream
    def _stream_loop(self) -> Steps:
        while True:
            job = yield NextJob()
            kind = job[0]
            if kind == "trace":
                _, batch, cmd = job
                yield Sleep(self.times.trace_per_op, modelled=True)
                # Tracing holds on to the input arrays that exist now; the others are looked up when it runs.
                for t in cmd.inputs:
                    if t in self.store and t not in batch.captured:
                        batch.captured[t] = self.store[t]
            elif kind == "run":
                yield from self._run_batch(job[1])
            elif kind == "eager":
                batch = job[1]
                self.stats.fallbacks["instance broke off"] = self.stats.fallbacks.get("instance broke off", 0) + 1
                for cmd in batch.ops:
                    yield Sleep(self.seconds(cmd))
                    self._run_captured(batch, cmd, eager=True)
                self._finish(batch)
            elif kind == "serial":
                batch = job[1]
                batch.state = "running"
                for cmd in batch.ops:
                    yield Sleep(self.seconds(cmd))
                    self._run_captured(batch, cmd, eager=True)
                self._finish(batch)
            else:  # "free"
                self._apply_free(job[1])

    def _run_batch(self, batch: Batch) -> Steps:
        times = self.times
        batch.state = "compiling"
        self._event(f"batch {batch.index} ({batch.phase}, {len(batch.ops)} ops) compiling")
        sig = signature([OpRecord(c.op, c.inputs, c.outputs, c.attrs) for c in batch.ops])
        if sig in self._compiled:
            yield Sleep(times.cached_compile, modelled=True)
        else:
            yield Sleep(times.compile_base + times.compile_per_op * len(batch.ops), modelled=True)
            self._compiled.add(sig)
        batch.state = "running"
        self._event(f"batch {batch.index} running")
        missing = [t for t in batch.external_inputs() if t not in batch.captured and t not in self.store]
        if missing:
            # The input-availability check failed: run the ops one by one instead (the compilation is lost).
            self.stats.fallbacks["inputs missing at run"] = self.stats.fallbacks.get("inputs missing at run", 0) + 1
            for cmd in batch.ops:
                yield Sleep(self.seconds(cmd))
                self._run_captured(batch, cmd, eager=True)
        else:
            yield Sleep(times.batch_speedup * sum(self.seconds(c) for c in batch.ops))
            for cmd in batch.ops:
                self._run_captured(batch, cmd, eager=False)
        self._finish(batch)

    def _run_captured(self, batch: Batch, cmd: Op, eager: bool) -> None:
        """Run ``cmd`` of ``batch`` on captured arrays, batch-local results and the store."""
        local = batch.local
        values = []
        for t in cmd.inputs:
            value = local.get(t, batch.captured.get(t, self.store.get(t)))
            if value is None:
                self.failures_by_kind.append(("B", cmd.describe(), self.driver.now()))
                self._event(f"FAILED (B) batch {batch.index} {cmd.describe()}: t{t} was freed or never stored")
                self._fail_missing(cmd, t)
                return
            values.append(value)
        results = self._numpy.execute(cmd.op, tuple(values), dict(cmd.attrs), cmd.metas)
        local.update(zip(cmd.outputs, results))
        self.stats.ops_total += 1
        if eager:
            self.stats.ops_eager += 1
        else:
            self.stats.ops_compiled += 1

    def _fail_missing(self, cmd: Op, tid: int) -> None:
        self._fail(cmd.seq, "input not found", f"Input tensor not found: t{tid}", cmd.describe())

    def _finish(self, batch: Batch) -> None:
        local, batch.local = batch.local, {}
        for cmd in batch.ops:
            for t in cmd.outputs:
                if t in self.dead:
                    self.store.pop(t, None)  # freed before it was stored: never materialised
                    self.dead.discard(t)
                elif t in local:
                    self.store[t] = local[t]
                if self.pending.get(t) is batch:
                    del self.pending[t]
        batch.state = "done"
        self._event(f"batch {batch.index} done, outputs stored")
        batch.captured = {}
        for tid in self._deferred.pop(batch.index, []):
            self._free_after[tid] -= 1
            if not self._free_after[tid]:
                del self._free_after[tid]
                self._apply_free(tid)
        self.driver.fire(batch.done)
