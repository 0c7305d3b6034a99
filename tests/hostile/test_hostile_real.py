"""Hostile rank code on real processes: a rank that dies without a Python exception is named as the one that failed.

A rank ended by ``os._exit``, a segfault or the OOM killer records nothing; its peers then fail in their next
collective and do record an error. The report must name the rank that died first, with its cause, and call
the peers' errors what they are: consequences. Scripts run as torchrun runs them fail as torchrun's do (a
non-zero exit, an argparse error) and are named the same way; a script that never creates a group, a rendezvous
nobody serves and rank code that creates the group real already made get a clear word instead of silence or a
hang.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import os
import pathlib
import re
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from hostile_cases import Case, check, params

import real
from real.__main__ import main as real_main


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


_TMP = pathlib.Path(tempfile.mkdtemp(prefix="simdist-hostile-real-"))


def _script(name: str, source: str) -> pathlib.Path:
    path = _TMP / name
    path.write_text(source)
    return path


# A torchrun-style script: rank 1 leaves with sys.exit(3) while rank 0 waits in a barrier.
_EXIT_3 = _script(
    "exit3.py",
    "import sys\nimport torch.distributed as dist\n\ndist.init_process_group('gloo')\nif dist.get_rank() == 1:\n"
    "    sys.exit(3)\ndist.barrier()\n",
)
_ARGPARSE = _script(
    "train.py",
    "import argparse\n\nparser = argparse.ArgumentParser()\nparser.add_argument('--lr', type=float, required=True)\n"
    "args = parser.parse_args()\n",
)
# An entry-style script launched without --entry: its GPU check exits early, its main() never runs.
_NO_GROUP = _script(
    "no_group.py",
    "import sys\n\n\ndef main():\n    return 1\n\n\nif __name__ == '__main__':\n    print('no GPU, exiting')\n"
    "    sys.exit()\n",
)
# An entry function that calls init_process_group itself, as torchrun code does, by a name bound at import.
_OWN_INIT = _script(
    "own_init.py",
    """
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import init_process_group


def main():
    world = dist.group.WORLD
    init_process_group("gloo")
    dist.init_process_group(backend=None, rank=dist.get_rank(), world_size=2, timeout=timedelta(seconds=99))
    kept = dist.group.WORLD is world
    refused = []
    for kwargs in ({"backend": "nccl"}, {"world_size": 3}):
        try:
            init_process_group(**kwargs)
        except ValueError as exc:
            refused.append(f"{type(exc).__name__}: {exc}")
    total = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(total)
    return {"kept": kept, "sum": total.item(), "refused": refused}
""",
)


def _cli(argv: list[str]) -> Callable[[], tuple[int, str, str]]:
    """A case's ``run``: ``python -m real ARGV`` in this process; (status, stdout, stderr), the ranks' lines included."""

    def run() -> tuple[int, str, str]:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = real_main(argv)
        return status, out.getvalue(), err.getvalue()

    return run


def _argparse_reported(got: tuple[int, str, str]) -> None:
    """Oracle: torchrun's status for a failed rank (1), argparse's own words, the rank and its exit status."""
    status, _out, err = got
    assert status == 1, err
    assert "[rank0]:train.py: error: the following arguments are required: --lr" in err, err
    assert re.search(
        r"python -m real: run failed: rank 0 failed on 1 real process:\nexited with status 2: SystemExit\(2\)\n"
        r"(.|\n)*train\.py\", line 5, in <module>\n(.|\n)*its stderr ended with:\n  usage: train\.py \[-h\] --lr LR\n"
        r"  train\.py: error: the following arguments are required: --lr",
        err,
    ), err


def _noted(got: tuple[int, str, str]) -> None:
    """Oracle: the script's own result (status 0, its line) and a note saying that no rank created a group."""
    status, out, err = got
    assert status == 0 and out == "[rank0]:no GPU, exiting\n", (out, err)
    assert "note: no rank of " in err and "(it defines main), name it with --entry NAME" in err, err


def _missing(got: tuple[int, str, str]) -> None:
    status, out, err = got
    assert status == 2 and not out and re.match(r"python -m real: error: script '.*absent\.py' not found", err), err


def _unserved() -> object:
    """This node is node 1 of 2; nobody serves node 0's endpoint."""
    endpoint = f"127.0.0.1:{real.free_port()}"
    rendezvous = real.Rendezvous(nnodes=2, node_rank=1, endpoint=endpoint)
    return real.run_script(_ARGPARSE, 1, entry=None, argv=["--lr", "1"], rendezvous=rendezvous, timeout=3)


def _kept_and_refused(result: real.RealResult) -> None:
    """Oracle: the group real made is kept, the sum is 1 + 2, and the two other calls are refused naming why."""
    line = _OWN_INIT.read_text().splitlines().index("            init_process_group(**kwargs)") + 1
    for rank, value in enumerate(result.returns):
        assert value["kept"] and value["sum"] == 3.0, value
        nccl, world = value["refused"]
        assert re.match(
            rf"RealGroupError: rank {rank}: init_process_group\(backend='nccl'\) at .*own_init\.py:{line}: real "
            rf"already created this process's default group with backend 'gloo'",
            nccl,
        ), nccl
        assert world.startswith(
            f"RealGroupError: rank {rank}: init_process_group(world_size=3) at {_OWN_INIT}:{line}: world_size=3, but "
            f"the group real created has 2 processes (RANK={rank}, WORLD_SIZE=2 from the launcher)"
        ), world


def _hooked_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _rank_batch(rank: int) -> torch.Tensor:
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(rank))


