"""Named cluster presets: a builder and its arguments, with sources for the numbers.

``Cluster.preset(name, world_size=..., **overrides)`` builds one (:class:`ClusterPresets` is a mixin of the
cluster class); ``world_size`` fills in the size argument of the preset's builder.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from typing_extensions import Self

from simdist.errors import ClusterSpecError
from simdist.network.builders import SIZE_KEY
from simdist.network.graph import positive_int, suggest, world_size_within_limit
from simdist.network.models import nccl_knows

#: arguments every builder takes besides its own
COMMON_KEYS = ("device", "algorithms", "name")


@dataclass(frozen=True)
class Preset:
    """A named cluster: a builder and its default keyword arguments (bytes/s and seconds as unit strings)."""

    name: str
    builder: str
    params: Mapping[str, Any] = field(default_factory=dict)
    summary: str = ""


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        # NVIDIA DGX H100 (DGX H100 user guide / H100 SXM5 data sheet): 8 H100 SXM5 per node; 4th-generation
        # NVLink gives each GPU 900 GB/s total, i.e. 450 GB/s per direction, through the node's NVSwitches.
        # Compute fabric: 8 single-port ConnectX-7 NICs, one per GPU, each 400 Gb/s NDR InfiniBand = 50 GB/s.
        # Latencies are per link (a rank-to-rank path crosses two): about 1 us per NVSwitch hop, about 5 us per
        # NIC-to-IB-switch hop including the NIC and software stack, in line with NCCL small-message timings.
        Preset(
            "dgx-h100",
            "two_level",
            {
                "nodes": 1,
                "gpus_per_node": 8,
                "intra_bandwidth": "450GB/s",
                "intra_latency": "1us",
                "inter_bandwidth": "400Gb/s",
                "inter_latency": "5us",
                "device": "H100",
                "collective_model": "nccl",
            },
            "nodes of 8 H100 SXM: NVLink4 450 GB/s per GPU via NVSwitch, 400 Gb/s IB NIC per GPU",
        ),
        # NVIDIA DGX A100 (DGX A100 user guide / A100 data sheet): 8 A100 SXM4 per node; 3rd-generation NVLink
        # gives 600 GB/s total per GPU, i.e. 300 GB/s per direction, through 6 NVSwitches. Compute fabric:
        # 8 single-port ConnectX-6 NICs, one per GPU, each 200 Gb/s HDR InfiniBand = 25 GB/s.
        Preset(
            "dgx-a100",
            "two_level",
            {
                "nodes": 1,
                "gpus_per_node": 8,
                "intra_bandwidth": "300GB/s",
                "intra_latency": "1us",
                "inter_bandwidth": "200Gb/s",
                "inter_latency": "5us",
                "device": "A100",
                "collective_model": "nccl",
            },
            "nodes of 8 A100 SXM: NVLink3 300 GB/s per GPU via NVSwitch, 200 Gb/s HDR IB NIC per GPU",
        ),
        Preset(
            "ring",
            "ring",
            {"n": 8, "bandwidth": "100GB/s", "latency": "5us"},
            "8 ranks in a bidirectional ring",
        ),
        Preset(
            "switch", "switch", {"n": 8, "bandwidth": "100GB/s", "latency": "5us"}, "8 ranks on one switch"
        ),
        Preset(
            "torus", "torus", {"dims": (4, 4), "bandwidth": "100GB/s", "latency": "5us"}, "4 x 4 2-D torus"
        ),
        # Commodity 10 GbE: a kernel TCP round trip through one switch is on the order of 100 us, so about
        # 50 us per link (a rank-to-rank path crosses two).
        Preset(
            "cpu-ethernet",
            "switch",
            {"n": 4, "bandwidth": "10Gb/s", "latency": "50us", "device": "cpu"},
            "4 CPU processes on one 10 Gb/s Ethernet switch",
        ),
    )
}
"""Named presets; ``Cluster.preset(name, **overrides)`` builds one."""


def preset_names() -> list[str]:
    """Return the names of all presets, sorted."""
    return sorted(PRESETS)


def _near_square(n: int) -> tuple[int, int]:
    """Return the 2-D torus shape (a, b), a <= b, a * b == n, with a as large as possible."""
    a = max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)
    return (a, n // a)


def lookup(name: str) -> Preset:
    """Return the preset called ``name`` (case and '_'/'-' insensitive), or raise listing the known ones."""
    if not isinstance(name, str):
        raise ClusterSpecError(f"preset name must be a string; found {name!r}")
    key = name.strip().lower().replace("_", "-")
    if key not in PRESETS:
        raise ClusterSpecError(
            f"unknown cluster preset {name!r}; known presets: {', '.join(preset_names())}."
            f"{suggest(key, preset_names(), cutoff=0.5)}"
        )
    return PRESETS[key]


def check_keys(given: Mapping[str, Any], allowed: list[str], where: str) -> None:
    """Raise if ``given`` has a key outside ``allowed``, suggesting the closest allowed key."""
    for key in given:
        if key not in allowed:
            raise ClusterSpecError(
                f"{where}: unknown key {key!r}; accepted keys are {', '.join(allowed)}."
                f"{suggest(str(key), allowed, cutoff=0.5)}"
            )


def _size(builder: str, params: dict[str, Any], world_size: int, where: str) -> None:
    """Fill in ``builder``'s size argument in ``params`` so that it builds ``world_size`` ranks."""
    key = SIZE_KEY[builder]
    if builder == "two_level":
        per_node = params.get("gpus_per_node", 8)
        per_node = positive_int(per_node, f"{where}: gpus_per_node")
        used = params.get("ranks_per_node")
        if used is None and world_size < per_node:
            # a world smaller than a node uses part of one, as torchrun --nproc-per-node N does on a bigger node
            params["ranks_per_node"] = used = world_size
        used = per_node if used is None else positive_int(used, f"{where}: ranks_per_node")
        if world_size % used:
            raise ClusterSpecError(
                f"{where}: world size {world_size} is not a multiple of the ranks per node ({used}, of gpus_per_node="
                f"{per_node}); use fewer ranks than a node's GPUs (part of one node) or a multiple of {used}, pass "
                f"ranks_per_node= or gpus_per_node= (Python or a cluster file), or choose a preset such as 'switch' or "
                f"'ring' (any size)"
            )
        params[key] = world_size // used
    elif builder == "torus":
        params[key] = _near_square(world_size)
    else:
        params[key] = world_size


