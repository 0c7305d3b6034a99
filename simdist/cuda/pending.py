"""Python errors in flight while C++ unwinds through the simulated device guard, kept for the program.

When an op raises inside a torch binding that holds a C++ device guard (``copy_``, indexing, item assignment,
``new_tensor``), torch leaves the Python error set while C++ unwinds, and the guard's destructor calls the
simulated guard's ``uncheckedSetDevice``, a ctypes callback (:mod:`simdist.cuda.native`). Python code that runs
with an error set is a fault: ctypes would replace the error with a SystemError, print it as "Exception ignored"
and clear it, and the binding would then return to the program without any error (a SystemError "returned NULL
without setting an exception", or nothing at all for item assignment through the type slot).

So each callback first takes the pending error off its thread (CPython's ``PyErr_Fetch``, called through ctypes
before anything can look at the error) and keeps it (:func:`take`); the tensor methods around those bindings
raise it again in place of the SystemError (:func:`guarded`).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from typing import Any

# ctypes.pythonapi calls hold the GIL; no argtypes, so that calling them runs no Python-level conversion
_fetch = ctypes.pythonapi.PyErr_Fetch
_fetch.restype = None
_normalize = ctypes.pythonapi.PyErr_NormalizeException
_normalize.restype = None
_set_traceback = ctypes.pythonapi.PyException_SetTraceback
_decref = ctypes.pythonapi.Py_DecRef
_decref.restype = None

#: where PyErr_Fetch writes (type, value, traceback); one thread runs Python at a time and reads them at once
_SLOTS = (ctypes.c_void_p * 3)()
_ARGS = tuple(ctypes.c_void_p(ctypes.addressof(_SLOTS) + 8 * i) for i in range(3))
_kept = threading.local()


def take() -> None:
    """Move the calling thread's pending Python error, if any, to its kept error (a callback's first call)."""
    _fetch(*_ARGS)  # before anything else: with the error still set, any other call would fail
    kind, value, traceback = _SLOTS[0], _SLOTS[1], _SLOTS[2]  # out of the shared slots at once
    _SLOTS[0] = _SLOTS[1] = _SLOTS[2] = None
    if not kind:
        return
    slots = (ctypes.c_void_p * 3)(kind, value, traceback)
    _normalize(*(ctypes.c_void_p(ctypes.addressof(slots) + 8 * i) for i in range(3)))
    kind, value, traceback = slots
    if value and traceback:
        _set_traceback(ctypes.c_void_p(value), ctypes.c_void_p(traceback))
    error = ctypes.cast(value, ctypes.py_object).value if value else None
    for reference in (kind, value, traceback):
        if reference:
            _decref(ctypes.c_void_p(reference))  # PyErr_Fetch handed over its references
    _kept.error = error


def kept() -> BaseException | None:
    """The error kept for the calling thread, no longer kept (None where there is none)."""
    error = getattr(_kept, "error", None)
    _kept.error = None
    return error if isinstance(error, BaseException) else None


def guarded(binding: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``binding(*args, **kwargs)`` (a torch binding that holds a device guard), raising the error kept while it ran
    where it returned without one (a SystemError, or nothing for a type slot)."""
    _kept.error = None
    try:
        out = binding(*args, **kwargs)
    except SystemError as e:
        error: BaseException = kept() or e
    else:
        late = kept()
        if late is None:
            return out
        error = late
    raise error
