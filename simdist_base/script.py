"""Load a script's entry function by path: the convention shared by ``simdist run`` and ``python -m real``.

A script defines ``main()`` (or another function chosen with ``--entry``) holding ordinary
``torch.distributed`` rank code; it may return a picklable value and may guard
``if __name__ == "__main__":`` for direct use. The script is imported under a unique module name, so
that guard does not fire when the simulator or the real launcher loads it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import re
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from simdist_base.errors import SimdistError

# Module names of loaded scripts start with this, so other code can tell a script function from a
# function of an importable module (see `script_path_of`).
SCRIPT_MODULE_PREFIX = "simdist_script_"


class ScriptError(SimdistError, ValueError):
    """A script cannot be used: the file is missing, does not import, or its entry function is absent or not callable.

    When importing the script raised, the exception is ``__cause__`` and the text shows its traceback through
    the script's own frames only.
    """


def script_module_name(path: str | Path) -> str:
    """The unique module name a script at ``path`` is imported under (stable for a given absolute path)."""
    resolved = Path(path).expanduser().resolve()
    stem = re.sub(r"\W", "_", resolved.stem)
    digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:10]
    return f"{SCRIPT_MODULE_PREFIX}{stem}_{digest}"


def load_entry(path: str | Path, entry: str = "main") -> Callable[..., Any]:
    """Import the script at ``path`` as a fresh module and return its function named ``entry``."""
    resolved = Path(path).expanduser().resolve()
    if not resolved.is_file():
        raise ScriptError(
            f"script {str(path)!r} not found (looked for {resolved}); pass the path of a Python file "
            f"that defines `def {entry}():`"
        )
    # Like `python script.py`: the script's own directory comes first, so it can import its neighbours.
    script_dir = str(resolved.parent)
    if script_dir not in sys.path:
        sys.path.insert(0, script_dir)

    name = script_module_name(resolved)
    spec = importlib.util.spec_from_file_location(name, resolved)
    if spec is None or spec.loader is None:
        raise ScriptError(f"cannot import {resolved} as a Python module; expected a .py source file")
    module = importlib.util.module_from_spec(spec)
    module.__simdist_script__ = str(resolved)  # type: ignore[attr-defined]
    # Registered before executing so dataclasses, pickle and typing inside the script can find it;
    # each load re-executes the file, as each `python script.py` would.
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except SystemExit as exc:
        sys.modules.pop(name, None)
        raise ScriptError(
            f"script {resolved} called sys.exit({exc.code!r}) while being imported; its top level runs before "
            f"{entry!r} is called: move the exit under `if __name__ == \"__main__\":`"
        ) from None
    except Exception as exc:
        sys.modules.pop(name, None)
        what = "is not valid Python" if isinstance(exc, SyntaxError) else (
            f"raised {type(exc).__name__} while being imported (its top level runs before {entry!r} is called)"
        )
        raise ScriptError(f"script {resolved} {what}:\n{user_traceback(exc)}") from exc
    except BaseException:  # KeyboardInterrupt and the like are the user's to see
        sys.modules.pop(name, None)
        raise

    if not hasattr(module, entry):
        functions = sorted(
            key
            for key, value in vars(module).items()
            if callable(value) and not key.startswith("_") and getattr(value, "__module__", None) == name
        )
        found = ", ".join(functions) if functions else "none"
        raise ScriptError(
            f"script {resolved} defines no {entry!r}; expected a top-level `def {entry}():` with the rank "
            f"code (functions it defines: {found}); define it or choose another with --entry"
        )
    fn = getattr(module, entry)
    if not callable(fn):
        raise ScriptError(
            f"{entry!r} in script {resolved} is {type(fn).__name__} {fn!r}, not a function; expected "
            f"`def {entry}():` holding the rank code"
        )
    return fn


def user_traceback(exc: BaseException) -> str:
    """``exc`` as Python prints it, keeping only the frames of user code (not the import machinery or simdist).

    A SyntaxError shows the file, line, the offending source and a caret, as ``python script.py`` does.
    """
    report = traceback.TracebackException.from_exception(exc)
    frames = [f for f in report.stack if not _is_machinery(f.filename)]
    lines = traceback.StackSummary.from_list(frames).format() if frames else []
    return "".join([*lines, *report.format_exception_only()]).rstrip("\n")


def _is_machinery(filename: str) -> bool:
    """Whether a frame belongs to the import system or to this module rather than to the user's code."""
    return filename.startswith("<frozen importlib") or filename == __file__


def script_path_of(fn: Callable[..., Any]) -> str | None:
    """The script path ``fn`` was loaded from by `load_entry`, or None for anything else."""
    module_name = getattr(fn, "__module__", None) or ""
    if not module_name.startswith(SCRIPT_MODULE_PREFIX):
        return None
    return getattr(sys.modules.get(module_name), "__simdist_script__", None)