def hooked_ddp_on_gpu() -> dict[str, torch.Tensor]:
    """Data parallelism written by hand for GPUs: a post-accumulate-grad hook on each parameter of a model moved to
    the GPU after it was built all-reduces its gradient and divides by the world size."""
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    model = _hooked_model().to("cuda")

    def average(p: torch.Tensor) -> None:
        dist.all_reduce(p.grad)
        p.grad.div_(dist.get_world_size())

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(average)
    model(_rank_batch(dist.get_rank()).to("cuda")).pow(2).sum().backward()
    return {n: p.grad.cpu() for n, p in model.named_parameters()}


def _averaged(result: real.RealResult) -> None:
    """Oracle: every rank's gradients are the single-process average of both ranks' (each hook reduced once)."""
    per_rank = []
    for rank in range(2):
        model = _hooked_model()
        model(_rank_batch(rank)).pow(2).sum().backward()
        per_rank.append({n: p.grad for n, p in model.named_parameters()})
    average = {n: (per_rank[0][n] + per_rank[1][n]) / 2 for n in per_rank[0]}
    for rank, grads in enumerate(result.returns):
        assert all(torch.equal(grads[n], average[n]) for n in average), f"rank {rank}: gradients not averaged"


def _refused(pattern: str) -> Callable[[tuple[int, str, str]], None]:
    """Oracle: python -m real's usage status (2), nothing started (no rank's output), and the message."""

    def refused(got: tuple[int, str, str]) -> None:
        status, out, err = got
        assert status == 2 and not out and "[rank" not in err, (status, out, err)
        assert re.match(rf"python -m real: error: {pattern}", err), err

    return refused


CASES: list[Case] = [
    Case("real-emulate-cuda-too-few-devices", "python -m real --nproc 2 --emulate-cuda --emulated-devices 1",
         _cli([str(_ARGPARSE), "--nproc", "2", "--emulate-cuda", "--emulated-devices", "1"]),
         check=_refused(r"2 processes on this node but 1 emulated CUDA device per node: each local rank needs its "
                        r"own device")),
    Case("real-emulate-cuda-cpu-model", "python -m real --emulate-cuda --emulated-gpu cpu",
         _cli([str(_ARGPARSE), "--nproc", "1", "--emulate-cuda", "--emulated-gpu", "cpu"]),
         check=_refused(r"--emulate-cuda: 'cpu' is not a GPU model; name one such as 'H100'")),
    Case("real-emulate-cuda-unknown-model", "python -m real --emulate-cuda --emulated-gpu H900",
         _cli([str(_ARGPARSE), "--nproc", "1", "--emulate-cuda", "--emulated-gpu", "H900"]),
         check=_refused(r"--emulate-cuda: no GPU model named 'H900' \(unknown device 'H900'; known devices: H100")),
    Case("real-emulated-devices-without-emulation", "python -m real --emulated-devices 4 without --emulate-cuda",
         _cli([str(_ARGPARSE), "--nproc", "1", "--emulated-devices", "4"]),
         check=_refused(r"--emulated-devices describes the devices of --emulate-cuda: add --emulate-cuda")),
    Case("real-emulate-cuda-not-a-flag", "real.run(fn, 2, emulate_cuda='yes')",
         lambda: real.run(exit_on_rank_1, 2, emulate_cuda="yes"),  # type: ignore[arg-type]
         error=real.RealConfigError, match=r"emulate_cuda must be True, False or a real\.EmulatedCuda; got 'yes'"),
    Case("real-emulate-cuda-hooked-ddp", "averages gradients in post-accumulate-grad hooks it registers after "
         "moving its model to the emulated GPU (real.run(..., emulate_cuda=True))",
         lambda: real.run(hooked_ddp_on_gpu, 2, backend="nccl", emulate_cuda=True, timeout=120),
         check=_averaged, slow=True),
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
    Case("real-script-exit-3", "a torchrun-style script calls sys.exit(3) on rank 1 while rank 0 waits in a barrier",
         lambda: real.run_script(_EXIT_3, 2, entry=None, timeout=120), error=real.RealRunError,
         match=r"^rank 1 failed on 2 real processes:\nexited with status 3: SystemExit\(3\)\n(.|\n)*exit3\.py\", "
               r"line 6, in <module>\n    sys\.exit\(3\)\nSystemExit: 3(\nother failing ranks .*\n  rank 0: .*)?$",
         slow=True),
    Case("real-script-argparse-error", "python -m real train.py without the argument its argparse requires",
         _cli([str(_ARGPARSE), "--nproc", "1"]), check=_argparse_reported, slow=True),
    Case("real-script-missing", "python -m real on a script that does not exist",
         _cli([str(_TMP / "absent.py"), "--nproc", "2", "--", "--lr", "1"]), check=_missing),
    Case("real-script-never-inits", "python -m real on an entry-style script without --entry: it exits before main()",
         _cli([str(_NO_GROUP), "--nproc", "1"]), check=_noted, slow=True),
    Case("real-rendezvous-unserved", "node 1 of 2 meets at an endpoint nobody serves (node 0 never started)",
         _unserved, error=real.RealRunError,
         match=r"node 1 of 2 \(static rendezvous at 127\.0\.0\.1:\d+\)(.|\n)*No rank process started: the nodes "
               r"never all met\. Start one python -m real per node", slow=True),
    Case("real-entry-calls-init", "an entry function calls init_process_group itself: compatibly, then with nccl "
         "and world_size=3 (real made a gloo group of 2)",
         lambda: real.run_script(_OWN_INIT, 2, timeout=120), check=_kept_and_refused, slow=True),
]


@pytest.mark.real
@pytest.mark.parametrize("case", params(CASES))
def test_hostile(case: Case) -> None:
    check(case)
