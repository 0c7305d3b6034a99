"""The user's source line that called into the engine, so errors can point at it."""

from __future__ import annotations

import os
import sys

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def call_site() -> str:
    """Return "file:line" of the innermost frame outside simdist/autograd, or "<unknown>"."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not os.path.abspath(filename).startswith(_PACKAGE_DIR):
            return f"{filename}:{frame.f_lineno}"
        frame = frame.f_back
    return "<unknown>"
