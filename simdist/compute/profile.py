"""Profile replay: measured op durations from a torch profiler trace (Kineto JSON) charged in place of the model.

A trace is read into the ops a run's cost mode sees, each with its name, the shapes of its tensor inputs and its
measured duration (seconds). What the mode sees is the op below autograd: an op whose kernel is composite
(``aten::linear``, ``aten::matmul``) decomposes before it reaches the mode, so its children are the ops; any
other op hides its children (``aten::addmm``'s own ``aten::empty``), which are part of its time.

- A **GPU trace** (``ProfilerActivity.CUDA``) times an op by the device kernels (and copies, memsets) it launched:
  a kernel links to its runtime call by ``correlation`` (or to its op by ``External id``), and a hidden child's
  kernels count for the op above it. An op that launched none took no device time.
- A **CPU trace** (``ProfilerActivity.CPU`` only) times an op by its ``cpu_op`` event, children included.
"""

from __future__ import annotations

import gzip
import json
import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from simdist.compute.devices import DEVICES, DeviceSpec
from simdist.errors import ProfileError

#: an op's key: its name and the shapes of its tensor inputs with at least one dimension, in argument order (a
#: tensor list is a tuple of shapes). 0-dim tensors are left out on both sides: a Python number passed to an op
#: reaches the mode as a 0-dim tensor, while the profiler records it as a scalar.
OpKey = tuple[str, tuple[Any, ...]]

#: Kineto categories of device activity that occupies the GPU's stream
_DEVICE_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
#: ``Input type`` entries of arguments that are not tensors (scalars, lists of numbers, None, other values)
_NOT_TENSOR_TYPES = frozenset(
    {"", "Scalar", "ScalarList", "GenericList", "None", "String", "Device", "Layout"}
)


@dataclass(frozen=True)
class ProfiledOp:
    """One op of a trace as the cost mode sees it: name, input shapes, measured seconds, start (trace seconds),
    its host seconds and its recorded arguments."""

    name: str
    shapes: tuple[Any, ...]
    seconds: float
    start: float
    #: seconds the op took on the host (its ``cpu_op`` event, children included): its dispatch and launches
    host: float = 0.0
    #: the op event's ``args`` as recorded (``Input type``, ``Input Dims``, ``Input Strides``, ``Concrete Inputs``)
    args: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)

    @property
    def key(self) -> OpKey:
        """What a run's op is matched by (with its occurrence)."""
        return self.name, self.shapes


@dataclass(frozen=True)
class KinetoTrace:
    """A Kineto trace read by :func:`parse_trace`: ``"gpu"`` or ``"cpu"``, the GPU's name, the ops in time order."""

    path: str
    kind: str
    gpu: str | None
    ops: tuple[ProfiledOp, ...]


