"""``simdist.comm.internal`` does what ``with _disable_current_modes(), torch.no_grad():`` does (torch's own
functions are the oracle), whatever dispatch modes are active, with grad on or off, and when the block raises."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch._ops import _len_torch_dispatch_stack_pre_dispatch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch._subclasses.functional_tensor import FunctionalTensorMode
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _disable_current_modes,
    _get_current_dispatch_mode_stack,
)

from simdist.comm.internal import internal


class _Counting(TorchDispatchMode):
    """Counts the ops that reach it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.ops += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _torch_way() -> Iterator[None]:
    with _disable_current_modes(), torch.no_grad():
        yield


def _modes(kind: str) -> list[Any]:
    """The modes a case enters, outermost first."""
    if kind == "none":
        return []
    if kind == "one":
        return [_Counting()]
    if kind == "two":
        return [_Counting(), _Counting()]
    if kind == "fake":  # an infra mode: torch keeps it in a slot of its own on the stack
        return [FakeTensorMode(), _Counting()]
    # "pre-dispatch": export tracing's stack, which holds torch's own modes only
    return [FunctionalTensorMode(pre_dispatch=True), _Counting()]


def _observe(context: Callable[[], Any], kind: str, grad: bool, raises: bool) -> list[Any]:
    """What a block under ``context`` sees, and what is left once it is done, as comparable values."""
    seen: list[Any] = []
    modes = _modes(kind)
    with contextlib.ExitStack() as stack:
        for m in modes:
            stack.enter_context(m)
        torch.set_grad_enabled(grad)
        before = _get_current_dispatch_mode_stack()
        pre = _len_torch_dispatch_stack_pre_dispatch()
        try:
            with context():
                counts = [getattr(m, "ops", None) for m in modes]
                x = torch.ones(3, requires_grad=True) * 2  # reaches no mode; not recorded
                seen += [
                    len(_get_current_dispatch_mode_stack()),
                    _len_torch_dispatch_stack_pre_dispatch(),
                    torch.is_grad_enabled(),
                    x.requires_grad,
                    [getattr(m, "ops", None) for m in modes] == counts,
                ]
                if raises:
                    raise KeyError("inside")
        except KeyError as e:
            seen.append(str(e))
        after = _get_current_dispatch_mode_stack()
        seen += [
            [modes.index(m) if m in modes else type(m).__name__ for m in after],
            all(a is b for a, b in zip(before, after)) and len(before) == len(after),
            _len_torch_dispatch_stack_pre_dispatch() == pre,
            torch.is_grad_enabled(),
        ]
        torch.set_grad_enabled(True)
    return seen


@pytest.mark.parametrize(
    "kind, grad, raises",
    list(itertools.product(["none", "one", "two", "fake", "pre-dispatch"], [True, False], [False, True])),
)
def test_internal_is_torch_disable_current_modes_under_no_grad(kind: str, grad: bool, raises: bool) -> None:
    ours = _observe(internal, kind, grad, raises)
    assert ours == _observe(_torch_way, kind, grad, raises)
    assert ours[:5] == [0, 0, False, False, True]  # nothing active inside: no mode saw the op, autograd off
