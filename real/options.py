"""A real launch's options, checked once before anything starts: processes, time limit, rendezvous, console."""

from __future__ import annotations

from dataclasses import dataclass, field

from real.emulated_cuda import EmulatedCuda
from real.errors import RealConfigError
from real.rendezvous import Rendezvous
from simdist_base.host import available_memory

#: the longest ``timeout`` accepted, seconds (30 days): the elastic launcher and thread waits need a finite,
#: representable limit, and a run meant to be longer is not a test
MAX_TIMEOUT = 30 * 24 * 3600.0
#: seconds a run may take by default where real bounds it (functions and entry functions): long enough for
#: the start-up of every process and a test's rank code, short enough that a hang ends with its stacks
DEFAULT_TIMEOUT = 300.0
#: resident memory of one rank process once torch and torch.distributed are imported (about 220 MB
#: measured), before the rank code allocates anything: ``nproc`` of them must fit in the memory available
PROCESS_MEMORY = 256 << 20
# Environment variables the launcher sets per rank process; letting `env` override them would break the run.
RESERVED_ENV = frozenset(
    {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"}
)
#: torchrun's ``--tee`` prefix, with the global rank: ``[rank3]:`` before each line a rank writes
LINE_PREFIX = "[rank${rank}]:"


@dataclass(frozen=True)
class Console:
    """How the rank processes' output reaches this terminal: each line prefixed with its rank or not, and from
    which local ranks (None: all; the others' output is dropped, as torchrun's ``--local-ranks-filter``)."""

    prefix: bool = False
    local_ranks: frozenset[int] | None = None


@dataclass(frozen=True)
class TimelineOptions:
    """Where each rank process writes its timeline (``rank<R>.timeline.json``), and whether it also writes a
    torch profiler trace there (``rank<R>.trace.json``)."""

    directory: str
    profile: bool = False


@dataclass(frozen=True)
class LaunchOptions:
    """Everything about a launch besides what each rank runs: checked here, so a bad one never starts."""

    nproc: int
    timeout: float = DEFAULT_TIMEOUT
    master_port: int | None = None
    env: dict[str, str] = field(default_factory=dict)
    rendezvous: Rendezvous = field(default_factory=Rendezvous)
    console: Console = field(default_factory=Console)
    #: each process runs on simulated CUDA devices (``--emulate-cuda``), or None: on the machine's own
    emulate_cuda: EmulatedCuda | None = None
    #: each rank records its collectives and sends/recvs there (``timeline=``), or None: nothing is recorded
    timeline: TimelineOptions | None = None

    def __post_init__(self) -> None:
        nproc, timeout = self.nproc, self.timeout
        if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
            raise RealConfigError(f"nproc must be a positive int (processes to start); got {nproc!r}")
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, (int, float))
            or not 0 < timeout <= MAX_TIMEOUT
        ):
            raise RealConfigError(
                f"timeout must be a positive number of seconds, at most {MAX_TIMEOUT:.0f} (30 days); got {timeout!r}"
            )
        available = available_memory()
        if available is not None and nproc * PROCESS_MEMORY > available:
            raise RealConfigError(
                f"nproc {nproc} would not fit: each rank process needs about {_mib(PROCESS_MEMORY)} once torch is "
                f"imported, {_mib(nproc * PROCESS_MEMORY)} in all, but only {_mib(available)} of memory is "
                f"available; start at most {available // PROCESS_MEMORY} processes"
            )
        port = self.master_port
        if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536):
            raise RealConfigError(
                f"master_port must be a TCP port in 1..65535, or None to pick a free one; got {port!r}"
            )
        if not isinstance(self.rendezvous, Rendezvous):
            raise RealConfigError(f"rendezvous must be a real.Rendezvous; got {self.rendezvous!r}")
        if port is not None and self.rendezvous.endpoint is not None:
            raise RealConfigError(
                f"master_port {port} and rendezvous endpoint {self.rendezvous.endpoint!r} both name the "
                f"meeting point; give one"
            )
        for key, value in (self.env or {}).items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise RealConfigError(f"env must map str to str; got {key!r}: {value!r}")
            if key in RESERVED_ENV:
                raise RealConfigError(
                    f"env may not set {key}: the launcher sets it for each rank process "
                    f"(reserved: {', '.join(sorted(RESERVED_ENV))})"
                )
        if self.emulate_cuda is not None:
            if not isinstance(self.emulate_cuda, EmulatedCuda):
                raise RealConfigError(
                    f"emulate_cuda must be a real.EmulatedCuda or None; got {self.emulate_cuda!r}"
                )
            self.emulate_cuda.check(nproc)
        ranks = self.console.local_ranks
        if ranks is not None and (not ranks or not all(0 <= r < nproc for r in ranks)):
            raise RealConfigError(
                f"the local ranks to show must be some of 0..{nproc - 1} (this node's processes); got "
                f"{sorted(ranks)}"
            )


def _mib(n_bytes: int) -> str:
    """A byte count in whole MiB (simdist's unit formatting lives with the simulator, which is not imported here)."""
    return f"{n_bytes >> 20} MiB"
