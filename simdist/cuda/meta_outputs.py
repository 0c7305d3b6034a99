"""What an op's meta kernel returns, remembered by its operands' shapes: a timing-only run's ops without the kernel.

In a timing-only run (``tensors="fake"``) the simulated GPUs' tensors are meta tensors, and torch runs each op's
meta kernel to learn its result's shape, strides and type. Torch registers most of those kernels in Python (its
``torch._refs`` decompositions, over the C++ ones): an elementwise ``mul`` on meta tensors costs some 0.3 ms, a
hundred times the same op's dispatch. A run of many ranks running one program makes the same op on the same
shapes once per rank. :class:`MetaOutputs` runs an op's kernel the first time it sees the op with operands of
those shapes, strides, types and devices and scalar arguments of those values, and from then on makes results of
the shapes and strides it returned, without the kernel.

It takes only what the kernel's result cannot depend on beyond that: no random op, no op whose result's shape
depends on values, no view. An op that returns new tensors is remade where they are fresh tensors of exactly the
storage their shape and strides need; an in-place or ``out=`` op, whose results are the arguments it writes, is
taken where they are meta tensors (no values to write) and its kernel changed none of their shapes (an ``out=``
kernel may resize its output): it has checked operands of those shapes before, so it returns them as they are. Anything else runs its kernel every time.
"""

from __future__ import annotations

from typing import Any

import torch

#: whether timing-only runs remember meta results (False: every op runs its kernel, as a reference to compare)
ENABLED = True

_META = torch.device("meta")
_SCALARS = (
    int,
    float,
    bool,
    complex,
    str,
    type(None),
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
)
#: tags of ops whose result is not a function of their operands' shapes
_UNCACHED_TAGS = (
    torch.Tag.nondeterministic_seeded,
    torch.Tag.dynamic_output_shape,
    torch.Tag.data_dependent_output,
)
#: a key whose op ran its kernel and returned what cannot be remade (a view, a non-tensor, shared storage)
_NO = object()


class _Kind:
    """How an op's results may be remembered (computed once per op from its schema)."""

    __slots__ = ("fresh", "mutated", "written")

    def __init__(self, func: Any) -> None:
        schema = func._schema
        #: results are new tensors (nothing aliased, nothing written)
        self.fresh = False
        #: an in-place or ``out=`` op: the arguments it writes (position, name), and for each result the one it is;
        #: None where the op's results cannot be remembered
        self.mutated: list[tuple[int, str]] | None = None
        self.written: list[tuple[int, str]] = []
        if (
            func.is_view
            or any(tag in func.tags for tag in _UNCACHED_TAGS)
            or torch.Tag.inplace_view in func.tags
        ):
            return
        if not all(str(r.type) in ("Tensor", "Tensor[]") for r in schema.returns):
            return
        args = schema.arguments
        if all(a.alias_info is None for a in args):
            self.fresh = bool(schema.returns) and all(r.alias_info is None for r in schema.returns)
            return
        if any(a.alias_info is not None and not a.alias_info.is_write for a in args):
            return  # an argument the op aliases without writing it (a view's input)
        mutated = [(j, a.name) for j, a in enumerate(args) if a.alias_info is not None]
        sets = [args[j].alias_info.before_set for j, _ in mutated]  # type: ignore[union-attr]
        written = []
        for r in schema.returns:
            info = r.alias_info
            if info is None or not info.is_write or info.before_set not in sets:
                return  # a new tensor beside a written one
            written.append(mutated[sets.index(info.before_set)])
        self.mutated, self.written = mutated, written


_KINDS: dict[Any, _Kind] = {}


def _kind(func: Any) -> _Kind:
    kind = _KINDS.get(func)
    if kind is None:
        kind = _KINDS[func] = _Kind(func)
    return kind


class _Uncacheable(Exception):
    """An argument that does not go into a key (a symbolic size, a generator, an object of no known kind)."""


def _key_of(value: Any, out: list[Any]) -> None:
    kind = type(value)
    if kind is torch.Tensor or kind is torch.nn.Parameter:
        if value.layout is not torch.strided:
            raise _Uncacheable
        out.append(
            (
                value.device,
                value.dtype,
                value.shape,
                value.stride(),
                value.storage_offset(),
                value.requires_grad,
                value.is_conj(),
                value.is_neg(),
            )
        )
    elif kind in _SCALARS:
        out.append((kind, value))
    elif kind is list or kind is tuple:
        out.append((kind, len(value)))
        for v in value:
            _key_of(v, out)
    else:
        raise _Uncacheable


def _storage_bytes(t: torch.Tensor) -> int:
    """The bytes ``torch.empty_strided`` gives a tensor of ``t``'s shape, strides and type."""
    if t.numel() == 0:
        return 0
    return t.element_size() * (1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride())))


