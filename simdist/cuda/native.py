"""The two native pieces a CPU build of torch lacks for tensors whose device is CUDA, filled from Python.

1. **A CUDA device guard.** Autograd asks c10's device-guard registry for CUDA's guard (its streams) whenever a
   tensor's device is CUDA; a CPU build has none, and the lookup then fails inside ``noexcept`` code, which ends
   the process. torch ships a guard implemented for Python backends (``torch._C._acc.DeviceGuard``) that it
   only lets register for PrivateUse1: it is registered there, its C++ address read back from the registry,
   copied to CUDA's slot with c10's own ``registerDeviceGuard``, and PrivateUse1 is given back. Its vtable is
   copied too, with ``getDevice``/``setDevice``/``exchangeDevice`` answering the calling thread's current
   device (:mod:`simdist.cuda.device`): C++ resolves ``.cuda()``, ``.to("cuda")`` and ``DeviceGuard`` through
   them, and it would otherwise put every rank on ``cuda:0``; ``deviceCount`` answers the node's GPUs.
2. **CUDA as torch's accelerator.** The autograd engine tracks streams only for inputs on
   ``at::getAccelerator()``'s device type, and without a stream it refuses to add CUDA gradients ("Cannot
   access accelerator device when none is available"). ``getAccelerator()`` answers CUDA when
   ``getCUDAHooks().isBuilt()`` is true. The hooks object of a CPU build is the default
   ``CUDAHooksInterface``: while a run lasts, its vptr points at a copy of that vtable in which ``isBuilt`` is
   true, ``hasPrimaryContext`` false, ``init`` does nothing, and pinned host memory is plain CPU memory (DDP's
   reducer allocates pinned temporaries in C++ under ``find_unused_parameters`` and ``static_graph``).

Besides, torch remembers that CUDA's lazy initialisation succeeded once (in rank code, where it does nothing) and
would never run it again, where a CPU build's refuses outside the run: torch's own ``set_requires_device_init``
resets that when the run ends.

The borrowed functions are native ones of torch that answer what the slot must (the Python guard's
``queryEvent`` returns true, its ``synchronizeStream`` does nothing, the default ``isBuilt`` returns false,
c10's ``GetCPUAllocator``), so a slot never calls into Python; only the three device callbacks do, and the
guard's stream slots (``getStream``, ``exchangeStream``, ``getNewStream``), which ask the Python guard's ``type_``.
Each of these first takes any pending Python error off the thread (:mod:`simdist.cuda.pending`).

All of this depends on torch 2.13's layout (vtable slots in declaration order from its headers, the sizes
its libraries declare), the Itanium C++ ABI and a 2-byte ``c10::Device`` passed in a register: Linux on x86-64
or AArch64. :func:`problems` checks every assumption it can before anything is written, :func:`install` runs
a backward pass on a simulated GPU tensor as a last check, and any failure stops the run before a rank starts
(:class:`CudaEmulationError`, naming what is missing).
"""

from __future__ import annotations

import ctypes
import os
import platform
from typing import Any

import torch

from simdist.cuda import device, pending
from simdist.errors import CudaEmulationError

_DT = torch._C._autograd.DeviceType
_CUDA = int(_DT.CUDA.value)
_PRIVATE_USE_1 = int(_DT.PrivateUse1.value)

#: the torch releases whose layout this was written against (slots and sizes below)
SUPPORTED_TORCH = ("2.13.",)
#: platforms with the Itanium C++ ABI and a register-passed c10::Device
SUPPORTED_MACHINES = ("x86_64", "aarch64")

# c10/core/impl/DeviceGuardImplInterface.h, in declaration order (the destructors come last)
_GUARD_SLOTS = 26
_GUARD_EXCHANGE, _GUARD_GET, _GUARD_SET, _GUARD_UNCHECKED_SET = 1, 2, 3, 4
_GUARD_QUERY_EVENT, _GUARD_DEVICE_COUNT, _GUARD_SYNCHRONIZE_STREAM = 14, 15, 18
# ATen/detail/AcceleratorHooksInterface.h: two destructors, then isBuilt, isAvailable, hasPrimaryContext, init,
# ... isPinnedPtr (11), getPinnedMemoryAllocator (12); a vtable has two words before its first slot
_HOOKS_IS_BUILT, _HOOKS_HAS_PRIMARY_CONTEXT, _HOOKS_INIT = 2, 4, 5
_HOOKS_IS_PINNED_PTR, _HOOKS_PINNED_ALLOCATOR = 11, 12
_VTABLE_HEADER = 2
#: bytes of c10's device-guard registry: one pointer per device type
_REGISTRY_BYTES = 21 * 8

