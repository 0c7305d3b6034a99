"""The calling program's ``__main__`` as spawned rank processes load it: by module name or by file path.

A function written in the script that calls ``real.run`` lives in ``__main__``. A spawned process has a
``__main__`` of its own, so the script is loaded there under another name (``__mp_main__``, or its module
name for ``python -m pkg``), where its ``if __name__ == "__main__":`` block does not run, and that module
becomes the process's ``__main__``; then ``__main__.step`` resolves as in the parent. This is what
``multiprocessing``'s spawn start method (and so ``torch.multiprocessing.spawn``) does.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import multiprocessing.process
import os
import sys
from dataclasses import dataclass
from importlib.machinery import SourceFileLoader
from types import ModuleType

from real.errors import RealConfigError

# The name multiprocessing's spawn start method gives the main script it re-runs in a child process.
MP_MAIN = "__mp_main__"


@dataclass(frozen=True)
class MainScript:
    """The calling script: its absolute ``path``, and its ``module`` name when run as ``python -m module``."""

    path: str
    module: str | None = None

    def install(self) -> ModuleType:
        """Load the script in this (spawned) process unless already loaded, and make it ``__main__``."""
        current = sys.modules.get("__main__")
        # multiprocessing's spawn has usually run the script as __mp_main__ and aliased __main__ to it
        # already; loading it a second time would run its top level twice.
        if _same_file(getattr(current, "__file__", None), self.path):
            return current  # type: ignore[return-value]
        if self.module is not None:
            # `python -m pkg` (pkg/__main__.py), which multiprocessing leaves alone: imported by its own
            # name, "pkg.__main__", which is not "__main__", so its guard does not fire.
            module = importlib.import_module(self.module)
        else:
            module = _load_path(self.path)
        sys.modules["__main__"] = module
        return module

    def check_defines(self, qualnames: list[str]) -> None:
        """Raise RealConfigError unless the script binds each name's first part outside its main guard."""
        outside, inside = top_level_names(self.path)
        for qualname in qualnames:
            self._check_defines(qualname, outside, inside)

    def _check_defines(self, qualname: str, outside: set[str], inside: set[str]) -> None:
        """Raise RealConfigError unless ``qualname``'s first part is in ``outside``."""
        name = qualname.partition(".")[0]
        if name in outside:
            return
        if name in inside:
            raise RealConfigError(
                f"{qualname!r} is defined inside the `if __name__ == \"__main__\":` block of {self.path}; "
                f"the rank processes load that script under another name, so the block does not run there "
                f"and {name!r} does not exist: move its definition above the block, to the script's top level"
            )
        raise RealConfigError(
            f"{qualname!r} belongs to __main__, but {self.path} does not define {name!r} at its top level "
            f"(it was added to __main__ some other way); the rank processes see only what the script "
            f"defines: define it at the top level of the script, or in a module on sys.path"
        )


def calling_script(what: str) -> MainScript:
    """The running program's ``__main__`` script, which ``what`` (a name, for error messages) belongs to."""
    main = sys.modules.get("__main__")
    file = getattr(main, "__file__", None)
    if not file:
        raise RealConfigError(
            f"{what} is defined in __main__ of an interactive session (python -c, the REPL or a notebook), "
            f"which has no file the spawned rank processes could load it from: save the code in a .py file "
            f"and run that file (with the real.run call under `if __name__ == \"__main__\":`), or move the "
            f"function into a module on sys.path"
        )
    # As multiprocessing does: a relative __file__ is relative to the directory the program started in.
    path = os.path.normpath(os.path.join(multiprocessing.process.ORIGINAL_DIR or os.getcwd(), file))
    if not os.path.isfile(path):
        raise RealConfigError(
            f"{what} is defined in __main__, run from {path}, which is not a source file the rank processes "
            f"could load (a zip archive or a directory?); run the program from a .py file, or move the "
            f"function into a module on sys.path"
        )
    module = getattr(getattr(main, "__spec__", None), "name", None)
    if module is not None and not importable(module.partition(".")[0]):
        module = None  # not importable by name in a fresh process: loaded by path instead
    return MainScript(path, module)


def top_level_names(path: str) -> tuple[set[str], set[str]]:
    """Names the script at ``path`` binds at top level: (outside, inside) its main-guard blocks."""
    try:
        with open(path, "rb") as file:
            tree = ast.parse(file.read(), filename=path)
    except (OSError, SyntaxError, ValueError) as exc:
        raise RealConfigError(
            f"cannot read the calling script {path} as Python source ({exc}); the rank processes load "
            f"functions of __main__ from it: run the program from a .py file, or move them into a module"
        ) from exc
    outside: set[str] = set()
    inside: set[str] = set()
    _collect(tree.body, False, outside, inside)
    return outside, inside


def importable(top_level: str) -> bool:
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


def _collect(statements: list[ast.stmt], in_guard: bool, outside: set[str], inside: set[str]) -> None:
    """Add the names ``statements`` bind at module level to ``inside`` or ``outside`` the main guard."""
    for node in statements:
        names = inside if in_guard else outside
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            continue  # its body binds names of its own scope
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).partition(".")[0] for alias in node.names)
            continue
        guard = isinstance(node, ast.If) and _is_main_guard(node.test)
        for field, value in ast.iter_fields(node):
            if field in ("body", "orelse", "finalbody"):
                # Only the guard's own body is skipped on import; its `else:` runs there.
                _collect(value, in_guard or (guard and field == "body"), outside, inside)
            elif field in ("handlers", "cases"):
                for clause in value:
                    if getattr(clause, "name", None):
                        names.add(clause.name)
                    _collect(clause.body, in_guard, outside, inside)
            else:
                # Targets of assignments, for loops, with-as and walrus expressions.
                names.update(_stored_names(value))


def _stored_names(value: object) -> set[str]:
    """Names an expression (or a list of them) assigns to."""
    nodes = value if isinstance(value, list) else [value]
    return {
        n.id
        for node in nodes
        if isinstance(node, ast.AST)
        for n in ast.walk(node)
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
    }


def _is_main_guard(test: ast.expr) -> bool:
    """Whether ``test`` is ``__name__ == "__main__"`` (either way round)."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    return any(isinstance(s, ast.Name) and s.id == "__name__" for s in sides) and any(
        isinstance(s, ast.Constant) and s.value == "__main__" for s in sides
    )


def _same_file(a: str | None, b: str) -> bool:
    """Whether paths ``a`` and ``b`` name the same existing file."""
    try:
        return a is not None and os.path.samefile(a, b)
    except OSError:
        return False


def _load_path(path: str) -> ModuleType:
    """Execute the script at ``path`` as module ``__mp_main__``, as multiprocessing's spawn does."""
    # An explicit source loader, since a script need not end in .py (`python train` works too).
    spec = importlib.util.spec_from_file_location(MP_MAIN, path, loader=SourceFileLoader(MP_MAIN, path))
    assert spec is not None and spec.loader is not None  # given a loader, a spec always comes back
    module = importlib.util.module_from_spec(spec)
    # Registered before executing so dataclasses and pickle inside the script can find their module.
    sys.modules[MP_MAIN] = module
    spec.loader.exec_module(module)
    return module
