"""A program named by reference, so that a worker process can load it: a module's function or a script.

Runs are shipped to workers as these JSON references, never as pickled closures; the same reference, with a
hash of the code it names, goes into every replay token.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import inspect
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from simdist.engine.torchrun import ScriptProgram
from simdist.explore.errors import ExplorationError
from simdist_base.script import load_entry


@dataclass(frozen=True)
class Program:
    """A function every rank runs: ``module``'s ``name`` (a qualified name), or the script at ``script`` (run as
    torchrun runs it, or its function ``entry``) with ``argv`` as its arguments."""

    module: str = ""
    name: str = ""
    script: str = ""
    entry: str | None = None
    argv: tuple[str, ...] = field(default_factory=tuple)

    @classmethod
    def of(cls, fn: Callable[..., Any]) -> Program:
        """The reference of ``fn``; a clear error if it cannot be imported by name (a lambda, a closure)."""
        module = getattr(fn, "__module__", None)
        qualname = getattr(fn, "__qualname__", None)
        if not module or not qualname or "<" in qualname:
            raise ExplorationError(
                f"{qualname or fn!r} cannot be loaded by name in a worker process (a lambda, a closure or a nested "
                "function): define it at the top level of an importable module, or explore with workers=1"
            )
        if module == "__main__":
            path = getattr(sys.modules.get("__main__"), "__file__", None)
            if not path:
                raise ExplorationError(
                    f"{qualname} is defined in an interactive session (__main__ has no file): a worker process cannot "
                    "load it; define it in a module, or explore with workers=1"
                )
            return cls(script=os.path.abspath(path), entry=qualname)
        return cls(module=module, name=qualname)

    def to_json(self) -> dict[str, Any]:
        """This reference as a JSON object."""
        if self.script:
            return {"script": self.script, "entry": self.entry, "argv": list(self.argv)}
        return {"module": self.module, "name": self.name}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Program:
        """The reference :meth:`to_json` wrote."""
        if "script" in data:
            return cls(script=str(data["script"]), entry=data.get("entry"), argv=tuple(data.get("argv", ())))
        return cls(module=str(data["module"]), name=str(data["name"]))

    @contextlib.contextmanager
    def loaded(self) -> Iterator[tuple[Callable[..., Any], dict[str, Any]]]:
        """The function and the run options it needs (a script's ``argv``, its own process group)."""
        if not self.script:
            obj: Any = importlib.import_module(self.module)
            for part in self.name.split("."):
                obj = getattr(obj, part)
            yield obj, {}
            return
        argv = [self.script, *self.argv]
        if self.entry is not None:
            yield load_entry(self.script, self.entry), {"argv": argv}
            return
        program = ScriptProgram.load(self.script)
        with program.importable():
            yield program.main, {"argv": argv, "default_group": False}

    def code_hash(self) -> str:
        """SHA-256 of the code this reference names: the script's or the module's source."""
        if self.script:
            path = self.script
        else:
            module = sys.modules.get(self.module) or importlib.import_module(self.module)
            path = getattr(module, "__file__", None) or ""
        try:
            with open(path, "rb") as f:
                return hashlib.sha256(f.read()).hexdigest()
        except OSError:
            return ""


def code_hash(fn: Callable[..., Any]) -> str:
    """SHA-256 of ``fn``'s module source (of ``fn``'s own source where its module has no file)."""
    module = sys.modules.get(getattr(fn, "__module__", "") or "")
    path = getattr(module, "__file__", None)
    if path:
        try:
            with open(path, "rb") as f:
                return hashlib.sha256(f.read()).hexdigest()
        except OSError:
            pass
    try:
        return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()
    except (OSError, TypeError):
        return ""
