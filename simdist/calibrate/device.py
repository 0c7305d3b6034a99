"""Fit a device model's compute figures to a torch profiler trace (Kineto JSON) of one rank's step.

Every op the trace timed is rebuilt on meta tensors (``calls``) and priced by simdist's own cost model
(``simdist.compute.op_cost``: max(FLOPs / rate, bytes / bandwidth) + launch overhead, matmuls through the
device's GEMM shape model where it has one), so the fit adjusts exactly the figures a run uses:

1. the launch overhead ``L`` and memory bandwidth ``B`` from the ops without FLOPs (elementwise, copies,
   reductions): ``t = L + bytes / B``, least squares on relative errors (each op weighs the same);
2. each dtype's matmul rate (the GEMM model's scale) from the ops with FLOPs of that dtype, ``L`` and ``B``
   held: the rate minimising the squared log errors (a golden-section search: the GEMM model is not linear);
3. on a GPU trace, the host's launch time per kernel: the median host time of the ops that launched kernels.

A CPU trace (``ProfilerActivity.CPU`` only) fits the CPU the same way, each op's time being its ``cpu_op`` span.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from simdist.calibrate.calls import Call, rebuild
from simdist.calibrate.samples import CalibrationError
from simdist.calibrate.search import golden, log_loss
from simdist.compute import op_cost, op_flops
from simdist.compute.devices import DeviceSpec, get_device
from simdist.compute.fusion import is_pointwise
from simdist.compute.profile import KinetoTrace, parse_trace
from simdist.errors import ProfileError

#: fewest priced ops a fit needs, and fewest of them without FLOPs (latency and bandwidth need sizes to tell apart)
MIN_OPS = 10
MIN_MEMORY_OPS = 5
#: the largest memory-bound op must move at least this many times the smallest's bytes
MIN_BYTES_SPAN = 16.0
#: figures no device has: a fit beyond them means the trace's times are not Kineto's microseconds. The fastest
#: memory of 2026 (HBM3e, 8 TB/s) is well inside 20 TB/s, and no memory, nor a CPU core, is slower than the floors
MAX_BANDWIDTH = 2e13  # bytes/s
MIN_BANDWIDTH = 1e8
MAX_FLOPS = 1e17  # FLOP/s
MIN_FLOPS = 1e8
MAX_LAUNCH = 0.01  # seconds
#: the op kinds the residuals are reported by, in order
KINDS = ("matmul", "other FLOPs", "elementwise", "other memory-bound")


@dataclass(frozen=True)
class PricedOp:
    """One profiled op beside the fitted model's time for it."""

    name: str
    kind: str
    dtype: torch.dtype | None
    flops: float
    nbytes: float
    measured: float
    predicted: float

    @property
    def error(self) -> float:
        """(predicted - measured) / measured."""
        return self.predicted / self.measured - 1.0


@dataclass(frozen=True)
class DeviceFit:
    """The fitted device, how it prices each profiled op, and the ops it could not use."""

    device: DeviceSpec
    trace: str
    #: "gpu" (kernel times) or "cpu" (op times)
    kind: str
    ops: tuple[PricedOp, ...]
    #: op name -> how many of its events could not be rebuilt or timed
    unused: dict[str, int]
    #: dtypes whose rate was fitted (the others keep the base device's)
    fitted_dtypes: tuple[torch.dtype, ...]

    def kinds(self) -> list[tuple[str, int, float, float, float, float]]:
        """(kind, ops, median |error|, max |error|, measured seconds, predicted seconds) per op kind present."""
        out = []
        for kind in KINDS:
            ops = [o for o in self.ops if o.kind == kind]
            if ops:
                errs = [abs(o.error) for o in ops]
                out.append((kind, len(ops), statistics.median(errs), max(errs),
                            sum(o.measured for o in ops), sum(o.predicted for o in ops)))  # fmt: skip
        return out

    def report(self) -> str:
        """The fitted figures and the residuals per op kind, as ``simdist calibrate --compute`` prints them."""
        d = self.device
        rates = ", ".join(
            f"{str(t).removeprefix('torch.')} {d.peak_flops[t] / 1e12:.4g} TFLOP/s"
            for t in self.fitted_dtypes
        )
        lines = [
            (
                f"fitted device {d.name!r} from {self.trace} ({self.kind} trace, {len(self.ops)} ops priced, "
                f"{sum(self.unused.values())} not usable):"
            ),
            f"  memory bandwidth {d.memory_bandwidth / 1e9:.4g} GB/s, launch overhead {d.launch_overhead * 1e6:.3g} us"
            + (f", host launch {d.host_overhead * 1e6:.3g} us per kernel" if self.kind == "gpu" else ""),
            f"  matmul rates: {rates or 'none fitted (no op with FLOPs): the base device figures'}",
            "residuals (predicted vs measured) per op kind:",
            f"  {'kind':<19} {'ops':>5} {'median':>8} {'max':>8} {'measured':>11} {'predicted':>11}",
        ]
        for kind, count, med, worst, measured, predicted in self.kinds():
            lines.append(f"  {kind:<19} {count:>5} {med:>8.1%} {worst:>8.1%} "
                         f"{measured * 1e3:>9.3f}ms {predicted * 1e3:>9.3f}ms")  # fmt: skip
        errs = [abs(o.error) for o in self.ops]
        measured, predicted = sum(o.measured for o in self.ops), sum(o.predicted for o in self.ops)
        lines.append(f"  {'all':<19} {len(errs):>5} {statistics.median(errs):>8.1%} {max(errs):>8.1%} "
                     f"{measured * 1e3:>9.3f}ms {predicted * 1e3:>9.3f}ms")  # fmt: skip
        if self.unused:
            top = sorted(self.unused.items(), key=lambda kv: (-kv[1], kv[0]))[:6]
            lines.append("not usable (not rebuilt from the trace, or no time): "
                         + ", ".join(f"{n} x{c}" for n, c in top))  # fmt: skip
        return "\n".join(lines)


