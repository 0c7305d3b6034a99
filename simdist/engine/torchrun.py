"""Run a script as torchrun would, once per rank: ``simdist run train.py -- ARGS`` and :func:`run_script`.

Each rank executes the script's module code as ``__main__`` (its ``if __name__ == "__main__":`` block included)
in a module of its own (the rank's ``sys.modules["__main__"]``), with ``sys.argv`` ``[script, *args]``, torchrun's environment and no process group:
the script makes it with ``init_process_group``, however it imported that function. ``sys.exit(0)`` (or falling
off the end) ends a rank normally; a non-zero exit or an uncaught exception is that rank's failure. Nothing of
the script runs in the calling process: it is only read and compiled there, so a syntax error is reported
before any rank starts.

With ``entry=`` the script follows the entry-function convention instead (:func:`simdist.script.load_entry`):
it is imported once, and every rank calls that function in a world whose default group already exists.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import functools
import os
import sys
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from simdist.engine import elastic
from simdist.engine.rank_process import own_main_module
from simdist.engine.runner import RunResult, run
from simdist.errors import RankExit, RunArgumentError
from simdist.network.cluster import Cluster
from simdist_base.script import ScriptError, load_entry

#: the options :func:`run_script` sets itself: a script's ranks start without a default group, with their argv
_SET_BY_RUN_SCRIPT = ("argv", "default_group", "args", "kwargs", "copy_args")


def run_script(
    path: str | Path,
    cluster: Cluster | str,
    *,
    argv: Sequence[str] = (),
    entry: str | None = None,
    prefix_output: bool = True,
    max_restarts: int = 0,
    nnodes: int | str | None = None,
    **options: Any,
) -> RunResult:
    """Run the script at ``path`` on every rank of ``cluster``, as ``simdist run path [options] -- argv`` does.

    Without ``entry`` each rank runs the script as torchrun would (see the module's description); every rank's
    return value is None. With ``entry`` every rank calls the script's function of that name and returns what it
    returns. Rank code reads ``sys.argv`` as ``[path, *argv]`` in both. ``prefix_output`` starts each line rank
    code writes with ``[rankN]:``; ``options`` are :func:`simdist.run`'s (``local_ranks_filter``, ``seed``, ...).
    ``max_restarts`` and ``nnodes`` are torchrun's ``--max-restarts`` and ``--nnodes N|MIN:MAX``: a failed attempt
    (a rank that raised or crashed) restarts every rank, on the surviving nodes if a node was lost
    (:mod:`simdist.engine.elastic`).
    Raises :class:`ScriptError` when the script cannot be read or compiled, or lacks ``entry``.
    """
    for name in _SET_BY_RUN_SCRIPT:
        if name in options:
            raise RunArgumentError(
                f"run_script sets {name} itself (the script's ranks read sys.argv as [path, *argv] and make their own "
                f"process group); pass the script's arguments as argv=[...]"
            )
    if isinstance(argv, (str, bytes)) or not isinstance(argv, Sequence):
        raise RunArgumentError(
            f"argv must be a list of the script's arguments (strings), got {type(argv).__name__} {argv!r:.60}"
        )
    rank_argv = [os.fspath(path), *argv]
    launcher: Callable[..., RunResult] = run
    if max_restarts or nnodes is not None:
        if isinstance(cluster, str):
            cluster = Cluster.load(cluster)
        launcher = functools.partial(elastic.launch, max_restarts=max_restarts, nnodes=nnodes)
    if entry is not None:
        return launcher(load_entry(path, entry), cluster, argv=rank_argv, prefix_output=prefix_output, **options)
    program = ScriptProgram.load(path)
    with program.importable():
        return launcher(
            program.main, cluster, argv=rank_argv, default_group=False, prefix_output=prefix_output, **options
        )


class ScriptProgram:
    """A script read and compiled once, executed as ``__main__`` by each rank in a namespace of its own."""

    def __init__(self, path: Path, source: str, code: Any) -> None:
        #: the script's absolute path (its ``__file__``, as Python sets it for ``python script.py``)
        self.path = path
        self.source = source
        self.code = code
        self.main = self._rank_main()

    @classmethod
    def load(cls, path: str | Path) -> ScriptProgram:
        """Read and compile the script at ``path``; a :class:`ScriptError` says why it cannot be run."""
        resolved = Path(os.path.abspath(os.path.expanduser(os.fspath(path))))
        if not resolved.is_file():
            raise ScriptError(
                f"script {os.fspath(path)!r} not found (looked for {resolved}); pass the path of a Python file"
            )
        try:
            source = resolved.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ScriptError(f"cannot read script {resolved}: {e}") from None
        try:
            code = compile(source, str(resolved), "exec", dont_inherit=True)
        except (SyntaxError, ValueError) as e:
            shown = "".join(traceback.format_exception_only(type(e), e)).rstrip(
                "\n"
            )  # file, line, source, caret
            raise ScriptError(f"script {resolved} is not valid Python:\n{shown}") from e
        return cls(resolved, source, code)

    def _rank_main(self) -> Callable[[], None]:
        code, path = self.code, str(self.path)

        def main() -> None:
            module = ModuleType("__main__")
            module.__dict__.update(
                {"__file__": path, "__builtins__": builtins, "__loader__": None, "__cached__": None}
            )
            # pickle finds the script's classes as __main__.Name, as in the rank's own process
            own_main_module(module)
            try:
                exec(code, module.__dict__)  # noqa: S102 - running the user's script is what this is for
            except SystemExit as e:
                if e.code not in (None, 0):
                    raise  # a non-zero exit is the rank's failure, as torchrun reports it
            except RankExit as e:
                if e.code != 0:
                    raise

        main.__name__ = "__main__"
        main.__qualname__ = path  # RunResult.program: what the run ran
        return main

    @contextlib.contextmanager
    def importable(self) -> Iterator[None]:
        """During the block the script's directory comes first on ``sys.path``, as for ``python script.py``."""
        directory = str(self.path.parent)
        sys.path.insert(0, directory)
        try:
            yield
        finally:
            with contextlib.suppress(ValueError):
                sys.path.remove(directory)

    def entry_hint(self) -> str | None:
        """What to tell a user whose script defines ``main()`` that nothing calls: run it with ``--entry main``."""
        tree = ast.parse(self.source)
        defs = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
        if not any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body):
            return None
        for statement in tree.body:
            if isinstance(statement, defs):
                continue
            for node in ast.walk(statement):
                if isinstance(node, ast.Name) and node.id in ("main", "__name__"):
                    return None  # it calls main() (or runs it under a __main__ guard) itself
        return (
            f"{self.path} defines main() but nothing in it calls main(): simdist run executed its module code on every "
            "rank, as torchrun does, and that only defined functions. To call main() on every rank in a world whose "
            "process group already exists, run it with --entry main"
        )
