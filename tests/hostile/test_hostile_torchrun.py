"""Hostile torchrun-style scripts (``simdist run SCRIPT -- ARGS``, ``simdist.run_script``): exits on one rank, argparse
errors, scripts reading or replacing ``sys.argv``, module-level endless loops, ``init_process_group`` with arguments
a real launch refuses or hangs on, signals to the rank's own pid, output into a closed pipe, bad command lines."""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hostile_cases import Case, check, params

import simdist
from simdist.cli import main as simdist_main

RING2 = simdist.Cluster.ring(2)
_TMP = Path(tempfile.mkdtemp(prefix="simdist-hostile-torchrun-"))
atexit.register(shutil.rmtree, _TMP, ignore_errors=True)


def _script(name: str, source: str) -> Path:
    path = _TMP / name
    path.write_text(source)
    return path


def _run(name: str, source: str, *args: str, **options: object):
    """A case's ``run``: the script run as torchrun would on two ranks."""
    return lambda: simdist.run_script(_script(name, source), RING2, argv=list(args), **options)


def _cli(argv: list[str]) -> tuple[int, str]:
    """``simdist`` with ``argv`` in this process: its exit status (argparse's counted) and what it printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            status = int(simdist_main(argv) or 0)
        except SystemExit as e:
            status = e.code if isinstance(e.code, int) else 1
    return status, out.getvalue()


def _usage_error(argv: list[str], match: str):
    """A case's ``run`` for a command line argparse must refuse (status 2): raises SystemExit with its output."""

    def run() -> None:
        status, output = _cli(argv)
        assert status == 2 and "Traceback" not in output, (status, output)
        raise SystemExit(output)

    return run


INIT = "import os, sys, torch\nimport torch.distributed as dist\n"

_ARGV = (
    INIT
    + """
dist.init_process_group()
if dist.get_rank() == 0:
    sys.argv = ["replaced"]  # this rank's own command line only
seen = list(sys.argv)
dist.barrier()
with open(os.path.join(os.path.dirname(__file__), f"argv-{dist.get_rank()}.json"), "w") as f:
    json.dump([seen, sys.argv], f)
"""
)


def _argv_per_rank(result: simdist.RunResult) -> None:
    """Oracle: each rank sees its own argv, the script's path and arguments, never the launcher's; a rank that
    replaces it changes its own only."""
    path = str(_TMP / "argv.py")
    rank0 = json.loads((_TMP / "argv-0.json").read_text())
    rank1 = json.loads((_TMP / "argv-1.json").read_text())
    assert rank0 == [["replaced"], ["replaced"]] and rank1 == [[path, "--lr", "0.5"]] * 2, (rank0, rank1)
    assert sys.argv[0] != path


def _closed_pipe() -> tuple[int, str]:
    """A torchrun-style script on 64 ranks printing long lines into a reader that stops after 100 bytes."""
    script = _script("talkative.py", "print('x' * 4000)\nprint('y' * 4000)\n")
    command = [
        sys.executable,
        "-c",
        "import sys; from simdist.cli import main; sys.exit(main())",
        "run",
        str(script),
        "--world-size",
        "64",
    ]
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=_TMP)
    assert child.stdout is not None and child.stderr is not None
    child.stdout.read(100)
    child.stdout.close()
    err = child.stderr.read().decode()
    return child.wait(timeout=120), err


def _quiet_exit(result: tuple[int, str]) -> None:
    """Oracle: what Unix tools do when their reader goes away: stop, no traceback on stderr."""
    status, err = result
    assert status == 1 and "Traceback" not in err and "BrokenPipeError" not in err, (status, err)


def _note_for_entry_scripts(result: tuple[int, str]) -> None:
    """Oracle: the run succeeds (the module ran, as torchrun runs it) and says how to call main() instead."""
    status, output = result
    assert (
        status == 0 and "defines main() but nothing in it calls main()" in output and "--entry main" in output
    )


