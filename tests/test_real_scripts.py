"""Scripts on real processes as torchrun runs them, several nodes, and rank code's own init_process_group.

The oracle of a torchrun-style launch is torchrun itself (``python -m torch.distributed.run``): the same probe
script runs under both and must see the same module name, command line, working directory, path and launcher
environment. Tests marked ``real`` start processes; the rest check the pieces without launching.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed import distributed_c10d as c10d
from torch.distributed import init_process_group as bound_before  # as rank code binds it at its top
from torch.distributed.run import determine_local_world_size

import real
import real.__main__ as cli
from real import RealConfigError, Rendezvous
from real.init_guard import backends_named, conflict, intercepted
from real.options import MAX_TIMEOUT, TimelineOptions
from real.rank_process import exit_status
from real.rendezvous import C10D_PORT, RDZV_TIMEOUT
from real.target import MainTarget, ScriptTarget
from simdist_base.script import ScriptError

REPO = Path(__file__).resolve().parents[1]

# Records what one rank sees, into OUT/rank<R>.json, and prints one line.
PROBE = """
import argparse
import json
import os
import sys
import threading

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("words", nargs="*")
args = parser.parse_args()
dist.init_process_group("gloo")
total = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(total)
record = {
    "name": __name__,
    "file": __file__,
    "argv": sys.argv[1:],
    "path0": sys.path[0],
    "cwd": os.getcwd(),
    "main_thread": threading.current_thread() is threading.main_thread(),
    "env": dict(os.environ),
    "sum": total.item(),
    "rank": dist.get_rank(),
    "world": dist.get_world_size(),
    "threads": torch.get_num_threads(),
}
with open(os.path.join(args.out, f"rank{dist.get_rank()}.json"), "w") as file:
    json.dump(record, file)
print(f"rank {dist.get_rank()} of {dist.get_world_size()} done")
dist.destroy_process_group()
"""

#: launcher variables whose values differ from launch to launch (a port, a temporary file)
PER_LAUNCH = {"MASTER_PORT", "TORCHELASTIC_ERROR_FILE"}


def _env() -> dict[str, str]:
    """This environment with this checkout first on the child's module path, and without the suite's
    OMP_NUM_THREADS (tests/conftest.py): each launcher's own thread count for its rank processes is compared."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    return {**env, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


def _records(out: Path, nproc: int) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


