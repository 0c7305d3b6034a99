"""Hostile rank code on real processes: a rank that dies without a Python exception is named as the one that failed.

A rank ended by ``os._exit``, a segfault or the OOM killer records nothing; its peers then fail in their next
collective and do record an error. The report must name the rank that died first, with its cause, and call
the peers' errors what they are: consequences.
"""

from __future__ import annotations

import ctypes
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable

import pytest
import torch.distributed as dist
from hostile_cases import Case, check, params

import real


def exit_on_rank_1() -> None:
    """Rank 1 leaves with ``os._exit(7)`` between two barriers; rank 0 waits in the second."""
    dist.barrier()
    if dist.get_rank() == 1:
        os._exit(7)
    dist.barrier()


def segfault_on_rank_1() -> None:
    """Rank 1 reads address 0 (a segfault, as a crashing extension causes); rank 0 waits in a barrier."""
    dist.barrier()
    if dist.get_rank() == 1:
        ctypes.string_at(0)
    dist.barrier()


def sigkill_on_rank_1() -> None:
    """Rank 1 is SIGKILLed, as the OOM killer does; rank 0 waits in a barrier."""
    dist.barrier()
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def _launch(fn: Callable[[], None]) -> Callable[[], object]:
    return lambda: real.run(fn, 2, backend="gloo", timeout=120)


# Rank 0 either records a gloo error after rank 1's process ended (listed as its consequence) or is stopped
# by the launcher first (then not a failure at all); rank 1 is named first either way.
_PEER = r"(\nother failing ranks .*\n  rank 0: .*\(after rank 1's process had ended\))?$"

def _from_stdin() -> subprocess.CompletedProcess:
    """``python3 -`` reading a program that launches a script file on 2 real processes."""
    with tempfile.TemporaryDirectory() as tmp:
        script = pathlib.Path(tmp) / "job.py"
        script.write_text("def main():\n    return 41 + 1\n")
        program = f"import real\nprint(real.run_script({str(script)!r}, nproc=2).returns)\n"
        return subprocess.run(
            [sys.executable, "-"], input=program, capture_output=True, text=True, timeout=240, cwd=tmp, env=_env(),
            check=False,
        )


def _printed_returns(done: subprocess.CompletedProcess) -> None:
    """Oracle: what the script's entry returns, from each rank (spawn must not try to re-run "<stdin>")."""
    assert done.returncode == 0 and done.stdout.strip() == "[42, 42]", (done.returncode, done.stdout, done.stderr[-2000:])


def _env() -> dict[str, str]:
    """This environment, with this checkout first on the module path of the child."""
    root = str(pathlib.Path(__file__).resolve().parents[2])
    return {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}


CASES: list[Case] = [
    Case("real-os-exit", "rank 1 calls os._exit(7) while rank 0 waits in a barrier", _launch(exit_on_rank_1),
         error=real.RealRunError,
         match=r"^rank 1 failed on 2 real processes \(backend gloo\):\nprocess exited with code 7 without a "
               r"Python exception in the rank code" + r"[^\n]*" + _PEER, slow=True),
    Case("real-segfault", "rank 1 segfaults (ctypes.string_at(0)) while rank 0 waits in a barrier",
         _launch(segfault_on_rank_1), error=real.RealRunError,
         match=r"^rank 1 failed on 2 real processes \(backend gloo\):\nkilled by signal SIGSEGV \(exit code -11\)\n"
               r"Fatal Python error: Segmentation fault\n(.|\n)*line \d+ in segfault_on_rank_1" + _PEER, slow=True),
    Case("real-script-from-stdin", "a program fed on stdin (python3 - < prog.py) calls real.run_script on a file",
         _from_stdin, check=_printed_returns, slow=True),
    Case("real-sigkill", "rank 1 is SIGKILLed (the OOM killer) while rank 0 waits in a barrier",
         _launch(sigkill_on_rank_1), error=real.RealRunError,
         match=r"^rank 1 failed on 2 real processes \(backend gloo\):\nkilled by signal SIGKILL \(exit code -9\)"
               + _PEER, slow=True),
]


@pytest.mark.real
@pytest.mark.parametrize("case", params(CASES))
def test_hostile(case: Case) -> None:
    check(case)
