"""DTensor, its placements and FSDP1's wrapper, as the oracle reads them without importing them up front.

Importing ``torch.distributed.tensor`` costs about a second of CPU (it pulls in sympy), and every process that
imports simdist would pay it: real launches' rank processes, scenario scripts, the command line. No DTensor and no
FSDP1 module exists before a program imports its module, so the checks below look for the module among those
already imported; only assembling a DTensor's pieces (possibly in a process that never ran the program, a real
launch's parent) imports the placement types it splits with.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import Any

#: where DTensor lives, and its placement types
DTENSOR_MODULE = "torch.distributed.tensor"
PLACEMENTS_MODULE = "torch.distributed.tensor.placement_types"
#: where FSDP1's wrapper lives
FSDP_MODULE = "torch.distributed.fsdp"


def is_dtensor(value: Any) -> bool:
    """Whether ``value`` is a DTensor."""
    module = sys.modules.get(DTENSOR_MODULE)
    return module is not None and isinstance(value, module.DTensor)


def is_fsdp1(value: Any) -> bool:
    """Whether ``value`` is FSDP1's ``FullyShardedDataParallel``."""
    module = sys.modules.get(FSDP_MODULE)
    return module is not None and isinstance(value, module.FullyShardedDataParallel)


def placements() -> ModuleType:
    """``torch.distributed.tensor.placement_types`` (``Shard``, ``_StridedShard``, ``Replicate``, ``Partial``),
    imported on first use."""
    return importlib.import_module(PLACEMENTS_MODULE)
