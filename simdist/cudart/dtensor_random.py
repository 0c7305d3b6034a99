"""DTensor's random ops on simulated GPUs: refused with an error naming what they need and the user's line.

On a CUDA mesh, DTensor runs a random op (``torch.nn.init`` on a sharded parameter, dropout on a DTensor) under an
RNG tracker that reads the device generator's state as CUDA's Philox state, 16 bytes: a seed and an offset. It
moves the offset to each shard's place in the whole tensor before the op and past the whole tensor after it, so
that replicated shards draw the same numbers and sharded ones draw different numbers, on every rank alike. A
simulated GPU's generator is a CPU generator (its numbers are the CPU program's, see ``docs/gpu.md``): its state is
that of a Mersenne Twister, which has no offset to move, and torch's tracker failed on it with a bare
AssertionError. Giving the state Philox's layout would not make it behave as Philox does (draws at an offset), so
the tracker's reading of a state that is not Philox's is refused instead.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import _random as dtensor_random

from simdist.cuda.fallbacks import user_line
from simdist.errors import UnsupportedCudaOpError

#: bytes of CUDA's Philox generator state: a 64-bit seed, then a 64-bit offset
PHILOX_STATE_BYTES = 16


def philox_state_init(original: Any = dtensor_random._PhiloxState.__init__) -> Any:
    """DTensor's reader of a Philox state (``_PhiloxState.__init__``), refusing a state that is not one."""

    def init(self: Any, state: torch.Tensor) -> None:
        if state.numel() != PHILOX_STATE_BYTES:
            raise UnsupportedCudaOpError(
                f"a random op on a DTensor (called at {user_line()}) needs CUDA's Philox generator state (a seed "
                f"and an offset, {PHILOX_STATE_BYTES} bytes), which DTensor moves to give each shard its own "
                f"numbers; the simulated GPU's generator is a CPU generator ({state.numel()} bytes of state) and "
                "has no offset. Draw on the plain tensor before sharding it (initialise parameters before "
                "fully_shard or distribute_tensor), or run this part of the program on the CPU"
            )
        original(self, state)

    init.__wrapped__ = original  # type: ignore[attr-defined]
    return init
