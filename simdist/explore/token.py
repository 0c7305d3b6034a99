"""Replay tokens: one run of an exploration as JSON (never pickle), enough to run it again.

A token holds the perturbation (its seed and the strategy's choices), the strategy that drew it, the cluster
(``Cluster.to_config``), the run options, the faults, the program's reference and a hash of its code, and the
simdist and torch versions. :func:`read` refuses anything else with a :class:`ReplayTokenError`;
:func:`changes` says what differs from the present code, versions and cluster.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from importlib import metadata
from types import ModuleType
from typing import Any

import torch

from simdist.clock.perturbation import Perturbation
from simdist.errors import SimdistError
from simdist.explore.errors import ExplorationError, ReplayTokenError
from simdist.network.cluster import Cluster
from simdist.options import RunOptions

#: the version of the token format
FORMAT = 1
#: what marks a JSON object as a replay token
KIND = "simdist-replay"

#: RunOptions fields a token cannot hold (not JSON values)
_NOT_STORED = ("compute",)


def versions() -> dict[str, str]:
    """The simdist and torch versions a token records."""
    try:
        own = metadata.version("simdist")
    except metadata.PackageNotFoundError:  # a source tree that was never installed
        own = "unknown"
    return {"simdist": own, "torch": torch.__version__}


def options_json(options: RunOptions) -> dict[str, Any]:
    """``options`` as JSON; a clear error for an option a token cannot hold."""
    if not isinstance(options.compute, bool):
        raise ExplorationError(
            "explore records each run's options as JSON in its replay token: compute=simdist.profile(...) cannot be "
            "stored; explore with compute=True or False"
        )
    out: dict[str, Any] = {}
    for f in dataclasses.fields(options):
        if f.name == "faults":  # the token's own "faults" list holds them, each as fault_json writes it
            out[f.name] = []
            continue
        value = getattr(options, f.name)
        out[f.name] = list(value) if isinstance(value, tuple) else value
    return out


def options_from_json(data: Any) -> RunOptions:
    """The options :func:`options_json` wrote."""
    if not isinstance(data, dict):
        raise ReplayTokenError(f"replay token: 'options' must be a JSON object, got {type(data).__name__}")
    try:
        return RunOptions.from_keywords(**data)
    except (TypeError, SimdistError) as e:
        raise ReplayTokenError(f"replay token: its run options are not simdist.run's: {e}") from None


def fault_json(fault: Any) -> dict[str, Any]:
    """A fault (a frozen dataclass of ``simdist.faults`` with JSON fields) as ``{"type": name, **fields}``."""
    if not dataclasses.is_dataclass(fault) or isinstance(fault, type):
        raise ExplorationError(
            f"faults must be simdist.faults objects (frozen dataclasses), got {type(fault).__name__} {fault!r:.60}"
        )
    out: dict[str, Any] = {"type": type(fault).__name__}
    for f in dataclasses.fields(fault):
        value = getattr(fault, f.name)
        out[f.name] = list(value) if isinstance(value, tuple) else value
    try:
        json.dumps(out)
    except TypeError as e:
        raise ExplorationError(f"fault {fault!r:.80} has a field that is not a JSON value ({e})") from None
    return out


def fault_from_json(data: Any, namespace: ModuleType) -> Any:
    """The fault :func:`fault_json` wrote, rebuilt from ``namespace`` (``simdist.faults``)."""
    if not isinstance(data, dict) or not isinstance(data.get("type"), str):
        raise ReplayTokenError(f"replay token: a fault is a JSON object with a 'type', got {data!r:.80}")
    fields = dict(data)
    name = fields.pop("type")
    cls = getattr(namespace, name, None)
    if not isinstance(cls, type) or not dataclasses.is_dataclass(cls):
        raise ReplayTokenError(f"replay token: {namespace.__name__} has no fault type {name!r}")
    hints = {f.name: f.type for f in dataclasses.fields(cls)}
    for key, value in fields.items():
        if isinstance(value, list) and "tuple" in str(hints.get(key, "")):
            fields[key] = tuple(value)
    try:
        return cls(**fields)
    except (TypeError, ValueError) as e:
        raise ReplayTokenError(
            f"replay token: fault {name} cannot be rebuilt from {fields!r:.80}: {e}"
        ) from None


def make(
    *,
    perturbation: Perturbation,
    strategy: str,
    seed: int,
    run: int,
    cluster: Cluster | None,
    options: RunOptions,
    faults: Sequence[dict[str, Any]],
    program: dict[str, Any],
    code: str,
) -> str:
    """A replay token (a JSON text) for one run."""
    return json.dumps(
        {
            "kind": KIND,
            "format": FORMAT,
            "strategy": strategy,
            "seed": seed,
            "run": run,
            "perturbation": perturbation.to_json(),
            "cluster": cluster.to_config() if cluster is not None else {},  # a target holds its own
            "options": options_json(options),
            "faults": list(faults),
            "program": program,
            "code": code,
            "versions": versions(),
        },
        sort_keys=True,
    )


#: the fields every token has, and the JSON types they hold
_FIELDS: dict[str, type | tuple[type, ...]] = {
    "strategy": str,
    "seed": int,
    "run": int,
    "perturbation": dict,
    "cluster": dict,
    "options": dict,
    "faults": list,
    "program": dict,
    "code": str,
    "versions": dict,
}


def read(token: str | dict[str, Any]) -> dict[str, Any]:
    """The fields of ``token`` (its JSON text, or the parsed object), checked."""
    if isinstance(token, (bytes, bytearray)):
        raise ReplayTokenError(
            "a replay token is JSON text (a str) or its parsed object, never bytes or a pickle"
        )
    if isinstance(token, str):
        try:
            data = json.loads(token)
        except json.JSONDecodeError as e:
            raise ReplayTokenError(
                f"a replay token is JSON text; this one is not ({e}): {token[:60]!r}"
            ) from None
    else:
        data = token
    if not isinstance(data, dict) or data.get("kind") != KIND:
        raise ReplayTokenError(
            f"not a simdist replay token (a JSON object with kind={KIND!r}, as Exploration.failures[i].replay holds)"
        )
    if data.get("format") != FORMAT:
        raise ReplayTokenError(f"replay token format {data.get('format')!r} is not this simdist's ({FORMAT})")
    for name, kind in _FIELDS.items():
        if not isinstance(data.get(name), kind) or isinstance(data.get(name), bool):
            raise ReplayTokenError(f"replay token: field {name!r} is missing or not a JSON {kind.__name__}")  # type: ignore[union-attr]
    try:
        data["perturbation"] = Perturbation.from_json(data["perturbation"])
    except SimdistError as e:
        raise ReplayTokenError(f"replay token: {e}") from None
    data["options"] = options_from_json(data["options"])
    return data


def changes(data: dict[str, Any], code: str, cluster: Cluster | None) -> list[str]:
    """What differs between a token's recording and now: the program's code, the versions, the cluster (None: a
    target's token, which has none)."""
    out = []
    if data["code"] and code and data["code"] != code:
        out.append(f"the program's code changed (hash {data['code'][:12]} when recorded, {code[:12]} now)")
    for name, now in versions().items():
        then = data["versions"].get(name)
        if then != now:
            out.append(f"{name} {then} when recorded, {now} now")
    if cluster is not None and data["cluster"] != cluster.to_config():
        out.append(
            f"the cluster differs from the one recorded ({data['cluster'].get('cluster', {}).get('name')!r})"
        )
    return out