@dataclass(frozen=True)
class _Op:
    """A profiled op ready to price: its rebuilt call, measured seconds and what kind it is."""

    name: str
    call: Call
    measured: float
    host: float
    flops: float
    dtype: torch.dtype | None
    nbytes: float
    kind: str


def _kind(call: Call, flops: float) -> str:
    if flops > 0:
        return "matmul" if "mm" in call.func._schema.name else "other FLOPs"
    return "elementwise" if is_pointwise(call.func) else "other memory-bound"


def _usable(trace: KinetoTrace) -> tuple[list[_Op], dict[str, int]]:
    """The trace's ops the cost model can price, and per op name how many it cannot."""
    probe = DeviceSpec("probe", {torch.float32: 1.0}, 1.0, launch_overhead=0.0)
    bytes_probe = DeviceSpec("bytes", {torch.float32: math.inf}, 1.0, launch_overhead=0.0)
    ops, unused = [], {}
    for op in trace.ops:
        call = rebuild(op.name, op.args) if op.seconds > 0 else None
        # an op the model prices at 0 on any device (a view, an allocation) runs no kernel: nothing to fit
        if call is None or op_cost(call.func, call.args, call.kwargs, call.out, probe) <= 0:
            unused[op.name] = unused.get(op.name, 0) + 1
            continue
        flops = op_flops(call.func, call.args, call.kwargs, call.out)
        dtype = next((a.dtype for a in call.args if isinstance(a, torch.Tensor)), None) if flops > 0 else None
        # the bytes the cost model counts (a gather reads only the rows it takes): its time on 1 byte/s
        moved = op_cost(call.func, call.args, call.kwargs, call.out, bytes_probe)
        ops.append(_Op(op.name, call, op.seconds, op.host, flops, dtype, moved, _kind(call, flops)))
    return ops, unused


def _price(ops: Sequence[_Op], device: DeviceSpec) -> np.ndarray:
    return np.array([op_cost(o.call.func, o.call.args, o.call.kwargs, o.call.out, device) for o in ops])


def _fit_memory(ops: Sequence[_Op], measured: np.ndarray, weight: np.ndarray) -> tuple[float, float]:
    """(launch seconds, bytes/s) of ``t = L + bytes / B`` minimising :func:`~simdist.calibrate.search.log_loss`."""
    moved = np.array([o.nbytes for o in ops])

    def best_bandwidth(launch: float) -> tuple[float, float]:
        def loss(log_bw: float) -> float:
            return log_loss(launch + moved / math.exp(log_bw), measured, weight)

        log_bw = golden(loss, math.log(1e3), math.log(MAX_BANDWIDTH * 10))
        return loss(log_bw), math.exp(log_bw)

    # the launch overhead lies between none and the fastest op's time; searched on a square-root scale, where
    # microsecond overheads of millisecond-long ops are resolved as finely as those of microsecond-long ones
    root = golden(lambda r: best_bandwidth(r * r)[0], 0.0, math.sqrt(float(measured.min())), tol=1e-6)
    return root * root, best_bandwidth(root * root)[1]