CASES: list[Case] = [
    Case(
        "exit-3-on-one-rank",
        "rank 1 calls sys.exit(3) after initialising",
        _run(
            "exit3.py",
            INIT + "dist.init_process_group()\nif dist.get_rank() == 1:\n    sys.exit(3)\ndist.barrier()\n",
        ),
        error=simdist.RankError,
        match=r"rank 1 raised SystemExit: 3\n--- traceback of rank 1 ---\n(?s:.*)exit3\.py\", line 5",
    ),
    Case(
        "exit-with-a-message",
        "a rank calls sys.exit('no data'), which Python reports with status 1",
        _run("exitmsg.py", INIT + "sys.exit('no data on this rank')\n"),
        error=simdist.RankError,
        match=r"rank 0 raised SystemExit: no data on this rank",
    ),
    Case(
        "exit-0-then-a-peer-waits",
        "rank 1 ends with sys.exit(0) while rank 0 all-reduces with it",
        _run(
            "exit0.py",
            INIT + "dist.init_process_group()\nif dist.get_rank() == 1:\n    sys.exit(0)\n"
            "dist.all_reduce(torch.ones(1))\n",
        ),
        error=simdist.DeadlockError,
        match=r"never issued by rank 1",
    ),
    Case(
        "argparse-error",
        "the script's argparse refuses its arguments (usage to stderr, exit status 2)",
        _run(
            "argparse_error.py",
            INIT + "import argparse\np = argparse.ArgumentParser()\np.add_argument('--lr', "
            "type=float)\np.parse_args()\n",
            "--lr",
            "fast",
        ),
        error=simdist.RankError,
        match=r"rank 0 raised SystemExit: 2",
    ),
    Case(
        "reads-and-replaces-sys-argv",
        "a script reads sys.argv (and one rank replaces it) under the launcher",
        _run("argv.py", "import json\n" + _ARGV, "--lr", "0.5"),
        check=_argv_per_rank,
    ),
    Case(
        "module-level-endless-loop",
        "the script's top level spins forever before it initialises",
        _run("spin.py", "while True:\n    pass\n", watchdog=0.5),
        error=simdist.WatchdogError,
        match=r"rank 0 ran for .*\(watchdog limit 0\.5 s\)(?s:.*)spin\.py\", line 1",
    ),
    Case(
        "busy-wait-on-the-clock",
        "while time.time() - t0 < 1: pass (the clock is simulated: no time passes)",
        _run(
            "busy.py", "import time\nt0 = time.time()\nwhile time.time() - t0 < 1:\n    pass\n", watchdog=0.5
        ),
        error=simdist.WatchdogError,
        match=r"busy\.py",
    ),
    Case(
        "init-twice",
        "a script calls init_process_group twice",
        _run("twice.py", INIT + "dist.init_process_group()\ndist.init_process_group()\n"),
        error=simdist.RankError,
        match=r"trying to initialize the default process group twice",
    ),
    Case(
        "never-initialised",
        "a script all-reduces without init_process_group",
        _run("noinit.py", INIT + "dist.all_reduce(torch.ones(1))\n"),
        error=simdist.RankError,
        match=r"Default process group has not been initialized",
    ),
    Case(
        "init-world-size-wrong",
        "init_process_group(world_size=3) on a launch of 2 (a real launch hangs)",
        _run("ws3.py", INIT + "dist.init_process_group(world_size=3)\n"),
        error=simdist.RankError,
        match=r"world_size 3 .* but this launch has 2 ranks.*wait timeout",
    ),
    Case(
        "init-rank-out-of-range",
        "init_process_group(rank=5) on a launch of 2 (gloo: rank < size)",
        _run("rank5.py", INIT + "dist.init_process_group(rank=5)\n"),
        error=simdist.RankError,
        match=r"rank < size\. 5 vs 2 \(gloo\)",
    ),
    Case(
        "init-rank-claimed-twice",
        "every rank passes rank=0 (a real launch waits until the timeout)",
        _run("rank0.py", INIT + "dist.init_process_group(rank=0, world_size=2)\n"),
        error=simdist.RankError,
        match=r"rank 1 raised InvalidArgumentError: .*launched as RANK=1",
    ),
    Case(
        "init-hash-store",
        "init_process_group(store=HashStore()), a store no other process can reach",
        _run(
            "hashstore.py",
            INIT + "dist.init_process_group(store=dist.HashStore(), world_size=2, "
            "rank=int(os.environ['RANK']))\n",
        ),
        error=simdist.RankError,
        match=r"a HashStore lives in one process's memory",
    ),
    Case(
        "init-file-store-in-a-missing-directory",
        "init_method='file:///no/such/dir/store' (FileStore waits forever)",
        _run(
            "filestore.py",
            INIT + "dist.init_process_group(init_method='file:///no/such/dir/store', world_size=2, "
            "rank=int(os.environ['RANK']))\n",
        ),
        error=simdist.RankError,
        match=r"the directory '/no/such/dir' does not exist",
    ),
    Case(
        "init-device-id-cpu",
        "init_process_group(device_id=torch.device('cpu')), which gloo refuses",
        _run("devcpu.py", INIT + "dist.init_process_group(device_id=torch.device('cpu'))\n"),
        error=simdist.RankError,
        match=r"device_id parameter must be an accelerator with an index",
    ),
    Case(
        "init-gone-before-its-peer",
        "rank 1 initialises with a 1 s timeout; rank 0 ends without initialising",
        _run(
            "alone.py",
            INIT + "import datetime\nif os.environ['RANK'] == '1':\n    dist.init_process_group("
            "timeout=datetime.timedelta(seconds=1))\n",
        ),
        error=simdist.RankError,
        match=r"wait timeout after 1 s .* rank 1 .* waited for rank 0 to join",
    ),
    Case(
        "kills-its-own-pid",
        "os.kill(os.getpid(), SIGTERM) in rank code (it must not signal the simulator)",
        _run("kill.py", INIT + "import signal\nos.kill(os.getpid(), signal.SIGTERM)\n"),
        error=simdist.RankError,
        match=r"rank 0 raised ProcessLookupError",
    ),
    Case(
        "nested-run-script",
        "rank code calls simdist.run_script on another script",
        _run("nested.py", "import simdist\nsimdist.run_script(__file__, 'ring')\n"),
        error=simdist.SimdistError,
        match=r"runs cannot be nested",
    ),
    Case(
        "missing-script",
        "simdist.run_script on a path that does not exist",
        lambda: simdist.run_script(_TMP / "nowhere.py", RING2),
        error=simdist.ScriptError,
        match=r"script '.*nowhere\.py' not found",
    ),
    Case(
        "argv-as-a-string",
        "simdist.run_script(..., argv='--lr 1')",
        lambda: simdist.run_script(_script("ok.py", "pass\n"), RING2, argv="--lr 1"),
        error=simdist.RunArgumentError,
        match=r"argv must be a list of the script's arguments",
    ),
    Case(
        "output-into-a-closed-pipe",
        "simdist run talkative.py | head -c 100 (64 ranks printing)",
        _closed_pipe,
        check=_quiet_exit,
    ),
    Case(
        "entry-script-without-entry",
        "simdist run on a script that only defines main()",
        lambda: _cli(["run", str(_script("entry.py", "def main():\n    return 1\n")), "--world-size", "2"]),
        check=_note_for_entry_scripts,
    ),
    Case(
        "script-arguments-without-double-dash",
        "simdist run train.py --lr 1 (the script's option before --)",
        _usage_error(["run", str(_TMP / "train.py"), "--lr", "1"], ""),
        error=SystemExit,
        match=r"unrecognized arguments: --lr 1; a script's own arguments go after --: simdist run .*train\.py "
        r"\[options\] -- --lr 1",
    ),
    Case(
        "double-dash-after-another-command",
        "simdist bench -- x",
        _usage_error(["bench", "--", "x"], ""),
        error=SystemExit,
        match=r"arguments after -- are a script's arguments, taken by simdist run and explore only; found them after simdist bench",
    ),
    Case(
        "local-ranks-filter-not-numbers",
        "simdist run --local-ranks-filter all",
        _usage_error(["run", str(_TMP / "train.py"), "--local-ranks-filter", "all"], ""),
        error=SystemExit,
        match=r"argument --local-ranks-filter/--local_ranks_filter: expected local ranks separated by commas",
    ),
    Case(
        "more-ranks-per-node-than-gpus",
        "Cluster.two_level(1, 8, ranks_per_node=9)",
        lambda: simdist.Cluster.two_level(1, 8, ranks_per_node=9),
        error=simdist.ClusterSpecError,
        match=r"ranks_per_node 9 is more than the node's gpus_per_node 8",
    ),
]


@pytest.mark.parametrize("case", params(CASES))
def test_hostile(case: Case) -> None:
    check(case)
