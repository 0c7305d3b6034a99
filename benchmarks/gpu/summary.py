"""Print the short summary of a results folder that run_all.sh ends with: ``python summary.py DIR``.

Needs the standard library only; the full tables against simdist's predictions come from compare.py.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any


def _load(folder: Path, name: str) -> dict[str, Any] | None:
    """The JSON file ``name`` of ``folder``; None (and a line saying so) if missing."""
    path = folder / name
    if not path.exists():
        print(f"{name}: missing (the section did not start)")
        return None
    return json.loads(path.read_text())


def _errors(name: str, data: dict[str, Any]) -> None:
    """The section's recorded errors, one line each."""
    for error in data.get("errors", []):
        print(f"  {name} ERROR in {error['where']}: {error['error'][:300]}")


def real_nccl(data: dict[str, Any]) -> None:
    """Checks passed, and every failed or inapplicable one."""
    records = data["records"]
    failed = [r for r in records if not r["ok"]]
    meta = data["meta"]
    print(
        f"real on {meta['backend']} (nproc {meta['nproc']}): {len(records) - len(failed)} of {len(records)} checks passed"
    )
    for r in failed:
        print(f"  FAILED {r['via']}: {r['check']}: {r['detail'][:400]}")
    skipped = [r["check"] for r in records if r["detail"].startswith("not applicable")]
    for check in skipped:
        print(f"  not applicable: {check}")


def compute(data: dict[str, Any]) -> None:
    """One line per case: kernel time, back-to-back time, achieved rate."""
    print(
        f"compute ({len(data['records'])} cases): median us = kernels' time (events); loop us = per call back to back"
    )
    print(f"  {'case':46s} {'median us':>10s} {'loop us':>9s}  rate")
    for r in data["records"]:
        rate = ""
        if r["flops"]:
            rate = f"{r['flops'] / r['median_s'] / 1e12:.1f} TFLOP/s"
        elif r["bytes"]:
            rate = f"{r['bytes'] / r['median_s'] / 1e9:.0f} GB/s"
        print(f"  {r['id']:46s} {r['median_s'] * 1e6:10.1f} {r['loop_s'] * 1e6:9.1f}  {rate}")


def memory(data: dict[str, Any]) -> None:
    """Peak after each phase, per configuration."""
    print("memory: max_memory_allocated (MiB) after each phase of a block's training step")
    for r in data["records"]:
        shape = " ".join(f"{k}={v}" for k, v in r["shape"].items())
        peaks = (
            ", ".join(f"{p} {b / 2**20:.1f}" for p, b in r["peak_bytes"].items()) or "not measured (no CUDA)"
        )
        print(f"  {r['dtype']} {shape}: {peaks}")


def _short(frame: str) -> str:
    """A C++ frame's function name without its return type, template arguments and parameters."""
    name = frame.removeprefix("void ")
    return re.split(r"[<(]", name, maxsplit=1)[0]


def allocating_op(frames: list[str]) -> str:
    """The aten op a block was allocated for (innermost first: the op, not the allocation it calls), "(backward)"
    when autograd's engine ran it, and the function that asked for the memory when that is not the op's output
    allocation (a kernel's scratch buffer)."""

    def names(pattern: str) -> list[str]:
        return [n for f in frames for n in re.findall(pattern, f)]

    ops = names(r"at::_ops::(\w+)::(?:call|redispatch)")
    native = [n for n in names(r"at::native::(\w+)") if "kernel" not in n]
    op = next((n for n in ops + native if not n.startswith("empty")), ops[0] if ops else "?")
    backward = any(
        k in f for f in frames for k in ("autograd::Engine", "autograd::generated", "InputMetadata")
    )
    inner = next((f for f in frames if "unwind" not in f), "")
    output = re.search(r"empty|create_out|TensorIterator|structured_\w+::meta|alloc|THPVariable", inner)
    scratch = "" if output or not inner else f", scratch of {_short(inner)}"
    return op + (" (backward)" if backward else "") + scratch


def memory_trace(data: dict[str, Any]) -> None:
    """The blocks live at each traced peak, largest first, with the op each was allocated for; for the program,
    every block, grouped by that op."""
    for r in data["records"]:
        if "program" in r:
            groups: dict[str, list[int]] = {}
            for block in r["live_at_peak"]:
                groups.setdefault(allocating_op(block["frames"]), []).append(block["size"])
            # a program's record was once stored under "program" itself, in place of its name
            name = r["program"] if isinstance(r["program"], str) else "gpu_program"
            print(
                f"memory trace {name}: peak {r['replayed_peak'] / 2**20:.1f} MiB, "
                f"{len(r['live_at_peak'])} blocks live, by the op that allocated them:"
            )
            for op, sizes in sorted(groups.items(), key=lambda g: (-sum(g[1]), g[0])):
                print(f"  {sum(sizes) / 2**20:8.1f} MiB in {len(sizes):3d}  {op}")
            continue
        shape = " ".join(f"{k}={v}" for k, v in r["shape"].items())
        print(
            f"memory trace {r['dtype']} {shape}: peak {r['replayed_peak'] / 2**20:.1f} MiB above the step's start, "
            f"{len(r['live_at_peak'])} blocks live"
        )
        for block in sorted(r["live_at_peak"], key=lambda b: (-b["size"], b["order"]))[:8]:
            print(f"  {block['size'] / 2**20:8.1f} MiB  {allocating_op(block['frames'])}")


def program(data: dict[str, Any]) -> None:
    """The program's losses, step times, peak memory and checksum."""
    for r in data["records"]:
        print(f"program {r['program']} ({r['backend']}, wall {r['wall_s']:.1f} s on {r['device']}):")
        print(f"  losses {', '.join(f'{v:.5f}' for v in r['losses'])}")
        print(f"  step ms {', '.join(f'{s * 1e3:.3f}' for s in r['step_s'])}")
        print(f"  peak bytes {r['peak_bytes']}; checksum {r['checksum']!r}")


def main(folder: Path) -> None:
    """Summarise every section found in ``folder``, then the machine."""
    for name, show in (
        ("real_nccl.json", real_nccl),
        ("compute.json", compute),
        ("memory.json", memory),
        ("memory_trace.json", memory_trace),
        ("program.json", program),
    ):
        data = _load(folder, name)
        if data is None:
            continue
        try:
            show(data)
        except (KeyError, TypeError, ZeroDivisionError) as exc:
            print(f"{name}: cannot summarise ({type(exc).__name__}: {exc})")
        _errors(name, data)
    meta = next((d["meta"] for n in ("compute.json", "program.json") if (d := _load_quiet(folder, n))), {})
    keys = ("device", "driver", "torch", "cuda", "nccl", "python")
    print("machine: " + ", ".join(f"{k} {meta.get(k)}" for k in keys))


def _load_quiet(folder: Path, name: str) -> dict[str, Any] | None:
    """The JSON file ``name`` of ``folder``, or None."""
    path = folder / name
    return json.loads(path.read_text()) if path.exists() else None


if __name__ == "__main__":
    main(Path(sys.argv[1]))
