"""The modelled network: clusters of ranks and switches joined by directed links, and named presets."""

from simdist.network.presets import PRESETS, build_preset, load_cluster, load_file, preset_names, save_cluster
from simdist.network.topology import ALGORITHMS, COLLECTIVES, Cluster, Link

__all__ = [
    "ALGORITHMS",
    "COLLECTIVES",
    "PRESETS",
    "Cluster",
    "Link",
    "build_preset",
    "load_cluster",
    "load_file",
    "preset_names",
    "save_cluster",
]