_REGISTRY = "_ZN3c104impl26device_guard_impl_registryE"
_REGISTER = "_ZN3c104impl19registerDeviceGuardENS_10DeviceTypeEPKNS0_24DeviceGuardImplInterfaceE"
_GET_CUDA_HOOKS = "_ZN2at6detail12getCUDAHooksEv"
_HOOKS_VTABLE = "_ZTVN2at18CUDAHooksInterfaceE"
_CPU_ALLOCATOR = "_ZN3c1015GetCPUAllocatorEv"
_REQUIRES_INIT = "_ZN5torch5utils24set_requires_device_initEN3c1010DeviceTypeEb"

# c10::Device is {int8 type; int8 index}: passed and returned in a register as a 16-bit integer
_DeviceFn = ctypes.CFUNCTYPE(ctypes.c_uint16, ctypes.c_void_p)
_ExchangeFn = ctypes.CFUNCTYPE(ctypes.c_uint16, ctypes.c_void_p, ctypes.c_uint16)
_SetFn = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_uint16)
_CountFn = ctypes.CFUNCTYPE(ctypes.c_int8, ctypes.c_void_p)
_BoolFn = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p, ctypes.c_void_p)


class _Symbol(ctypes.Structure):
    """ElfW(Sym): what ``dladdr1`` reports of a symbol (its size)."""

    _fields_ = [
        ("st_name", ctypes.c_uint32),
        ("st_info", ctypes.c_uint8),
        ("st_other", ctypes.c_uint8),
        ("st_shndx", ctypes.c_uint16),
        ("st_value", ctypes.c_uint64),
        ("st_size", ctypes.c_uint64),
    ]


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


class _CudaGuard(torch._C._acc.DeviceGuard):
    """torch's guard for Python backends (no-op streams and events), for device type CUDA."""

    def type_(self) -> Any:
        # C++ calls this from the guard's stream slots, also while it unwinds from a Python error (the autograd
        # engine's stream guard, when a backward hook raised): with the error still set the call would fail in
        # ``noexcept`` code and end the process
        pending.take()
        return _DT.CUDA


def _packed(index: int) -> int:
    return ((index & 0xFF) << 8) | _CUDA


# Each callback first takes any pending Python error off the thread (see simdist.cuda.pending): C++ calls
# uncheckedSetDevice while it unwinds from an op that raised.
def _get_device(this: int) -> int:
    pending.take()
    return _packed(device.current())


def _set_device(this: int, packed: int) -> None:
    pending.take()
    index = (packed >> 8) & 0xFF
    if index != 0xFF and index < device.count():  # -1: stay; an unknown ordinal was refused in Python already
        device.set_current(index)


def _exchange_device(this: int, packed: int) -> int:
    old = _packed(device.current())
    _set_device(this, packed)
    return old


def _device_count(this: int) -> int:
    pending.take()
    return max(1, min(device.count(), 127))


class _Native:
    """The process's handles on torch's libraries, and what has been built from them (once per process)."""

    def __init__(self) -> None:
        lib = os.path.join(os.path.dirname(torch.__file__), "lib")
        self.c10 = ctypes.CDLL(os.path.join(lib, "libc10.so"))
        self.torch_cpu = ctypes.CDLL(os.path.join(lib, "libtorch_cpu.so"))
        self.registry = self._address(self.c10, _REGISTRY)
        register = getattr(self.c10, _REGISTER)
        register.argtypes, register.restype = [ctypes.c_int8, ctypes.c_void_p], None
        self.register = register
        get_hooks = getattr(self.torch_cpu, _GET_CUDA_HOOKS)
        get_hooks.restype = ctypes.c_void_p
        self.hooks = get_hooks()
        self.hooks_vtable = self._address(self.torch_cpu, _HOOKS_VTABLE)
        self.cpu_allocator = self._address(self.c10, _CPU_ALLOCATOR)
        self.torch_python = ctypes.CDLL(os.path.join(lib, "libtorch_python.so"))
        requires_init = getattr(self.torch_python, _REQUIRES_INIT)
        requires_init.argtypes, requires_init.restype = [ctypes.c_int8, ctypes.c_bool], None
        #: torch's flag that CUDA still needs its lazy initialisation (torch.cuda._lazy_init, once per process)
        self.requires_init = requires_init
        #: the guard object (kept alive for the process: the registry holds a raw pointer to it), its C++
        #: address, and the vtable copy and callbacks it points at
        self.guard: _CudaGuard | None = None
        self.guard_address = 0
        self._keep: list[Any] = []
        #: the patched copy of the hooks' vtable, built once
        self.hooks_table: Any = None
        self.hooks_original = 0

    @staticmethod
    def _address(lib: ctypes.CDLL, name: str) -> int:
        return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value or 0

    def slot(self, device_type: int) -> ctypes.c_void_p:
        """Device type ``device_type``'s entry in c10's guard registry."""
        return ctypes.c_void_p.from_address(self.registry + 8 * device_type)

    def hooks_vptr(self) -> ctypes.c_void_p:
        """The vptr of torch's CUDA hooks object."""
        return ctypes.c_void_p.from_address(self.hooks)


