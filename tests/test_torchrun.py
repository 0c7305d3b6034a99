"""Scripts run as torchrun runs them (``simdist run SCRIPT -- ARGS``, ``simdist.run_script``): module code per rank as
``__main__``, each rank's ``sys.argv``, clock, process id and output, its own ``init_process_group`` (however it
imported it) checked as real gloo checks it, exits as torchrun counts them. The oracles: real processes launched by
torch's own torchrun (environment, parameters, and what ``init_process_group`` refuses), the collectives' closed
forms for the clocks, and the process itself (which ranks ran what, which files they wrote)."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import simdist
from real import free_port
from simdist.cli import main as cli_main
from simdist.engine.rank_process import FIRST_PID, WALL_CLOCK_BASE

SCRIPTS = Path(__file__).resolve().parent / "torchrun_scripts"
RING2 = simdist.Cluster.ring(2)
#: the same without a GPU model: a machine where CUDA is absent, as where the gloo outcomes were recorded
CPU_RING2 = simdist.Cluster.ring(2, device="cpu")


def _script(tmp_path: Path, source: str, name: str = "train.py") -> Path:
    path = tmp_path / name
    path.write_text(source)
    return path


def _torchrun(script: Path, nproc: int, *args: str, cwd: Path) -> None:
    """Launch ``script`` on ``nproc`` real gloo processes with torch's own torchrun."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--master-port",
        str(free_port()),
        str(script),
        *args,
    ]
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


# --------------------------------------------------------------------------- the script runs once per rank

PER_RANK = """
import os, sys
import torch.distributed as dist

# module level: runs on every rank, never in the calling process
with open(f"module-{os.environ['RANK']}.txt", "w") as f:
    f.write(" ".join(sys.argv))

if __name__ == "__main__":
    dist.init_process_group()
    print("main ran on", dist.get_rank(), "of", dist.get_world_size())
"""


def test_module_code_and_main_block_run_once_per_rank_never_in_the_caller(tmp_path, monkeypatch, capsys):
    script = _script(tmp_path, PER_RANK)
    monkeypatch.chdir(
        tmp_path
    )  # files the ranks write go where the script says: the caller's working directory
    argv_before, main_before = list(sys.argv), sys.modules["__main__"]
    res = simdist.run_script(script, simdist.Cluster.switch(3), argv=["--lr", "0.1"])
    assert sorted(p.name for p in tmp_path.glob("module-*.txt")) == [
        "module-0.txt",
        "module-1.txt",
        "module-2.txt",
    ]
    assert {(tmp_path / f"module-{r}.txt").read_text() for r in range(3)} == {f"{script} --lr 0.1"}
    out = capsys.readouterr().out.splitlines()
    assert sorted(out) == [f"[rank{r}]:main ran on {r} of 3" for r in range(3)]
    assert res.returns == [None] * 3 and res.program == str(script)
    assert sys.argv == argv_before and sys.modules["__main__"] is main_before


