"""The launcher runs where only torch is installed: ``import real``, ``real.run`` and ``python -m real`` without simpy.

GPU machines often have their own torch build and no simdist dependencies; the launcher must not import the
simulator (which needs simpy and patches torch privates of one torch range). tests/test_layers.py checks the
import graph; these tests run the launcher in interpreters where simpy cannot be imported at all.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from no_simpy import env_without_simpy

PROGRAM = textwrap.dedent(
    """
    import json
    import sys

    import torch
    import torch.distributed as dist

    import real


    def simulator_modules() -> list[str]:
        return sorted(m for m in sys.modules if m in ("simdist", "simpy") or m.startswith("simdist."))


    def reduce_ranks(n: int) -> dict:
        t = torch.full((n,), float(dist.get_rank() + 1))
        dist.all_reduce(t)
        return {"sum": t.tolist(), "loaded": simulator_modules()}


    def fail_on_rank_1() -> None:
        if dist.get_rank() == 1:
            raise ValueError("rank 1 refuses")
        dist.barrier()


    if __name__ == "__main__":
        try:
            import simpy  # noqa: F401
        except ImportError:
            pass
        else:
            raise SystemExit("simpy is importable: the environment does not hide it")
        result = real.run(reduce_ranks, 2, backend="gloo", args=(3,))
        try:
            real.run(fail_on_rank_1, 2, backend="gloo")
        except real.RealRunError as error:
            failed = {"first": error.first_rank, "text": str(error), "real_error": isinstance(error, real.RealError)}
        print(json.dumps({"returns": result.returns, "failed": failed, "parent": simulator_modules()}))
    """
)

# Run as torchrun runs it (python -m real's default): it creates its own group and prints what it found.
SCRIPT = textwrap.dedent(
    """
    import sys

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.ones(2) * (dist.get_rank() + 1) * float(sys.argv[1])
    dist.all_reduce(t)
    print([t.tolist(), "simdist" in sys.modules])
    dist.destroy_process_group()
    """
)


def _run(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """Run ``python args`` in ``tmp_path`` where simpy cannot be imported."""
    return subprocess.run(
        [sys.executable, *args],
        cwd=tmp_path,
        env=env_without_simpy(tmp_path),
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )


def test_the_environment_really_hides_the_simulator(tmp_path: Path) -> None:
    # Without this, the tests below could pass because simdist happened to be importable.
    completed = _run(["-c", "import simdist"], tmp_path)
    assert completed.returncode != 0 and "No module named 'simpy'" in completed.stderr


@pytest.mark.real
def test_real_run_works_without_simpy(tmp_path: Path) -> None:
    (tmp_path / "program.py").write_text(PROGRAM)
    completed = _run(["program.py"], tmp_path)
    assert completed.returncode == 0, completed.stderr
    out = json.loads(completed.stdout.splitlines()[-1])
    assert out["returns"] == [{"sum": [3.0, 3.0, 3.0], "loaded": []}] * 2
    assert out["parent"] == []
    assert out["failed"]["first"] == 1 and out["failed"]["real_error"]
    assert out["failed"]["text"].startswith("rank 1 failed on 2 real processes (backend gloo):")
    assert "ValueError: rank 1 refuses" in out["failed"]["text"]


@pytest.mark.real
def test_python_m_real_works_without_simpy(tmp_path: Path) -> None:
    (tmp_path / "script.py").write_text(SCRIPT)
    completed = _run(["-m", "real", "script.py", "--nproc", "2", "--", "2"], tmp_path)
    assert completed.returncode == 0, completed.stderr
    assert sorted(completed.stdout.splitlines()) == [
        "[rank0]:[[6.0, 6.0], False]",
        "[rank1]:[[6.0, 6.0], False]",
    ]


def test_emulate_cuda_without_the_simulator_stops_before_any_process_starts(tmp_path: Path) -> None:
    # the one launcher option that needs simdist says so, instead of failing in every rank process
    (tmp_path / "script.py").write_text(SCRIPT)
    completed = _run(["-m", "real", "script.py", "--nproc", "2", "--emulate-cuda", "--", "2"], tmp_path)
    assert completed.returncode == 2, completed.stderr
    assert (
        "--emulate-cuda runs each process on simdist's simulated CUDA device, but simdist cannot be imported"
        in (completed.stderr)
    )
    assert "No module named 'simpy'" in completed.stderr and "[rank" not in completed.stdout
