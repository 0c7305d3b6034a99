"""Errors raised by simdist. Each names the ranks, operations and call sites involved."""

from __future__ import annotations

import torch
import torch.distributed as dist

from simdist.ranks import format_ranks
from simdist_base.errors import SimdistError


def safe_str(exc: BaseException) -> str:
    """``str(exc)``, or a placeholder when a user exception's ``__str__`` raises."""
    try:
        return str(exc)
    except Exception:  # noqa: BLE001 - a broken __str__ must not hide the report it appears in
        return f"<{type(exc).__name__}.__str__ raised>"


class ClusterSpecError(SimdistError, ValueError):
    """A cluster description is invalid (bad unit, negative bandwidth, disconnected graph, unknown preset)."""


class RankExit(BaseException):
    """Raised in a rank that called ``os._exit(code)``: its process would end at once; the run reports it.

    A ``BaseException``, as ``SystemExit``, so that ``except Exception`` does not swallow it.
    """

    def __init__(self, code: int) -> None:
        self.code = code
        super().__init__(f"os._exit({code}) called by rank code: on a real launch this rank's process ends at once")


class RunArgumentError(SimdistError, ValueError):
    """An argument of :func:`simdist.run` is invalid (not callable, a seed out of range, an unknown mode)."""


class ProfileError(SimdistError, ValueError):
    """A ``compute=`` profile cannot time a run: not a Kineto trace, no ops or shapes, another device."""


class NcclEnvironmentError(SimdistError, ValueError):
    """``NCCL_ALGO`` or ``NCCL_PROTO`` in a rank's environment names no NCCL algorithm or protocol, or
    ``NCCL_NVLS_ENABLE`` is not an integer."""


class RankError(SimdistError):
    """A rank's function raised; the original exception is ``__cause__`` and the text has its traceback."""

    def __init__(self, rank: int, exc: BaseException, traceback_text: str, others: list[int] | None = None):
        self.rank = rank
        self.exc = exc
        self.traceback_text = traceback_text
        self.others = others
        extra = f" ({format_ranks(others)} also raised)" if others else ""
        super().__init__(
            f"rank {rank} raised {type(exc).__name__}: {safe_str(exc)}{extra}\n"
            f"--- traceback of rank {rank} ---\n{traceback_text}"
        )

    def __reduce__(self) -> tuple:
        # rebuilt from its fields, as an exploration's worker process sends it back
        return (type(self), (self.rank, self.exc, self.traceback_text, self.others))


class InvalidArgumentError(SimdistError, RuntimeError, ValueError):
    """A collective or point-to-point call has an argument the backend rejects (a root or peer outside the
    group, a reduce op the dtype does not support, a wrong list length or tensor size).

    Also a ``RuntimeError``, what ProcessGroupGloo raises for these, and a ``ValueError``, what simdist
    raised for some of them before.
    """


class CollectiveMismatchError(SimdistError):
    """Ranks of one group issued different collectives (op, shape, dtype or order) at the same position."""


class SymmetryError(SimdistError):
    """A run asked for ``symmetric=True`` is not symmetric: its simulated ranks ran differently, or it uses what a
    symmetric run cannot reduce (a fault, a perturbation, a send to a rank it does not simulate)."""


class DeadlockError(SimdistError):
    """Every unfinished rank is blocked and nothing is scheduled: the program can never make progress."""


class SimTimeoutError(SimdistError, dist.DistBackendError):
    """A collective or point-to-point operation did not complete within its timeout (simulated seconds).

    Also a ``torch.distributed.DistBackendError``, which is what a real backend raises on a timeout.
    """


class FaultSpecError(SimdistError, ValueError):
    """A fault (``simdist.faults``) is malformed, or names a rank, link or node the run's cluster does not have."""


class RankCrashError(SimdistError):
    """A rank crashed (a ``simdist.faults.Crash`` or ``NodeLoss``): the message says when and where it died and
    what its peers met (a hang, a timeout, the end of their work). ``crashed`` maps each dead global rank to its
    simulated time of death (seconds); ``peer_failure`` is what the first surviving rank raised, if any."""

    def __init__(self, message: str, crashed: dict[int, float], peer_failure: BaseException | None = None) -> None:
        self.crashed = crashed
        self.peer_failure = peer_failure
        super().__init__(message)


class LinkFailureError(SimdistError, dist.DistBackendError):
    """A transfer needs a link that failed (``simdist.faults.LinkDown`` or ``NodeLoss``) and the cluster has no
    other route: names the link, the ranks and the operation. Also a ``torch.distributed.DistBackendError``, what
    NCCL's failed transport is raised as."""


class ProcessTornDown(BaseException):
    """Raised in a rank whose NCCL watchdog takes its process down (``TORCH_NCCL_ASYNC_ERROR_HANDLING`` 1 or 3 and
    a collective past its group's timeout): the process ends, as with ``std::abort``; rank code cannot catch it
    with ``except Exception``. The run reports it as that rank's failure."""


class RendezvousTimeoutError(SimTimeoutError, dist.DistStoreError):
    """A rank's ``init_process_group`` waited its timeout (simulated seconds) for ranks that never joined the group.

    Also a ``torch.distributed.DistStoreError``, what a real rendezvous raises when its wait times out.
    """


