"""Faults a simulated run can meet: ``simdist.run(fn, cluster, faults=[simdist.faults.Crash(rank=3, at=0.01)])``.

Every fault is a frozen record of JSON values (see :mod:`simdist.faults.specs`); ``Fault.to_json`` and
:func:`from_json` turn it into ``{"type": name, **fields}`` and back; ``getattr(simdist.faults, name)`` is the class
for every name in ``Fault.TYPES``.
"""

from simdist.faults.specs import (
    Crash,
    Fault,
    FlappingLink,
    LinkDown,
    LinkRef,
    MessageDelay,
    NodeLoss,
    SlowLink,
    Straggler,
    from_json,
)

__all__ = [
    "Crash",
    "Fault",
    "FlappingLink",
    "LinkDown",
    "LinkRef",
    "MessageDelay",
    "NodeLoss",
    "SlowLink",
    "Straggler",
    "from_json",
]
