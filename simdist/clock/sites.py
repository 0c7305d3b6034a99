"""Call sites of operations: the user's frame, and a library's own frame when library code issued the operation.

An operation issued by torch's own code (a pipeline schedule's warm-up, FSDP's all-gather, an optimizer reading
a gradient) is named by two frames: torch's line that issued it and the user's line that led there, as in
``torch/distributed/pipelining/schedules.py:648 in _batch_p2p, called from train.py:45 in main``. An operation
the user called directly (``dist.all_reduce``) is named by the user's line alone: the frames of torch's public
entry points (:data:`TORCH_ENTRY`) are looked through, never shown. Other libraries the caller names
(simdist's strategies: their FSDP's all-gather, their DDP's all-reduce) are named as torch is: their line,
called from the user's.
"""

from __future__ import annotations

import enum
import os
import sys
from types import CodeType, FrameType

import torch
from typing_extensions import Self

#: torch's package directory, with a trailing separator: frames under it are torch's own
TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
#: length of the prefix dropped when showing a torch frame (so it reads ``torch/distributed/...``)
_TORCH_PARENT = len(os.path.dirname(TORCH_DIR.rstrip(os.sep))) + 1

#: torch's public entry points (paths under :data:`TORCH_DIR`; a trailing separator names a directory): an
#: operation whose innermost torch frames lie here was called by the code around them, which is the site
#: worth naming. The c10d and functional-collective APIs and their logging wrappers; the dispatcher's op
#: objects; autograd's entry (torch's C++ DDP reducer issues its all-reduces from inside ``backward()``).
TORCH_ENTRY = tuple(
    TORCH_DIR + p.replace("/", os.sep)
    for p in (
        "distributed/distributed_c10d.py",
        "distributed/c10d_logger.py",
        "distributed/_functional_collectives.py",
        "distributed/_functional_collectives_impl.py",
        "_ops.py",
        "_tensor.py",
        "autograd/",
        "utils/_contextlib.py",
    )
)

#: one frame: (absolute file name, line, function)
Frame = tuple[str, int, str]

#: (id of a code object, offset of its call instruction, ...) of a site's frames -> the site. Programs issue
#: their operations from few places, again and again; finding a frame's line scans its function's line
#: table (~0.6 us for a small function, more for torch's long ones), so each site is built once. A site
#: holds its code objects, so their ids cannot be reused while its entry exists.
_SITES: dict[tuple[int, ...], Site] = {}
#: entries kept before the table starts over (programs that generate code keep adding code objects)
_SITES_MAX = 1 << 16


def _line(code: CodeType, lasti: int) -> int:
    """The line of the instruction at byte offset ``lasti`` of ``code`` (what ``frame.f_lineno`` gives)."""
    return next((n for a, b, n in code.co_lines() if a <= lasti < b and n is not None), code.co_firstlineno)


def _frame(code: CodeType, lasti: int) -> Frame:
    return (code.co_filename, _line(code, lasti), code.co_name)


class Site(str):
    """A call site as text (what messages show), carrying the frames it stands for.

    ``frames`` lists, innermost first, torch's frames between the operation and the user's code (its entry
    points left out), then the user's frame (absent when no user code is on the stack). A race waiver
    matches any of them. Their lines are found when first asked for: most sites are only ever shown.
    """

    #: the user's frame, None when torch's or the simulator's own threads issued the operation
    user: Frame | None
    _frames: tuple[Frame, ...] | None
    _calls: tuple[tuple[CodeType, int], ...]

    def __new__(cls, text: str, frames: tuple[Frame, ...], user: Frame | None) -> Self:
        site = super().__new__(cls, text)
        site._frames = frames
        site.user = user
        return site

    @property
    def frames(self) -> tuple[Frame, ...]:
        """(file, line, function) of torch's frames between the operation and the user's, then the user's."""
        if self._frames is None:
            self._frames = tuple(_frame(c, i) for c, i in self._calls)
        return self._frames

    def __reduce__(self) -> tuple:
        return (Site, (str(self), self.frames, self.user))


