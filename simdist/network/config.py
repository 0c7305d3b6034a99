"""Clusters read from and written to TOML or JSON config files.

A config file has a ``[cluster]`` table in one of three forms (JSON: the same keys as nested objects):

* ``builder = "two_level"`` plus that builder's keyword arguments (``nodes = 2``, ``inter_bandwidth = "400Gb/s"``);
* ``preset = "dgx-h100"`` plus overrides of the preset's builder arguments;
* ``world_size = 4`` (and optionally ``switches = ["sw", ...]`` to fix their order) with an explicit
  top-level ``[[links]]`` list of ``src``, ``dst``, ``bandwidth``, ``latency`` (and optional
  ``duplex = true`` for a link in each direction). Links are numbered by source vertex (ranks, then
  switches), then in the order listed.

Every form also takes ``device``, ``name`` and a ``[cluster.algorithms]`` table; a cluster timed by the gloo
model (``collective_model = "gloo"``) a ``[cluster.gloo]`` table whose ``local_bandwidth`` (bytes/s) is the rate
at which a rank works through its own memory (adding a received message in, ProcessGroupGloo's copies). In the first two forms
``world_size`` may replace the size argument (``n``, ``nodes`` or ``dims``) of a builder that has one.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import networkx as nx
from typing_extensions import Self

from simdist.algorithms import nccl
from simdist.compute.devicefile import device_from_config
from simdist.errors import ClusterSpecError
from simdist.network.builders import BUILDERS
from simdist.network.graph import positive_int, suggest, world_size_within_limit
from simdist.network.models import check_collective_model
from simdist.network.presets import COMMON_KEYS, PRESETS, check_keys, lookup, preset_names
from simdist.units import parse_bandwidth

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: tomllib arrived in 3.11; tomli is its backport.
    try:
        import tomli as tomllib  # type: ignore[no-redef]
    except ModuleNotFoundError:
        tomllib = None  # type: ignore[assignment]


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
        check_keys(link, [*required, "duplex"], where)
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


def _gloo_table(table: Any, model: str) -> float:
    """The local bandwidth (bytes/s) of a ``[cluster.gloo]`` table, on a cluster timed by the gloo model."""
    if model != "gloo":
        raise ClusterSpecError(
            f"[cluster.gloo] times gloo's adds and copies, and this cluster's collectives are timed by the {model} "
            'model: add collective_model = "gloo" or remove [cluster.gloo]'
        )
    if not isinstance(table, Mapping):
        raise ClusterSpecError(f"[cluster.gloo] must be a table (local_bandwidth = ...); found {table!r}")
    check_keys(table, ["local_bandwidth"], "[cluster.gloo]")
    if "local_bandwidth" not in table:
        raise ClusterSpecError("[cluster.gloo] needs local_bandwidth (bytes/s, or a string such as '3GB/s')")
    try:
        return parse_bandwidth(table["local_bandwidth"])
    except ClusterSpecError as exc:
        raise ClusterSpecError(f"[cluster.gloo] local_bandwidth: {exc}") from None


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object as a dict, refusing a key given twice (TOML refuses it too; JSON would keep the last)."""
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise ClusterSpecError(f"key {key!r} is given twice in one object; give each key once")
        seen[key] = value
    return seen


