"""Each rank's own random number generators, as each process of a real launch has its own.

A real process starts torch's default generator, Python's ``random`` and NumPy's global generator from seeds
of its own (torch 2.13 seeds its CPU generator randomly at start-up, as Python and NumPy do), so unseeded
ranks draw different numbers, and ``torch.manual_seed(0)`` / ``random.seed(0)`` / ``np.random.seed(0)`` on
every rank makes every rank draw the same ones. Here the ranks are threads of one process, whose generators
are shared. So:

- torch's default generator is saved and restored per rank at every baton hand-off (by the baton: a
  generator state is a small tensor, about a microsecond to swap); each rank starts from its own state;
- Python's ``random`` and NumPy's legacy global generator cost 50 and 250 microseconds to save and restore, far
  more than a hand-off: instead, during a run, their module-level functions (``random.random``,
  ``np.random.rand``, ``np.random.seed``, ...) call the calling rank's own ``random.Random`` /
  ``np.random.RandomState``. Code outside rank threads calls the process's generators, untouched;
- every seed a rank starts from, and every seed an argument-less ``seed()`` call would take from the operating
  system (``torch.seed()``, ``random.seed()``, ``np.random.seed()``, ``np.random.default_rng()``,
  ``random.Random()``), is derived from the run's seed, the rank and a counter: runs stay reproducible.

What this does not reach: a generator function bound before the run (``from random import random`` at import
time binds the process's generator), and ``np.random.RandomState()`` / bit generators constructed without a
seed in rank code (they take entropy from the operating system, as in a real process).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import random
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from simdist.clock.baton import current_rank_state
from simdist.patching import NUMPY_RANDOM_FUNCTIONS, PYTHON_RANDOM_FUNCTIONS, replaced

#: the generators a rank has one of, in the order their seeds are derived
STREAMS = ("torch", "python", "numpy")


def derive_seed(seed: int, rank: int, stream: str, index: int = 0) -> int:
    """A 64-bit seed for ``rank``'s ``stream`` generator in a run of ``seed`` (``index``: its n-th reseeding).

    SHA-256 of the four values: the same on every platform and Python version, and unrelated across ranks.
    ``seed`` is taken modulo 2**64, as ``torch.manual_seed`` takes it (-1 and 2**64 - 1 are one seed).
    """
    seed %= 2**64
    digest = hashlib.sha256(f"simdist:{seed}:{rank}:{stream}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


class RankGenerators:
    """The generators of every rank of one run, created when a rank first uses them."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._python: dict[int, random.Random] = {}
        self._numpy: dict[int, np.random.RandomState] = {}
        #: per rank, the count of seeds handed out for argument-less ``seed()`` calls
        self._reseeds: dict[int, Iterator[int]] = {}

    def torch_state(self, rank: int) -> torch.Tensor:
        """The state ``rank``'s torch default generator starts from (``torch.initial_seed()`` reads its seed)."""
        return _CPU_GENERATOR().manual_seed(derive_seed(self.seed, rank, "torch")).get_state()

    def python(self, rank: int) -> random.Random:
        """``rank``'s Python ``random`` generator."""
        gen = self._python.get(rank)
        if gen is None:
            gen = self._python[rank] = _ORIGINAL_RANDOM_CLASS(derive_seed(self.seed, rank, "python"))
        return gen

    def numpy(self, rank: int) -> np.random.RandomState:
        """``rank``'s NumPy legacy global generator (what ``np.random.rand`` and ``np.random.seed`` use)."""
        gen = self._numpy.get(rank)
        if gen is None:
            bits = np.random.MT19937(np.random.SeedSequence(derive_seed(self.seed, rank, "numpy")))
            gen = self._numpy[rank] = np.random.RandomState(bits)
        return gen

    def fresh_seed(self, rank: int) -> int:
        """A new seed for an argument-less ``seed()`` call of ``rank`` (a real process reads the OS's entropy)."""
        counter = self._reseeds.setdefault(rank, itertools.count(1))
        return derive_seed(self.seed, rank, "reseed", next(counter))


_ORIGINAL_RANDOM_CLASS = random.Random
#: torch's own CPU generator class: ``torch.Generator`` is a Python stand-in while a run emulates CUDA (a generator
#: made in a rank thread asks which rank and device it is for), and each rank's start needs a CPU one only
_CPU_GENERATOR = torch._C.Generator
_original_random_seed = random.Random.seed


@contextlib.contextmanager
def per_rank_generators(gens: RankGenerators) -> Iterator[None]:
    """During the block, rank code's ``random``, ``numpy.random`` and argument-less seeding use its rank's own."""

    def on_rank(fallback: Callable[..., Any], name: str, rank_gen: Callable[[int], Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            state = current_rank_state()
            if state is None:
                return fallback(*args, **kwargs)
            return getattr(rank_gen(state.rank), name)(*args, **kwargs)

        call.__name__, call.__qualname__, call.__doc__ = name, name, fallback.__doc__
        return call

    def python_seed(self: random.Random, a: Any = None, version: int = 2) -> None:
        state = current_rank_state()
        if a is None and state is not None:
            a = gens.fresh_seed(state.rank)
        _original_random_seed(self, a, version)

    numpy_seed = np.random.seed

    def rank_numpy_seed(seed: Any = None) -> None:
        state = current_rank_state()
        if state is None:
            return numpy_seed(seed)
        gens.numpy(state.rank).seed(gens.fresh_seed(state.rank) % 2**32 if seed is None else seed)
        return None

    default_rng = np.random.default_rng

    def rank_default_rng(seed: Any = None) -> np.random.Generator:
        state = current_rank_state()
        if seed is None and state is not None:
            seed = gens.fresh_seed(state.rank)
        return default_rng(seed)

    torch_seed = torch.seed

    def rank_torch_seed() -> int:
        state = current_rank_state()
        if state is None:
            return torch_seed()
        value = gens.fresh_seed(state.rank)
        torch.default_generator.manual_seed(value)
        return value

    patches: dict[str, Any] = {f"random.{n}": on_rank(getattr(random, n), n, gens.python) for n in PYTHON_RANDOM_FUNCTIONS}
    patches.update({f"numpy.random.{n}": on_rank(getattr(np.random, n), n, gens.numpy) for n in NUMPY_RANDOM_FUNCTIONS})
    patches.update(
        {
            "random.Random.seed": python_seed,
            "numpy.random.seed": rank_numpy_seed,
            "numpy.random.default_rng": rank_default_rng,
            "torch.seed": rank_torch_seed,
            "torch.random.seed": rank_torch_seed,
        }
    )
    with replaced("simdist.engine.rng", patches):
        yield