def _fit_rate(
    ops: Sequence[_Op], measured: np.ndarray, weight: np.ndarray, device: DeviceSpec, dtype: torch.dtype
) -> float:
    """The FLOP/s of ``dtype`` minimising :func:`~simdist.calibrate.search.log_loss` of ``ops`` on ``device`` (golden section in log)."""

    def loss(log_rate: float) -> float:
        rate = math.exp(log_rate)
        trial = dataclasses.replace(device, peak_flops={**device.peak_flops, dtype: rate}, tf32_flops=None)
        return log_loss(_price(ops, trial), measured, weight)

    return math.exp(golden(loss, math.log(1e6), math.log(MAX_FLOPS * 10)))


def _signature(a: object) -> object:
    """What tells two calls of an op apart: each tensor's shape and dtype, each other value itself."""
    if isinstance(a, torch.Tensor):
        return tuple(a.shape), a.dtype
    if isinstance(a, (list, tuple)):
        return tuple(_signature(x) for x in a)
    return repr(a)


def _distinct(ops: Sequence[_Op]) -> tuple[list[_Op], np.ndarray, np.ndarray]:
    """One row per distinct call (name and shapes): the call, its fastest time (a loaded machine only ever adds
    time, to single calls), and how many times it ran."""
    groups: dict[tuple[str, tuple], list[_Op]] = {}
    for o in ops:
        key = (o.name, tuple(_signature(a) for a in (*o.call.args, *o.call.kwargs.values())))
        groups.setdefault(key, []).append(o)
    rows = [g[0] for g in groups.values()]
    fastest = np.array([statistics.median(o.measured for o in g) for g in groups.values()])
    return rows, fastest, np.array([float(len(g)) for g in groups.values()])


def _fit(ops: Sequence[_Op], device: DeviceSpec, dtypes: Sequence[torch.dtype], by_time: bool) -> DeviceSpec:
    """``device`` with the launch overhead, bandwidth and ``dtypes``' rates fitted to ``ops``; ``by_time``: each
    distinct call weighs its count times ``device``'s time for it (what it adds to a step), else its count."""
    rows, measured, count = _distinct(ops)
    weight = count * (_price(rows, device) if by_time else 1.0)
    memory = np.array([o.flops == 0 for o in rows])
    launch, bandwidth = _fit_memory([o for o, m in zip(rows, memory) if m], measured[memory], weight[memory])
    device = dataclasses.replace(device, memory_bandwidth=bandwidth, launch_overhead=launch)
    for dtype in dtypes:
        mask = np.array([o.dtype == dtype for o in rows])
        rate = _fit_rate([o for o, m in zip(rows, mask) if m], measured[mask], weight[mask], device, dtype)
        device = dataclasses.replace(device, peak_flops={**device.peak_flops, dtype: rate})
    return device


def fit_device(trace: str | Path | KinetoTrace, base: str | DeviceSpec | None = None) -> DeviceFit:
    """The device whose figures best explain the op times of ``trace`` (a path or a parsed trace).

    ``base`` gives the figures a trace cannot (memory capacity, the GEMM shape model's tiles, the CUDA name, rates
    of dtypes the trace does not use); by default the device the trace's GPU name matches, or none for a CPU trace.
    """
    if not isinstance(trace, KinetoTrace):
        try:
            trace = parse_trace(trace)
        except ProfileError as exc:
            raise CalibrationError(str(exc)) from None
    where = trace.path
    spec = get_device(base) if isinstance(base, str) else base
    if spec is None and trace.kind == "gpu":
        raise CalibrationError(
            f"{where}: a GPU trace ({trace.gpu or 'its GPU unnamed'}) is fitted onto a base device, which gives what a "
            f"trace cannot (memory capacity, SMs, the GEMM tiles): name one (--device A100)"
        )
    ops, unused = _usable(trace)
    memory = [o for o in ops if o.flops == 0]
    sizes = [o.nbytes for o in memory if o.nbytes > 0]
    if (
        len(ops) < MIN_OPS
        or len(memory) < MIN_MEMORY_OPS
        or not sizes
        or max(sizes) < MIN_BYTES_SPAN * min(sizes)
    ):
        raise CalibrationError(
            f"{where}: too few usable kernels: {len(ops)} ops priced ({len(memory)} without FLOPs"
            + (f", moving {min(sizes):.0f} to {max(sizes):.0f} bytes" if sizes else "")
            + f"), {sum(unused.values())} not usable; a fit needs at least {MIN_OPS} ops, {MIN_MEMORY_OPS} of them "
            f"memory-bound (elementwise, copies) over sizes {MIN_BYTES_SPAN:g}x apart: profile a whole training step "
            f"with record_shapes=True"
        )
    name = spec.name if spec is not None else "cpu-fitted"
    source = f"fitted by simdist calibrate to {where} ({len(ops)} ops)"
    dtypes = sorted({o.dtype for o in ops if o.flops > 0 and o.dtype is not None}, key=str)
    peaks = dict(spec.peak_flops) if spec is not None else {}
    # float32 is every other dtype's fallback: fitted, or below the most used fitted rate's stand-in
    peaks.setdefault(torch.float32, 1e12)
    start = (
        dataclasses.replace(spec, source=source, peak_flops=peaks)
        if spec is not None
        else DeviceSpec(name, peaks, 1e10, source=source, host_link_bandwidth=math.inf, multiprocessors=1)
    )
    # first each call weighs the same; then as much as its time adds to the step, so the bandwidth and rates
    # are those of the calls that take the time (a GPU's small kernels reach a fraction of its bandwidth)
    device = _fit(ops, _fit(ops, start, dtypes, by_time=False), dtypes, by_time=True)
    if spec is None and dtypes and torch.float32 not in dtypes:
        common = max(dtypes, key=lambda d: sum(o.dtype == d for o in ops))
        device = dataclasses.replace(
            device, peak_flops={**device.peak_flops, torch.float32: device.peak_flops[common]}
        )
    if trace.kind == "gpu":
        device = dataclasses.replace(device, host_overhead=statistics.median(o.host for o in ops))
    _check_units(device, dtypes, where)
    device = _rounded(device)
    return DeviceFit(device, where, trace.kind, _priced(ops, device), unused, tuple(dtypes))