def parse_trace(path: str | Path) -> KinetoTrace:
    """Read a torch profiler trace (``export_chrome_trace``'s Kineto JSON) into the ops a cost mode sees.

    Raises :class:`ProfileError` for a file that is not a Kineto trace, holds no ops, or was recorded without
    ``record_shapes=True``.
    """
    where = str(path)
    try:
        # torch's tensorboard_trace_handler(use_gzip=True) and many published traces are gzipped JSON
        opener = gzip.open if where.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise ProfileError(f"cannot read the profiler trace {where}: {e.strerror or e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError, EOFError) as e:
        raise ProfileError(
            f"{where} is not JSON ({e}); a profile is the file torch.profiler.profile(...).export_chrome_trace writes"
        ) from None
    events = data.get("traceEvents") if isinstance(data, dict) else None
    if not isinstance(events, list):
        raise ProfileError(
            f"{where} is not a Kineto trace: it has no 'traceEvents' list; a profile is the file "
            "torch.profiler.profile(...).export_chrome_trace writes"
        )
    spans = _spans(events, where)
    ops = [e for e in spans if e.get("cat") == "cpu_op"]
    if not ops:
        raise ProfileError(
            f"{where} holds no op ('cpu_op' events): record the program's step inside torch.profiler.profile(...) with "
            "ProfilerActivity.CPU among its activities"
        )
    if not any("Input Dims" in e["args"] for e in ops):
        raise ProfileError(
            f"{where} was recorded without input shapes, which replay matches ops by: profile with "
            "torch.profiler.profile(..., record_shapes=True)"
        )
    device = [e for e in spans if e.get("cat") in _DEVICE_CATEGORIES]
    visible = _visible_ops(ops)
    if device:
        seconds = _device_seconds(ops, visible, device, spans)
        kind = "gpu"
    else:
        seconds = {id(e): e["dur"] * 1e-6 for e in visible}
        kind = "cpu"
    found = tuple(
        ProfiledOp(
            e["name"], _trace_shapes(e["args"]), seconds[id(e)], e["ts"] * 1e-6, e["dur"] * 1e-6, e["args"]
        )
        for e in sorted(visible, key=lambda e: (e["ts"], -e["dur"]))
    )
    return KinetoTrace(where, kind, _gpu_name(data) if kind == "gpu" else None, found)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _spans(events: list[Any], where: str) -> list[dict[str, Any]]:
    """The trace's complete events ("X") with a name, a start and a duration, each with an ``args`` dict.

    An op or device event whose duration is negative or not finite cannot be charged: it is refused, naming it.
    """
    out = []
    for i, e in enumerate(events):
        if not (isinstance(e, dict) and e.get("ph") == "X" and isinstance(e.get("name"), str)):
            continue
        ts, dur = e.get("ts"), e.get("dur")
        if not (_is_number(ts) and _is_number(dur) and math.isfinite(ts)):
            continue
        if not (math.isfinite(dur) and dur >= 0) and e.get("cat") in ("cpu_op", *_DEVICE_CATEGORIES):
            raise ProfileError(
                f"{where}: event {i} ({e['name']!r}) lasts {dur!r} us; an op's or a kernel's duration is a "
                "finite number of microseconds >= 0"
            )
        out.append({**e, "args": e["args"] if isinstance(e.get("args"), dict) else {}})
    return out


def _gpu_name(data: dict[str, Any]) -> str | None:
    props = data.get("deviceProperties")
    if isinstance(props, list):
        for p in props:
            if isinstance(p, dict) and isinstance(p.get("name"), str):
                return p["name"]
    return None


def _composite(name: str, cache: dict[str, bool]) -> bool:
    """Whether op ``name`` decomposes above the cost mode (CompositeImplicitAutograd); names
    that are not ops (autograd nodes, ``record_function`` labels, ``ProfilerStep#1``) are transparent too."""
    if name not in cache:
        cache[name] = _decomposes(name)
    return cache[name]


def _decomposes(name: str) -> bool:
    namespace, sep, op = name.partition("::")
    if not sep or not namespace.isidentifier() or not op.isidentifier():
        return True
    try:
        packet = getattr(getattr(torch.ops, namespace), op)
        overloads = packet.overloads()
    except (AttributeError, RuntimeError):
        return True
    # The trace does not name the overload: the default one decides where there is one (aten::linear decomposes,
    # aten::linear.out does not), else all of them. TorchScript-only overloads are not in the dispatcher.
    default = _has_composite(name) if "default" in overloads else None
    if default is not None:
        return default
    found = [c for c in (_has_composite(f"{name}.{o}") for o in overloads if o != "default") if c is not None]
    return bool(found) and all(found)


def _has_composite(qualified: str) -> bool | None:
    """Whether the dispatcher's op ``qualified`` (``aten::sum.dim_IntList``) decomposes; None if it has no such op."""
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "CompositeImplicitAutograd")
    except RuntimeError:
        return None


def _threads(ops: Iterable[dict[str, Any]]) -> dict[Any, list[dict[str, Any]]]:
    """The ops of each (pid, tid), outer before inner."""
    by: dict[Any, list[dict[str, Any]]] = {}
    for e in ops:
        by.setdefault((str(e.get("pid")), str(e.get("tid"))), []).append(e)
    for evs in by.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
    return by


def _nest(evs: Sequence[dict[str, Any]]) -> Iterable[tuple[dict[str, Any], list[dict[str, Any]]]]:
    """Each event of one thread with the events enclosing it, outermost first."""
    stack: list[dict[str, Any]] = []
    for e in evs:
        while stack and e["ts"] >= stack[-1]["ts"] + stack[-1]["dur"]:
            stack.pop()
        yield e, list(stack)
        stack.append(e)