def _text(path: Path) -> str:
    """The file at ``path`` decoded as UTF-8 (a leading byte-order mark is allowed)."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ClusterSpecError(f"cluster file {str(path)!r} cannot be read: {exc.strerror or exc}") from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise ClusterSpecError(
            f"{path}: not UTF-8 text: byte {data[exc.start]:#04x} at offset {exc.start} (line {line}) is "
            f"not valid UTF-8; save the file as UTF-8"
        ) from None


def _read(path: Path) -> Any:
    """Return the parsed contents of the .toml or .json file at ``path``."""
    suffix = path.suffix.lower()
    if suffix not in (".toml", ".json"):
        raise ClusterSpecError(
            f"cluster file {str(path)!r} must end in .toml or .json; found {suffix or 'no suffix'!r}"
        )
    if path.is_dir():
        raise ClusterSpecError(
            f"cluster file {str(path)!r} is a directory; give the path of a .toml/.json file"
        )
    if not path.is_file():
        raise ClusterSpecError(
            f"cluster file {str(path)!r} does not exist; give a preset name or a .toml/.json path"
        )
    text = _text(path)
    if suffix == ".json":
        try:
            return json.loads(text, object_pairs_hook=_no_duplicate_keys)
        except json.JSONDecodeError as exc:
            raise ClusterSpecError(f"{path}: not valid JSON: {exc}") from None
        except ClusterSpecError as exc:
            raise ClusterSpecError(f"{path}: {exc}") from None
        except RecursionError:
            raise ClusterSpecError(f"{path}: not a cluster description: its values nest too deeply") from None
    if tomllib is None:
        raise ClusterSpecError(f"{path}: reading TOML needs Python 3.11+ or the 'tomli' package; or use JSON")
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ClusterSpecError(f"{path}: not valid TOML: {exc}") from None
    except RecursionError:
        raise ClusterSpecError(f"{path}: not a cluster description: its values nest too deeply") from None


def _toml_value(value: Any) -> str:
    """Return ``value`` (bool, int, finite float, str, or a list or table of these) written as a TOML value."""
    if isinstance(value, Mapping):  # inside a list: an inline table
        return "{" + ", ".join(f"{json.dumps(str(k))} = {_toml_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)  # repr of a finite float is valid TOML and reads back exactly
    return json.dumps(value)  # a JSON string is a valid TOML basic string


#: the [cluster] keys of an explicit [[links]] list that say how its ranks sit in nodes (``Cluster.save`` writes them)
NODE_KEYS = ("ranks_per_node", "gpus_per_node")


def _nodes(params: dict[str, Any], world_size: int) -> tuple[int | None, int | None]:
    """(ranks_per_node, gpus_per_node) taken out of ``params``: both or neither, ranks of whole nodes."""
    given = [k for k in NODE_KEYS if k in params]
    if not given:
        return None, None
    if len(given) == 1:
        raise ClusterSpecError(
            f"[cluster] gives {given[0]} without {'gpus_per_node' if given[0] == 'ranks_per_node' else 'ranks_per_node'}: give both or neither"
        )
    used = positive_int(params.pop("ranks_per_node"), "[cluster] ranks_per_node")
    per_node = positive_int(params.pop("gpus_per_node"), "[cluster] gpus_per_node")
    if used > per_node or world_size % used:
        raise ClusterSpecError(
            f"[cluster] ranks_per_node = {used} must be at most gpus_per_node = {per_node} and divide world_size = "
            f"{world_size}"
        )
    return used, per_node


def _toml_table(header: str, table: Mapping[str, Any]) -> list[str]:
    """``table`` as TOML lines under ``[header]``: its values first, then each nested table as ``[header.key]``."""
    lines = [
        f"[{header}]",
        *(f"{k} = {_toml_value(v)}" for k, v in table.items() if not isinstance(v, Mapping)),
    ]
    for key, value in table.items():
        if isinstance(value, Mapping) and value:
            lines += ["", *_toml_table(f"{header}.{key}", value)]
    return lines


def config_to_toml(config: Mapping[str, Any]) -> str:
    """Return the config mapping made by ``Cluster.to_config`` as TOML text."""
    lines = _toml_table("cluster", config["cluster"])
    for link in config.get("links", []):
        lines += ["", "[[links]]", *(f"{k} = {_toml_value(v)}" for k, v in link.items())]
    return "\n".join(lines) + "\n"


class ClusterFiles:
    """Build clusters from config mappings, files and names, and write them back; mixed into the cluster class."""

    @classmethod
    def from_config(
        cls, config: Mapping[str, Any], world_size: int | None = None, source: str = "config"
    ) -> Self:
        """Build a cluster from a parsed config mapping (the file format above); ``source`` names it in errors."""
        try:
            return cls._from_config(config, world_size, source)
        except ClusterSpecError as exc:
            message = str(exc)
            raise ClusterSpecError(
                message if message.startswith(source) else f"{source}: {message}"
            ) from None

    @classmethod
    def from_file(cls, path: str | Path, world_size: int | None = None) -> Self:
        """Load a cluster from a .toml or .json config file; ``world_size`` sizes it or must match it."""
        path = Path(path)
        return cls.from_config(_read(path), world_size, source=str(path))

    @classmethod
    def load(cls, spec: str, world_size: int | None = None) -> Self:
        """The cluster named by ``spec``: a preset name or a .toml/.json path, sized by ``world_size``."""
        if not isinstance(spec, str) or not spec.strip():
            raise ClusterSpecError(
                f"cluster spec must be a preset name ({', '.join(preset_names())}) or a file path; found {spec!r}"
            )
        if spec.strip().lower().replace("_", "-") in PRESETS:
            return cls.preset(spec, world_size=world_size)  # type: ignore[attr-defined]
        path = Path(spec)
        if path.suffix.lower() in (".toml", ".json") or path.is_file():
            return cls.from_file(path, world_size)
        return cls.preset(spec, world_size=world_size)  # type: ignore[attr-defined]  # raises, with suggestions

    def save(self, path: str | Path) -> None:
        """Write this cluster to a .toml or .json file (explicit links form) that ``load`` reads back."""
        path = Path(path)
        config = self.to_config()  # type: ignore[attr-defined]
        suffix = path.suffix.lower()
        if suffix == ".json":
            path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        elif suffix == ".toml":
            path.write_text(config_to_toml(config), encoding="utf-8")
        else:
            raise ClusterSpecError(f"cannot save a cluster to {str(path)!r}: use a .toml or .json file name")

    @classmethod
    def _from_config(cls, config: Mapping[str, Any], world_size: int | None, source: str) -> Self:
        """Build a cluster from ``config``; errors are prefixed with ``source`` by the caller."""
        if not isinstance(config, Mapping):
            raise ClusterSpecError(
                f"expected a table with a 'cluster' table; found a {type(config).__name__}"
            )
        check_keys(config, ["cluster", "links"], "top level")
        table = config.get("cluster")
        if not isinstance(table, Mapping):
            raise ClusterSpecError(
                "needs a [cluster] table with builder = ..., preset = ..., or world_size = ... and [[links]]"
            )
        links = config.get("links")
        forms = [k for k in ("preset", "builder") if k in table] + (
            ["[[links]]"] if links is not None else []
        )
        if len(forms) != 1:
            raise ClusterSpecError(
                'the [cluster] table needs exactly one of preset = "...", builder = "...", or a [[links]] list; '
                f"found {', '.join(forms) if forms else 'none of them'}"
            )
        params = {
            k: v for k, v in table.items() if k not in ("preset", "builder", "world_size", "nccl", "gloo")
        }
        if "device" in params:
            params["device"] = device_from_config(params["device"])
        overrides = nccl.Overrides.from_config(table["nccl"]) if "nccl" in table else None
        cluster = cls._form(config, params, world_size, links)
        if overrides is not None:
            if cluster.collective_model != "nccl":
                raise ClusterSpecError(
                    "[cluster.nccl] corrects NCCL's model, and this cluster's collectives are timed by the "
                    f'{cluster.collective_model} model: add collective_model = "nccl" or remove [cluster.nccl]'
                )
            cluster.nccl_overrides = overrides
        if "gloo" in table:
            cluster.local_bandwidth = _gloo_table(table["gloo"], cluster.collective_model)
        return cluster

    @classmethod
    def _form(
        cls, config: Mapping[str, Any], params: dict[str, Any], world_size: int | None, links: Any
    ) -> Self:
        """The cluster of a preset, a builder or an explicit list of links, as ``config``'s [cluster] says."""
        table = config["cluster"]
        if "world_size" in table:
            file_size = positive_int(table["world_size"], "[cluster] world_size")
            world_size_within_limit(file_size, "[cluster] world_size")
            if world_size is not None and world_size != file_size:
                raise ClusterSpecError(
                    f"world_size = {file_size} in the file but a world size of {world_size} was requested; make them agree"
                )
            world_size = file_size
        if "preset" in table:
            preset = lookup(table["preset"])
            check_keys(params, cls.builder_keys(preset.builder), f"[cluster] (preset {preset.name!r})")
            return cls.preset(preset.name, world_size=world_size, **params)  # type: ignore[attr-defined]
        if "builder" in table:
            builder = table["builder"]
            if not isinstance(builder, str):
                raise ClusterSpecError(
                    f"builder must be a builder name (a string: {', '.join(BUILDERS)}); found a "
                    f"{type(builder).__name__}: {builder!r}"
                )
            if builder not in BUILDERS:
                raise ClusterSpecError(
                    f"unknown builder {builder!r}; known builders: {', '.join(BUILDERS)}.{suggest(str(builder), BUILDERS, cutoff=0.5)}"
                )
            check_keys(params, cls.builder_keys(builder), f"[cluster] (builder {builder!r})")
            return cls.build(builder, dict(params), world_size, f"builder {builder!r}")  # type: ignore[attr-defined]
        check_keys(
            params,
            [*COMMON_KEYS, *NODE_KEYS, "collective_model", "switches"],
            "[cluster] (explicit [[links]])",
        )
        if world_size is None:
            raise ClusterSpecError("an explicit [[links]] list needs world_size = N in the [cluster] table")
        switches = params.pop("switches", [])
        nodes = _nodes(params, world_size)
        model = params.pop("collective_model", "alpha-beta")
        cluster = cls(_links_graph(links, world_size, switches), **params)  # type: ignore[call-arg]
        # the nodes first: NCCL's model reads them (a cluster saved from a preset or two_level keeps its nodes)
        cluster.ranks_per_node, cluster.gpus_per_node = nodes
        cluster.collective_model = check_collective_model(model, cluster.device)
        return cluster