_state: dict[str, Any] = {"native": None, "installed": False}


def _symbol_size(address: int) -> int | None:
    """The size the dynamic symbol table declares for the symbol at ``address`` (glibc's ``dladdr1``), or None."""
    try:
        dladdr1 = ctypes.CDLL(None).dladdr1
    except (AttributeError, OSError):
        return None
    dladdr1.argtypes = [
        ctypes.c_void_p,
        ctypes.POINTER(_DlInfo),
        ctypes.POINTER(ctypes.c_void_p),
        ctypes.c_int,
    ]
    info, extra = _DlInfo(), ctypes.c_void_p()
    if not dladdr1(address, ctypes.byref(info), ctypes.byref(extra), 1) or not extra.value:  # RTLD_DL_SYMENT
        return None
    return int(ctypes.cast(extra, ctypes.POINTER(_Symbol)).contents.st_size)


def problems() -> list[str]:
    """What stops the simulated CUDA device from being set up in this process (empty if nothing does)."""
    found: list[str] = []
    if not torch.__version__.startswith(SUPPORTED_TORCH):
        found.append(
            f"torch {torch.__version__} (the native layout used is that of torch {', '.join(SUPPORTED_TORCH)}x)"
        )
    if platform.system() != "Linux" or platform.machine() not in SUPPORTED_MACHINES:
        found.append(
            f"platform {platform.system()} {platform.machine()} (supported: Linux on {', '.join(SUPPORTED_MACHINES)})"
        )
    if torch.version.cuda is not None or torch.backends.cuda.is_built():
        found.append("a torch build with CUDA (the emulation is for CPU builds; run GPU code on its GPUs)")
    if found:
        return found
    try:
        native = _native()
    except (OSError, AttributeError) as e:
        return [f"torch's native symbols ({e})"]
    if _symbol_size(native.registry) != _REGISTRY_BYTES:
        found.append(
            f"c10's device-guard registry of {_REGISTRY_BYTES} bytes (found {_symbol_size(native.registry)})"
        )
    if native.slot(_CUDA).value not in (None, native.guard_address or None):
        found.append("an empty CUDA device-guard slot (another library registered a CUDA guard)")
    if native.slot(_PRIVATE_USE_1).value:
        found.append(
            "a free PrivateUse1 device-guard slot (a PrivateUse1 backend is registered in this process)"
        )
    vptr = native.hooks_vptr().value
    table = native.hooks_table
    if vptr not in (
        native.hooks_vtable + 8 * _VTABLE_HEADER,
        None if table is None else ctypes.addressof(table) + 16,
    ):
        found.append("torch's default CUDAHooksInterface as the CUDA hooks (another library replaced them)")
    size = _symbol_size(native.hooks_vtable)
    if size is None or size % 8 or size // 8 <= _VTABLE_HEADER + _HOOKS_PINNED_ALLOCATOR:
        found.append(f"the vtable of at::CUDAHooksInterface with its size (found {size})")
    return found


def _native() -> _Native:
    native = _state["native"]
    if native is None:
        native = _state["native"] = _Native()
    return native


def _build_guard(native: _Native) -> None:
    """Register the CUDA guard (borrowing the PrivateUse1 slot to learn its address); once per process."""
    guard = _CudaGuard()
    if not torch._C._acc.register_python_privateuseone_device_guard(guard):
        raise CudaEmulationError(
            "could not register torch's Python device guard (the PrivateUse1 slot is taken)"
        )
    address = native.slot(_PRIVATE_USE_1).value or 0
    native.register(_PRIVATE_USE_1, None)
    vptr = ctypes.c_void_p.from_address(address)
    table = (ctypes.c_void_p * _GUARD_SLOTS).from_buffer_copy(ctypes.string_at(vptr.value, _GUARD_SLOTS * 8))
    callbacks = [
        _DeviceFn(_get_device),
        _SetFn(_set_device),
        _ExchangeFn(_exchange_device),
        _CountFn(_device_count),
    ]
    table[_GUARD_GET] = ctypes.cast(callbacks[0], ctypes.c_void_p).value
    table[_GUARD_SET] = table[_GUARD_UNCHECKED_SET] = ctypes.cast(callbacks[1], ctypes.c_void_p).value
    table[_GUARD_EXCHANGE] = ctypes.cast(callbacks[2], ctypes.c_void_p).value
    table[_GUARD_DEVICE_COUNT] = ctypes.cast(callbacks[3], ctypes.c_void_p).value
    vptr.value = ctypes.addressof(table)
    native.guard, native.guard_address = guard, address
    native._keep += [table, callbacks]
    # the borrowed slots must answer what the hooks need of them
    query_event = _BoolFn(table[_GUARD_QUERY_EVENT])
    if query_event(address, None) is not True:
        raise CudaEmulationError("torch's Python device guard's queryEvent does not return true")


