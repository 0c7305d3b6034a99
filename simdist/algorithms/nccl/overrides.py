"""Corrections of NCCL's tuning model to one cluster's measurements (what ``simdist calibrate`` fits to
nccl-tests output): a latency added to every call and a factor on each algorithm's bandwidth.

A cluster file carries them in its ``[cluster.nccl]`` table::

    [cluster.nccl]
    latency = 2.5e-06            # seconds added to the per-call latency of every algorithm and protocol

    [cluster.nccl.bandwidth]     # factor on NCCL's bandwidth of each algorithm (all protocols)
    Ring = 0.93
    NVLS = 1.08

``tuning.cost`` applies them: ``time = max(0, latency_NCCL + latency) + bytes / (bandwidth_NCCL x factor)``; the
choice of algorithm and protocol is made on the corrected times, as NCCL's tuner would with those numbers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from simdist.algorithms.nccl.env import ALGORITHM_NAMES
from simdist.errors import ClusterSpecError


@dataclass(frozen=True)
class Overrides:
    """A latency (seconds, added to every call's) and per-algorithm bandwidth factors; none by default."""

    latency: float = 0.0
    #: (algorithm, factor) pairs, NCCL's algorithm names (``Ring``, ``Tree``, ``NVLS``, ``NVLSTree``), kept sorted
    bandwidth: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        if (
            isinstance(self.latency, bool)
            or not isinstance(self.latency, (int, float))
            or not math.isfinite(self.latency)
        ):
            raise ClusterSpecError(f"nccl latency must be a finite number of seconds; found {self.latency!r}")
        for algo, factor in self.bandwidth:
            if algo not in ALGORITHM_NAMES:
                raise ClusterSpecError(
                    f"nccl bandwidth: unknown algorithm {algo!r}; NCCL's are {', '.join(ALGORITHM_NAMES)}"
                )
            if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor < math.inf:
                raise ClusterSpecError(
                    f"nccl bandwidth of {algo}: the factor must be a positive number; found {factor!r}"
                )
        object.__setattr__(self, "bandwidth", tuple(sorted(self.bandwidth)))

    def factor(self, algorithm: str) -> float:
        """The factor on ``algorithm``'s bandwidth (1 where none is given)."""
        return next((f for a, f in self.bandwidth if a == algorithm), 1.0)

    @property
    def is_default(self) -> bool:
        """Whether these change nothing."""
        return self.latency == 0 and all(f == 1 for _, f in self.bandwidth)

    def to_config(self) -> dict[str, Any]:
        """The ``[cluster.nccl]`` table of these overrides."""
        table: dict[str, Any] = {"latency": self.latency}
        if self.bandwidth:
            table["bandwidth"] = dict(self.bandwidth)
        return table

    @classmethod
    def from_config(cls, table: Any) -> Overrides:
        """The overrides a ``[cluster.nccl]`` table gives (a ClusterSpecError naming what is wrong)."""
        if not isinstance(table, Mapping):
            raise ClusterSpecError(
                f"[cluster.nccl] must be a table (latency = ..., [cluster.nccl.bandwidth]); found {table!r}"
            )
        unknown = sorted(set(table) - {"latency", "bandwidth"})
        if unknown:
            raise ClusterSpecError(
                f"[cluster.nccl]: unknown key(s) {', '.join(unknown)}; expected latency, bandwidth"
            )
        bandwidth = table.get("bandwidth", {})
        if not isinstance(bandwidth, Mapping):
            raise ClusterSpecError(
                f"[cluster.nccl] bandwidth must be a table of algorithm = factor; found {bandwidth!r}"
            )
        return cls(table.get("latency", 0.0), tuple(sorted(bandwidth.items())))


#: NCCL's model as transcribed: no correction
NO_OVERRIDES = Overrides()
