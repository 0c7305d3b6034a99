"""What a rank process runs, and the checks that it can be sent to a freshly spawned process.

Functions and classes travel by reference (module and qualified name), as pickle sends them. Those of
the calling script (``__main__``) resolve in each rank process through the same script, loaded there
under a name other than ``__main__`` (see `real.main_script`).
"""

from __future__ import annotations

import io
import pickle
import sys
import traceback
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from real.errors import RealConfigError
from real.main_script import MainScript, calling_script, importable
from simdist_base.script import SCRIPT_MODULE_PREFIX, ScriptError, load_entry, script_path_of

_MOVE_IT = (
    "spawned rank processes find it by module and qualified name, so it must be a top-level function of "
    'the script being run (above its `if __name__ == "__main__":` block) or of an importable module; '
    "or put the rank code in a script and use real.run_script(path, nproc) / python -m real SCRIPT"
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
    """A script's entry function, loaded by path in each rank process; ``argv`` is the ``sys.argv[1:]`` it sees."""

    path: str
    entry: str = "main"
    argv: tuple[str, ...] = ()

    def resolve(self) -> Callable[..., Any]:
        """The script's entry function, freshly loaded."""
        return load_entry(self.path, self.entry)


@dataclass(frozen=True)
class MainTarget:
    """A script run as ``__main__`` with its own command line, as torchrun runs it: it creates its own group."""

    path: str
    argv: tuple[str, ...] = ()


#: what a rank process can run: a function (real creates the group around it) or a torchrun-style script
Target = CallableTarget | ScriptTarget | MainTarget


@dataclass(frozen=True)
class Job:
    """Everything a rank process needs besides the launcher's environment variables.

    ``backend`` is the group real creates around a function; None for a script that creates its own.
    """

    target: Target
    backend: str | None
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    #: the simulated CUDA devices each process runs on (an EmulatedCuda), or None: the machine's own
    emulate_cuda: Any = None
    #: where each rank records its timeline (a real.options.TimelineOptions), or None: nothing is recorded
    timeline: Any = None


def checked_entry(path: str | Path, entry: str, argv: tuple[str, ...]) -> ScriptTarget:
    """A script's entry function, loaded here once so that a missing file or entry fails before any process starts.

    The script's top level runs during that load; it sees the command line the rank processes will give it.
    """
    resolved = str(Path(path).expanduser().resolve())
    saved = sys.argv
    sys.argv = [resolved, *argv]
    try:
        load_entry(resolved, entry)
    finally:
        sys.argv = saved
    return ScriptTarget(resolved, entry, argv)


def main_target(path: str | Path, argv: tuple[str, ...]) -> MainTarget:
    """A torchrun-style script, checked here: a missing file or a syntax error fails before any process starts.

    Only compiled, not run: its top level is the rank code, which runs in the rank processes alone.
    """
    resolved = Path(path).expanduser().resolve()
    if not resolved.is_file():
        raise ScriptError(
            f"script {str(path)!r} not found (looked for {resolved}); pass the path of a Python file"
        )
    try:
        source = resolved.read_bytes()
    except OSError as exc:
        raise ScriptError(f"script {resolved} cannot be read ({exc}); the rank processes run it") from exc
    try:
        compile(source, str(resolved), "exec")
    except (SyntaxError, ValueError) as exc:
        # As Python shows it: the file, line, source and caret (nothing of real's own frames).
        shown = "".join(traceback.format_exception_only(type(exc), exc)).rstrip("\n")
        raise ScriptError(f"script {resolved} is not valid Python:\n{shown}") from exc
    return MainTarget(str(resolved), argv)


def target_for(fn: Callable[..., Any]) -> CallableTarget | ScriptTarget:
    """Wrap ``fn`` for sending to rank processes; a function from a loaded script is sent as a script path."""
    if not callable(fn):
        raise RealConfigError(f"fn must be callable; got {type(fn).__name__} {fn!r}")
    qualname = getattr(fn, "__qualname__", "")
    script = script_path_of(fn)
    if script is not None:
        if "." in qualname:
            raise RealConfigError(f"{qualname!r} from script {script} is not top-level; {_MOVE_IT}")
        return ScriptTarget(script, qualname)
    if "<lambda>" in qualname:
        raise RealConfigError(f"fn {qualname!r} is a lambda; {_MOVE_IT}")
    if "<locals>" in qualname:
        raise RealConfigError(f"fn {qualname!r} is defined inside another function; {_MOVE_IT}")
    return CallableTarget(fn)


class _RecordingPickler(pickle.Pickler):
    """A pickler that notes the module of every function and class it pickles by reference."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.modules: dict[str, dict[str, object]] = {}

    def reducer_override(self, obj: Any) -> Any:
        # Functions, classes, and objects pickled by name like them (functools.lru_cache wrappers).
        if isinstance(obj, (types.FunctionType, type)) or (
            callable(obj) and isinstance(getattr(obj, "__qualname__", None), str)
        ):
            module = getattr(obj, "__module__", None) or ""
            self.modules.setdefault(module, {}).setdefault(obj.__qualname__, obj)
        return NotImplemented


def dump_job(job: Job) -> tuple[bytes, MainScript | None]:
    """The pickled ``job`` and the calling script it refers to; RealConfigError if a process can't load it."""
    buffer = io.BytesIO()
    pickler = _RecordingPickler(buffer)
    try:
        pickler.dump(job)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise RealConfigError(
            f"cannot send the function and its arguments to the rank processes: {exc}. "
            f"Functions and classes are sent by reference; {_MOVE_IT}. Arguments must be picklable."
        ) from exc
    main: MainScript | None = None
    for module, objects in pickler.modules.items():
        names = list(objects)
        if module == "__main__":
            main = calling_script(repr(names[0]))
            main.check_defines(names)
        elif module.startswith(SCRIPT_MODULE_PREFIX):
            raise RealConfigError(
                f"{names[0]!r} is defined in a script loaded by path; rank processes load such a script "
                f"only for its entry function. {_MOVE_IT}"
            )
        elif module and not importable(module.partition(".")[0]):
            raise RealConfigError(
                f"{names[0]!r} is defined in module {module!r}, which a fresh process cannot import from "
                f"sys.path; {_MOVE_IT}"
            )
    return buffer.getvalue(), main


def load_job(blob: bytes, main: MainScript | None) -> Job:
    """Unpickle a job from `dump_job` in a rank process, first loading the calling script it refers to."""
    if main is None:
        return pickle.loads(blob)
    module = main.install()
    try:
        return pickle.loads(blob)
    except AttributeError as exc:
        # The parent checked the script's top-level names, so this is a script that binds a name only
        # under a condition that differs in the rank process.
        raise RealConfigError(
            f"a rank process loaded the calling script {main.path} as module {module.__name__!r} and "
            f"could not find a function or class sent from __main__ ({exc}); define what real.run sends "
            f"at the top level of the script, unconditionally"
        ) from exc
