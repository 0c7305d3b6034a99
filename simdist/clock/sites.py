"""The user's call site of an operation: the innermost frame outside the simulator's and torch's own code."""

from __future__ import annotations

import sys


def caller_site(skip_prefixes: tuple[str, ...]) -> str:
    """``file:line in function`` of the innermost frame outside simdist and torch (the user's call site)."""
    frame = sys._getframe(1)
    while frame is not None:
        fname = frame.f_code.co_filename
        if not fname.startswith(skip_prefixes):
            return f"{fname}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return "<unknown>"
