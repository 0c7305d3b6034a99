"""How far a GPU's GEMM kernels fall short of the device's rate on a given shape: tiles, waves, split-K and the
memory-bound regime of skinny shapes (seconds)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from simdist.errors import ClusterSpecError

#: (rows, columns, efficiency) of the output tiles a GEMM library picks from. Large tiles reuse each operand
#: element over more multiply-adds, so they run at the full rate; smaller ones, picked where large ones would
#: leave SMs idle, run slower (NVIDIA's Matrix Multiplication Background guide, "Typical Tile Dimensions In
#: cuBLAS And Performance": 256x128 and 128x128 tiles are the most efficient, 64x64 the least). The efficiencies
#: are fitted to the H100 measurement (benchmarks/gpu/results/h100-2026-11-26, docs/compute.md).
HOPPER_TILES: tuple[tuple[int, int, float], ...] = (
    (128, 256, 1.0),
    (256, 128, 1.0),
    (128, 128, 0.8),
    (128, 64, 0.6),
    (64, 128, 0.6),
    (64, 64, 0.36),
)


@dataclass(frozen=True)
class GemmShapeModel:
    """The shape efficiency of one GPU's GEMM kernels (cuBLAS-like): what a matmul of a given shape takes.

    The output is cut into tiles, each computed by one thread block (CTA) on one SM; the device runs the CTAs in
    waves of ``multiprocessors`` (a partial last wave costs a whole one: wave quantisation), and a tile partly
    outside the output costs a whole tile (tile quantisation). Where the tiles do not fill one wave, K is split
    across the idle SMs (split-K) in pieces of at least ``split_k_depth``, so the time never falls as a dimension
    grows. With ``stream_k``, the tiles of a last, partial wave share out their K loops over all the SMs (stream-K
    scheduling, as Hopper's persistent GEMM kernels do), so that wave costs its share of a wave, not a whole one.
    Each wave also pays ``wave_seconds`` (filling the pipeline, writing the tile out). The library picks the tile
    that finishes first. A skinny shape is memory-bound: its operands stream at ``memory_efficiency`` of the
    device's bandwidth.
    """

    #: (rows, columns, efficiency relative to the device's rate) of each tile the library may pick
    tiles: tuple[tuple[int, int, float], ...] = HOPPER_TILES
    #: seconds each wave adds besides its multiply-adds (pipeline fill and epilogue)
    wave_seconds: float = 0.5e-6
    #: the least K one split-K piece gets
    split_k_depth: int = 256
    #: the fraction of the device's memory bandwidth a GEMM's operand streaming reaches
    memory_efficiency: float = 0.8
    #: whether a last, partial wave's tiles are spread over every SM (stream-K) instead of costing a whole wave
    stream_k: bool = False

    def __post_init__(self) -> None:
        if not self.tiles or not all(
            isinstance(rows, int) and isinstance(cols, int) and rows > 0 and cols > 0 and 0 < eff <= 1
            for rows, cols, eff in self.tiles
        ):
            raise ClusterSpecError(
                f"GemmShapeModel: tiles must be (rows, columns, efficiency) with positive int sizes and "
                f"0 < efficiency <= 1, found {self.tiles!r}"
            )
        if not (self.wave_seconds >= 0 and math.isfinite(self.wave_seconds)):
            raise ClusterSpecError(
                f"GemmShapeModel: wave_seconds must be finite seconds >= 0, found {self.wave_seconds!r}"
            )
        if not (isinstance(self.split_k_depth, int) and self.split_k_depth > 0):
            raise ClusterSpecError(
                f"GemmShapeModel: split_k_depth must be a positive int, found {self.split_k_depth!r}"
            )
        if not isinstance(self.stream_k, bool):
            raise ClusterSpecError(f"GemmShapeModel: stream_k must be a bool, found {self.stream_k!r}")
        if not 0 < self.memory_efficiency <= 1:
            raise ClusterSpecError(
                f"GemmShapeModel: memory_efficiency must be in (0, 1], found {self.memory_efficiency!r}"
            )

    def seconds(
        self, batch: int, m: int, n: int, k: float, rate: float, moved: float, bandwidth: float, sms: int
    ) -> float:
        """Seconds a (batch x) [m, k] @ [k, n] GEMM takes at ``rate`` FLOP/s on ``sms`` SMs, moving ``moved``
        bytes at ``bandwidth`` bytes/s: the slower of its tiled compute and its memory traffic (no launch)."""
        compute = _tiled_seconds(self, batch, m, n, k, rate, sms)
        return max(compute, moved / (bandwidth * self.memory_efficiency))


@lru_cache(maxsize=4096)
def _tiled_seconds(
    model: GemmShapeModel, batch: int, m: int, n: int, k: float, rate: float, sms: int
) -> float:
    """The compute time of the tile the library would pick (cached: a training step repeats a few shapes)."""
    per_sm = rate / sms
    best = math.inf
    for rows, cols, efficiency in model.tiles:
        tiles = batch * -(-m // rows) * -(-n // cols)
        if tiles < sms:
            # one wave; K split over the idle SMs, but no piece shallower than split_k_depth (nor than K)
            waves, depth = 1, k / min(sms // tiles, max(1.0, k / model.split_k_depth))
        elif model.stream_k:
            # whole waves, then the leftover tiles' multiply-adds spread over every SM; each wave started pays its
            # fixed cost
            whole, left = divmod(tiles, sms)
            tile_seconds = 2.0 * rows * cols * k / (per_sm * efficiency)
            best = min(best, (whole + left / sms) * tile_seconds + (whole + (left > 0)) * model.wave_seconds)
            continue
        else:
            waves, depth = -(-tiles // sms), k
        seconds = waves * (2.0 * rows * cols * depth / (per_sm * efficiency) + model.wave_seconds)
        best = min(best, seconds)
    return best
