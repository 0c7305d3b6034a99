"""The modelled network: clusters of ranks and switches joined by directed links, named presets, config files,
and timed transfers over the links."""

from simdist.network.builders import BUILDERS
from simdist.network.cluster import (
    Cluster,
    build_preset,
    cluster_from_config,
    load_cluster,
    load_file,
    save_cluster,
)
from simdist.network.config import config_to_toml
from simdist.network.graph import Link, validate_algorithms
from simdist.network.links import Network
from simdist.network.presets import PRESETS, Preset, preset_names

__all__ = [
    "BUILDERS",
    "PRESETS",
    "Cluster",
    "Link",
    "Network",
    "Preset",
    "build_preset",
    "cluster_from_config",
    "config_to_toml",
    "load_cluster",
    "load_file",
    "preset_names",
    "save_cluster",
    "validate_algorithms",
]
