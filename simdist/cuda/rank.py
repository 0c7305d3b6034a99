"""One rank's simulated CUDA devices: whether its code uses them yet, their random generators, and what a copy
between host and device costs.

A rank of a run on a GPU cluster is one process of a GPU job. Until its code first touches CUDA (a tensor on
``cuda``, ``torch.cuda.set_device``), its CPU tensors stand for device tensors, as simdist has always priced
programs written for the CPU; from then on CPU tensors are host memory, ops on them are host work (not on the
GPU's stream, not device memory), and copies between the two cross the host link.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from simdist.cuda.meta_outputs import MetaOutputs
from simdist.cuda.pinned import PinnedMemory
from simdist.cuda.rngstate import DeviceGenerator


class RankCuda:
    """The simulated CUDA devices of rank ``rank``, shared by every thread of the rank.

    ``seed_for(index)`` is the seed device ``index``'s generator starts from (derived from the run's seed, as the
    CPU generator's is), ``synchronize()`` makes the calling host wait for its current stream (a blocking copy), and
    ``first_use()`` is called once, when the rank's code first uses CUDA.
    """

    def __init__(
        self,
        rank: int,
        seed_for: Callable[[int], int],
        synchronize: Callable[[], None],
        first_use: Callable[[], None] | None = None,
        host_link_bandwidth: float = float("inf"),
        link_latency: float = 0.0,
        on_kernel: Callable[[Any, Any], None] | None = None,
    ) -> None:
        self.rank = rank
        #: whether the rank's code has used CUDA (from then on, CPU tensors are host tensors)
        self.in_use = False
        #: whether torch.cuda's lazy initialisation has run (``torch.cuda.is_initialized()``): a tensor on the device
        #: or ``set_device`` runs it, ``init_process_group(device_id=...)`` does not (DeviceMesh then picks the
        #: device from LOCAL_RANK, as on a GPU machine)
        self.initialized = False
        self._seed_for = seed_for
        self.synchronize = synchronize
        self._first_use = first_use
        #: bytes/s of a copy between host and device, and its fixed cost (seconds)
        self.host_link_bandwidth = host_link_bandwidth
        self.link_latency = link_latency
        #: called with each op on the device and its CPU result once it is queued (the race detector's view of
        #: side streams); None: nothing to tell
        self.on_kernel = on_kernel
        #: ``on_device(index)``: a context in which the calling thread's device work goes to its current stream on
        #: device ``index`` (an op on that device's tensors while the thread's current device is another); None:
        #: the current device's stream serves
        self.on_device: Callable[[int], AbstractContextManager[None]] | None = None
        #: the rank's pinned host memory
        self.pinned = PinnedMemory()
        self._generators: dict[int, DeviceGenerator] = {}
        #: the seed ``torch.manual_seed`` / ``torch.cuda.manual_seed_all`` gave every device, for generators made later
        self._seed_all: int | None = None
        #: side streams made so far (``torch.cuda.Stream()``): the next one is numbered one more, from 1 (0 is
        #: the
        #: default stream), per rank so that a run's trace names them alike every time
        self.streams_made = 0
        #: DTensor's random-number tracker of the rank (torch keeps one per process)
        self.dtensor_rng_tracker: Any = None
        #: a timing-only run (``tensors="fake"``): the devices' tensors hold shapes and dtypes, no values
        self.fake = False
        #: a timing-only run's remembered meta results, shared by its ranks (see simdist.cuda.meta_outputs)
        self.meta_outputs: MetaOutputs | None = None

    def use(self, initialize: bool = True) -> None:
        """Record that the rank's code uses CUDA (the first call switches its host tensors to host memory);
        ``initialize``: the use runs torch.cuda's lazy initialisation, as all do but binding a group to a GPU."""
        if initialize:
            self.initialized = True
        if not self.in_use:
            self.in_use = True
            if self._first_use is not None:
                self._first_use()

    def generator(self, index: int) -> DeviceGenerator:
        """Device ``index``'s generator (ordinary ops draw from its CPU generator, see :mod:`simdist.cuda.rngstate`)."""
        gen = self._generators.get(index)
        if gen is None:
            seed = self._seed_for(index) if self._seed_all is None else self._seed_all
            gen = self._generators[index] = DeviceGenerator().manual_seed(seed)
        return gen

    def seed_all(self, seed: int) -> None:
        """Seed every device's generator with ``seed`` (``torch.manual_seed``, ``torch.cuda.manual_seed_all``)."""
        self._seed_all = int(seed)
        for gen in self._generators.values():
            gen.manual_seed(self._seed_all)

    def new_stream(self) -> int:
        """The number of a new side stream of the rank."""
        self.streams_made += 1
        return self.streams_made

    def copy_seconds(self, nbytes: int, share: float = 1.0) -> float:
        """Seconds a copy of ``nbytes`` between host and device takes on the host link, at ``share`` of its bandwidth
        (1 from or to pinned memory, ``simdist.cuda.pinned.PAGEABLE_SHARE`` from or to pageable memory)."""
        return self.link_latency + nbytes / (self.host_link_bandwidth * share)
