"""A program named by reference, so that a worker process can load it: a module's function, a script, or a
:class:`~simdist.explore.target.Target` (its class by name, with its fields).

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
from simdist.explore.target import Target, fields_json, from_fields, import_class
from simdist_base.script import load_entry


@dataclass(frozen=True)
class Program:
    """A function every rank runs: ``module``'s ``name`` (a qualified name), or the script at ``script`` (run as
    torchrun runs it, or its function ``entry``) with ``argv`` as its arguments. With ``fields``, the name is a
    :class:`Target`'s class and the reference is that target, rebuilt from its fields."""

    module: str = ""
    name: str = ""
    script: str = ""
    entry: str | None = None
    argv: tuple[str, ...] = field(default_factory=tuple)
    fields: dict[str, Any] | None = field(default=None, hash=False)

    @classmethod
    def of(cls, fn: Callable[..., Any] | Target) -> Program:
        """The reference of ``fn``; a clear error if it cannot be imported by name (a lambda, a closure)."""
        if isinstance(fn, Target):
            ref = cls.of(type(fn))
            return cls(ref.module, ref.name, ref.script, ref.entry, fields=fields_json(fn))
        module = getattr(fn, "__module__", None)
        qualname = getattr(fn, "__qualname__", None)
        if not module or not qualname or "<" in qualname:
            raise ExplorationError(
                f"{qualname or fn!r} cannot be loaded by name in a worker process (a lambda, a closure or a nested "
                "function): define it at the top level of an importable module, or explore with workers=1"
            )
        if module == "__main__":
            path = getattr(sys.modules.get("__main__"), "__file__", None)
            if not path or not os.path.isfile(path):  # python -c, a notebook, or a program read from stdin
                raise ExplorationError(
                    f"{qualname} is defined in an interactive session or a program read from standard input (__main__ has no file): a worker process cannot "
                    "load it; define it in a module, or explore with workers=1"
                )
            return cls(script=os.path.abspath(path), entry=qualname)
        return cls(module=module, name=qualname)

    def to_json(self) -> dict[str, Any]:
        """This reference as a JSON object."""
        if self.script:
            out = {"script": self.script, "entry": self.entry, "argv": list(self.argv)}
        else:
            out = {"module": self.module, "name": self.name}
        return out if self.fields is None else {**out, "fields": self.fields}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Program:
        """The reference :meth:`to_json` wrote."""
        fields = data.get("fields")
        if "script" in data:
            return cls(
                script=str(data["script"]),
                entry=data.get("entry"),
                argv=tuple(data.get("argv", ())),
                fields=fields,
            )
        return cls(module=str(data["module"]), name=str(data["name"]), fields=fields)

    @contextlib.contextmanager
    def loaded(self) -> Iterator[tuple[Callable[..., Any], dict[str, Any]]]:
        """The function and the run options it needs (a script's ``argv``, its own process group); a target."""
        if self.fields is not None:
            where = f"the target reference {self.to_json()!r:.80}"
            cls = (
                load_entry(self.script, str(self.entry))
                if self.script
                else import_class(self.module, self.name)
            )
            yield from_fields(cls, self.fields, where), {}  # type: ignore[misc]
            return
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
