"""Named cluster presets, and clusters read from TOML or JSON config files.

A config file has a ``[cluster]`` table in one of three forms (JSON: the same keys as nested objects):

* ``builder = "two_level"`` plus that builder's keyword arguments (``nodes = 2``, ``inter_bandwidth = "400Gb/s"``);
* ``preset = "dgx-h100"`` plus overrides of the preset's builder arguments;
* ``world_size = 4`` (and optionally ``switches = ["sw", ...]`` to fix their order) with an explicit
  top-level ``[[links]]`` list of ``src``, ``dst``, ``bandwidth``, ``latency`` (and optional
  ``duplex = true`` for a link in each direction). Links are numbered by source vertex (ranks, then
  switches), then in the order listed.

Every form also takes ``device``, ``name`` and a ``[cluster.algorithms]`` table. In the first two forms
``world_size`` may replace the size argument (``n``, ``nodes`` or ``dims``) of a builder that has one.
"""

from __future__ import annotations

import difflib
import inspect
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import networkx as nx

from simdist.errors import ClusterSpecError
from simdist.network.topology import Cluster, _positive_int

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: tomllib arrived in 3.11; tomli is its backport.
    try:
        import tomli as tomllib  # type: ignore[no-redef]
    except ModuleNotFoundError:
        tomllib = None  # type: ignore[assignment]

BUILDERS: dict[str, Callable[..., Cluster]] = {
    "ring": Cluster.ring,
    "switch": Cluster.switch,
    "fully_connected": Cluster.fully_connected,
    "two_level": Cluster.two_level,
    "torus": Cluster.torus,
}
"""Builder names usable as ``builder = ...`` in config files, mapped to the ``Cluster`` classmethods."""

# The keyword that sets each builder's size, so that a world size can fill it in.
_SIZE_KEY = {"ring": "n", "switch": "n", "fully_connected": "n", "two_level": "nodes", "torus": "dims"}
_COMMON_KEYS = ("device", "algorithms", "name")


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


def _suggest(word: str, choices: list[str]) -> str:
    """Return " Did you mean ...?" for close matches of ``word``, or ""."""
    close = difflib.get_close_matches(word, choices, n=3, cutoff=0.5)
    return f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""


def _builder_keys(builder: str) -> list[str]:
    """Return the keyword arguments ``builder`` accepts, in signature order."""
    return list(inspect.signature(BUILDERS[builder]).parameters)


def _check_keys(given: Mapping[str, Any], allowed: list[str], where: str) -> None:
    """Raise if ``given`` has a key outside ``allowed``, suggesting the closest allowed key."""
    for key in given:
        if key not in allowed:
            raise ClusterSpecError(
                f"{where}: unknown key {key!r}; accepted keys are {', '.join(allowed)}.{_suggest(str(key), allowed)}"
            )


