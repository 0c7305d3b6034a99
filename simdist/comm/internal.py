"""A context for the simulator's own tensor work inside rank threads.

Copies and reductions the simulator performs on a rank's behalf (message payloads, internal buffers) are
communication, not the rank's compute: they must not pass through the rank's cost-model dispatch mode (which
would charge them and costs microseconds per op) nor be recorded by autograd.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import _disable_current_modes


@contextlib.contextmanager
def internal() -> Iterator[None]:
    """Run tensor operations with no dispatch mode and no autograd recording."""
    with _disable_current_modes(), torch.no_grad():
        yield