class ClusterPresets:
    """Build clusters by builder name or preset name; mixed into the cluster class."""

    world_size: int

    @classmethod
    def builder_keys(cls, builder: str) -> list[str]:
        """The keyword arguments builder ``builder`` accepts, in signature order."""
        return list(inspect.signature(getattr(cls, builder)).parameters)

    @classmethod
    def build(
        cls, builder: str, params: dict[str, Any], world_size: int | None = None, where: str = ""
    ) -> Self:
        """Call builder ``builder`` with ``params`` (sized by ``world_size`` when its size key is absent)."""
        if not isinstance(builder, str) or builder not in SIZE_KEY:
            raise ClusterSpecError(
                f"unknown builder {builder!r}; known builders: {', '.join(SIZE_KEY)}.{suggest(str(builder), SIZE_KEY)}"
            )
        where = where or f"builder {builder!r}"
        if not isinstance(params, Mapping):
            raise ClusterSpecError(
                f"{where}: the arguments must be a mapping of keyword to value; found {params!r}"
            )
        check_keys(params, cls.builder_keys(builder), where)
        params = dict(params)
        if world_size is not None:
            world_size = world_size_within_limit(
                positive_int(world_size, f"{where}: world_size"), f"{where}: world_size"
            )
            if SIZE_KEY[builder] not in params:
                _size(builder, params, world_size, where)
        signature = inspect.signature(getattr(cls, builder))
        missing = [
            k
            for k, p in signature.parameters.items()
            if p.default is inspect.Parameter.empty and k not in params
        ]
        if missing:
            raise ClusterSpecError(
                f"{where} needs {', '.join(repr(k) for k in missing)}; give it, or a world_size that sets it"
            )
        cluster = getattr(cls, builder)(**params)
        if world_size is not None and cluster.world_size != world_size:
            raise ClusterSpecError(
                f"{where} describes {cluster.world_size} ranks but a world size of {world_size} was requested; drop "
                f"the explicit {SIZE_KEY[builder]!r} to let the world size set it, or request {cluster.world_size} ranks"
            )
        return cluster

    @classmethod
    def preset(cls, name: str, /, world_size: int | None = None, **overrides: Any) -> Self:
        """Build preset ``name`` with builder arguments ``overrides``; ``world_size`` sizes a parametric preset.

        ``name`` is positional-only so that ``name=...`` among the overrides renames the cluster.
        """
        preset = lookup(name)
        where = f"preset {preset.name!r}"
        check_keys(overrides, cls.builder_keys(preset.builder), where)
        params = {"name": preset.name, **preset.params}
        if world_size is not None:
            params.pop(
                SIZE_KEY[preset.builder], None
            )  # the preset's default size yields to the requested one
        params.update(overrides)
        # NCCL's model is the GPU presets' default where it knows the device's generation; a device it does not
        # know (one you built, the CPU) is timed as any custom cluster is, unless NCCL's model is asked for
        nccl_default = params.get("collective_model") == "nccl" and "collective_model" not in overrides
        if nccl_default and "device" in overrides and not nccl_knows(params["device"]):
            params["collective_model"] = "alpha-beta"
        return cls.build(preset.builder, params, world_size, where)