def _visible_ops(ops: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ops the cost mode would see: those every enclosing op of which decomposes."""
    cache: dict[str, bool] = {}
    return [
        e
        for evs in _threads(ops).values()
        for e, outer in _nest(evs)
        if not _composite(e["name"], cache) and all(_composite(o["name"], cache) for o in outer)
    ]


def _device_seconds(
    ops: Sequence[dict[str, Any]],
    visible: Sequence[dict[str, Any]],
    device: Sequence[dict[str, Any]],
    events: list[dict[str, Any]],
) -> dict[int, float]:
    """Each visible op's device seconds: the kernels it and the ops it hides launched.

    A kernel's ``correlation`` names its runtime call (``cudaLaunchKernel``), which ran inside the op that launched
    it on that op's thread; this holds in every Kineto version. Where the runtime call is missing, the kernel's
    ``External id`` names the op (newer traces give kernel, runtime call and op the same External id; older ones
    gave the kernel its correlation there).
    """
    shown = {id(e) for e in visible}
    runtime = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    owner: dict[int, dict[str, Any]] = {}  # id(op or runtime event) -> the visible op it counts for
    launched: dict[Any, dict[str, Any]] = {}  # correlation -> the visible op its kernel counts for
    for evs in _threads([*ops, *runtime]).values():
        for e, outer in _nest(evs):
            top = next((o for o in outer if id(o) in shown), e if id(e) in shown else None)
            if top is None:
                continue
            owner[id(e)] = top
            corr = _link(e["args"].get("correlation"))
            if e.get("cat") != "cpu_op" and corr is not None:
                launched[corr] = top
    by_external: dict[Any, dict[str, Any]] = {}
    for e in ops:
        ext = _link(e["args"].get("External id"))
        if ext is not None:
            by_external.setdefault(ext, e)
    seconds = {id(e): 0.0 for e in visible}
    for k in device:
        args = k["args"]
        top = launched.get(_link(args.get("correlation")))
        if top is None:
            op = by_external.get(_link(args.get("External id")))
            top = owner.get(id(op)) if op is not None else None
        if top is not None:
            seconds[id(top)] += k["dur"] * 1e-6
    return seconds


def _trace_shapes(args: dict[str, Any]) -> tuple[Any, ...]:
    """An op event's tensor input shapes (see :data:`OpKey`)."""
    dims = args.get("Input Dims") or []
    types = args.get("Input type") or []
    shapes: list[Any] = []
    for i, d in enumerate(dims):
        kind = types[i] if i < len(types) else ""
        if kind in _NOT_TENSOR_TYPES or not isinstance(d, list):
            continue
        if kind == "TensorList":
            shapes.append(tuple(tuple(s) for s in d if _is_shape(s)))
        elif d and _is_shape(d):
            shapes.append(tuple(d))
    return tuple(shapes)


def _link(x: Any) -> int | str | None:
    """A correlation or External id, or None where the value is none (or not an id)."""
    return x if isinstance(x, (int, str)) and not isinstance(x, bool) else None


def _is_shape(d: Any) -> bool:
    return isinstance(d, list) and all(isinstance(n, int) and not isinstance(n, bool) for n in d)


def call_shapes(args: Sequence[Any], kwargs: dict[str, Any] | None) -> tuple[Any, ...]:
    """A dispatched call's tensor input shapes, as :func:`parse_trace` reads them from a trace (see :data:`OpKey`)."""
    shapes: list[Any] = []
    for a in (*args, *(kwargs.values() if kwargs else ())):
        if isinstance(a, torch.Tensor):
            if a.dim():
                shapes.append(tuple(a.shape))
        elif isinstance(a, (list, tuple)) and a and all(isinstance(t, torch.Tensor) for t in a):
            shapes.append(tuple(tuple(t.shape) for t in a))
    return tuple(shapes)


@dataclass
class ReplayStats:
    """How a run's ops met its profile, summed over ranks (ops the model prices at 0 s, views, are not counted)."""

    #: the trace replayed
    path: str
    #: ops charged a measured duration (the occurrence the profile holds, or the median where it holds fewer)
    matched: int = 0
    #: of ``matched``, those past the profile's occurrences of their op and shapes, charged its median
    reused: int = 0
    #: ops the profile does not hold, priced by the model
    unmatched: int = 0
    #: simulated seconds charged from the profile, and from the model for unmatched ops
    replayed_seconds: float = 0.0
    model_seconds: float = 0.0
    #: each unmatched op name with (how many, model seconds)
    unmatched_ops: dict[str, list[float]] = field(default_factory=dict)

    @property
    def unmatched_share(self) -> float:
        """The share of the run's compute time priced by the model, 0 to 1."""
        total = self.replayed_seconds + self.model_seconds
        return self.model_seconds / total if total > 0 else 0.0

    def summary(self) -> str:
        """One line: matched, reused and unmatched counts, the unmatched time share and the commonest unmatched ops."""
        text = (
            f"profile {self.path}: {self.matched} ops replayed ({self.reused} past the profile's occurrences, at their "
            f"median), {self.unmatched} priced by the model ({100 * self.unmatched_share:.1f}% of compute time)"
        )
        top = sorted(self.unmatched_ops.items(), key=lambda kv: (-kv[1][1], kv[0]))[:5]
        if top:
            text += ": " + ", ".join(f"{name} x{int(c)}" for name, (c, _) in top)
        return text


#: what a run installs in a rank's cost mode: (op name, args, kwargs, the model's seconds) -> seconds to charge
CostProvider = Callable[[str, Sequence[Any], "dict[str, Any] | None", float], float]


class Profile:
    """A measured profile to time a run's ops with: ``simdist.run(..., compute=simdist.profile("step.json"))``."""

    def __init__(self, path: str | Path) -> None:
        self.trace = parse_trace(path)
        durations: dict[OpKey, list[float]] = {}
        for op in self.trace.ops:
            durations.setdefault(op.key, []).append(op.seconds)
        #: each (op, shapes) key's measured seconds, in the order they ran
        self.durations: dict[OpKey, tuple[float, ...]] = {k: tuple(v) for k, v in durations.items()}
        self._median = {k: statistics.median(v) for k, v in durations.items()}

    def __repr__(self) -> str:
        return f"simdist.profile({self.trace.path!r})"

    def check_device(self, device: DeviceSpec) -> None:
        """Refuse a trace of another device than the cluster's: GPU kernels of another GPU, or the CPU's ops on a GPU."""
        t = self.trace
        if t.kind == "cpu" and device.is_gpu:
            raise ProfileError(
                f"{t.path} is a CPU trace (no GPU kernels in it) and the cluster's device is {device.name}: its times are "
                f"the CPU's; profile the program on a {device.name} with ProfilerActivity.CUDA, or replay it on a "
                "cluster with device='cpu'"
            )
        if t.kind == "gpu" and not device.is_gpu:
            raise ProfileError(
                f"{t.path} times GPU kernels ({t.gpu or 'an unnamed GPU'}) and the cluster's device is {device.name}: "
                "replay it on a cluster of that GPU"
            )
        if t.kind == "gpu" and t.gpu and not _same_gpu(t.gpu, device):
            raise ProfileError(
                f"{t.path} was recorded on {t.gpu!r} and the cluster's device is {device.name} "
                f"({device.cuda_device_name!r}): a profile times the GPU it ran on; replay it on a cluster of that "
                "GPU, or profile on this one"
            )

    def replay(self, device: DeviceSpec) -> ProfileReplay:
        """A run's use of this profile on ``device`` (checked to be the trace's)."""
        self.check_device(device)
        return ProfileReplay(self)


def _same_gpu(gpu: str, device: DeviceSpec) -> bool:
    """Whether the trace's GPU name (``NVIDIA H100 80GB HBM3``) is the device's: its CUDA name, or else a name that
    contains the device's (a PCIe H100 on ``H100``), unless it is another built-in device's CUDA name (an A100 40GB
    is not the 80GB ``A100``)."""
    g = gpu.strip().lower()
    if device.cuda_name and g == device.cuda_name.lower():
        return True
    if any(d.cuda_name and g == d.cuda_name.lower() for d in DEVICES.values()):
        return False
    return device.name.lower().removesuffix("-sxm") in g


class ProfileReplay:
    """One run's replay of a profile: each rank counts the occurrences of every (op, shapes) it ran."""

    def __init__(self, profile: Profile) -> None:
        self.profile = profile
        self.stats = ReplayStats(profile.trace.path)

    def provider(self) -> CostProvider:
        """The cost provider of one rank (its own occurrence counter; a rank's threads run one at a time)."""
        seen: dict[OpKey, int] = {}
        durations = self.profile.durations
        median = self.profile._median
        stats = self.stats

        def price(name: str, args: Sequence[Any], kwargs: dict[str, Any] | None, modeled: float) -> float:
            key = (name, call_shapes(args, kwargs))
            measured = durations.get(key)
            if measured is None:
                stats.unmatched += 1
                stats.model_seconds += modeled
                entry = stats.unmatched_ops.setdefault(name, [0, 0.0])
                entry[0] += 1
                entry[1] += modeled
                return modeled
            k = seen.get(key, 0)
            seen[key] = k + 1
            stats.matched += 1
            if k < len(measured):
                seconds = measured[k]
            else:
                stats.reused += 1
                seconds = median[key]
            stats.replayed_seconds += seconds
            return seconds

        return price


def profile(path: str | Path) -> Profile:
    """A torch profiler trace of the program, to time a run's ops with measured durations (``compute=`` of
    :func:`simdist.run`); see docs/compute.md, "Profile replay"."""
    return Profile(path)
