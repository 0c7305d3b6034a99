"""A simulated GPU's random generator: the CPU generator ordinary ops draw from, and CUDA's Philox state.

Ordinary random ops on a simulated GPU draw from a CPU generator (a Mersenne Twister), so a GPU program draws the
numbers of its CPU twin. CUDA's generator is a Philox generator whose whole state is a seed and an offset, and
DTensor's random ops move that offset to give each shard its own part of the whole tensor's numbers
(:mod:`simdist.cuda.philox` draws those). A :class:`DeviceGenerator` is both: a ``torch.Generator`` on the CPU
(what ordinary ops are given), carrying a Philox seed and offset beside it. Its state (``get_state``) is CUDA's 16
bytes, a little-endian ``uint64`` seed then an ``int64`` offset, as DTensor reads them, followed by the CPU
generator's state, so that saving and restoring it (activation checkpointing, ``torch.random.fork_rng``) restores
both streams.
"""

from __future__ import annotations

from typing import Any

import torch

from simdist.errors import InvalidArgumentError

_TorchGenerator = torch._C.Generator

#: bytes of CUDA's Philox state: a uint64 seed, then an int64 offset (CUDAGeneratorImpl::get_state)
PHILOX_STATE_BYTES = 16
#: bytes of a CPU generator's state (CPUGeneratorImplState)
CPU_STATE_BYTES = int(_TorchGenerator().get_state().numel())
#: bytes of a device generator's state: CUDA's, then the CPU generator's
STATE_BYTES = PHILOX_STATE_BYTES + CPU_STATE_BYTES
#: CUDA moves the offset in steps of 4 (one Philox round gives four 32-bit numbers); DTensor rounds to them too
OFFSET_STEP = 4


def offset_increment(numel: int) -> int:
    """How far an op drawing ``numel`` elements moves the offset: ``numel`` rounded up to a step of 4."""
    return (numel + OFFSET_STEP - 1) // OFFSET_STEP * OFFSET_STEP


class DeviceGenerator(_TorchGenerator):
    """A generator of a simulated GPU: a CPU generator with CUDA's Philox seed and offset beside it.

    ``philox_seed`` is the seed the generator was last seeded with (its ``initial_seed()``), ``offset`` counts the
    elements drawn since, in steps of 4, and ``at_offset`` is set while DTensor's RNG tracker runs an op: random ops
    then draw counter-based numbers at (``philox_seed``, ``offset``) instead of the CPU generator's.
    """

    philox_seed: int
    offset: int
    at_offset: bool

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        gen = super().__new__(cls, *args, **kwargs)
        gen.philox_seed = int(_TorchGenerator.initial_seed(gen))
        gen.offset = 0
        gen.at_offset = False
        return gen

    def manual_seed(self, seed: Any) -> DeviceGenerator:
        """Seed both streams: the CPU generator with ``seed``, Philox's with ``seed`` at offset 0 (as CUDA's)."""
        _TorchGenerator.manual_seed(self, seed)
        self.philox_seed = int(_TorchGenerator.initial_seed(self))
        self.offset = 0
        return self

    def seed(self) -> int:
        """Seed both streams from a new seed, as :meth:`manual_seed`; return it."""
        value = int(_TorchGenerator.seed(self))
        self.philox_seed = value
        self.offset = 0
        return value

    def advance(self, numel: int) -> None:
        """Move the offset past an op that drew ``numel`` elements, as CUDA's generator moves it per op."""
        self.offset += offset_increment(numel)

    def get_state(self) -> torch.Tensor:
        """CUDA's state (seed, offset: 16 bytes) followed by the CPU generator's state, as a uint8 tensor."""
        # the seed's bits as an int64
        seed = self.philox_seed - (1 << 64) if self.philox_seed >= 1 << 63 else self.philox_seed
        philox = torch.tensor([seed, self.offset], dtype=torch.int64)
        return torch.cat([philox.view(torch.uint8), _TorchGenerator.get_state(self)])

    def set_state(self, new_state: torch.Tensor) -> DeviceGenerator:
        """Restore a state of :meth:`get_state`, or CUDA's 16 bytes alone (the CPU stream is then seeded with the
        seed, as :meth:`manual_seed` seeds it)."""
        if not isinstance(new_state, torch.Tensor) or new_state.dtype != torch.uint8:
            raise TypeError(
                f"expected a torch.ByteTensor as a simulated GPU generator's state, got "
                f"{getattr(new_state, 'dtype', type(new_state).__name__)}"
            )
        state = new_state.detach().to("cpu").contiguous().view(-1)
        if state.numel() not in (STATE_BYTES, PHILOX_STATE_BYTES):
            raise InvalidArgumentError(
                f"RNG state is wrong size: a simulated GPU's generator state is {STATE_BYTES} bytes (CUDA's "
                f"{PHILOX_STATE_BYTES}-byte seed and offset, then the {CPU_STATE_BYTES} bytes of the CPU generator "
                f"its ordinary ops draw from) or CUDA's {PHILOX_STATE_BYTES} bytes alone; got {state.numel()} bytes "
                "(a state of torch.get_rng_state() is the CPU generator's, not a GPU's)"
            )
        seed, offset = (int(v) for v in state[:PHILOX_STATE_BYTES].clone().view(torch.int64))
        seed &= (1 << 64) - 1
        if state.numel() == STATE_BYTES:
            _TorchGenerator.set_state(self, state[PHILOX_STATE_BYTES:].clone())
        else:
            _TorchGenerator.manual_seed(self, seed)
        self.philox_seed = seed
        self.offset = offset
        return self
