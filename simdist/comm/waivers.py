"""Race waivers: known race findings, named by call site, that do not stop a run under ``races="error"``.

A waiver is a pattern ``PATH[:LINE][:FUNCTION]``: ``PATH`` is a file, or the end of a file's path at a
directory boundary (``schedules.py`` and ``torch/distributed/pipelining/schedules.py`` both name torch's
``.../torch/distributed/pipelining/schedules.py``; ``stage.py`` does not name ``backstage.py``). ``LINE`` and
``FUNCTION`` (a function's name as Python reports it, ``_warmup_p2p``, ``<lambda>``) narrow it. A waiver
matches a call site when it matches any of its frames: torch's frames between the operation and the user's
code, or the user's frame (see :class:`simdist.clock.sites.Site`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from simdist.clock.sites import Frame
from simdist.errors import RunArgumentError

#: what the FUNCTION part may be: a Python name, or one of the bracketed names Python gives code objects
_FUNCTION = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|<[a-z]+>")

_FORM = (
    "expected PATH[:LINE][:FUNCTION], PATH a file or the end of its path ending in .py (or a '<...>' name such "
    "as '<string>'), e.g. 'torch/distributed/pipelining/schedules.py:_warmup_p2p' or 'train.py:45'"
)


@dataclass(frozen=True)
class RaceWaiver:
    """One parsed waiver: the text given, the path suffix, and the optional line and function name."""

    text: str
    path: str
    line: int | None
    function: str | None

    def matches(self, frame: Frame) -> bool:
        """Whether this waiver names ``frame`` (absolute file name, line, function)."""
        path, line, function = frame
        if self.line is not None and line != self.line:
            return False
        if self.function is not None and function != self.function:
            return False
        return path == self.path or path.endswith(os.sep + self.path)

    def matches_site(self, site: Any) -> bool:
        """Whether this waiver names any frame of ``site`` (a :class:`Site`; plain text has no frames)."""
        return any(self.matches(f) for f in getattr(site, "frames", ()))


def parse_waiver(text: str) -> RaceWaiver:
    """Parse ``PATH[:LINE][:FUNCTION]``; raise :class:`RunArgumentError` saying what is wrong."""
    path, *rest = text.strip().split(":")
    line: int | None = None
    function: str | None = None
    if len(rest) > 2:
        raise RunArgumentError(f"race waiver {text!r} has {len(rest) + 1} ':'-separated parts; {_FORM}")
    for i, part in enumerate(rest):
        if part.isascii() and part.isdigit() and i == 0:
            line = int(part)
            if line < 1:
                raise RunArgumentError(f"race waiver {text!r}: line {part} does not exist (lines count from 1); {_FORM}")
        elif _FUNCTION.fullmatch(part) and (i == 1 or len(rest) == 1):
            function = part
        else:
            what = ("a line number", "a function's name")[i] if len(rest) == 2 else "a line number or a function's name"
            hint = " (a method is named alone: '_recv', not 'Stage._recv')" if "." in part else ""
            raise RunArgumentError(f"race waiver {text!r}: {part!r} is not {what}{hint}; {_FORM}")
    named = path.startswith("<") and path.endswith(">")
    if not named:
        path = os.path.normpath(path) if path else path
    if not (named or (path.endswith(".py") and not path.startswith(".."))):
        raise RunArgumentError(f"race waiver {text!r}: {path!r} does not name a Python file; {_FORM}")
    return RaceWaiver(text, path, line, function)


def parse_waivers(waivers: Sequence[str] | None) -> tuple[RaceWaiver, ...]:
    """Parse ``run(race_waivers=...)``, pattern strings (their types checked by :class:`simdist.options.RunOptions`)."""
    if waivers is None:
        return ()
    parsed: list[RaceWaiver] = []
    for w in waivers:
        if any(p.text == w for p in parsed):
            raise RunArgumentError(f"race_waivers lists {w!r} twice; list each pattern once")
        parsed.append(parse_waiver(w))
    return tuple(parsed)
