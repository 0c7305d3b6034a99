"""simdist's architecture as data: the chain of layers, the packages outside it, and the extension points.

Each layer imports only the layers before it (``tests/test_layers.py`` checks every import against
:data:`LAYERS`). A lower layer may still be given behaviour by a higher one through an extension point: a
function or list the lower layer declares and a higher layer fills. Every such point is in
:data:`EXTENSION_POINTS`; the test refuses any other write from one module into another's state. The layer
table of ``docs/README.md`` is generated from here (``python3 -m simdist.layers``), and so is the list of the
simulator's own source folders (:data:`SIMULATOR_FILES`), whose frames are never a program's call site.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import typing_extensions


@dataclass(frozen=True)
class Layer:
    """One layer of the chain: its packages and modules, and what they hold."""

    name: str
    modules: tuple[str, ...]
    holds: str


LAYERS: tuple[Layer, ...] = (
    Layer("base", ("simdist_base",),
          "what the `real` launcher shares with the simulator and needs nothing but torch for: the error root, "
          "script loading, the host-memory check, a real run's timeline records"),
    Layer("foundation",
          ("simdist.errors", "simdist.layers", "simdist.options", "simdist.patching", "simdist.ranks", "simdist.units",
           "simdist.trace", "simdist.untraced", "simdist.uninitialised", "simdist.cuda", "simdist.compute",
           "simdist.algorithms", "simdist.faults"),
          "the error hierarchy, this architecture, a run's validated options, the inventory of process-wide "
          "changes, unit strings, the trace record, the mark that keeps torch.compile out of simdist's per-op "
          "code, the fill of uninitialised memory, the simulated GPU's tensor and native pieces, device models and "
          "the per-op cost mode, collective and reduce-op records and algorithms as message schedules, the faults a run can meet as records"),
    Layer("clock and rank threads", ("simdist.clock",),
          "the simpy clock, one thread per rank and the baton passed between them, each rank's pending compute, "
          "call sites, perturbations and the clock that breaks ties by them"),
    Layer("network", ("simdist.network",),
          "the cluster graph and its checks, routing, builders, presets, config files, timed transfers over links"),
    Layer("communication", ("simdist.comm",),
          "the run's shared context, op descriptions, matching and ordering across ranks, algorithm selection, "
          "message execution, point-to-point, works and futures, the race detector, the end-of-backward drain, "
          "per-thread torch.distributed worlds"),
    Layer("simulated CUDA runtime", ("simdist.cudart",),
          "`torch.cuda` and `torch.accelerator` in rank code: devices, properties, events and streams in simulated "
          "time, memory statistics, per-device generators, and their installation for a run"),
    Layer("torch.distributed face", ("simdist.c10d",),
          "what torch and rank code call: the `\"simdist\"` backend's installation, the process group, the "
          "arguments it refuses as gloo does, functional collectives' kernels"),
    Layer("the run", ("simdist.engine",),
          "`simdist.run` and `RunResult`, the process-wide state a run changes, each rank's generators, "
          "`now`/`charge`/`set_algorithms`"),
    Layer("equivalence oracle", ("simdist.oracle",),
          "`check_equivalence`: capture, assembly of sharded tensors, comparison, localisation"),
    Layer("reports", ("simdist.report",), "self-contained HTML pages of runs, checks and scenarios, and their index"),
    Layer("exploration", ("simdist.explore",),
          "`simdist.explore`, `simdist.replay` and `simdist.shrink`: strategies over perturbed runs (random, PCT, "
          "exhaustive with partial-order reduction), replay tokens, the determinism self-check, shrinking a failure to "
          "its fewest departures and where it departs, the local process pool, Dask and Ray as engines, the progress "
          "bar"),
    Layer("testing", ("simdist.testing",),
          "hypothesis strategies of perturbations, clusters and faults for users' test suites"),
    Layer("tools",
          ("simdist", "simdist.cli", "simdist.bench", "simdist.calibrate", "simdist.script", "simdist.pytest_plugin"),
          "the public API (and the composition root that fills the extension points), the command line, "
          "`simdist bench`, `simdist calibrate`, loading scripts, the pytest plugin"),
)

#: packages outside the chain and the modules each may import (strategies: plain torch.distributed)
OUTSIDE: Mapping[str, tuple[str, ...]] = {
    "simdist.strategies": ("simdist.strategies",),
    "simdist.autograd": ("simdist.autograd", "simdist.errors"),
    "simdist.runtime": ("simdist.runtime", "simdist.autograd", "simdist.clock", "simdist.errors"),
}


@dataclass(frozen=True)
class ExtensionPoint:
    """``name`` in module ``declared_in``, filled by the modules ``filled_by`` (higher in the chain)."""

    name: str
    declared_in: str
    filled_by: tuple[str, ...]
    what: str


EXTENSION_POINTS: tuple[ExtensionPoint, ...] = (
    ExtensionPoint("install_report_writer", "simdist.engine.runner", ("simdist",),
                   "what `RunResult.save_report` calls: the report layer's page writer"),
    ExtensionPoint("install_report_writer", "simdist.oracle.report", ("simdist",),
                   "what `EquivalenceReport.save_report` calls: the report layer's page writer"),
    ExtensionPoint("ISSUE_OBSERVERS", "simdist.c10d.process_group", ("simdist.oracle.record",),
                   "called as each rank issues a collective or send/recv: localisation counts and names them"),
)


#: the root of the ``simdist`` package
PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def _source(module: str) -> str:
    """The folder (with a trailing separator) or file of a simdist module or package."""
    path = os.path.join(os.path.dirname(PACKAGE_DIR), *module.split("."))
    return path + os.sep if os.path.isdir(path) else path + ".py"


#: the simulator's own source files and folders, from the foundation to the reports: frames of them are never a
#: program's call site, a user's stack starts below them (the tools are left out: they never run in a rank)
SIMULATOR_FILES: tuple[str, ...] = tuple(
    _source(m) for layer in LAYERS[1:] if layer.name != "tools" for m in layer.modules
)
#: simdist's own code that issues operations for the user, as torch's does (its strategies): a call site names
#: their line, then the user's
LIBRARY_FILES: tuple[str, ...] = (_source("simdist.strategies"),)


#: wrappers around any call (typing_extensions' deprecation shims, contextlib's decorators): never a call site
WRAPPER_FILES: tuple[str, ...] = (
    os.path.abspath(typing_extensions.__file__).rsplit(".", 1)[0],
    os.path.join(os.path.dirname(os.path.abspath(os.__file__)), "contextlib"),
)
#: frames no call site is ever in: the simulator's and the wrappers'
NOT_CALL_SITES: tuple[str, ...] = SIMULATOR_FILES + WRAPPER_FILES


def is_simulator_frame(filename: str) -> bool:
    """Whether a frame of ``filename`` is the simulator's own (see :data:`SIMULATOR_FILES`)."""
    return filename.startswith(SIMULATOR_FILES)


def markdown() -> str:
    """The layer table of ``docs/README.md``."""
    rows = ["| layer | packages | what they hold |", "|---|---|---|"]
    for layer in LAYERS:
        rows.append(f"| {layer.name} | {', '.join(f'`{m}`' for m in layer.modules)} | {layer.holds} |")
    rows += ["", "| extension point | declared in | filled by | what |", "|---|---|---|---|"]
    for p in EXTENSION_POINTS:
        rows.append(f"| `{p.name}` | `{p.declared_in}` | {', '.join(f'`{m}`' for m in p.filled_by)} | {p.what} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown())
