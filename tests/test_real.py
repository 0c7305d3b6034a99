"""The real launcher: rank functions on real processes through torch's elastic launcher.

Tests marked ``real`` start processes (a few seconds each on a small machine); the rest check what
must be rejected before any process starts.
"""

from __future__ import annotations

import collections
import importlib.util
import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import numpy as np
import pytest
import real_fns
import torch

import real
from real import RealConfigError, RealRunError
from real.__main__ import main as cli_main
from real.backend import resolve_backend
from real.main_script import MP_MAIN, MainScript
from real.oracle import FinalStateCheck, check_final_state, check_final_states
from real.rank_process import _to_cpu
from real.report import failure_error
from real.status import StatusDir
from real.target import Job, ScriptTarget, dump_job, load_job, target_for
from simdist.errors import SimdistError
from simdist.script import ScriptError, load_entry
from tests.oracle_fns import Setup, parallel, reference

Pair = collections.namedtuple("Pair", "a b")
REPO = Path(__file__).resolve().parents[1]
SCRIPT = str(REPO / "tests" / "real_fns.py")


@pytest.fixture
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make any attempt to start processes fail the test: these errors must come before launching."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the launcher was started although the run should have been rejected")

    monkeypatch.setattr("real.launcher.elastic_launch", refuse)


# --- real processes ----------------------------------------------------------------------------------


@pytest.mark.real
@pytest.mark.parametrize("nproc", [3])  # an odd world size; other tests launch 2 and 4 processes
def test_all_reduce_on_real_processes_matches_arithmetic(nproc: int) -> None:
    n = 6
    sigint_before = signal.getsignal(signal.SIGINT)
    result = real.run(real_fns.all_reduce_arange, nproc, args=(n,), env={"REAL_TEST_EXTRA": "yes"})

    expected = np.arange(n) * sum(range(1, nproc + 1))
    assert (result.nproc, result.backend, len(result.returns)) == (nproc, "gloo", nproc)
    assert result.wall_time > 0
    for rank, value in enumerate(result.returns):
        np.testing.assert_array_equal(value["sum"].numpy(), expected)
        assert (value["rank"], value["world"], value["backend"]) == (rank, nproc, "gloo")
        assert value["env"]["RANK"] == value["env"]["LOCAL_RANK"] == str(rank)
        assert value["env"]["WORLD_SIZE"] == str(nproc)
        assert value["env"]["MASTER_ADDR"] == "127.0.0.1"
        assert value["extra"] == "yes"
        # the launcher's OMP_NUM_THREADS (tests/conftest.py sets 1 unless the environment sets a count); where it
        # sets none, real's own 1 for several processes per node is compared with torchrun's in test_real_scripts
        assert value["omp_threads"] == int(os.environ["OMP_NUM_THREADS"])
    # Every rank rendezvoused through the same store.
    assert len({value["env"]["MASTER_PORT"] for value in result.returns}) == 1
    # The agent ran off the main thread: the caller's Ctrl-C handling is untouched.
    assert signal.getsignal(signal.SIGINT) is sigint_before


@pytest.mark.real
def test_rank_exception_names_the_rank_and_carries_its_traceback() -> None:
    with pytest.raises(RealRunError) as info:
        real.run(real_fns.fail_on_rank_1, 2, timeout=120)
    error = info.value
    assert error.first_rank == 1 and not error.timed_out
    assert "rank 1 failed" in str(error)
    assert "ValueError: rank 1 refuses to reduce" in str(error)
    assert "fail_on_rank_1" in error.failures[1]  # the traceback reaches into the rank code


#: timeouts of successive launches of a hung rank: the first is enough for an idle machine to start it
HANG_TIMEOUTS = (4, 20, 160)


