"""What a worker runs, and the check that it can be sent to a freshly spawned process."""

from __future__ import annotations

import io
import pickle
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from real.errors import RealConfigError
from simdist.script import SCRIPT_MODULE_PREFIX, load_entry, script_path_of

_MOVE_IT = (
    "spawned workers import it by module and name, so it must be a top-level function of an importable "
    "module: move it into a module (a .py file on sys.path), or put the rank code in a script and use "
    "real.run_script(path, nproc) / python -m real SCRIPT"
)


@dataclass(frozen=True)
class CallableTarget:
    """A module-level callable, pickled by reference."""

    fn: Callable[..., Any]

    def resolve(self) -> Callable[..., Any]:
        """The callable to run."""
        return self.fn


@dataclass(frozen=True)
class ScriptTarget:
    """A script's entry function, loaded by path in each worker."""

    path: str
    entry: str = "main"

    def resolve(self) -> Callable[..., Any]:
        """The script's entry function, freshly loaded."""
        return load_entry(self.path, self.entry)


@dataclass(frozen=True)
class Job:
    """Everything a worker needs besides the launcher's environment variables."""

    target: CallableTarget | ScriptTarget
    backend: str
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)


def target_for(fn: Callable[..., Any]) -> CallableTarget | ScriptTarget:
    """Wrap ``fn`` for sending to workers; a function from a loaded script is sent as a script path."""
    if not callable(fn):
        raise RealConfigError(f"fn must be callable; got {type(fn).__name__} {fn!r}")
    script = script_path_of(fn)
    if script is not None:
        qualname = getattr(fn, "__qualname__", "")
        if "." in qualname:
            raise RealConfigError(f"{qualname!r} from script {script} is not top-level; {_MOVE_IT}")
        return ScriptTarget(script, qualname)
    qualname = getattr(fn, "__qualname__", "")
    if "<lambda>" in qualname:
        raise RealConfigError(f"fn {qualname!r} is a lambda; {_MOVE_IT}")
    if "<locals>" in qualname:
        raise RealConfigError(f"fn {qualname!r} is defined inside another function; {_MOVE_IT}")
    if getattr(fn, "__module__", None) == "__main__":
        raise RealConfigError(f"fn {qualname!r} is defined in __main__ (the program being run); {_MOVE_IT}")
    return CallableTarget(fn)


class _RecordingPickler(pickle.Pickler):
    """A pickler that notes the module of every function and class it pickles by reference."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.modules: dict[str, object] = {}

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, (types.FunctionType, type)):
            self.modules.setdefault(getattr(obj, "__module__", None) or "", obj)
        return NotImplemented


def dump_job(job: Job) -> bytes:
    """Pickle ``job``, raising RealConfigError if a fresh process could not unpickle it."""
    buffer = io.BytesIO()
    pickler = _RecordingPickler(buffer)
    try:
        pickler.dump(job)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise RealConfigError(
            f"cannot send the function and its arguments to the worker processes: {exc}. "
            f"Functions and classes are sent by reference; {_MOVE_IT}. Arguments must be picklable."
        ) from exc
    for module, obj in pickler.modules.items():
        name = getattr(obj, "__qualname__", repr(obj))
        if module == "__main__":
            raise RealConfigError(f"{name!r} is defined in __main__ (the program being run); {_MOVE_IT}")
        if module.startswith(SCRIPT_MODULE_PREFIX):
            raise RealConfigError(
                f"{name!r} is defined in a script loaded by path; workers load a script only for its entry "
                f"function. {_MOVE_IT}"
            )
        if module and not _importable(module.partition(".")[0]):
            raise RealConfigError(
                f"{name!r} is defined in module {module!r}, which a fresh process cannot import from "
                f"sys.path; {_MOVE_IT}"
            )
    return buffer.getvalue()


def _importable(top_level: str) -> bool:
    """Whether a fresh interpreter with this sys.path could import ``top_level`` (ignoring sys.modules)."""
    if top_level in sys.builtin_module_names:
        return True
    # Ask the import system's finders directly: find_spec() would answer from sys.modules and so
    # accept modules that were loaded by path and exist only in this process.
    for finder in sys.meta_path:
        find_spec = getattr(finder, "find_spec", None)
        if find_spec is None:
            continue
        try:
            if find_spec(top_level, None) is not None:
                return True
        except Exception:  # noqa: BLE001, S112 - a third-party finder failing must not decide the answer
            continue
    return False