def _priced(ops: Sequence[_Op], device: DeviceSpec) -> tuple[PricedOp, ...]:
    return tuple(
        PricedOp(o.name, o.kind, o.dtype, o.flops, o.nbytes, o.measured, float(p))
        for o, p in zip(ops, _price(ops, device))
    )


def predict(trace: KinetoTrace, device: DeviceSpec) -> tuple[PricedOp, ...]:
    """Each usable op of ``trace`` beside ``device``'s time for it: a fitted device checked on ops it never saw."""
    return _priced(_usable(trace)[0], device)


def _round(x: float) -> float:
    """``x`` to four significant digits: what a fit of noisy times resolves, and what a cluster file shows."""
    return float(f"{x:.4g}")


def _rounded(device: DeviceSpec) -> DeviceSpec:
    """``device`` with its fitted figures rounded (:func:`_round`)."""
    return dataclasses.replace(
        device,
        peak_flops={d: _round(f) for d, f in device.peak_flops.items()},
        memory_bandwidth=_round(device.memory_bandwidth),
        launch_overhead=_round(device.launch_overhead),
        host_overhead=_round(device.host_overhead),
    )


def _check_units(device: DeviceSpec, dtypes: Sequence[torch.dtype], where: str) -> None:
    """Refuse figures no device has: the trace's durations are not in microseconds (Kineto's unit)."""
    wrong = []
    if device.memory_bandwidth > MAX_BANDWIDTH:
        wrong.append(
            f"memory bandwidth {device.memory_bandwidth / 1e12:.3g} TB/s (> {MAX_BANDWIDTH / 1e12:g})"
        )
    if device.memory_bandwidth < MIN_BANDWIDTH:
        wrong.append(f"memory bandwidth {device.memory_bandwidth / 1e6:.3g} MB/s (< {MIN_BANDWIDTH / 1e6:g})")
    if device.launch_overhead > MAX_LAUNCH:
        wrong.append(f"launch overhead {device.launch_overhead * 1e3:.3g} ms per op (> {MAX_LAUNCH * 1e3:g})")
    wrong += [
        f"{str(d).removeprefix('torch.')} {device.peak_flops[d] / 1e15:.3g} PFLOP/s (> {MAX_FLOPS / 1e15:g})"
        for d in dtypes
        if device.peak_flops[d] >= MAX_FLOPS
    ]
    wrong += [
        f"{str(d).removeprefix('torch.')} {device.peak_flops[d] / 1e6:.3g} MFLOP/s (< {MIN_FLOPS / 1e6:g})"
        for d in dtypes
        if device.peak_flops[d] < MIN_FLOPS
    ]
    if wrong:
        raise CalibrationError(
            f"{where}: the fit gives {'; '.join(wrong)}, which no device reaches: the trace's durations are not in "
            f"microseconds as Kineto writes them (converted to another unit, or edited?)"
        )