class OutOfMemoryError(SimdistError, torch.OutOfMemoryError):
    """A rank's live tensor bytes would exceed its device's memory capacity (``simdist.run(..., memory=True)``).

    Also a ``torch.OutOfMemoryError``, what torch raises when a CUDA allocation fails, so rank code that
    catches it (to retry with a smaller batch) behaves as on a real device. Carries the rank, the simulated
    time (seconds), the op, the bytes requested, in use and available.
    """

    def __init__(
        self, message: str, *, rank: int, sim_time: float, op: str, requested: int, in_use: int, capacity: float
    ) -> None:
        self.rank = rank
        self.sim_time = sim_time
        self.op = op
        self.requested = requested
        self.in_use = in_use
        self.capacity = capacity
        super().__init__(message)

    def __reduce__(self) -> tuple:
        # keyword-only fields: the default (cls, self.args) would lose them when the error crosses processes
        fields = {k: getattr(self, k) for k in ("rank", "sim_time", "op", "requested", "in_use", "capacity")}
        return (_rebuild_oom, (str(self), fields))


def _rebuild_oom(message: str, fields: dict) -> OutOfMemoryError:
    """Unpickle an :class:`OutOfMemoryError`."""
    return OutOfMemoryError(message, **fields)


class RaceError(SimdistError):
    """Rank code or a second operation touched a buffer that an operation still in flight owns."""


class SymmetryWarning(UserWarning):
    """A ``symmetric=True`` run's times are approximate: collectives that share ranks overlapped in time, and the
    full run would have shared links between them, which a symmetric run's closed forms do not see."""


class RaceWarning(UserWarning):
    """The warning-mode form of :class:`RaceError` (``simdist.run(..., races="warn")``)."""


class WatchdogError(SimdistError):
    """A rank kept the simulator (ran Python without communicating or waiting) longer than the watchdog allows.

    Carries the rank, the wall-clock seconds it held the simulator, its simulated time and its Python stack.
    """

    def __init__(self, rank: int, held: float, limit: float, sim_time: float, stack: str, thread: str = "") -> None:
        self.rank = rank
        self.held = held
        self.sim_time = sim_time
        self.stack = stack
        who = f"rank {rank}" + (f" (its thread {thread!r})" if thread else "")
        super().__init__(
            f"{who} ran for {held:.1f} s of wall-clock time without communicating or waiting (watchdog limit "
            f"{limit:g} s), at simulated time {sim_time:.9g} s. Simulated ranks run one at a time, so a rank "
            f"that never hands over (an endless loop, very long CPU work, a wait on a lock, queue or event that "
            f"another thread of the same rank must set) stops every rank.\n"
            f"--- where rank {rank} was ---\n{stack}"
            f"If the work is legitimate, raise the limit: simdist.run(..., watchdog=SECONDS), "
            f"`simdist run --watchdog SECONDS` or $SIMDIST_WATCHDOG."
        )


class CudaEmulationError(SimdistError):
    """The simulated CUDA device cannot be set up in this process (an unsupported torch build, platform or
    library), found before any rank starts; the message names what is missing."""


class DeviceMismatchError(SimdistError, RuntimeError):
    """An operation mixes tensors on different devices (``cuda:0`` and ``cuda:1``, or a GPU and the CPU), as CUDA
    refuses it. Also a ``RuntimeError``, what torch raises on a GPU."""


class CudaError(SimdistError, torch.AcceleratorError):
    """What the CUDA runtime reports on a simulated device: an index the node does not have ("invalid device
    ordinal"), an event not yet reached ("device not ready"). Also a ``torch.AcceleratorError``, what torch raises
    for CUDA's errors."""


class HostConversionError(SimdistError, TypeError):
    """A tensor on a simulated GPU was converted to NumPy, which needs host memory. Also a ``TypeError``, what torch
    raises for a CUDA tensor."""


class NoValuesError(SimdistError, RuntimeError):
    """Rank code read the values of a tensor (``.item()``, a copy to the host, a comparison) in a timing-only run
    (``tensors="fake"``), whose tensors on the simulated GPUs hold shapes and dtypes but no values. Also a
    ``RuntimeError``, what torch raises for a meta tensor's values."""


class UnsupportedCudaOpError(SimdistError, NotImplementedError):
    """Rank code called, on a simulated GPU, an op that only CUDA implements and that has no CPU stand-in; the
    message names the op and the user's line. Also a ``NotImplementedError``, what torch raises for an op a backend
    lacks."""


class NoCudaError(SimdistError, RuntimeError):
    """Rank code used CUDA in a run whose cluster has no GPU model (``device="cpu"``). Also a ``RuntimeError``."""


#: errors raised in rank code where torch would raise its own (rank code may catch them): uncaught, each is its
#: rank's failure (a :class:`RankError` with the rank's traceback), not a diagnosis of the whole run
RAISED_AS_TORCH: tuple[type[SimdistError], ...] = (
    SimTimeoutError,
    InvalidArgumentError,
    DeviceMismatchError,
    CudaError,
    HostConversionError,
    NoValuesError,
    NoCudaError,
    UnsupportedCudaOpError,
)
