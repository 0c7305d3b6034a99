"""A context for the simulator's own tensor work inside rank threads.

Copies and reductions the simulator performs on a rank's behalf (message payloads, internal buffers) are
communication, not the rank's compute: they must not pass through the rank's cost-model dispatch mode (which
would charge them and costs microseconds per op) nor be recorded by autograd.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._C import _len_torch_dispatch_stack, _set_grad_enabled
from torch._ops import _len_torch_dispatch_stack_pre_dispatch
from torch.utils._python_dispatch import _disable_current_modes, _pop_mode, _push_mode


class internal:
    """Run tensor operations with no dispatch mode and no autograd recording.

    What ``with _disable_current_modes(), torch.no_grad():`` does. torch's function also takes the modes of its
    pre-dispatch stack (export tracing) apart and checks them; with none there (a rank's own modes only), it pops
    and pushes back the stack's modes as below, and costs some 15 us more per collective a rank issues, in its
    imports and generator frames.
    """

    __slots__ = ("_grad", "_modes", "_torch")

    def __enter__(self) -> None:
        if _len_torch_dispatch_stack_pre_dispatch():
            self._torch: Any = _disable_current_modes()
            self._torch.__enter__()
        else:
            self._torch = None
            self._modes = [_pop_mode() for _ in range(_len_torch_dispatch_stack())]
        self._grad = torch.is_grad_enabled()
        _set_grad_enabled(False)

    def __exit__(self, *exc: object) -> None:
        _set_grad_enabled(self._grad)
        if self._torch is not None:
            self._torch.__exit__(*exc)
            return
        for mode in reversed(self._modes):
            _push_mode(mode)