def test_nothing_of_the_script_runs_when_it_cannot_be_compiled(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    script = _script(tmp_path, "open('ran.txt', 'w').close()\ndef broken(:\n")
    with pytest.raises(simdist.ScriptError, match=r"is not valid Python:\n  File .*train\.py\", line 2"):
        simdist.run_script(script, RING2)
    assert not (tmp_path / "ran.txt").exists()


PICKLES = """
from __future__ import annotations

import dataclasses, io, sys, typing
import torch, torch.distributed as dist


@dataclasses.dataclass
class Config:
    width: int = 2
    shared: typing.ClassVar[int] = 0  # a class variable, not a field, read from the module's own namespace


class Net(torch.nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(config.width, config.width)


dist.init_process_group()
buf = io.BytesIO()
torch.save(Net(Config()), buf)  # pickles __main__.Net, as a script's own process does
buf.seek(0)
loaded = torch.load(buf, weights_only=False)
rank = dist.get_rank()
dist.barrier()  # the other rank has run its own copy of the module meanwhile
print(type(loaded) is Net, [f.name for f in dataclasses.fields(Config)], sys.modules["__main__"].rank == rank)
"""


def test_a_script_is_its_ranks_main_module(tmp_path, capsys):
    """Each rank's sys.modules['__main__'] is its own run of the script: pickle and torch.save find the script's
    classes there, and dataclasses read its annotations from it, as in a process torchrun started."""
    main_before = sys.modules["__main__"]
    simdist.run_script(_script(tmp_path, PICKLES), RING2)
    assert sorted(capsys.readouterr().out.splitlines()) == [
        f"[rank{r}]:True ['width'] True" for r in range(2)
    ]
    assert sys.modules["__main__"] is main_before


ARGPARSE = """
import argparse, json, os, sys
import torch, torch.distributed as dist
from torch.distributed import init_process_group  # bound at import, as torchrun scripts do

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--scale", type=float, default=1.0)
args = parser.parse_args()
init_process_group()
t = torch.ones(2) * (dist.get_rank() + 1) * args.scale
dist.all_reduce(t)
json.dump({"argv": sys.argv, "sum": t.tolist()}, open(os.path.join(args.out, f"r{dist.get_rank()}.json"), "w"))
"""


def test_each_rank_parses_its_own_argv(tmp_path):
    script = _script(tmp_path, ARGPARSE)
    simdist.run_script(script, RING2, argv=[str(tmp_path), "--scale", "2"])
    for r in range(2):
        seen = json.loads((tmp_path / f"r{r}.json").read_text())
        assert seen == {"argv": [str(script), str(tmp_path), "--scale", "2"], "sum": [6.0, 6.0]}


def test_the_command_line_passes_what_follows_the_double_dash_to_the_script(tmp_path, capsys):
    script = _script(tmp_path, ARGPARSE)
    assert cli_main(["run", str(script), "--world-size", "3", "--", str(tmp_path), "--scale", "0.5"]) == 0
    assert json.loads((tmp_path / "r2.json").read_text())["sum"] == [3.0, 3.0]
    assert "simulated time" in capsys.readouterr().out
    assert _usage_error(
        ["run", str(script), "--world-size", "3", "--scale", "0.5"]
    )  # not simdist's own option
    err = capsys.readouterr().err
    assert "unrecognized arguments: --scale 0.5; a script's own arguments go after --" in err
    assert _usage_error(["clusters", "--", "x"])
    assert "arguments after -- are a script's arguments, taken by simdist run and explore only" in capsys.readouterr().err


def _usage_error(argv: list[str]) -> bool:
    """Whether the command line stops at argparse's usage error (exit status 2)."""
    with pytest.raises(SystemExit) as info:
        cli_main(argv)
    return info.value.code == 2


# --------------------------------------------------------------------------- exits, as torchrun counts them

EXITS = """
import os, sys
import torch.distributed as dist
dist.init_process_group()
how = sys.argv[1]
if dist.get_rank() == 1:
    if how == "exit0":
        sys.exit(0)
    if how == "exit3":
        sys.exit(3)
    if how == "os_exit0":
        os._exit(0)
    if how == "message":
        sys.exit("no data on this rank")
open(f"after-{dist.get_rank()}.txt", "w").close()  # what a rank runs after the point where rank 1 may have ended
"""


@pytest.mark.parametrize("how", ["exit0", "os_exit0", "fall-off-the-end"])
def test_an_exit_with_status_zero_ends_a_rank_normally(tmp_path, monkeypatch, how):
    monkeypatch.chdir(tmp_path)
    res = simdist.run_script(_script(tmp_path, EXITS), RING2, argv=[how])
    assert res.returns == [None, None]
    assert (tmp_path / "after-0.txt").exists() and (tmp_path / "after-1.txt").exists() == (
        how == "fall-off-the-end"
    )


@pytest.mark.parametrize(
    ("how", "shown"), [("exit3", "SystemExit: 3"), ("message", "SystemExit: no data on this rank")]
)
def test_a_non_zero_exit_is_that_ranks_failure(tmp_path, monkeypatch, how, shown):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(simdist.RankError, match=f"rank 1 raised {shown}") as info:
        simdist.run_script(_script(tmp_path, EXITS), RING2, argv=[how])
    assert (
        info.value.rank == 1 and "sys.exit(" in info.value.traceback_text
    )  # the script's line, not simdist's


# --------------------------------------------------------------------------- init_process_group, however imported

#: a module the test imports before the run: its init_process_group is bound to torch's own function then
BOUND_EARLY = """
from torch.distributed import init_process_group


def setup():
    init_process_group(backend="gloo")
"""

USES_BOUND_EARLY = """
import torch, torch.distributed as dist
import setup_early

setup_early.setup()
t = torch.ones(1) * (dist.get_rank() + 1)
dist.all_reduce(t)
print(t.item(), dist.get_backend())
"""


def test_a_script_initialises_its_group_however_it_imported_init_process_group(tmp_path, monkeypatch, capsys):
    (tmp_path / "setup_early.py").write_text(BOUND_EARLY)
    monkeypatch.syspath_prepend(str(tmp_path))
    setup_early = importlib.import_module("setup_early")  # before the run: its name is torch's own function
    assert setup_early.init_process_group is torch.distributed.distributed_c10d.init_process_group
    try:
        simdist.run_script(_script(tmp_path, USES_BOUND_EARLY), simdist.Cluster.switch(3))
    finally:
        sys.modules.pop("setup_early", None)
    assert sorted(capsys.readouterr().out.splitlines()) == [f"[rank{r}]:6.0 gloo" for r in range(3)]
    # and as dist.init_process_group, with the module bound inside the run
    simdist.run_script(_script(tmp_path, ARGPARSE), RING2, argv=[str(tmp_path)])


#: an entry-function script that binds torch's own init_process_group when it is imported, before the run
ENTRY_BOUND_EARLY = """
import os, sys
import torch, torch.distributed as dist
from torch.distributed import init_process_group


def main():
    if os.environ["RANK"] in sys.argv[1].split(","):  # the ranks that call it
        init_process_group(backend="gloo")
        if sys.argv[2:] == ["twice"]:
            init_process_group(backend="gloo")
    if sys.argv[2:] == ["again"]:  # a group of the function's own after the one simdist made
        dist.destroy_process_group()
        init_process_group(backend="gloo")
    pair = dist.new_group([0, 1])  # the group names stay in step whichever ranks called it
    t = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(t, group=pair)
    return t.item(), dist.get_backend()
"""


@pytest.mark.parametrize("who", ["0,1", "1"])
def test_an_entry_function_initialises_with_a_name_bound_before_the_run(tmp_path, who):
    """The entry-function convention makes the group before main() runs; torch's own init_process_group, bound at
    import, finds it (on every rank, or on some) instead of refusing to make it twice."""
    script = _script(tmp_path, ENTRY_BOUND_EARLY, "entry_bound.py")
    res = simdist.run_script(script, RING2, argv=[who], entry="main", backend_name="gloo")
    assert res.returns == [(3.0, "gloo")] * 2
    again = simdist.run_script(script, RING2, argv=[who, "again"], entry="main", backend_name="gloo")
    assert again.returns == [(3.0, "gloo")] * 2
    with pytest.raises(simdist.RankError, match="trying to initialize the default process group twice"):
        simdist.run_script(script, RING2, argv=[who, "twice"], entry="main", backend_name="gloo")
    with pytest.raises(simdist.RankError, match=r"init_process_group\(backend='gloo'\) inside simdist\.run"):
        simdist.run_script(script, CPU_RING2, argv=[who], entry="main")  # the run presents 'simdist'
    # on a GPU cluster a GPU machine's backends are accepted, and the group presents the one asked for
    presented = ["gloo" if str(r) in who.split(",") else "simdist" for r in range(2)]
    assert simdist.run_script(script, RING2, argv=[who], entry="main").returns == [(3.0, p) for p in presented]


def test_a_second_init_process_group_in_a_script_is_refused_as_torch_refuses_it(tmp_path):
    script = _script(
        tmp_path, "import torch.distributed as dist\ndist.init_process_group()\ndist.init_process_group()\n"
    )
    with pytest.raises(simdist.RankError, match="trying to initialize the default process group twice"):
        simdist.run_script(script, RING2)


def test_a_script_that_never_initialises_fails_as_under_torchrun(tmp_path):
    script = _script(tmp_path, "import torch, torch.distributed as dist\ndist.all_reduce(torch.ones(1))\n")
    with pytest.raises(simdist.RankError, match="Default process group has not been initialized"):
        simdist.run_script(script, RING2)


def _gloo_outcomes() -> list[dict]:
    return json.loads((SCRIPTS / "init_cases.gloo.json").read_text())["ranks"]


def _agree_with_gloo(simulated: dict, real: dict, rank: int) -> None:
    """Each case ends as on real gloo: initialised alike, or refused with an exception of gloo's type (its message
    kept) where gloo refuses, and with a clear error naming the wait where real processes wait until the timeout."""
    assert simulated.keys() == real.keys()
    for case, gloo in real.items():
        sim = simulated[case]
        where = f"rank {rank}, case {case}: simdist {sim}, gloo {gloo}"
        assert ("raised" in sim) == ("raised" in gloo), where
        if "raised" not in gloo:
            assert sim == gloo, where
            continue
        if gloo["raised"][0] == "DistStoreError":  # real processes waited until the timeout
            assert "wait timeout" in sim["message"].lower() and "RuntimeError" in sim["raised"], where
            continue
        assert gloo["raised"][0] in sim["raised"], where
        expected = gloo["message"].split("] ")[-1]  # gloo's enforce text without its build path
        assert expected in sim["message"], where


def test_init_process_group_refuses_what_real_gloo_refuses(tmp_path):
    """Against the outcomes real gloo processes gave for the same script (tests/torchrun_scripts/init_cases.gloo.json,
    measured by the test below)."""
    res = simdist.run_script(SCRIPTS / "init_cases.py", CPU_RING2, argv=[str(tmp_path)])
    for rank, real in enumerate(_gloo_outcomes()):
        _agree_with_gloo(json.loads((tmp_path / f"rank{rank}.json").read_text()), real, rank)
    assert res.sim_time >= 3.0  # rank 0 waited its 3 s for rank 1, which claimed rank 0 too and was refused


@pytest.mark.real
@pytest.mark.slow
def test_the_recorded_gloo_outcomes_are_what_real_gloo_does(tmp_path):
    _torchrun(SCRIPTS / "init_cases.py", 2, str(tmp_path), cwd=tmp_path)
    for rank, recorded in enumerate(_gloo_outcomes()):
        measured = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert {k: v.get("raised", v) for k, v in measured.items()} == {
            k: v.get("raised", v) for k, v in recorded.items()
        }


# --------------------------------------------------------------------------- against torch's own torchrun


@pytest.mark.real
@pytest.mark.slow
def test_a_ddp_script_sees_torchruns_environment_and_trains_the_same_parameters(tmp_path):
    """One torchrun launch of a DDP training script, then the same script under simdist: every rank's environment
    and argv as torchrun gives them, and the trained parameters bitwise equal."""
    real_dir, sim_dir = tmp_path / "real", tmp_path / "sim"
    real_dir.mkdir()
    sim_dir.mkdir()
    script = SCRIPTS / "train_ddp.py"
    _torchrun(script, 2, str(real_dir), "--steps", "3", cwd=tmp_path)
    simdist.run_script(script, RING2, argv=[str(sim_dir), "--steps", "3"])
    for rank in range(2):
        real = json.loads((real_dir / f"rank{rank}.json").read_text())
        sim = json.loads((sim_dir / f"rank{rank}.json").read_text())
        assert sim["name"] == real["name"] == "__main__"
        assert sim["argv"][1:] == [str(sim_dir), "--steps", "3"] and real["argv"][1:] == [
            str(real_dir),
            "--steps",
            "3",
        ]
        assert sim["argv"][0] == real["argv"][0] == str(script)
        where = {"MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"}  # the real launch's own address and id
        assert {k: v for k, v in sim["env"].items() if k not in where} == {
            k: v for k, v in real["env"].items() if k not in where
        }
        assert all(sim["env"][k] for k in where)
    real_params = torch.load(real_dir / "params.pt")
    sim_params = torch.load(sim_dir / "params.pt")
    assert real_params.keys() == sim_params.keys()
    for name in real_params:
        assert torch.equal(real_params[name], sim_params[name]), name


# --------------------------------------------------------------------------- each rank's clock, pid, output

CLOCKS = """
import time
import torch, torch.distributed as dist
import simdist


def timed():
    simdist.set_algorithms(all_reduce="ring")
    start = [time.time(), time.perf_counter(), time.monotonic(), time.time_ns(), time.perf_counter_ns(),
             time.monotonic_ns()]
    dist.all_reduce(torch.ones(1 << 20))
    end = [time.time(), time.perf_counter(), time.monotonic(), time.time_ns(), time.perf_counter_ns(),
           time.monotonic_ns()]
    return [e - s for e, s in zip(end, start)], end[0] - simdist.now()
"""


def test_a_ranks_clocks_read_simulated_time(tmp_path):
    """time.time / perf_counter / monotonic (and _ns) time an all-reduce at its ring closed form,
    2(n-1) alpha + 2(n-1)/n m beta, as simdist.now() does."""
    ns = {}
    exec(compile(CLOCKS, str(tmp_path / "clocks.py"), "exec"), ns)  # noqa: S102
    cluster = simdist.Cluster.ring(4, bandwidth="100GB/s", latency="5us", device="cpu")
    before = time.time()
    res = simdist.run(ns["timed"], cluster, compute=False)
    after = time.time()
    n, m, alpha, beta = 4, 4 * (1 << 20), 5e-6, 1 / 100e9
    closed_form = 2 * (n - 1) * alpha + 2 * (n - 1) / n * m * beta
    for deltas, base in res.returns:
        for d in deltas[:3]:
            assert d == pytest.approx(closed_form, rel=1e-6, abs=1e-6)  # time.time() is a float of ~1.7e9 s
        for d in deltas[3:]:
            assert d == pytest.approx(closed_form * 1e9, rel=1e-6, abs=1e3)
        assert base == WALL_CLOCK_BASE  # the same in every run, whenever it runs
    assert time.monotonic() > 0 and before <= time.time() >= after  # outside the run, the real clocks


def _pids() -> tuple[int, bool]:
    pid = os.getpid()
    try:
        os.kill(pid, 0)  # would signal a live process
    except ProcessLookupError:
        return pid, False
    return pid, True


def test_each_rank_has_a_process_id_of_its_own_that_no_live_process_has():
    res = simdist.run(_pids, simdist.Cluster.switch(3))
    assert res.returns == [(FIRST_PID + r, False) for r in range(3)]
    assert simdist.run(_pids, simdist.Cluster.switch(3)).returns == res.returns  # the same on every run
    assert os.getpid() != FIRST_PID and os.getpid() < FIRST_PID


PRINTS = """
import sys
import torch.distributed as dist
dist.init_process_group()
r = dist.get_rank()
print(f"out {r}")
print(f"err {r}", file=sys.stderr)
sys.stdout.write(f"two {r}\\nlines {r}\\n")
sys.stdout.write(f"unfinished {r}")
"""


def test_each_line_a_rank_prints_starts_with_its_rank(tmp_path, capsys):
    script = _script(tmp_path, PRINTS)
    simdist.run_script(script, simdist.Cluster.two_level(2, 2, device="cpu"))
    captured = capsys.readouterr()
    for r in range(4):
        lines = [line for line in captured.out.splitlines() if line.startswith(f"[rank{r}]:")]
        assert lines == [
            f"[rank{r}]:out {r}",
            f"[rank{r}]:two {r}",
            f"[rank{r}]:lines {r}",
            f"[rank{r}]:unfinished {r}",
        ]
        assert f"[rank{r}]:err {r}" in captured.err.splitlines()
    assert len(captured.out.splitlines()) == 16


def test_local_ranks_filter_shows_only_those_local_ranks_on_every_node(tmp_path, capsys):
    script = _script(tmp_path, PRINTS)
    simdist.run_script(script, simdist.Cluster.two_level(2, 2, device="cpu"), local_ranks_filter=[1])
    out = capsys.readouterr().out
    assert {line.split(":")[0] for line in out.splitlines()} == {
        "[rank1]",
        "[rank3]",
    }  # local rank 1 of both nodes
    simdist.run_script(script, RING2, prefix_output=False, local_ranks_filter=[0])
    assert capsys.readouterr().out.splitlines() == ["out 0", "two 0", "lines 0", "unfinished 0"]


def test_the_command_line_prefixes_and_filters_like_torchrun(tmp_path, capsys):
    script = _script(tmp_path, PRINTS)
    assert cli_main(["run", str(script), "--world-size", "3", "--local-ranks-filter", "0,2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert {line.split(":")[0] for line in out if line.startswith("[")} == {"[rank0]", "[rank2]"}
    assert (
        cli_main(["run", str(script), "--world-size", "2", "--no-prefix", "--local-ranks-filter", "1"]) == 0
    )
    assert [line for line in capsys.readouterr().out.splitlines() if "1" in line][:2] == ["out 1", "two 1"]
    assert _usage_error(["run", str(script), "--local-ranks-filter", "0,x"])
    assert (
        "argument --local-ranks-filter/--local_ranks_filter: expected local ranks separated by commas"
        in capsys.readouterr().err
    )


# --------------------------------------------------------------------------- entry functions, and the choice


def test_an_entry_script_that_the_torchrun_mode_would_not_run_gets_a_note(tmp_path, capsys):
    script = _script(
        tmp_path, "import torch.distributed as dist\n\ndef main():\n    return dist.get_rank()\n"
    )
    assert cli_main(["run", str(script), "--world-size", "2"]) == 0
    assert "defines main() but nothing in it calls main()" in capsys.readouterr().err
    assert cli_main(["run", str(script), "--world-size", "2", "--entry", "main"]) == 0
    captured = capsys.readouterr()
    assert "rank 1: 1" in captured.out and "note" not in captured.err


def test_a_script_that_stops_before_communicating_gets_a_note(tmp_path, capsys):
    """As the public examples do without a GPU: print why, exit with status 0, having run no step."""
    script = _script(
        tmp_path, "import sys\nprint('Unable to locate sufficient 2 gpus. Exiting.')\nsys.exit()\n"
    )
    assert cli_main(["run", str(script), "--world-size", "2"]) == 0
    captured = capsys.readouterr()
    assert "[rank1]:Unable to locate sufficient 2 gpus. Exiting." in captured.out
    assert "no rank of 2 communicated (0 messages)" in captured.err
    assert (
        cli_main(
            ["run", str(_script(tmp_path, ARGPARSE, "reduce.py")), "--world-size", "2", "--", str(tmp_path)]
        )
        == 0
    )
    assert "communicated" not in capsys.readouterr().err  # it all-reduced


def test_an_entry_function_reads_the_script_arguments_too(tmp_path):
    script = _script(tmp_path, "import sys\n\ndef main():\n    return list(sys.argv)\n")
    res = simdist.run_script(script, RING2, argv=["--x", "1"], entry="main")
    assert res.returns == [[str(script), "--x", "1"]] * 2


def test_run_script_refuses_the_options_it_sets_itself(tmp_path):
    script = _script(tmp_path, "pass\n")
    with pytest.raises(simdist.RunArgumentError, match="run_script sets default_group itself"):
        simdist.run_script(script, RING2, default_group=True)
    with pytest.raises(simdist.RunArgumentError, match="argv must be a list of the script's arguments"):
        simdist.run_script(script, RING2, argv="--lr 1")


# --------------------------------------------------------------------------- a world smaller than a node


def _local() -> tuple[str, str, str, str]:
    return (
        os.environ["LOCAL_RANK"],
        os.environ["LOCAL_WORLD_SIZE"],
        os.environ["GROUP_RANK"],
        os.environ["WORLD_SIZE"],
    )


@pytest.mark.parametrize("world", [1, 2, 5, 7])
def test_a_world_smaller_than_a_node_uses_part_of_it(world):
    """As torchrun --nproc-per-node N on a DGX: N ranks on one node, LOCAL_RANK r; the node keeps its 8 GPUs, and
    the ranks' collectives take as long as on a node of exactly N GPUs (the unused ones change nothing)."""
    partial = simdist.Cluster.preset("dgx-h100", world_size=world)
    assert (partial.world_size, partial.ranks_per_node, partial.gpus_per_node) == (world, world, 8)
    res = simdist.run(_local, partial)
    assert res.returns == [(str(r), str(world), "0", str(world)) for r in range(world)]
    exact = simdist.Cluster.two_level(
        1, world, "450GB/s", "1us", "400Gb/s", "5us", device="H100", collective_model="nccl"
    )

    def step() -> None:
        torch.distributed.all_reduce(torch.ones(1 << 16))

    assert simdist.run(step, partial).sim_time == simdist.run(step, exact).sim_time
