"""Every program of the suite in one rank function, so that one launch of real processes runs them all."""

from __future__ import annotations

from typing import Any

from gpu_programs import amp, ddp, events_memory, fsdp2_mixed, oom, pipeline, tp

#: the programs, by name, in the order one launch runs them
PROGRAMS = {
    "ddp": ddp.main,
    "fsdp2_mixed": fsdp2_mixed.main,
    "tp": tp.main,
    "amp": amp.main,
    "events_memory": events_memory.main,
    "oom": oom.main,
    "pipeline": pipeline.main,
}


def run_all(kind: str = "cuda", names: tuple[str, ...] = tuple(PROGRAMS)) -> dict[str, Any]:
    """Run the programs ``names`` one after the other in one process group (each program asks for it, as a
    script does; the launcher made it)."""
    return {name: PROGRAMS[name](kind) for name in names}