def _build(key: tuple[int, ...], calls: list[tuple[CodeType, int]], has_user: bool) -> Site:
    """The site of ``calls`` (torch's frames innermost first, then the user's if ``has_user``), remembered."""
    first = _frame(*calls[0])
    user = _frame(*calls[-1]) if has_user else None
    if user is None:
        text = show(first)
    elif len(calls) == 1:
        text = f"{user[0]}:{user[1]} in {user[2]}"
    else:
        text = f"{show(first)}, called from {user[0]}:{user[1]} in {user[2]}"
    site = str.__new__(Site, text)
    site._frames = None
    site._calls = tuple(calls)
    site.user = user
    if len(_SITES) >= _SITES_MAX:
        _SITES.clear()
    _SITES[key] = site
    return site


def show(frame: Frame) -> str:
    """``path:line in function``, torch's files relative to torch's parent directory."""
    path, line, func = frame
    if path.startswith(TORCH_DIR):
        path = path[_TORCH_PARENT:]
    return f"{path}:{line} in {func}"


def caller_site(skip_prefixes: tuple[str, ...], library: tuple[str, ...] = ()) -> Site:
    """The call site of the operation being issued, seen from the innermost frame outward.

    Frames under ``skip_prefixes`` (the simulator's own) and torch's entry points are passed over. torch's
    other frames, and frames under ``library`` (code that, like torch's, issues operations for the user), are
    collected; the innermost of them is shown before the user's frame, the innermost frame that is none of
    these. Cost: a string test or two per frame up to the user's and one table look-up; a site seen for the
    first time is built (lines, text) and remembered.
    """
    innermost = frame = sys._getframe(1)
    key: list[int] = []
    has_user = False
    while frame is not None:
        code = frame.f_code
        fname = code.co_filename
        if fname.startswith(TORCH_DIR) or fname.startswith(library):
            if not fname.startswith(TORCH_ENTRY):
                key.append(id(code))
                key.append(frame.f_lasti)
        elif not fname.startswith(skip_prefixes):
            if not key:  # the user called the operation: the common case, kept short
                k = (id(code), frame.f_lasti)
                return _SITES.get(k) or _build(k, [(code, frame.f_lasti)], True)
            key.append(id(code))
            key.append(frame.f_lasti)
            has_user = True
            break
        frame = frame.f_back
    if not key:
        return Site("<unknown>", (), None)
    # has_user ends the key: a library's frame is the user's frame to a caller that names no library, and the
    # short key of that caller's common case (one frame, no flag) is never the key of a longer walk
    k = (*key, has_user)
    site = _SITES.get(k)
    if site is None:  # walk again for the code objects (rare: once per site)
        calls = []
        frame = innermost
        while frame is not None and len(calls) < len(key) // 2:
            fname = frame.f_code.co_filename
            if not fname.startswith(TORCH_ENTRY) and (fname.startswith(TORCH_DIR) or not fname.startswith(skip_prefixes)):
                calls.append((frame.f_code, frame.f_lasti))
            frame = frame.f_back
        site = _build(k, calls, has_user)
    return site


#: an argument longer than this when shown is left out of :func:`torch_scope`
_SCOPE_ARG_MAX = 24


def _short(value: object) -> str | None:
    """``value`` as a short label (a number, a string, a tuple of them such as a schedule's action), or None."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float, str)) or (
        isinstance(value, tuple) and all(v is None or isinstance(v, (int, float, str, enum.Enum)) for v in value)
    ):
        text = repr(value) if not isinstance(value, tuple) else str(value)
        return text if len(text) <= _SCOPE_ARG_MAX and "\n" not in text else None
    return None


def torch_scope(frame: FrameType | None) -> str:
    """torch's frames from ``frame`` outward that have short arguments, innermost first, as ``f(a=1F0)``.

    Says where inside torch's code a blocked thread waits when torch's own loop drives the operations: a
    pipeline schedule's runtime waits in ``_perform_action(action=1F0)`` (stage 1, forward, microbatch 0).
    Only numbers, strings and tuples of them are shown, so no tensor is ever printed; "" when none.
    """
    parts = []
    while frame is not None:
        code = frame.f_code
        if code.co_filename.startswith(TORCH_DIR) and not code.co_filename.startswith(TORCH_ENTRY):
            names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
            shown = [f"{n}={t}" for n in names if n != "self" and (t := _short(frame.f_locals.get(n))) is not None]
            if shown:
                parts.append(f"{code.co_name}({', '.join(shown)})")
        frame = frame.f_back
    return ", in ".join(parts)
