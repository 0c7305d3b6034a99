"""Call sites of operations: the user's frame, and torch's own frame when torch's code issued the operation.

An operation issued by torch's own code (a pipeline schedule's warm-up, FSDP's all-gather, an optimizer reading
a gradient) is named by two frames: torch's line that issued it and the user's line that led there, as in
``torch/distributed/pipelining/schedules.py:648 in _batch_p2p, called from train.py:45 in main``. An operation
the user called directly (``dist.all_reduce``) is named by the user's line alone: the frames of torch's public
entry points (:data:`TORCH_ENTRY`) are looked through, never shown.
"""

from __future__ import annotations

import os
import sys

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


class Site(str):
    """A call site as text (what messages show), carrying the frames it stands for.

    ``frames`` lists, innermost first, torch's frames between the operation and the user's code (its entry
    points left out), then the user's frame (absent when no user code is on the stack). A race waiver
    matches any of them.
    """

    frames: tuple[Frame, ...]
    #: the user's frame, None when torch's or the simulator's own threads issued the operation
    user: Frame | None

    def __new__(cls, text: str, frames: tuple[Frame, ...], user: Frame | None) -> Self:
        site = super().__new__(cls, text)
        site.frames = frames
        site.user = user
        return site

    def __reduce__(self) -> tuple:
        return (Site, (str(self), self.frames, self.user))


def show(frame: Frame) -> str:
    """``path:line in function``, torch's files relative to torch's parent directory."""
    path, line, func = frame
    if path.startswith(TORCH_DIR):
        path = path[_TORCH_PARENT:]
    return f"{path}:{line} in {func}"


def caller_site(skip_prefixes: tuple[str, ...]) -> Site:
    """The call site of the operation being issued, seen from the innermost frame outward.

    Frames under ``skip_prefixes`` (the simulator's own) and torch's entry points are passed over. torch's
    other frames are collected; the innermost of them is shown before the user's frame, the innermost frame
    that is neither the simulator's nor torch's. Cost: a string test or two per frame up to the user's, and a
    tuple per torch frame outside the entry points (none for an operation the user called directly).
    """
    frame = sys._getframe(1)
    frames: list[Frame] = []
    while frame is not None:
        fname = frame.f_code.co_filename
        if fname.startswith(skip_prefixes):
            pass
        elif not fname.startswith(TORCH_DIR):
            user = (fname, frame.f_lineno, frame.f_code.co_name)
            text = f"{fname}:{user[1]} in {user[2]}"
            if frames:
                text = f"{show(frames[0])}, called from {text}"
            frames.append(user)
            return Site(text, tuple(frames), user)
        elif not fname.startswith(TORCH_ENTRY):
            frames.append((fname, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    return Site(show(frames[0]) if frames else "<unknown>", tuple(frames), None)