@pytest.mark.real
@pytest.mark.timeout(sum(HANG_TIMEOUTS) + 120)
def test_timeout_kills_a_hung_run_and_shows_where_it_was_stuck(tmp_path: Path) -> None:
    # The timeout counts the process's start too: on a busy machine it can hit before the rank reaches hang(),
    # a timeout all the same but not the one under test. Then the launch is repeated with a longer timeout.
    arrived = tmp_path / "arrived"
    for timeout in HANG_TIMEOUTS:
        with pytest.raises(RealRunError) as info:
            real.run(real_fns.hang, 1, args=(str(arrived),), timeout=timeout)
        error = info.value
        assert error.timed_out and f"timed out after {timeout} s" in str(error)
        if arrived.exists():
            break
    else:
        pytest.fail(f"the rank never reached hang() within {HANG_TIMEOUTS[-1]} s: {error}")
    assert "still running: ranks 0" in str(error)
    assert set(error.stacks) == {0}
    assert "in hang" in error.stacks[0]


@pytest.mark.real
def test_run_script_loads_the_script_in_each_rank_process() -> None:
    result = real.run_script(SCRIPT, 2, kwargs={"scale": 10})
    assert result.returns == [30, 30]


@pytest.mark.real
def test_cli_prints_each_ranks_return_value() -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "real", "tests/real_fns.py", "--nproc", "2", "--entry", "main"],
        cwd=REPO,
        capture_output=True,
        check=False,
        text=True,
        timeout=120,
    )
    assert completed.returncode == 0, completed.stderr
    lines = completed.stdout.splitlines()
    assert lines[:2] == ["rank 0: 3", "rank 1: 3"]
    assert lines[2].startswith("wall time: ")


