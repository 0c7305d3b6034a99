"""Rank code's own ``init_process_group`` in a rank process: accepted where real made the group, noted elsewhere.

An entry function runs inside the default group real created for it, yet most rank code written for torchrun
calls ``init_process_group`` itself, which torch refuses ("trying to initialize the default process group
twice!"). Such a call is accepted, keeping real's group, when it asks for what real created (the same backend,
rank and world size); otherwise it fails naming both. A torchrun-style script creates its own group, and real
only notes that it did, and with which backend.

Why a closure cell: rank code often binds the function before real runs (``from torch.distributed import
init_process_group`` at the top of a module that the process imported while starting), so replacing the module
attribute would miss that name. Every binding refers to one function object, torch's logging wrapper, which
calls the function held in its closure cell ``func``; replacing that cell's content reaches every caller,
however it named the function. A torch release that shapes the wrapper otherwise gets its module attributes
replaced instead, which reaches ``dist.init_process_group(...)`` and names bound afterwards.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import sys
from collections.abc import Callable, Iterator
from datetime import timedelta
from types import CellType
from typing import Any

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from real.errors import RealGroupError

#: what a handler receives: torch's own init_process_group, and the call's positional and keyword arguments
Handler = Callable[[Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any]

# Frames of these directories are not the caller's: torch.distributed's wrappers and real itself.
_NOT_CALLERS = (os.path.dirname(dist.__file__), os.path.dirname(__file__), functools.__file__)


@contextlib.contextmanager
def intercepted(handler: Handler) -> Iterator[None]:
    """Route every call of ``init_process_group`` in this process through ``handler`` while the block runs."""
    public = c10d.init_process_group
    cell = _wrapped_cell(public)
    if cell is not None:
        inner = cell.cell_contents
        cell.cell_contents = _calling(handler, inner)
        try:
            yield
        finally:
            cell.cell_contents = inner
        return
    saved = dist.init_process_group
    dist.init_process_group = c10d.init_process_group = _calling(handler, public)
    try:
        yield
    finally:
        dist.init_process_group, c10d.init_process_group = saved, public


def observer(record: Callable[[str], None]) -> Handler:
    """A handler that lets torch create the group and then calls ``record`` with its backend's name."""

    def observe(init: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        result = init(*args, **kwargs)
        record(str(dist.get_backend()))
        return result

    return observe


def keeper(group: dist.ProcessGroup, backend: str, rank: int, world_size: int) -> Handler:
    """A handler that accepts a call asking for ``group`` (real's, with ``backend``) while it is the default."""

    def keep(init: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not dist.is_initialized() or c10d._get_default_group() is not group:
            return init(*args, **kwargs)  # destroyed meanwhile, or replaced: torch decides
        try:
            call = inspect.signature(init).bind(*args, **kwargs).arguments
        except TypeError:
            return init(*args, **kwargs)  # torch's own error for arguments it does not take
        problem = conflict(call, backend, rank, world_size)
        if problem is not None:
            raise RealGroupError(f"rank {rank}: {_describe(call)} at {caller_site()}: {problem}")
        timeout = call.get("timeout")
        if isinstance(timeout, timedelta) and hasattr(c10d, "_set_pg_timeout"):
            c10d._set_pg_timeout(timeout, group)  # as torch would have created the group with it
        return None

    return keep


def conflict(call: dict[str, Any], backend: str, rank: int, world_size: int) -> str | None:
    """Why an ``init_process_group`` call with arguments ``call`` cannot use real's group; None if it can."""
    asked = call.get("backend")
    if asked is not None and backends_named(asked) != {backend}:
        return (
            f"real already created this process's default group with backend {backend!r} before calling the "
            f"entry function, and this call asks for {str(asked)!r}. Ask for {backend!r} or no backend; or "
            f"have real create what the code asks for (--backend / real.run(..., backend=...), gloo or nccl); "
            f"or run the script torchrun-style (python -m real without --entry), where it creates its own group"
        )
    launcher = f"(RANK={rank}, WORLD_SIZE={world_size} from the launcher)"
    if call.get("world_size", -1) not in (-1, world_size):
        return (
            f"world_size={call['world_size']!r}, but the group real created has {world_size} processes "
            f"{launcher}; pass {world_size} or leave it out"
        )
    if call.get("rank", -1) not in (-1, rank):
        return (
            f"rank={call['rank']!r}, but this process is rank {rank} {launcher}; pass {rank} or leave it out"
        )
    return None


def backends_named(backend: object) -> set[str]:
    """The backends ``init_process_group(backend=...)`` names: ``"gloo"`` or a map ``"cpu:gloo,cuda:nccl"``."""
    return {part.rpartition(":")[2].strip().lower() for part in str(backend).split(",")}


def caller_site() -> str:
    """``file:line`` of the innermost frame outside torch.distributed and real: the rank code's call."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_NOT_CALLERS):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return "an unknown line"
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


def cut_at_caller(exc: BaseException) -> None:
    """Drop the traceback frames after the rank code's last one: torch's wrapper and this module's handler."""
    tb, last = exc.__traceback__, None
    while tb is not None:
        if not tb.tb_frame.f_code.co_filename.startswith(_NOT_CALLERS):
            last = tb
        tb = tb.tb_next
    if last is not None:
        last.tb_next = None


def _describe(call: dict[str, Any]) -> str:
    """The call as the user wrote it, roughly: ``init_process_group(backend='nccl')``."""
    shown = ", ".join(f"{k}={v!r}" for k, v in call.items())
    return f"init_process_group({shown})"


def _calling(handler: Handler, init: Callable[..., Any]) -> Callable[..., Any]:
    """A function that looks like ``init`` (name, signature) and hands each call to ``handler``."""

    @functools.wraps(init)
    def call(*args: Any, **kwargs: Any) -> Any:
        return handler(init, args, kwargs)

    return call


def _wrapped_cell(public: Callable[..., Any]) -> CellType | None:
    """The closure cell holding the function torch's logging wrapper calls, if ``public`` is shaped so."""
    code = getattr(public, "__code__", None)
    closure = getattr(public, "__closure__", None)
    if code is None or not closure or code.co_freevars != ("func",):
        return None
    inner = closure[0].cell_contents
    if not callable(inner) or getattr(inner, "__name__", None) != "init_process_group":
        return None
    return closure[0]
