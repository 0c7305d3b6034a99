"""Each rank's float32 precision switches, as each process of a real launch has its own.

``torch.backends.cuda.matmul.allow_tf32``, ``torch.set_float32_matmul_precision``, ``torch.backends.cudnn.allow_tf32``
and the ``fp32_precision`` attributes all write one table in torch's C++ context, per (backend, op). Rank threads
share it, so without this a rank allowing TF32 would allow it for every rank (and for the process after the
run). The cost model reads the table when it prices a matmul or a convolution (TF32 rate or not), and the CPU's
oneDNN matmuls read it too ("medium" lets them run in bfloat16), so it is one per rank.

Reading the whole table takes about 7 us, far more than a baton hand-off, so it is not read at every hand-off:
the setters are wrapped during a run, and a rank's table is read when its thread hands the baton back only if
it called one of them since it took it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

#: the (backend, op) entries of torch's float32 precision table; the legacy switches write these too
PAIRS: tuple[tuple[str, str], ...] = (
    ("generic", "all"),
    ("cuda", "all"),
    ("cuda", "matmul"),
    ("cuda", "conv"),
    ("cuda", "rnn"),
    ("mkldnn", "all"),
    ("mkldnn", "matmul"),
    ("mkldnn", "conv"),
    ("mkldnn", "rnn"),
)
#: torch._C's setters that write the table (the Python switches all call one of them)
SETTERS = (
    "_set_fp32_precision_setter",
    "_set_float32_matmul_precision",
    "_set_cublas_allow_tf32",
    "_set_cudnn_allow_tf32",
    "_set_onednn_allow_tf32",
)

#: torch._C's legacy (getter, setter) pairs. torch keeps their values beside the table (a legacy setter writes
#: both) and its legacy getters raise where the two disagree, so a rank's state holds them too.
#: The matmul precision comes last: its setter writes the cuBLAS switch too, so written before it, it would be
#: left disagreeing with what a program that set both last set.
LEGACY: tuple[tuple[str, str], ...] = (
    ("_get_cublas_allow_tf32", "_set_cublas_allow_tf32"),
    ("_get_cudnn_allow_tf32", "_set_cudnn_allow_tf32"),
    ("_get_onednn_allow_tf32", "_set_onednn_allow_tf32"),
    ("_get_float32_matmul_precision", "_set_float32_matmul_precision"),
)

#: (each legacy value, or None where torch's getter refuses to answer; the table's values in PAIRS' order)
_Table = tuple[tuple[Any, ...], tuple[str, ...]]


def _legacy(getter: str) -> Any:
    try:
        return getattr(torch._C, getter)()
    except RuntimeError:  # "you have used mix of the legacy and new APIs": no single legacy value
        return None


def _read() -> _Table:
    get = torch._C._get_fp32_precision_getter
    return tuple(_legacy(g) for g, _ in LEGACY), tuple(get(backend, op) for backend, op in PAIRS)


def _write(state: _Table) -> None:
    # The legacy values first, then the table over what their setters wrote into it.
    legacy, table = state
    for (_, setter), value in zip(LEGACY, legacy):
        if value is not None:
            getattr(torch._C, setter)(value)
    set_ = torch._C._set_fp32_precision_setter
    for (backend, op), value in zip(PAIRS, table):
        set_(backend, op, value)


class RankPrecision:
    """The float32 precision table per rank (a :class:`simdist.clock.baton.PerRankState`): each rank starts from
    the process's, and what it sets is its own."""

    def __init__(self) -> None:
        self._process = self._in_place = _read()
        self._ranks: dict[int, _Table] = {}
        #: whether the running rank called a setter since it took the baton
        self._changed = False

    def enter(self, rank: int) -> None:
        """Put ``rank``'s table in place (written only where it differs from what is)."""
        wanted = self._ranks.get(rank, self._process)
        if wanted != self._in_place:
            _write(wanted)
            self._in_place = wanted

    def leave(self, rank: int) -> None:
        """Keep the table as ``rank`` left it, if it set anything."""
        if self._changed:
            self._changed = False
            self._ranks[rank] = self._in_place = _read()

    def restore(self) -> None:
        """The run is over: the process's table, as it was before the run."""
        if self._in_place != self._process:
            _write(self._process)
            self._in_place = self._process

    def setters(self) -> dict[str, Callable[..., Any]]:
        """Replacements of torch._C's setters (and ``ContextProp.__set__``, which cuDNN's and oneDNN's switches
        bound them through at import) that note the running rank changed its table, for simdist.patching."""
        patches: dict[str, Callable[..., Any]] = {}
        for name in SETTERS:
            patches[f"torch._C.{name}"] = self._noting(getattr(torch._C, name))
        patches["torch.backends.ContextProp.__set__"] = self._noting(torch.backends.ContextProp.__set__)
        return patches

    def _noting(self, setter: Callable[..., Any]) -> Callable[..., Any]:
        def noted(*args: Any, **kwargs: Any) -> Any:
            self._changed = True
            return setter(*args, **kwargs)

        return noted
