"""DTensor's random ops on simulated GPUs: its RNG tracker reads and moves the device generator's Philox offset,
and the ops it runs draw counter-based numbers at that offset.

On a CUDA mesh, DTensor runs a random op (``torch.nn.init`` on a sharded parameter, dropout on a DTensor,
``torch.distributed.tensor.randn``) under an RNG tracker (``OffsetBasedRNGTracker``) that reads the device
generator's state as CUDA's Philox state, a seed and an offset in its first 16 bytes (``_PhiloxState``). It moves
the offset to each shard's place in the whole tensor before the op and past the whole tensor after it, so that
replicated shards draw the same numbers and sharded ones different numbers, on every rank alike. A simulated GPU's
generator carries that seed and offset beside the CPU generator its ordinary ops draw from
(:mod:`simdist.cuda.rngstate`): ``_PhiloxState`` reads them from its longer state, and while the tracker's region
runs the op, the device generator draws counter-based numbers at the offset (:mod:`simdist.cuda.philox`).

torch keeps the tracker in a module global, one per process; ranks that run as threads of one process each get
their own (:class:`PerRankTracker`), as each process of a job has its own.

Nothing here imports DTensor (its import costs about a second, sympy's): each replacement is made from torch's
own function when the run starts, or when rank code first imports DTensor (:class:`simdist.patching.OnImport`).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

import torch

from simdist.cuda import device as current_device
from simdist.cuda.fallbacks import user_line
from simdist.cuda.rngstate import PHILOX_STATE_BYTES, STATE_BYTES
from simdist.cudart.state import rank
from simdist.errors import UnsupportedCudaOpError


def philox_state_init(original: Any) -> Any:
    """DTensor's reader of a Philox state (``_PhiloxState.__init__``), for a simulated GPU generator's state: its
    seed and offset are a view of the state's first 16 bytes, which :func:`philox_state_whole` gives back whole."""

    def init(self: Any, state: torch.Tensor) -> None:
        if state.numel() != STATE_BYTES:
            # torch hands an op's generator argument on as a bare torch.Generator: a simulated GPU's generator
            # arrives without the seed and offset simdist keeps beside it, as a CPU generator's state
            raise UnsupportedCudaOpError(
                f"a random op on a DTensor (called at {user_line()}) was given a generator: on simulated GPUs DTensor "
                f"draws from the device's own generator only (the op's generator arrives as a CPU generator, "
                f"{state.numel()} bytes of state without CUDA's seed and offset). Pass no generator, and seed the "
                "device's with torch.manual_seed"
            )
        original(self, state)
        self._whole = self._state
        self._state = self._whole[:PHILOX_STATE_BYTES]

    init.__wrapped__ = original  # type: ignore[attr-defined]
    return init


@property  # type: ignore[misc]
def philox_state_whole(self: Any) -> torch.Tensor:
    """The whole generator state ``_PhiloxState`` was made from, with the seed and offset it has moved."""
    return self._whole


def distribute_region(original: Any) -> Any:
    """The tracker's region (``OffsetBasedRNGTracker._distribute_region``), in which the device generator of a
    simulated GPU draws counter-based numbers at the offset the tracker has set."""

    @contextlib.contextmanager
    def region(self: Any, spec: Any, generator: torch.Generator | None = None) -> Iterator[None]:
        cuda = rank()
        if cuda is None or self._device.type != "cuda" or not self.distribute_region_enabled:
            with original(self, spec, generator):
                yield
            return
        with original(self, spec, generator):
            # the tracker sets the current device's state (torch.cuda.set_rng_state without a device), which is
            # the generator the op draws from where the program has called set_device as CUDA programs do
            gen = cuda.generator(current_device.current())
            before, gen.at_offset = gen.at_offset, True
            try:
                yield
            finally:
                gen.at_offset = before

    region.__wrapped__ = original  # type: ignore[attr-defined]
    return region


#: what torch's tracker logs where a rank's state differs from rank 0's (OffsetBasedRNGTracker.__init__, torch 2.13)
_STATES_DIFFER = (
    "DTensor is synchronizing RNG states of every rank with the state from rank 0. "
    "This behavior is deprecated. "
    "Please call `torch.manual_seed()` on every rank that participates in SPMD DTensor Operations with "
    "the same seed. If using Pipeline Parallelism, each pipeline state would use a different seed, "
    "but all ranks belonging to one pipeline stage would use the same seed."
)


def tracker_init(original: Any) -> Any:
    """The tracker's constructor (``OffsetBasedRNGTracker.__init__``), which compares CUDA's state with rank 0's.

    torch broadcasts rank 0's device state, compares it with the rank's own element by element (``all(a == b)``:
    one read to the host each, on a device tensor) and sets it. On CUDA the state is 16 bytes; a simulated GPU's
    goes on with the CPU generator's 5,056, and comparing those too would cost 5,072 reads (36 ms of simulated time
    in benchmarks/gpu_emulation_bench.py's FSDP2 initialisation) and seconds of wall time per rank. So the comparison reads CUDA's 16 bytes, as on a
    GPU, and the whole state is broadcast and set as torch does (every rank's ordinary random ops then draw rank
    0's numbers, as on CUDA, where both are one Philox stream).
    """

    def init(self: Any, device_mesh: Any, run_state_sync: bool = True) -> None:
        original(self, device_mesh, run_state_sync=False)  # torch's checks, and its device; no state yet
        if not run_state_sync:
            return
        rng_state = self._get_device_state()
        torch.distributed.broadcast(rng_state, 0)
        # a simulated GPU's state: CUDA's 16 bytes, then the CPU generator's; any other, whole
        n = PHILOX_STATE_BYTES if rng_state.numel() == STATE_BYTES else rng_state.numel()
        mine, theirs = self._get_device_state()[:n], rng_state[:n]
        if not all(mine == theirs):
            original.__globals__["logger"].warning(_STATES_DIFFER)
        self._set_device_state(rng_state)

    init.__wrapped__ = original  # type: ignore[attr-defined]
    return init


class PerRankTracker(types.ModuleType):
    """``torch.distributed.tensor._random`` during a run: its ``_rng_tracker`` is the calling rank's own (each
    rank makes one as its first DTensor random op runs, broadcasting rank 0's generator state as torch does)."""

    @property
    def _rng_tracker(self) -> Any:
        cuda = rank()
        return vars(self)["_rng_tracker"] if cuda is None else cuda.dtensor_rng_tracker

    @_rng_tracker.setter
    def _rng_tracker(self, tracker: Any) -> None:
        cuda = rank()
        if cuda is None:
            vars(self)["_rng_tracker"] = tracker
        else:
            cuda.dtensor_rng_tracker = tracker


def manual_seed(original: Any) -> Any:
    """DTensor's ``manual_seed(seed, device_mesh)``, which makes the calling rank's tracker if it has none."""

    def seed(seed: int, device_mesh: Any) -> None:
        cuda = rank()
        if cuda is None:
            return original(seed, device_mesh)
        # torch's function reads and sets the tracker as a global of its module (the module's own dict, which
        # :class:`PerRankTracker` does not see): it sees the rank's for its duration, which hands no other rank
        # the baton (it makes a tracker without synchronising states, then seeds)
        shared = original.__globals__  # torch.distributed.tensor._random's own dict
        saved = shared["_rng_tracker"]
        shared["_rng_tracker"] = cuda.dtensor_rng_tracker
        try:
            original(seed, device_mesh)
            cuda.dtensor_rng_tracker = shared["_rng_tracker"]
        finally:
            shared["_rng_tracker"] = saved
        return None

    seed.__wrapped__ = original  # type: ignore[attr-defined]
    return seed
