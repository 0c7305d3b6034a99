"""Where and how the agents of a launch meet: torchrun's ``--nnodes``, ``--node-rank`` and ``--rdzv-*`` options.

One ``python -m real`` (one elastic agent) runs per node and starts that node's processes. With the ``static``
rendezvous every node names node 0's address and its own node rank, and node 0 serves the store; with
``c10d`` every node names the same endpoint and run id, one agent serves the store there, and node ranks are
given out as the agents join. A single node needs none of this: it meets itself on a free local port.
"""

from __future__ import annotations

import ipaddress
import math
from dataclasses import dataclass
from typing import Any

from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from real.errors import RealConfigError

RDZV_BACKENDS = ("static", "c10d")
#: the port of a c10d endpoint that names none, as torchrun's
C10D_PORT = 29400
#: the longest a node waits for the others, seconds: torchrun's default rendezvous timeout (a launch's own
#: shorter timeout shortens it)
RDZV_TIMEOUT = 600
#: the address a single node meets itself on, which needs no host-name lookup
LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class Rendezvous:
    """How this node's agent meets the others': the number of nodes, this node's rank and the meeting point.

    ``endpoint`` is ``"host:port"``: node 0's store for ``static`` (required with several nodes), the store of
    the ``c10d`` rendezvous (port 29400 when left out). ``node_rank`` is used by ``static`` only; ``c10d``
    gives node ranks out as agents join, so every node passes the same ``run_id``. ``local_addr`` is the
    address other nodes reach this one at (default: the loopback address when every node is on this machine,
    else the host name).
    """

    nnodes: int = 1
    node_rank: int = 0
    endpoint: str | None = None
    backend: str = "static"
    run_id: str = "none"
    local_addr: str | None = None

    def __post_init__(self) -> None:
        for name in ("nnodes", "node_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise RealConfigError(f"Rendezvous {name} must be an int; got {value!r}")
        if self.nnodes < 1:
            raise RealConfigError(f"nnodes must be at least 1 (the number of nodes); got {self.nnodes}")
        if self.backend not in RDZV_BACKENDS:
            raise RealConfigError(
                f"rendezvous backend {self.backend!r} is not supported; expected one of {', '.join(RDZV_BACKENDS)}"
            )
        if self.backend == "static" and not 0 <= self.node_rank < self.nnodes:
            raise RealConfigError(
                f"node_rank must be in 0..{self.nnodes - 1} for {self.nnodes} node(s) (the static rendezvous "
                f"numbers nodes from 0, node 0 serving the store); got {self.node_rank}"
            )
        if self.node_rank < 0:
            raise RealConfigError(f"node_rank must be at least 0; got {self.node_rank}")
        if not isinstance(self.run_id, str) or not self.run_id:
            raise RealConfigError(
                f"run_id must be a non-empty string shared by every node; got {self.run_id!r}"
            )
        if self.endpoint is not None:
            self._split(self.endpoint)
        elif self.nnodes > 1:
            where = (
                "node 0's address and port" if self.backend == "static" else "the c10d store's host[:port]"
            )
            raise RealConfigError(
                f"a launch on {self.nnodes} nodes needs the rendezvous endpoint every node meets at ({where}): "
                f"pass --rdzv-endpoint HOST:PORT (or --master-addr and --master-port), the same on every node"
            )

    @property
    def needs_port(self) -> bool:
        """Whether the launcher picks the port: a single node with no endpoint given."""
        return self.endpoint is None

    def endpoint_with(self, port: int | None) -> str:
        """The endpoint to meet at: the one given, else the loopback address at ``port``."""
        if self.endpoint is not None:
            host, found = self._split(self.endpoint)
            return f"{_bracketed(host)}:{found}"
        return f"{LOOPBACK}:{port}"

    def local_ranks(self, nproc: int) -> range | None:
        """The global ranks of this node's ``nproc`` processes, when known before the rendezvous."""
        if self.backend == "static":
            return range(self.node_rank * nproc, (self.node_rank + 1) * nproc)
        return range(nproc) if self.nnodes == 1 else None

    def settings(self, endpoint: str, timeout: float) -> dict[str, Any]:
        """The LaunchConfig fields of this rendezvous at ``endpoint``, giving up after ``timeout`` seconds (at
        most RDZV_TIMEOUT)."""
        seconds = max(1, math.ceil(min(timeout, RDZV_TIMEOUT)))
        if self.backend == "static":
            configs: dict[str, Any] = {"rank": self.node_rank, "timeout": seconds}
        else:
            configs = {"join_timeout": seconds, "timeout": seconds}
        # The agents' keys in the store are prefixed with the run id, so every node must pass the same one.
        host = self._split(endpoint)[0]
        local_addr = self.local_addr
        if local_addr is None and _loopback(host):
            local_addr = LOOPBACK  # every node is on this machine: skip a host-name lookup that can be slow
        return {
            "min_nodes": self.nnodes,
            "max_nodes": self.nnodes,
            "rdzv_backend": self.backend,
            "rdzv_endpoint": endpoint,
            "rdzv_configs": configs,
            "run_id": self.run_id,
            "local_addr": local_addr,
        }

    def describe(self, endpoint: str) -> str:
        """This node's part in words: ``node 1 of 2 (static rendezvous at 127.0.0.1:29500)``."""
        node = (
            f"node {self.node_rank} of {self.nnodes}"
            if self.backend == "static"
            else f"one of {self.nnodes} nodes"
        )
        return f"{node} ({self.backend} rendezvous at {endpoint})"

    def _split(self, endpoint: str) -> tuple[str, int]:
        """``endpoint`` as (host, port); RealConfigError naming it when it is not ``host[:port]``."""
        default = C10D_PORT if self.backend == "c10d" else -1
        try:
            host, port = parse_rendezvous_endpoint(endpoint, default_port=default)
        except ValueError as exc:
            raise RealConfigError(f"rendezvous endpoint {endpoint!r} is not HOST:PORT ({exc})") from exc
        if not isinstance(endpoint, str) or not endpoint.strip() or not host:
            raise RealConfigError(f"rendezvous endpoint {endpoint!r} is not HOST:PORT")
        if port == -1:
            raise RealConfigError(
                f"rendezvous endpoint {endpoint!r} names no port; the static rendezvous meets at node 0's "
                f"HOST:PORT (or pass --master-port)"
            )
        if not 0 < port < 65536:
            raise RealConfigError(f"rendezvous endpoint {endpoint!r}: port {port} is not in 1..65535")
        return host, port


def _loopback(host: str) -> bool:
    """Whether ``host`` is this machine's loopback address (``localhost``, ``127.x``, ``::1``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _bracketed(host: str) -> str:
    """An IPv6 address in brackets, as an endpoint writes it before its port."""
    return f"[{host}]" if ":" in host else host