@pytest.mark.real
def test_cli_reports_a_failing_rank_with_exit_code_1(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main([SCRIPT, "--nproc", "2", "--entry", "fail_on_rank_1"]) == 1
    err = capsys.readouterr().err
    assert "rank 1 failed" in err and "ValueError: rank 1 refuses to reduce" in err


# --- functions of the calling script (__main__) -------------------------------------------------------

WEIGHTS = [1.0, 2.0, 5.0]

# A script that calls real.run on one of its own functions, as a user's first script does. Each load of
# the script appends its module name to loads.txt beside it, to count how often its top level runs.
TRAIN_SCRIPT = """
import json
import os

import torch
import torch.distributed as dist

import real
from weights import WEIGHTS  # a module next to the script

with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "loads.txt"), "a") as log:
    log.write(__name__ + "\\n")


class Scale:
    def __init__(self, k):
        self.k = k


def offset(rank):
    return 10 * rank


def step(scale, offset_fn):
    rank = dist.get_rank()
    t = torch.tensor(WEIGHTS, dtype=torch.float64) * (rank + 1) * scale.k + offset_fn(rank)
    dist.all_reduce(t)
    return {"rank": rank, "sum": t.tolist(), "module": __name__}


if __name__ == "__main__":
    result = real.run(step, 2, args=(Scale(3), offset), timeout=120)
    print(json.dumps(result.returns))
"""


def _python_env() -> dict[str, str]:
    """The environment for a child interpreter that imports this checkout's `real` and `simdist`."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


@pytest.mark.real
def test_run_accepts_a_function_of_the_calling_script(tmp_path: Path) -> None:
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    project.mkdir()
    elsewhere.mkdir()
    (project / "weights.py").write_text(f"WEIGHTS = {WEIGHTS!r}\n")
    (project / "train.py").write_text(TRAIN_SCRIPT)
    # Started by a relative path from another directory, as `python ../project/train.py`.
    completed = subprocess.run(
        [sys.executable, os.path.join("..", "project", "train.py")],
        cwd=elsewhere,
        env=_python_env(),
        capture_output=True,
        check=False,
        text=True,
        timeout=180,
    )
    assert completed.returncode == 0, completed.stderr
    returns = json.loads(completed.stdout.splitlines()[-1])
    expected = [sum(w * (r + 1) * 3 + 10 * r for r in range(2)) for w in WEIGHTS]
    assert returns == [{"rank": r, "sum": expected, "module": "__mp_main__"} for r in range(2)]
    # The script ran once as the program and once in each rank process, where its guard did not fire.
    assert sorted((project / "loads.txt").read_text().split()) == ["__main__", "__mp_main__", "__mp_main__"]


def test_functions_of_an_interactive_main_are_rejected_with_what_to_do() -> None:
    program = textwrap.dedent(
        """
        import json
        import real

        def step():
            return 1

        def outer():
            def inner():
                return 1
            return inner

        found = {}
        for name, fn in [("lambda", lambda: 1), ("nested", outer()), ("main", step)]:
            try:
                real.run(fn, 2, timeout=30)
                found[name] = "launched"
            except real.RealConfigError as exc:
                found[name] = str(exc)
        print(json.dumps(found))
        """
    )
    completed = subprocess.run(
        [sys.executable, "-c", program],
        env=_python_env(),
        capture_output=True,
        check=False,
        text=True,
        timeout=120,
    )
    assert completed.returncode == 0, completed.stderr
    found = json.loads(completed.stdout.splitlines()[-1])
    assert found["lambda"].startswith("fn '<lambda>' is a lambda;")
    assert found["nested"].startswith("fn 'outer.<locals>.inner' is defined inside another function;")
    assert found["main"].startswith(
        "'step' is defined in __main__ of an interactive session (python -c, the REPL or a notebook)"
    )
    assert "save the code in a .py file" in found["main"]


# The same kind of script, run in this process by `_as_main` without launching anything.
MAIN_SCRIPT = """
class Scale:
    def __init__(self, k):
        self.k = k


def step(scale):
    return [w * scale.k for w in (1, 2)]


if __name__ == "__main__":
    def late():
        return 0

    class Late:
        pass
"""


def _as_main(
    monkeypatch: pytest.MonkeyPatch, path: Path | None, module_name: str | None = None
) -> types.ModuleType:
    """Run MAIN_SCRIPT as this process's ``__main__``: from file ``path`` (None: as ``python -c``)."""
    main = types.ModuleType("__main__")
    if path is not None:
        path.write_text(MAIN_SCRIPT)
        main.__file__ = str(path)
    if module_name is not None:  # as `python -m module_name`
        main.__spec__ = importlib.util.spec_from_file_location(module_name, path)
    monkeypatch.setitem(sys.modules, "__main__", main)
    exec(compile(MAIN_SCRIPT, str(path or "<string>"), "exec"), main.__dict__)  # noqa: S102
    return main


def _in_fresh_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Give this process the bare ``__main__`` a spawned process starts with (restored afterwards)."""
    monkeypatch.setitem(sys.modules, "__main__", types.ModuleType("__main__"))
    monkeypatch.setitem(sys.modules, MP_MAIN, types.ModuleType(MP_MAIN))  # removed again afterwards


def test_a_function_of_the_calling_script_and_its_arguments_reach_a_fresh_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    main = _as_main(monkeypatch, tmp_path / "train.py")
    blob, script = dump_job(Job(target_for(main.step), "gloo", (main.Scale(3),)))
    assert script == MainScript(str(tmp_path / "train.py"))

    _in_fresh_process(monkeypatch)
    job = load_job(blob, script)
    loaded = sys.modules["__main__"]
    assert loaded.__name__ == MP_MAIN and not hasattr(loaded, "late")  # the guard did not fire
    assert job.target.fn is loaded.step and job.target.fn is not main.step
    # The argument's class is the freshly loaded one too, so isinstance checks in rank code hold.
    assert type(job.args[0]) is loaded.Scale
    assert job.target.fn(*job.args) == main.step(main.Scale(3)) == [3, 6]


def test_a_script_run_as_python_m_is_sent_by_module_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "real_test_main_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    main = _as_main(monkeypatch, package / "__main__.py", "real_test_main_pkg.__main__")
    blob, script = dump_job(Job(target_for(main.step), "gloo", (main.Scale(2),)))
    assert script == MainScript(str(package / "__main__.py"), "real_test_main_pkg.__main__")

    # multiprocessing leaves a package's __main__ alone in a spawned process: it is imported by name.
    _in_fresh_process(monkeypatch)
    try:
        job = load_job(blob, script)
        loaded = sys.modules["__main__"]
        assert loaded is sys.modules["real_test_main_pkg.__main__"] and not hasattr(loaded, "late")
        assert job.target.fn(*job.args) == [2, 4]
    finally:
        for name in ("real_test_main_pkg", "real_test_main_pkg.__main__"):
            sys.modules.pop(name, None)


def test_what_the_calling_script_defines_under_its_guard_is_rejected(
    no_launch: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    main = _as_main(monkeypatch, tmp_path / "train.py")
    block = r"'{}' is defined inside the `if __name__ == \"__main__\":` block of .*train\.py.*move its"
    with pytest.raises(RealConfigError, match=block.format("late")):
        real.run(main.late, 2)
    with pytest.raises(RealConfigError, match=block.format("Late")):
        real.run(main.step, 2, args=(main.Late(),))


def test_function_added_to_main_at_run_time_is_rejected(
    no_launch: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    main = _as_main(monkeypatch, tmp_path / "train.py")
    exec("def added():\n    return 1\n", main.__dict__)  # noqa: S102
    with pytest.raises(RealConfigError, match=r"train\.py does not define 'added' at its top level"):
        real.run(main.added, 2)


def test_function_of_a_main_without_a_file_is_rejected(
    no_launch: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    main = _as_main(monkeypatch, None)
    with pytest.raises(RealConfigError, match=r"'step' is defined in __main__ of an interactive session"):
        real.run(main.step, 2)


# --- rejected before launching -----------------------------------------------------------------------


def _closure() -> object:
    scale = 2

    def inner() -> int:
        return scale

    return inner


def test_lambda_is_rejected_before_launching(no_launch: None) -> None:
    with pytest.raises(RealConfigError, match="lambda.*run_script"):
        real.run(lambda: 1, 2)


def test_closure_is_rejected_before_launching(no_launch: None) -> None:
    with pytest.raises(RealConfigError, match="inside another function"):
        real.run(_closure(), 2)


def test_function_of_a_module_not_on_sys_path_is_rejected(no_launch: None, tmp_path: Path) -> None:
    # Loaded by path under a name no fresh process can import: pickle by reference would work here
    # and fail in every rank process.
    (tmp_path / "path_only_module.py").write_text("def f():\n    return 1\n")
    spec = importlib.util.spec_from_file_location("path_only_module", tmp_path / "path_only_module.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["path_only_module"] = module
    try:
        spec.loader.exec_module(module)
        with pytest.raises(RealConfigError, match="'path_only_module', which a fresh process cannot import"):
            real.run(module.f, 2)
    finally:
        del sys.modules["path_only_module"]


def test_unpicklable_argument_is_rejected(no_launch: None) -> None:
    with pytest.raises(RealConfigError, match="cannot send"):
        real.run(real_fns.main, 2, args=(lambda: 1,))


def test_script_function_is_sent_as_its_path() -> None:
    fn = load_entry(SCRIPT, "fail_on_rank_1")
    assert target_for(fn) == ScriptTarget(SCRIPT, "fail_on_rank_1")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"nproc": 0}, "nproc must be a positive int"),
        ({"nproc": 2, "timeout": 0}, "timeout must be a positive"),
        ({"nproc": 2, "env": {"RANK": "3"}}, "env may not set RANK"),
        ({"nproc": 2, "backend": "mpi"}, "backend 'mpi' is not supported"),
        ({"nproc": 2, "master_port": 70000}, "master_port must be"),
    ],
)
def test_bad_arguments_are_rejected(no_launch: None, kwargs: dict, match: str) -> None:
    with pytest.raises(RealConfigError, match=match):
        real.run(real_fns.main, **kwargs)


def test_real_errors_belong_to_simdists_error_hierarchy(no_launch: None, tmp_path: Path) -> None:
    # Callers can catch every error simdist and real raise on purpose with one except clause.
    with pytest.raises(SimdistError) as config:
        real.run(real_fns.main, 0)
    assert isinstance(config.value, RealConfigError) and isinstance(config.value, ValueError)
    run_error = failure_error(StatusDir(tmp_path), 2, "gloo", None, timed_out=True, timeout=1)
    assert isinstance(run_error, RealRunError) and isinstance(run_error, SimdistError)
    assert isinstance(run_error, RuntimeError)


def test_nccl_without_cuda_is_a_clear_error(no_launch: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RealConfigError, match="backend 'nccl' needs CUDA GPUs.*use backend='gloo'"):
        real.run(real_fns.main, 2, backend="nccl")


def test_nccl_with_fewer_gpus_than_processes_is_a_clear_error(
    no_launch: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(RealConfigError, match=r"nproc=2 > 1 visible CUDA device"):
        real.run(real_fns.main, 2, backend="nccl")


def test_auto_backend_falls_back_to_gloo_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_backend("auto", 2) == resolve_backend(None, 2) == "gloo"


def test_cli_bad_arguments_exit_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert cli_main([str(tmp_path / "missing.py"), "--nproc", "2"]) == 2
    assert "not found" in capsys.readouterr().err
    assert cli_main([SCRIPT, "--nproc", "2", "--entry", "no_such_function"]) == 2
    assert "defines no 'no_such_function'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        cli_main([SCRIPT, "--nproc", "0"])
    assert info.value.code == 2


# --- pieces ------------------------------------------------------------------------------------------


def test_earliest_recorded_failure_is_reported_as_the_root_cause(tmp_path: Path) -> None:
    status = StatusDir(tmp_path)
    for rank, message in [(2, "first"), (0, "second")]:
        try:
            raise RuntimeError(message)
        except RuntimeError as exc:
            status.record_error(rank, exc)
    error = failure_error(status, 3, "gloo", None, timed_out=False, timeout=10)
    assert error.first_rank == 2
    assert str(error).startswith("rank 2 failed on 3 real processes (backend gloo):")
    assert "rank 0: RuntimeError: second" in str(error)
    assert "No rank process reached real's entry point" in str(error)  # no rank marked itself started


def test_returns_are_moved_to_cpu_keeping_their_containers() -> None:
    counts = collections.defaultdict(list, {"x": torch.ones(2, requires_grad=True) * 2})
    moved = _to_cpu({"pair": Pair(torch.zeros(1), [torch.ones(1)]), "counts": counts, "n": 3})
    assert isinstance(moved["pair"], Pair) and isinstance(moved["counts"], collections.defaultdict)
    assert not moved["counts"]["x"].requires_grad  # detached, so it pickles
    pickle.dumps(moved)
    assert moved["n"] == 3


def test_load_entry_imports_the_script_like_python_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))  # load_entry adds the script's directory
    (tmp_path / "helper_for_real_test.py").write_text("VALUE = 41\n")
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """
            import helper_for_real_test
            ran_as_main = False

            def main():
                return helper_for_real_test.VALUE + 1

            if __name__ == "__main__":
                ran_as_main = True
            """
        )
    )
    monkeypatch.delitem(sys.modules, "helper_for_real_test", raising=False)
    fn = load_entry(script)
    assert fn() == 42  # the script imported its neighbour: its directory is on sys.path
    assert sys.path[0] == str(tmp_path)
    assert sys.modules[fn.__module__].ran_as_main is False


def test_load_entry_errors_say_what_was_expected(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))
    with pytest.raises(ScriptError, match="not found"):
        load_entry(tmp_path / "absent.py")
    script = tmp_path / "s.py"
    script.write_text("main = 3\ndef other():\n    pass\n")
    with pytest.raises(ScriptError, match=r"'main' in script .* is int 3, not a function"):
        load_entry(script)
    with pytest.raises(ScriptError, match=r"defines no 'train'.*functions it defines: other"):
        load_entry(script, "train")


@pytest.mark.real
def test_the_final_state_of_real_processes_is_checked_against_the_reference() -> None:
    clean = Setup()
    assert check_final_state(parallel, reference, 2, args=(clean, "bucketed"), reference_args=(clean,)).ok
    bad = Setup(perturb=(2, 0, 0, 1), delta=0.5)
    # several programs on one launch, each rank process running them in turn: the divergent one first, so a
    # program's state leaking into the next would show in the clean ones after it
    reports = check_final_states(
        [
            FinalStateCheck(parallel, reference, args=(bad, "torch_ddp"), reference_args=(bad,)),
            FinalStateCheck(parallel, reference, args=(clean, "bucketed"), reference_args=(clean,)),
            FinalStateCheck(parallel, reference, args=(clean, "torch_ddp"), reference_args=(clean,)),
        ],
        2,
    )
    rep = reports[0]
    assert rep.first.step == 2 and rep.first.kind == "grad" and rep.first.ranks == (1,)
    assert [r.ok for r in reports] == [False, True, True], [str(r) for r in reports]
    with pytest.raises(TypeError, match="FinalStateCheck"):
        check_final_states([(parallel, reference)], 2)  # type: ignore[list-item]
