"""Check ``real`` on NCCL: every collective, returns moved to the CPU, the error paths: ``real_nccl.json``.

``python benchmarks/gpu/real_nccl.py [--out DIR] [--dry-run] [--nproc N]``, with this repository on PYTHONPATH.
On one GPU NCCL runs one rank (``--nproc 1``); without CUDA the same checks run on gloo, so a CPU machine can
check the script. Each check is a record ``{"check", "via", "ok", "detail"}``: through ``real.run`` and
through ``python -m real`` on a script file.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from typing import Any

import nccl_checks
import torch
from common import HERE, REPO, Results, machine, parser

import real

#: seconds for one launch: about 10 s on a GPU machine, CUDA and NCCL start-up included; more on a busy CPU
LAUNCH_TIMEOUT = 45.0 if torch.cuda.is_available() else 180.0


def _record(results: Results, check: str, via: str, ok: bool, detail: str = "") -> None:
    """Save one check and print it."""
    results.add({"check": check, "via": via, "ok": ok, "detail": detail})
    print(
        f"  {'ok  ' if ok else 'FAIL'} {via:15s} {check}{': ' + detail if detail and not ok else ''}",
        flush=True,
    )


def _tensors(value: Any) -> list[torch.Tensor]:
    """Every tensor inside ``value`` (lists, tuples, dicts)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def check_collectives(results: Results, backend: str, nproc: int, env: dict[str, str]) -> bool:
    """Every collective through real.run; returns whether the backend initialised at all."""
    result = real.run(nccl_checks.collectives, nproc, backend=backend, timeout=LAUNCH_TIMEOUT, env=env)
    _record(results, "launch", "real.run", result.backend == backend, f"backend {result.backend}")
    _record(results, "wall time", "real.run", True, f"{result.wall_time:.2f} s")
    for rank, ret in enumerate(result.returns):
        seen = ret["seen"]
        want_device = f"cuda:{rank}" if backend == "nccl" else "cpu"
        _record(
            results,
            f"rank {rank}: backend and device",
            "real.run",
            seen["backend"] == backend and seen["device"] == want_device and seen["world"] == nproc,
            str(seen),
        )
        for name, problem in ret["checks"].items():
            skipped = problem is not None and problem.startswith("not applicable")
            _record(results, f"rank {rank}: {name}", "real.run", problem is None or skipped, problem or "")
        back = _tensors(ret["returned"])
        values = [float(t[0]) for t in back]
        _record(
            results,
            f"rank {rank}: returns on the CPU",
            "real.run",
            all(t.device.type == "cpu" for t in back) and values == [7.0, 8.0, 9.0],
            f"devices {[str(t.device) for t in back]}, values {values}",
        )
    return True


def check_failures(results: Results, backend: str, nproc: int, env: dict[str, str]) -> None:
    """A rank raising, and a rank leaving by os._exit: RealRunError names the rank and the cause."""
    for fn, expected in (
        (nccl_checks.raise_after_a_collective, "ValueError: deliberate failure after an all_reduce"),
        (nccl_checks.exit_after_a_collective, "process exited with code 3"),
    ):
        name = f"error path: {fn.__name__}"
        try:
            real.run(fn, nproc, backend=backend, timeout=LAUNCH_TIMEOUT, env=env)
        except real.RealRunError as error:
            text = str(error)
            ok = error.first_rank == 0 and text.startswith("rank 0 failed") and expected in text
            _record(results, name, "real.run", ok, text[:2000])
        else:
            _record(results, name, "real.run", False, "no RealRunError")


def check_cli(results: Results, backend: str, nproc: int, env: dict[str, str]) -> None:
    """``python -m real nccl_checks.py --entry main``: rank values printed, exit 0; ``--entry fail``: exit 1 naming rank 0."""
    script = str(HERE / "nccl_checks.py")
    child_env = {
        **os.environ,
        **env,
        "PYTHONPATH": os.pathsep.join([str(REPO), str(HERE), os.environ.get("PYTHONPATH", "")]),
    }
    base = [
        sys.executable,
        "-m",
        "real",
        script,
        "--nproc",
        str(nproc),
        "--entry",
        "main",
        "--backend",
        backend,
        "--timeout",
        "180",
    ]
    done = subprocess.run(
        base, capture_output=True, text=True, env=child_env, timeout=LAUNCH_TIMEOUT + 30, check=False
    )
    want = nproc * (nproc + 1) / 2
    lines = [line for line in done.stdout.splitlines() if line.startswith("rank ")]
    ok = (
        done.returncode == 0
        and len(lines) == nproc
        and all(f"tensor([{want:g}., {want:g}.," in line for line in lines)
    )
    _record(
        results,
        "script entry main",
        "python -m real",
        ok,
        f"exit {done.returncode}\n{done.stdout}\n{done.stderr[-2000:]}",
    )
    done = subprocess.run(
        [*base, "--entry", "fail"],
        capture_output=True,
        text=True,
        env=child_env,
        timeout=LAUNCH_TIMEOUT + 30,
        check=False,
    )
    ok = done.returncode == 1 and re.search(r"run failed: rank 0 failed", done.stderr) is not None
    _record(
        results,
        "script entry fail: exit 1",
        "python -m real",
        ok,
        f"exit {done.returncode}\n{done.stderr[-2000:]}",
    )


def main() -> None:
    """Run every check and write real_nccl.json."""
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=1, help="rank processes (NCCL: at most one per GPU)")
    options = p.parse_args()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    results = Results(
        options.out / "real_nccl.json",
        {**machine(), "backend": backend, "nproc": options.nproc, "dry_run": options.dry_run},
    )
    start = time.perf_counter()
    env: dict[str, str] = {}
    with results.guard("collectives"):
        try:
            check_collectives(results, backend, options.nproc, env)
        except real.RealRunError as error:
            # A machine whose network interfaces NCCL's bootstrap cannot use: one retry on the loopback.
            _record(results, "launch", "real.run", False, str(error)[:3000])
            env = {"NCCL_SOCKET_IFNAME": "lo", "NCCL_DEBUG": "WARN"}
            print("  retrying with NCCL_SOCKET_IFNAME=lo", flush=True)
            check_collectives(results, backend, options.nproc, env)
    with results.guard("failures"):
        check_failures(results, backend, options.nproc, env)
    with results.guard("cli"):
        check_cli(results, backend, options.nproc, env)
    records = results.data["records"]
    failed = [r["check"] for r in records if not r["ok"]]
    results.set("passed", len(records) - len(failed))
    results.set("failed", failed)
    print(
        f"real on {backend}: {len(records) - len(failed)} of {len(records)} checks passed, "
        f"{len(results.data['errors'])} errors, {time.perf_counter() - start:.0f} s",
        flush=True,
    )


if __name__ == "__main__":
    main()
