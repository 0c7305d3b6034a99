"""The root of simdist's error hierarchy, importable without the simulator (``simdist.errors`` re-exports it)."""

from __future__ import annotations


class SimdistError(Exception):
    """Base class of every error simdist raises on purpose."""