@pytest.mark.real
@pytest.mark.slow
def test_a_script_runs_under_python_m_real_as_under_torchrun(tmp_path: Path) -> None:
    (tmp_path / "probe.py").write_text(PROBE)
    runs = {}
    for name, launcher in [
        (
            "torchrun",
            ["-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(real.free_port())],
        ),
        ("real", ["-m", "real", "--nproc", "2", "--local-ranks-filter", "1"]),
    ]:
        out = tmp_path / name
        out.mkdir()
        script_args = ["--out", str(out), "two", "words"]
        argv = (
            [*launcher, "probe.py", *script_args]
            if name == "torchrun"
            else [*launcher, "probe.py", "--", *script_args]
        )
        done = subprocess.run(
            [sys.executable, *argv],
            cwd=tmp_path,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=240,
            check=False,
        )
        assert done.returncode == 0, (name, done.stdout, done.stderr[-3000:])
        runs[name] = (_records(out, 2), done.stdout)

    (torchrun, _), (ours, stdout) = runs["torchrun"], runs["real"]
    for theirs, mine in zip(torchrun, ours):
        env_theirs, env_mine = theirs.pop("env"), mine.pop("env")
        assert mine["argv"][1] == str(tmp_path / "real") and theirs["argv"][1] == str(tmp_path / "torchrun")
        mine["argv"][1] = theirs["argv"][1]
        assert mine == theirs  # __main__, its file, sys.argv, sys.path[0], cwd, main thread, ranks, threads
        assert env_mine.keys() == env_theirs.keys()
        assert {k: v for k, v in env_mine.items() if k not in PER_LAUNCH} == {
            k: v for k, v in env_theirs.items() if k not in PER_LAUNCH
        }
    assert [r["sum"] for r in ours] == [3.0, 3.0] and ours[0]["name"] == "__main__"
    # torchrun's --tee prefix with the global rank, and --local-ranks-filter: only local rank 1's line.
    assert stdout.splitlines() == ["[rank1]:rank 1 of 2 done"]


NODE = """
import json
import os

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
total = torch.tensor([float(dist.get_rank())])
dist.all_reduce(total)
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE")
print(json.dumps({**{k: int(os.environ[k]) for k in keys}, "rank": dist.get_rank(), "sum": total.item()}))
dist.destroy_process_group()
"""


@pytest.mark.real
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_agents_meet_through_the_c10d_rendezvous(tmp_path: Path) -> None:
    script = tmp_path / "node.py"
    script.write_text(NODE)
    endpoint = f"127.0.0.1:{real.free_port()}"
    common = ["--nproc", "2", "--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint]
    # One node is a `python -m real` of its own; the other runs in this process through the Python API.
    other = subprocess.Popen(
        [sys.executable, "-m", "real", str(script), *common, "--rdzv-id", "job7", "--timeout", "200"],
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        here = real.run_script(
            script, 2, entry=None, timeout=200,
            rendezvous=Rendezvous(nnodes=2, endpoint=endpoint, backend="c10d", run_id="job7"),
        )  # fmt: skip
        stdout, stderr = other.communicate(timeout=120)
    finally:
        other.kill()
    assert other.returncode == 0, stderr[-3000:]
    seen = [json.loads(line.partition("]:")[2]) for line in stdout.splitlines()]
    assert len(seen) == 2 and len(here.ranks) == 2
    ranks = sorted([*here.ranks, *(s["rank"] for s in seen)])
    assert ranks == [0, 1, 2, 3]
    assert here.returns == [None, None] and here.backend == "gloo" and here.nproc == 2
    for record in seen:
        assert (
            record["WORLD_SIZE"] == 4 and record["LOCAL_WORLD_SIZE"] == 2 and record["GROUP_WORLD_SIZE"] == 2
        )
        assert record["RANK"] == record["rank"] == 2 * record["GROUP_RANK"] + record["LOCAL_RANK"]
        assert record["sum"] == 0 + 1 + 2 + 3
    # The prefix names each line's global rank; the two nodes hold disjoint, consecutive ranks.
    other_ranks = sorted(s["rank"] for s in seen)
    assert other_ranks in ([0, 1], [2, 3]) and set(other_ranks).isdisjoint(here.ranks)
    assert sorted(line.partition("]:")[0] for line in stdout.splitlines()) == [
        f"[rank{r}" for r in other_ranks
    ]


# --- the command line, without launching ------------------------------------------------------------


@pytest.fixture
def planned(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """Capture what ``python -m real`` would launch, instead of launching it."""
    calls: list[tuple] = []

    def capture(target: object, backend: object, options: object) -> None:
        calls.append((target, backend, options))
        raise real.RealRunError("not launched")

    monkeypatch.setattr(cli, "launch", capture)
    return calls


def test_the_scripts_arguments_follow_the_first_double_dash(planned: list[tuple], tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    assert cli.main([str(script), "--nproc", "3", "--", "--lr", "3", "--", "--nproc", "9"]) == 1
    target, _backend, options = planned[-1]
    assert target == MainTarget(str(script), ("--lr", "3", "--", "--nproc", "9"))
    assert options.nproc == 3 and options.console.prefix and options.console.local_ranks is None
    # torchrun's spellings of the same options
    assert (
        cli.main(["--nproc_per_node", "2", "--node_rank", "0", str(script), "--local_ranks_filter", "0,1"])
        == 1
    )
    assert planned[-1][2].nproc == 2 and planned[-1][2].console.local_ranks == {0, 1}
    assert cli.main([str(script), "--nproc-per-node", "2", "--no-prefix"]) == 1
    assert not planned[-1][2].console.prefix


def test_entry_runs_a_function_with_the_scripts_arguments(planned: list[tuple], tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("def step():\n    return 1\n")
    assert cli.main([str(script), "--nproc", "2", "--entry", "step", "--backend", "gloo", "--", "x"]) == 1
    target, backend, _options = planned[-1]
    assert target == ScriptTarget(str(script), "step", ("x",)) and backend == "gloo"


def test_an_entry_script_s_top_level_sees_its_own_arguments_when_checked(
    planned: list[tuple], tmp_path: Path
) -> None:
    # The launcher loads the script once to check its entry; its top level parses the script's arguments then.
    script = tmp_path / "train.py"
    script.write_text(
        "import argparse\nimport sys\n\nparser = argparse.ArgumentParser()\n"
        "parser.add_argument('--lr', type=float, required=True)\nLR = parser.parse_args().lr\n\n\n"
        "def main():\n    return LR\n"
    )
    saved = list(sys.argv)
    assert cli.main([str(script), "--nproc", "2", "--entry", "main", "--", "--lr", "3"]) == 1  # launched
    assert sys.argv == saved
    assert planned[-1][0] == ScriptTarget(str(script), "main", ("--lr", "3"))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--backend", "nccl"], "--backend nccl chooses the group real creates around an entry function"),
        (["--local-ranks-filter", "0,x"], "--local-ranks-filter takes local ranks separated by commas"),
        (["--local-ranks-filter", "2"], r"local ranks to show must be some of 0..1"),
        (["--nnodes", "2"], "a launch on 2 nodes needs the rendezvous endpoint"),
        (["--nnodes", "2", "--node-rank", "2", "--master-port", "29500"], r"node_rank must be in 0..1"),
        (["--nnodes", "2", "--rdzv-endpoint", "h:port"], r"rendezvous endpoint 'h:port' is not HOST:PORT"),
        (["--nnodes", "2", "--rdzv-endpoint", "h"], "names no port"),
        (["--master-port", "1", "--rdzv-endpoint", "h:2"], "name the meeting point once"),
        (["--master-addr", "10.0.0.1"], "needs --master-port"),
        (
            ["--standalone", "--nnodes", "2", "--rdzv-endpoint", "h:1"],
            r"--standalone runs one node .*, but --nnodes, --rdzv-endpoint are given",
        ),
        (["--standalone", "--master-port", "29500"], r"but --master-port is given: drop --standalone"),
    ],
)
def test_options_no_launch_could_use_exit_2(
    planned: list[tuple], tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    assert cli.main([str(script), "--nproc", "2", *argv]) == 2
    assert not planned
    err = capsys.readouterr().err
    assert err.startswith("python -m real: error: ") and re.search(message, err), err


@pytest.mark.parametrize("text", ["1", "3", "cpu", "auto", "gpu", "two", "-1x"])
def test_nproc_per_node_reads_as_torchrun_reads_it(
    planned: list[tuple], tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str
) -> None:
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    try:  # the oracle: torchrun's own reading of --nproc-per-node
        expected: int | None = determine_local_world_size(text)
    except ValueError:
        expected = None
    if expected is None:
        with pytest.raises(SystemExit) as exited:
            cli.main([str(script), "--nproc-per-node", text])
        assert exited.value.code == 2 and "argument --nproc/--nproc-per-node" in capsys.readouterr().err
        assert not planned
    else:
        assert cli.main([str(script), "--nproc-per-node", text]) == 1  # planned, not launched
        assert planned[-1][2].nproc == expected


def test_arguments_after_the_script_without_double_dash_are_refused_saying_where_they_go(
    planned: list[tuple], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    # torchrun's habit: the script's arguments right after it; here they follow `--`, as for simdist run.
    with pytest.raises(SystemExit) as exited:
        cli.main(["--nproc-per-node", "2", str(script), "3", "--lr", "1e-3"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and not planned
    assert (
        f"unrecognized arguments: 3 --lr 1e-3; the script's own arguments follow `--`: python -m real {script} "
        "[options] -- 3 --lr 1e-3" in err
    ), err
    # An option real does not have, before the script, is only that.
    with pytest.raises(SystemExit):
        cli.main(["--max-restarts=3", str(script), "--nproc", "2"])
    err = capsys.readouterr().err
    assert "unrecognized arguments: --max-restarts=3\n" in err and "follow `--`" not in err, err


def test_only_an_entry_function_is_bounded_in_time_by_default(planned: list[tuple], tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("def main():\n    return 1\n")
    # torchrun kills no run for its length: a training script may run for days.
    assert cli.main([str(script), "--nproc", "2"]) == 1
    assert planned[-1][2].timeout == MAX_TIMEOUT
    meeting = planned[-1][2].rendezvous.settings("127.0.0.1:1", planned[-1][2].timeout)
    assert meeting["rdzv_configs"]["timeout"] == RDZV_TIMEOUT == 600  # torchrun's rendezvous default
    assert cli.main([str(script), "--nproc", "2", "--entry", "main"]) == 1
    assert planned[-1][2].timeout == 300.0  # as real.run's
    assert cli.main([str(script), "--nproc", "2", "--timeout", "7.5"]) == 1
    assert planned[-1][2].timeout == 7.5


def test_standalone_is_one_node_on_a_free_port(planned: list[tuple], tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    assert cli.main(["--standalone", "--nproc-per-node", "2", str(script)]) == 1
    assert planned[-1][2].rendezvous == Rendezvous() and planned[-1][2].rendezvous.needs_port


def test_a_torchrun_style_script_is_checked_before_launching(planned: list[tuple], tmp_path: Path) -> None:
    with pytest.raises(ScriptError, match="not found"):
        real.run_script(tmp_path / "absent.py", 2, entry=None)
    broken = tmp_path / "broken.py"
    broken.write_text("x = (\n")
    with pytest.raises(ScriptError, match=r"is not valid Python:\n  File .*broken\.py"):
        real.run_script(broken, 2, entry=None)
    ok = tmp_path / "ok.py"
    ok.write_text("raise SystemExit('its top level is not run here')\n")
    with pytest.raises(RealConfigError, match="argv must be a list of strings"):
        real.run_script(ok, 2, entry=None, argv="--lr 3")  # type: ignore[arg-type]
    with pytest.raises(RealConfigError, match="pass argv"):
        real.run_script(ok, 2, entry=None, args=(1,))
    with pytest.raises(RealConfigError, match="backend 'nccl' chooses the group real creates"):
        real.run_script(ok, 2, backend="nccl", entry=None)


# --- rendezvous ---------------------------------------------------------------------------------------


@given(nnodes=st.integers(1, 64), data=st.data())
def test_static_nodes_share_what_they_meet_by_and_know_their_ranks(nnodes: int, data: st.DataObject) -> None:
    port = data.draw(st.integers(1, 65535))
    nproc = data.draw(st.integers(1, 8))
    endpoint = f"10.1.2.3:{port}"
    nodes = [Rendezvous(nnodes=nnodes, node_rank=r, endpoint=endpoint, run_id="j") for r in range(nnodes)]
    settings = [node.settings(node.endpoint_with(None), 30) for node in nodes]
    # Each agent's keys in the store are prefixed by the run id: every node must use the same.
    assert {s["run_id"] for s in settings} == {"j"} and {s["rdzv_endpoint"] for s in settings} == {endpoint}
    assert [s["rdzv_configs"]["rank"] for s in settings] == list(range(nnodes))
    # The global ranks of the nodes' processes tile 0..world-1, as the static rendezvous assigns them.
    ranks = [r for node in nodes for r in node.local_ranks(nproc)]  # type: ignore[union-attr]
    assert ranks == list(range(nnodes * nproc))
    # A remote endpoint: the host name is looked up, not the loopback address assumed.
    assert {s["local_addr"] for s in settings} == {None}


def test_rendezvous_defaults_and_refusals() -> None:
    single = Rendezvous()
    assert single.needs_port and single.endpoint_with(4242) == "127.0.0.1:4242"
    assert single.settings("127.0.0.1:4242", 9.2)["rdzv_configs"] == {"rank": 0, "timeout": 10}
    c10d_node = Rendezvous(nnodes=3, node_rank=5, endpoint="localhost", backend="c10d")  # node_rank unused
    assert c10d_node.endpoint_with(None) == f"localhost:{C10D_PORT}" and c10d_node.local_ranks(2) is None
    assert c10d_node.settings(c10d_node.endpoint_with(None), 60)["local_addr"] == "127.0.0.1"
    for kwargs, match in [
        ({"nnodes": 0}, "nnodes must be at least 1"),
        ({"nnodes": True}, "nnodes must be an int"),
        ({"backend": "etcd"}, "rendezvous backend 'etcd' is not supported"),
        ({"run_id": ""}, "run_id must be a non-empty string"),
        ({"endpoint": "h:70000"}, r"endpoint 'h:70000' is not HOST:PORT \(.*between 0 and 65536"),
        ({"endpoint": "h:0"}, r"port 0 is not in 1\.\.65535"),
    ]:
        with pytest.raises(RealConfigError, match=match):
            Rendezvous(**kwargs)
    with pytest.raises(RealConfigError, match="both name the meeting point"):
        real.run(test_rendezvous_defaults_and_refusals, 1, master_port=5, rendezvous=Rendezvous(2, 0, "h:1"))


# --- rank code's own init_process_group ---------------------------------------------------------------

DEVICES = st.sampled_from(["cpu", "cuda"])
NAMES = st.sampled_from(["gloo", "nccl", "GLOO", "Nccl"])


@given(st.one_of(NAMES, st.dictionaries(DEVICES, NAMES, min_size=1)))
def test_the_backends_a_call_names_are_those_torch_reads(backend: str | dict[str, str]) -> None:
    text = backend if isinstance(backend, str) else ",".join(f"{d}:{b}" for d, b in backend.items())
    # Oracle: torch's own parsing of init_process_group's backend argument into a device -> backend map.
    torch_reads = set(c10d.BackendConfig(dist.Backend(text)).get_device_backend_map().values())
    if isinstance(backend, str):  # one name stands for every device it supports
        assert backends_named(text) == {text.lower()} and torch_reads <= {text.lower()}
    else:
        assert backends_named(text) == torch_reads


def test_a_call_that_asks_for_real_s_group_is_accepted_and_any_other_named() -> None:
    assert conflict({}, "gloo", 1, 2) is None
    assert (
        conflict({"backend": "cpu:gloo", "rank": 1, "world_size": 2, "init_method": "env://"}, "gloo", 1, 2)
        is None
    )
    assert conflict({"backend": dist.Backend.GLOO}, "gloo", 0, 2) is None
    both = conflict({"backend": "cpu:gloo,cuda:nccl"}, "gloo", 0, 2)
    assert both is not None and "backend 'gloo'" in both and "'cpu:gloo,cuda:nccl'" in both
    assert "the group real created has 2 processes" in (conflict({"world_size": 3}, "gloo", 0, 2) or "")
    assert "this process is rank 1 (RANK=1" in (conflict({"rank": 0}, "gloo", 1, 2) or "")


def test_every_way_of_naming_init_process_group_reaches_the_handler(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple] = []
    before = c10d.init_process_group.__closure__[0].cell_contents  # type: ignore[index]
    with intercepted(lambda init, args, kwargs: calls.append((init.__name__, args, kwargs))):
        dist.init_process_group("gloo")
        c10d.init_process_group(backend="nccl")
        bound_before("cpu:gloo", world_size=4)  # bound at this module's import, long before
    assert calls == [
        ("init_process_group", ("gloo",), {}),
        ("init_process_group", (), {"backend": "nccl"}),
        ("init_process_group", ("cpu:gloo",), {"world_size": 4}),
    ]
    assert c10d.init_process_group.__closure__[0].cell_contents is before  # type: ignore[index]
    assert not dist.is_initialized()
    # A torch whose wrapper is shaped otherwise: the module attributes are replaced instead, then restored.
    monkeypatch.setattr("real.init_guard._wrapped_cell", lambda public: None)
    public = dist.init_process_group
    with intercepted(lambda init, args, kwargs: calls.append(args)):
        dist.init_process_group("x")
        c10d.init_process_group("y")
    assert calls[-2:] == [("x",), ("y",)] and dist.init_process_group is c10d.init_process_group is public


# --- exit statuses ------------------------------------------------------------------------------------


def test_a_rank_s_exit_status_is_the_one_python_exits_with() -> None:
    codes = ["None", "0", "3", "256", "-1", "True", "'bad input'"]
    threads, statuses = [], {}

    def python_exits(code: str) -> None:
        done = subprocess.run(
            [sys.executable, "-c", f"raise SystemExit({code})"], capture_output=True, check=False
        )
        statuses[code] = done.returncode

    for code in codes:  # the oracle: real interpreters, started side by side
        threads.append(threading.Thread(target=python_exits, args=(code,)))
        threads[-1].start()
    for thread in threads:
        thread.join(60)
    assert {code: exit_status(SystemExit(eval(code))) for code in codes} == statuses


def test_timeline_options_reach_the_launch(planned: list[tuple], tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    assert cli.main([str(script), "--nproc", "2", "--timeline", str(tmp_path / "tl"), "--profile"]) == 1
    assert planned[-1][2].timeline == TimelineOptions(str(tmp_path / "tl"), profile=True)
    assert cli.main([str(script), "--nproc", "2"]) == 1
    assert planned[-1][2].timeline is None
