"""``NCCL_ALGO`` and ``NCCL_PROTO`` read as NCCL 2.21.5 reads them (``parseList``, src/graph/tuning.cc 34-52), and
``NCCL_NVLS_ENABLE`` (src/transport/nvls.cc 231-241: 0 turns NVLink SHARP off, so NVLS and NVLS-tree are never
chosen).

A value is a comma-separated list of names, matched without regard to case; a leading ``^`` turns the
list into the names to leave out. NCCL ignores a name it does not know; here it is an error naming the
variable, the name and the accepted ones, since a misspelt pin would otherwise be silently lost.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

#: ``ncclAlgoStr`` and ``ncclProtoStr`` (src/collectives.cc of NCCL 2.21.5), in NCCL's order
ALGORITHM_NAMES = ("Tree", "Ring", "CollNetDirect", "CollNetChain", "NVLS", "NVLSTree")
PROTOCOL_NAMES = ("LL", "LL128", "Simple")


@dataclass(frozen=True)
class Enabled:
    """The NCCL algorithms and protocols a communicator may use (by default, all)."""

    algorithms: frozenset[str] = frozenset(ALGORITHM_NAMES)
    protocols: frozenset[str] = frozenset(PROTOCOL_NAMES)


def _parse(variable: str, value: str, names: tuple[str, ...]) -> frozenset[str]:
    text = value.strip()
    exclude = text.startswith("^")
    if exclude:
        text = text[1:]
    chosen: set[str] = set()
    by_lower = {n.lower(): n for n in names}
    for token in text.split(","):
        token = token.strip()
        if not token:
            continue
        name = by_lower.get(token.lower())
        if name is None:
            raise ValueError(
                f"{variable}={value!r}: unknown name {token!r}; expected a comma-separated list of "
                f"{', '.join(names)} (case-insensitive), optionally after '^' to exclude them"
            )
        chosen.add(name)
    if not exclude and not chosen:
        raise ValueError(
            f"{variable}={value!r} names nothing; expected a comma-separated list of {', '.join(names)}, "
            f"optionally after '^' to exclude them (unset the variable for NCCL's own choice)"
        )
    return frozenset(n for n in names if n not in chosen) if exclude else frozenset(chosen)


def _nvls_enabled(value: str | None) -> bool:
    """``NCCL_NVLS_ENABLE`` as an integer (``ncclLoadParam``, src/misc/param.cc 62-76; unset or empty: the
    default, 2): 0 off; 1 and 2 ("where the GPUs support it") leave NVLS to the fabric."""
    if value is None or not value:
        return True
    try:
        return int(value.strip(), 0) != 0
    except ValueError:
        # NCCL's strtoll would read the leading digits, or 0 (NVLS off) where there are none
        raise ValueError(
            f"NCCL_NVLS_ENABLE={value!r} is not an integer; expected 0 (NVLink SHARP off), 1 or 2 (on where "
            f"the GPUs support it, the default)"
        ) from None


def parse_enabled(environ: Mapping[str, str]) -> Enabled:
    """The algorithms and protocols ``NCCL_ALGO``, ``NCCL_PROTO`` and ``NCCL_NVLS_ENABLE`` in ``environ`` leave
    enabled."""
    algo, proto = environ.get("NCCL_ALGO"), environ.get("NCCL_PROTO")
    algorithms = (
        _parse("NCCL_ALGO", algo, ALGORITHM_NAMES) if algo is not None else frozenset(ALGORITHM_NAMES)
    )
    if not _nvls_enabled(environ.get("NCCL_NVLS_ENABLE")):
        algorithms -= {"NVLS", "NVLSTree"}
    return Enabled(
        algorithms,
        _parse("NCCL_PROTO", proto, PROTOCOL_NAMES) if proto is not None else frozenset(PROTOCOL_NAMES),
    )
