"""Names of a model's tensors as the equivalence oracle compares them: qualified names without wrappers' prefixes.

A parallel program wraps its model (``DistributedDataParallel(model)`` names its parameters ``module.x``,
torch's FSDP1 ``_fsdp_wrapped_module.x``, activation checkpointing ``_checkpoint_wrapped_module.x``,
``torch.compile`` ``_orig_mod.x``, torch.export's tracing wrapper, which torch pipelining's ``pipeline()`` runs,
``_export_root.x``); the reference usually does not. A name component is dropped when the
module it names is a wrapper's only child under one of :data:`WRAPPER_ATTRS` and the wrapper holds no tensor of
its own, so ``module.`` is stripped from a DDP wrapper but kept where a user's own module has a child called
``module`` beside others. Whatever this does not cover, :class:`NameMap` maps by hand.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Iterator, Mapping

from torch import nn

#: attribute names under which wrappers hold the module they wrap
WRAPPER_ATTRS = ("module", "_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod", "_export_root")


def _is_wrapper(module: nn.Module, child: str) -> bool:
    """Whether ``module`` only wraps its child ``child`` (its one child, and no tensors of its own)."""
    if child not in WRAPPER_ATTRS:
        return False
    children = list(module._modules)
    own = [n for n, p in module._parameters.items() if p is not None]
    own += [n for n, b in module._buffers.items() if b is not None]
    return children == [child] and not own


def canonical_names(root: nn.Module) -> Iterator[tuple[str, nn.Module, str]]:
    """(prefix without wrappers, module, its full prefix) for ``root`` and every submodule, in module order."""
    stack: list[tuple[str, nn.Module, str]] = [("", root, "")]
    seen: set[int] = set()
    while stack:
        name, module, full = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        yield name, module, full
        children = [(n, c) for n, c in module._modules.items() if c is not None]
        for child_name, child in reversed(children):
            child_full = f"{full}.{child_name}" if full else child_name
            if _is_wrapper(module, child_name):
                stack.append((name, child, child_full))
            else:
                stack.append((f"{name}.{child_name}" if name else child_name, child, child_full))


def named_tensors(root: nn.Module) -> tuple[list[tuple[str, nn.Parameter]], list[tuple[str, object]]]:
    """``root``'s parameters and buffers under their names without wrappers' prefixes, each tensor once.

    A tensor reachable under several names (a tied weight) keeps its first name in module order, as
    ``named_parameters()`` does.
    """
    params: list[tuple[str, nn.Parameter]] = []
    buffers: list[tuple[str, object]] = []
    seen: set[int] = set()
    for prefix, module, _ in canonical_names(root):
        for kind, table in ((params, module._parameters), (buffers, module._buffers)):
            for n, t in table.items():
                if t is None or id(t) in seen:
                    continue
                if table is module._buffers and n in module._non_persistent_buffers_set:
                    continue
                seen.add(id(t))
                kind.append((f"{prefix}.{n}" if prefix else n, t))
    return params, buffers


class NameMap:
    """Maps a parallel program's tensor names to the reference's, and says which names are compared at all.

    ``names`` is a dict (exact names, or ``fnmatch`` patterns whose ``*`` parts carry over when the target has
    as many ``*``: ``{"stages.*.w": "layers.*.w"}``) or a function returning the reference's name, or ``None``
    to leave a tensor out. ``ignore`` lists patterns of tensors compared nowhere (in either program).
    """

    def __init__(
        self,
        names: Mapping[str, str] | Callable[[str], str | None] | None = None,
        ignore: tuple[str, ...] | list[str] = (),
    ) -> None:
        if names is not None and not callable(names) and not isinstance(names, Mapping):
            raise TypeError(f"names must be a dict or a function of a name, got {type(names).__name__}")
        self.names = names
        self.ignore = tuple(ignore)

    def ignored(self, name: str) -> bool:
        """Whether ``name`` is left out of every comparison."""
        return any(fnmatch.fnmatchcase(name, p) for p in self.ignore)

    def reference_name(self, name: str) -> str | None:
        """The reference's name of the parallel program's tensor ``name`` (``None``: not compared)."""
        if self.ignored(name):
            return None
        if self.names is None:
            return name
        if callable(self.names):
            return self.names(name)
        if name in self.names:
            return self.names[name]
        for pattern, target in self.names.items():
            if "*" in pattern and fnmatch.fnmatchcase(name, pattern):
                return _substitute(pattern, target, name)
        return name


def _substitute(pattern: str, target: str, name: str) -> str:
    """``target`` with its ``*`` replaced by what ``pattern``'s ``*`` matched in ``name`` (in order)."""
    regex = "(.*)".join(re.escape(part) for part in pattern.split("*"))
    m = re.fullmatch(regex, name)
    parts = list(m.groups()) if m else []
    if target.count("*") != len(parts):
        return target
    out = target
    for p in parts:
        out = out.replace("*", p, 1)
    return out