def _spec(t: Any) -> tuple[torch.Size, tuple[int, ...], torch.dtype] | None:
    """What remakes ``t`` (None: a result that cannot be remade as a new meta tensor)."""
    if (
        type(t) is not torch.Tensor
        or t.device != _META
        or t.layout is not torch.strided
        or t.requires_grad
        or t._is_view()
        or t.storage_offset() != 0
        or t.is_conj()
        or t.is_neg()
        or t.untyped_storage().nbytes() != _storage_bytes(t)
    ):
        return None
    return (t.shape, t.stride(), t.dtype)


def for_run(fake: bool) -> MetaOutputs | None:
    """The table a run's ranks share: one for a timing-only run (``fake``), else None."""
    return MetaOutputs() if fake and ENABLED else None


class MetaOutputs:
    """One run's remembered meta results (the run's ranks share it; it goes with the run)."""

    def __init__(self) -> None:
        self._known: dict[tuple[Any, ...], Any] = {}
        #: ops run through their kernel, and results remade without it (what a run's statistics may show)
        self.ran = 0
        self.remade = 0

    def call(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        """``func(*args, **kwargs)`` on meta tensors: remade from a remembered result where one applies."""
        kind = _kind(func)
        if (not kind.fresh and kind.mutated is None) or torch._C._len_torch_dispatch_stack():
            # another dispatch mode below this one (torch's FakeTensorMode inside FSDP2's set-up) makes the results
            return func(*args, **kwargs)
        parts: list[Any] = [func, torch.get_default_dtype()]
        try:
            _key_of(args, parts)
            if kwargs:
                for name in sorted(kwargs):
                    parts.append(name)
                    _key_of(kwargs[name], parts)
        except _Uncacheable:
            return func(*args, **kwargs)
        key = tuple(parts)
        known = self._known.get(key)
        if known is None:
            self.ran += 1
            if kind.fresh:
                out = func(*args, **kwargs)
                self._known[key] = _remember(out)
                return out
            mutated = _arguments(kind.mutated, args, kwargs)  # type: ignore[arg-type]
            before = [_layout(t) for t in mutated]
            out = func(*args, **kwargs)
            same = [_layout(t) for t in mutated] == before and all(map(_on_meta, mutated))
            self._known[key] = _WRITTEN if same and _returns(kind.written, out, args, kwargs) else _NO
            return out
        if known is _NO:
            self.ran += 1
            return func(*args, **kwargs)
        self.remade += 1
        if (
            known is _WRITTEN
        ):  # the op checked these operands before and changed no shape: its results are them
            results = _arguments(kind.written, args, kwargs)
            return None if not results else results[0] if len(results) == 1 else tuple(results)
        container, specs = known
        made = [torch.empty_strided(size, stride, dtype=dtype, device=_META) for size, stride, dtype in specs]
        return made[0] if container is None else container(made)


#: a key whose op writes its arguments, ran its kernel, and changed none of their shapes
_WRITTEN = object()


def _arguments(where: list[tuple[int, str]], args: Any, kwargs: dict[str, Any]) -> list[Any]:
    """The arguments at ``where`` (position, name): passed by position, or by name."""
    return [args[j] if j < len(args) else kwargs[name] for j, name in where]


def _layout(t: Any) -> Any:
    """What an op writing ``t`` might change of it (``out=`` kernels resize their outputs)."""
    if isinstance(t, torch.Tensor):
        return (t.shape, t.stride(), t.storage_offset(), t.dtype)
    return [_layout(x) for x in t]


def _on_meta(t: Any) -> bool:
    """Whether ``t`` (a tensor or a list of them) holds no values: writing it changes nothing but its shape."""
    if isinstance(t, torch.Tensor):
        return t.device == _META
    return all(map(_on_meta, t))


def _returns(where: list[tuple[int, str]], out: Any, args: Any, kwargs: dict[str, Any]) -> bool:
    """Whether ``out`` is exactly the arguments at ``where`` (None where the op returns nothing)."""
    if not where:
        return out is None
    got = [out] if len(where) == 1 else list(out)
    want = _arguments(where, args, kwargs)
    return len(got) == len(want) and all(a is b for a, b in zip(got, want))


def _remember(out: Any) -> Any:
    """How to remake ``out``: (None, [one spec]) for a tensor, (list or tuple, specs) for several, or ``_NO``."""
    if isinstance(out, torch.Tensor):
        spec = _spec(out)
        return _NO if spec is None else (None, [spec])
    if type(out) in (list, tuple) and out:
        specs = [_spec(t) for t in out]
        if any(s is None for s in specs):
            return _NO
        return type(out), specs
    return _NO