def _build_hooks_table(native: _Native) -> Any:
    size = _symbol_size(native.hooks_vtable) or 0
    words = size // 8
    table = (ctypes.c_void_p * words).from_buffer_copy(ctypes.string_at(native.hooks_vtable, size))
    guard_table = ctypes.c_void_p.from_address(native.guard_address).value or 0
    borrowed = [ctypes.c_void_p.from_address(guard_table + 8 * i).value for i in range(_GUARD_SLOTS)]
    true_fn, no_op = borrowed[_GUARD_QUERY_EVENT], borrowed[_GUARD_SYNCHRONIZE_STREAM]
    false_fn = table[_VTABLE_HEADER + _HOOKS_IS_BUILT]
    if _BoolFn(false_fn)(native.hooks, None) is not False:
        raise CudaEmulationError("at::CUDAHooksInterface::isBuilt does not return false on this build")
    table[_VTABLE_HEADER + _HOOKS_IS_BUILT] = true_fn
    table[_VTABLE_HEADER + _HOOKS_HAS_PRIMARY_CONTEXT] = false_fn
    table[_VTABLE_HEADER + _HOOKS_INIT] = no_op
    table[_VTABLE_HEADER + _HOOKS_IS_PINNED_PTR] = true_fn
    table[_VTABLE_HEADER + _HOOKS_PINNED_ALLOCATOR] = native.cpu_allocator
    return table


def install(devices: int) -> None:
    """Make ``devices`` simulated CUDA devices usable from C++ (the guard, CUDA as the accelerator) until
    :func:`uninstall`; raises :class:`CudaEmulationError` naming what is missing, having changed nothing."""
    missing = problems()
    if missing:
        raise CudaEmulationError(
            "simulated CUDA devices need, in this process: " + "; ".join(missing) + ". Run CUDA code on a "
            "supported torch (pip install 'torch>=2.13,<2.14' CPU build) or run a program written for the CPU"
        )
    native = _native()
    if native.guard is None:
        _build_guard(native)
    if native.hooks_table is None:
        native.hooks_table = _build_hooks_table(native)
    device.set_count(devices)
    native.register(_CUDA, native.guard_address)
    vptr = native.hooks_vptr()
    native.hooks_original = vptr.value or 0
    vptr.value = ctypes.addressof(native.hooks_table) + 8 * _VTABLE_HEADER
    _state["installed"] = True
    try:
        if torch._C._accelerator_getAccelerator().type != "cuda":
            raise CudaEmulationError(
                "torch's accelerator does not answer CUDA once the CUDA hooks are patched"
            )
    except BaseException:
        uninstall()
        raise


def uninstall() -> None:
    """Undo :func:`install`: torch's CUDA hooks and an empty CUDA guard slot, as before."""
    if not _state["installed"]:
        return
    native = _native()
    native.hooks_vptr().value = native.hooks_original
    native.register(_CUDA, None)
    # torch remembers that CUDA's lazy initialisation succeeded (in rank code) and would never run it again: a
    # CPU build's, which refuses, must run outside the run as before
    native.requires_init(_CUDA, True)
    device.set_count(0)
    _state["installed"] = False


def state() -> tuple[int, int, int]:
    """What this module changes in the process, as it is now: torch's CUDA hooks' vptr, c10's CUDA guard slot and
    the simulated device count (for the check that a run leaves the process as it found it)."""
    try:
        native = _native()
    except (OSError, AttributeError):
        return 0, 0, device.count()
    return native.hooks_vptr().value or 0, native.slot(_CUDA).value or 0, device.count()


def installed() -> bool:
    """Whether simulated CUDA devices are usable from C++ now (between :func:`install` and :func:`uninstall`)."""
    return bool(_state["installed"])