def _near_square(n: int) -> tuple[int, int]:
    """Return the 2-D torus shape (a, b), a <= b, a * b == n, with a as large as possible."""
    a = max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)
    return (a, n // a)


def _size(builder: str, params: dict[str, Any], world_size: int, where: str) -> None:
    """Fill in ``builder``'s size argument in ``params`` so that it builds ``world_size`` ranks."""
    key = _SIZE_KEY[builder]
    if builder == "two_level":
        per_node = params.get("gpus_per_node", 8)
        per_node = _positive_int(per_node, f"{where}: gpus_per_node")
        if world_size % per_node:
            raise ClusterSpecError(
                f"{where}: world size {world_size} is not a multiple of gpus_per_node={per_node}; use a multiple "
                f"of {per_node} ranks, pass gpus_per_node= (Python or a cluster file), or choose a preset such as "
                f"'switch' or 'ring' (any size)"
            )
        params[key] = world_size // per_node
    elif builder == "torus":
        params[key] = _near_square(world_size)
    else:
        params[key] = world_size


def _build(builder: str, params: dict[str, Any], world_size: int | None, where: str) -> Cluster:
    """Call ``builder`` with ``params`` (sized by ``world_size`` when its size key is absent); check the size."""
    if world_size is not None:
        world_size = _positive_int(world_size, f"{where}: world_size")
        if _SIZE_KEY[builder] not in params:
            _size(builder, params, world_size, where)
    signature = inspect.signature(BUILDERS[builder])
    missing = [
        k for k, p in signature.parameters.items() if p.default is inspect.Parameter.empty and k not in params
    ]
    if missing:
        raise ClusterSpecError(
            f"{where} needs {', '.join(repr(k) for k in missing)}; give it, or a world_size that sets it"
        )
    cluster = BUILDERS[builder](**params)
    if world_size is not None and cluster.world_size != world_size:
        raise ClusterSpecError(
            f"{where} describes {cluster.world_size} ranks but a world size of {world_size} was requested; drop "
            f"the explicit {_SIZE_KEY[builder]!r} to let the world size set it, or request {cluster.world_size} ranks"
        )
    return cluster


def _lookup(name: str) -> Preset:
    """Return the preset called ``name`` (case and '_'/'-' insensitive), or raise listing the known ones."""
    if not isinstance(name, str):
        raise ClusterSpecError(f"preset name must be a string; found {name!r}")
    key = name.strip().lower().replace("_", "-")
    if key not in PRESETS:
        raise ClusterSpecError(
            f"unknown cluster preset {name!r}; known presets: {', '.join(preset_names())}."
            f"{_suggest(key, preset_names())}"
        )
    return PRESETS[key]


def build_preset(name: str, world_size: int | None = None, **overrides: Any) -> Cluster:
    """Build preset ``name`` with builder arguments ``overrides``; ``world_size`` sizes a parametric preset."""
    preset = _lookup(name)
    where = f"preset {preset.name!r}"
    _check_keys(overrides, _builder_keys(preset.builder), where)
    params = {"name": preset.name, **preset.params}
    if world_size is not None:
        params.pop(_SIZE_KEY[preset.builder], None)  # the preset's default size yields to the requested one
    params.update(overrides)
    return _build(preset.builder, params, world_size, where)


def cluster_from_config(
    config: Mapping[str, Any], world_size: int | None = None, source: str = "config"
) -> Cluster:
    """Build a cluster from a parsed config mapping (the file format above); ``source`` names it in errors."""
    try:
        return _from_config(config, world_size, source)
    except ClusterSpecError as exc:
        message = str(exc)
        raise ClusterSpecError(message if message.startswith(source) else f"{source}: {message}") from None


def _from_config(config: Mapping[str, Any], world_size: int | None, source: str) -> Cluster:
    """Build a cluster from ``config``; errors are prefixed with ``source`` by the caller."""
    if not isinstance(config, Mapping):
        raise ClusterSpecError(f"expected a table with a 'cluster' table; found a {type(config).__name__}")
    _check_keys(config, ["cluster", "links"], "top level")
    table = config.get("cluster")
    if not isinstance(table, Mapping):
        raise ClusterSpecError(
            "needs a [cluster] table with builder = ..., preset = ..., or world_size = ... and [[links]]"
        )
    links = config.get("links")
    forms = [k for k in ("preset", "builder") if k in table] + (["[[links]]"] if links is not None else [])
    if len(forms) != 1:
        raise ClusterSpecError(
            'the [cluster] table needs exactly one of preset = "...", builder = "...", or a [[links]] list; '
            f"found {', '.join(forms) if forms else 'none of them'}"
        )
    params = {k: v for k, v in table.items() if k not in ("preset", "builder", "world_size")}
    if "world_size" in table:
        file_size = _positive_int(table["world_size"], "[cluster] world_size")
        if world_size is not None and world_size != file_size:
            raise ClusterSpecError(
                f"world_size = {file_size} in the file but a world size of {world_size} was requested; make them agree"
            )
        world_size = file_size
    if "preset" in table:
        preset = _lookup(table["preset"])
        _check_keys(params, _builder_keys(preset.builder), f"[cluster] (preset {preset.name!r})")
        return build_preset(preset.name, world_size=world_size, **params)
    if "builder" in table:
        builder = table["builder"]
        if builder not in BUILDERS:
            raise ClusterSpecError(
                f"unknown builder {builder!r}; known builders: {', '.join(BUILDERS)}.{_suggest(str(builder), list(BUILDERS))}"
            )
        _check_keys(params, _builder_keys(builder), f"[cluster] (builder {builder!r})")
        return _build(builder, dict(params), world_size, f"builder {builder!r}")
    _check_keys(params, [*_COMMON_KEYS, "switches"], "[cluster] (explicit [[links]])")
    if world_size is None:
        raise ClusterSpecError("an explicit [[links]] list needs world_size = N in the [cluster] table")
    switches = params.pop("switches", [])
    return Cluster(_links_graph(links, world_size, switches), **params)


def _links_graph(links: Any, world_size: int, switches: Any) -> nx.DiGraph:
    """Return the graph of ranks 0..world_size-1, the ``switches`` (in order) and the [[links]] list."""
    if not isinstance(links, list):
        raise ClusterSpecError(f"links must be a list of tables ([[links]]); found a {type(links).__name__}")
    if not isinstance(switches, list) or not all(isinstance(s, str) and s for s in switches):
        raise ClusterSpecError(f"switches must be a list of switch names (strings); found {switches!r}")
    graph = nx.DiGraph()
    graph.add_nodes_from(range(world_size))
    # Switches listed here come first, in this order (it fixes link numbering); others as links name them.
    graph.add_nodes_from(switches)
    required = ["src", "dst", "bandwidth", "latency"]
    for i, link in enumerate(links):
        where = f"links[{i}]"
        if not isinstance(link, Mapping):
            raise ClusterSpecError(f"{where} must be a table with {', '.join(required)}; found {link!r}")
        _check_keys(link, [*required, "duplex"], where)
        missing = [k for k in required if k not in link]
        if missing:
            raise ClusterSpecError(
                f"{where} lacks {', '.join(missing)}; each link needs {', '.join(required)}"
            )
        for end in (link["src"], link["dst"]):
            if isinstance(end, bool) or not isinstance(end, (int, str)) or end == "":
                raise ClusterSpecError(
                    f"{where}: endpoint {end!r} must be an int rank or a switch name string"
                )
            if isinstance(end, int) and not 0 <= end < world_size:
                raise ClusterSpecError(
                    f"{where}: rank {end} is outside 0..{world_size - 1} (world_size = {world_size})"
                )
        duplex = link.get("duplex", False)
        if not isinstance(duplex, bool):
            raise ClusterSpecError(f"{where}: duplex must be true or false; found {duplex!r}")
        pairs = [(link["src"], link["dst"])] + ([(link["dst"], link["src"])] if duplex else [])
        for u, v in pairs:
            if graph.has_edge(u, v):
                raise ClusterSpecError(
                    f"{where}: link {u!r} -> {v!r} is declared twice; declare each direction once "
                    f"(merge parallel cables into one link with their summed bandwidth)"
                )
            graph.add_edge(u, v, bandwidth=link["bandwidth"], latency=link["latency"])
    return graph


def _read(path: Path) -> Any:
    """Return the parsed contents of the .toml or .json file at ``path``."""
    suffix = path.suffix.lower()
    if suffix not in (".toml", ".json"):
        raise ClusterSpecError(
            f"cluster file {str(path)!r} must end in .toml or .json; found {suffix or 'no suffix'!r}"
        )
    if not path.is_file():
        raise ClusterSpecError(
            f"cluster file {str(path)!r} does not exist; give a preset name or a .toml/.json path"
        )
    if suffix == ".json":
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ClusterSpecError(f"{path}: not valid JSON: {exc}") from None
    if tomllib is None:
        raise ClusterSpecError(f"{path}: reading TOML needs Python 3.11+ or the 'tomli' package; or use JSON")
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ClusterSpecError(f"{path}: not valid TOML: {exc}") from None


def load_file(path: str | Path, world_size: int | None = None) -> Cluster:
    """Load a cluster from a .toml or .json config file; ``world_size`` sizes it or must match it."""
    path = Path(path)
    return cluster_from_config(_read(path), world_size, source=str(path))


def load_cluster(spec: str, world_size: int | None = None) -> Cluster:
    """Return the cluster named by ``spec``: a preset name or a .toml/.json path, sized by ``world_size``."""
    if not isinstance(spec, str) or not spec.strip():
        raise ClusterSpecError(
            f"cluster spec must be a preset name ({', '.join(preset_names())}) or a file path; found {spec!r}"
        )
    if spec.strip().lower().replace("_", "-") in PRESETS:
        return build_preset(spec, world_size=world_size)
    path = Path(spec)
    if path.suffix.lower() in (".toml", ".json") or path.is_file():
        return load_file(path, world_size)
    return build_preset(spec, world_size=world_size)  # raises: unknown preset, with suggestions


def _toml_value(value: Any) -> str:
    """Return ``value`` (bool, int, finite float, str, or a list of these) written as a TOML value."""
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)  # repr of a finite float is valid TOML and reads back exactly
    return json.dumps(value)  # a JSON string is a valid TOML basic string


def config_to_toml(config: Mapping[str, Any]) -> str:
    """Return the config mapping made by ``Cluster.to_config`` as TOML text."""
    cluster = dict(config["cluster"])
    algorithms = cluster.pop("algorithms", None)
    lines = ["[cluster]", *(f"{k} = {_toml_value(v)}" for k, v in cluster.items())]
    if algorithms:
        lines += ["", "[cluster.algorithms]", *(f"{k} = {_toml_value(v)}" for k, v in algorithms.items())]
    for link in config.get("links", []):
        lines += ["", "[[links]]", *(f"{k} = {_toml_value(v)}" for k, v in link.items())]
    return "\n".join(lines) + "\n"


def save_cluster(cluster: Cluster, path: str | Path) -> None:
    """Write ``cluster`` to a .toml or .json file (explicit links form) that ``load_cluster`` reads back."""
    path = Path(path)
    config = cluster.to_config()
    suffix = path.suffix.lower()
    if suffix == ".json":
        path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    elif suffix == ".toml":
        path.write_text(config_to_toml(config), encoding="utf-8")
    else:
        raise ClusterSpecError(f"cannot save a cluster to {str(path)!r}: use a .toml or .json file name")
