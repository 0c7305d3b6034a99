"""Race findings inside torch's own code name torch's line and the user's; race waivers by call site."""

from __future__ import annotations

import inspect
import os
import pickle
import re
import traceback
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from test_cli_and_scenarios import RACY  # a script with two in-place all-reduces in flight on one buffer
from torch.distributed.pipelining import ScheduleGPipe, SplitPoint, pipeline
from torch.distributed.pipelining import schedules as pp_schedules

import simdist
import simdist.cli
from simdist import RaceError, RaceWarning
from simdist.clock.sites import TORCH_DIR, Site, caller_site
from simdist.comm.waivers import parse_waiver, parse_waivers

WIDTH, LAYERS, BATCH, MICROBATCHES = 8, 4, 8, 4
WARMUP = "torch/distributed/pipelining/schedules.py:_warmup_p2p"


def cpu(n: int) -> simdist.Cluster:
    return simdist.Cluster.switch(n, bandwidth="10GB/s", latency="5us", device="cpu")


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def data() -> tuple[MLP, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return MLP(), torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)


def _pipeline_rank() -> tuple[dict[str, torch.Tensor], torch.Tensor | None, list[torch.Tensor]]:
    """torch's tracer frontend: split evenly, one stage per rank, GPipe over MICROBATCHES microbatches."""
    rank, n = dist.get_rank(), dist.get_world_size()
    model, x, y = data()
    per = LAYERS // n
    split = {f"layers.{i}": SplitPoint.BEGINNING for i in range(per, LAYERS, per)}
    with warnings.catch_warnings():  # torch's tracer warns about its own pytree internals
        warnings.simplefilter("ignore", FutureWarning)
        pipe = pipeline(model, mb_args=(x.chunk(MICROBATCHES)[0],), split_spec=split)
    stage = pipe.build_stage(rank, torch.device("cpu"))
    schedule = ScheduleGPipe(stage, MICROBATCHES, loss_fn=F.mse_loss)
    out, losses = None, []
    if rank == 0:
        schedule.step(x)  # LINE first
    elif rank == n - 1:
        out = schedule.step(target=y, losses=losses)
    else:
        schedule.step()  # LINE middle
    return {k: p.grad for k, p in stage.submod.named_parameters()}, out, losses


def reference() -> tuple[dict[str, torch.Tensor], torch.Tensor, list[torch.Tensor]]:
    """The same model on one process: GPipe's loss per microbatch, gradients averaged over microbatches."""
    model, x, y = data()
    outs, losses = [], []
    for xm, ym in zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES)):
        outs.append(model(xm))
        losses.append(F.mse_loss(outs[-1], ym))
    (sum(losses) / MICROBATCHES).backward()
    return {k: p.grad for k, p in model.named_parameters()}, torch.cat(outs), losses


def check_against_reference(res: simdist.RunResult) -> None:
    grads, out, losses = reference()
    n = res.world_size
    got = {}
    for rank_grads, _, _ in res.returns:
        got.update(rank_grads)
    assert sorted(got) == sorted(grads)
    torch.testing.assert_close(got, grads)
    _, last_out, last_losses = res.returns[n - 1]
    torch.testing.assert_close(last_out.detach(), out.detach())
    torch.testing.assert_close(torch.stack(last_losses).detach(), torch.stack(losses).detach())


def marked_line(fn: object, marker: str) -> int:
    """The line of ``fn``'s source carrying ``# LINE marker``."""
    lines, first = inspect.getsourcelines(fn)
    return first + next(i for i, text in enumerate(lines) if f"# LINE {marker}" in text)


def torch_issue_line() -> int:
    """The line of torch's ``_batch_p2p`` that issues a mixed batch of sends and receives."""
    lines, first = inspect.getsourcelines(pp_schedules._batch_p2p)
    return first + next(i for i, text in enumerate(lines) if "dist.batch_isend_irecv(p2p_ops)" in text)


def test_two_stages_post_one_receive_per_buffer_and_match_the_single_process_model():
    res = simdist.run(_pipeline_rank, cpu(2), races="error")
    assert res.races == [] and res.waived_races == []
    check_against_reference(res)


def test_the_warmups_two_receives_into_one_tensor_name_torchs_line_and_the_users():
    with pytest.raises(RaceError) as e:
        simdist.run(_pipeline_rank, cpu(4), races="error")
    text = str(e.value)
    site = (
        f"torch/distributed/pipelining/schedules.py:{torch_issue_line()} in _batch_p2p, "
        f"called from {__file__}:{marked_line(_pipeline_rank, 'middle')} in _pipeline_rank"
    )
    assert re.search(r"race on rank [12]: two operations in flight", text)
    assert f"first:  recv on group 0, issued at 0 s from {site}\n" in text
    assert f"second: recv on group 0, issued at 0 s from {site}\n" in text


def test_warnings_point_at_the_users_line_and_every_middle_stage_is_recorded():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = simdist.run(_pipeline_rank, cpu(4), races="warn")
    found = [w for w in caught if issubclass(w.category, RaceWarning)]
    assert len(found) == 1  # one pair of call sites
    assert (found[0].filename, found[0].lineno) == (__file__, marked_line(_pipeline_rank, "middle"))
    assert sorted(r.rank for r in res.races) == [1, 2]  # the first and last stages receive from one side only
    frames = res.races[0].first.site.frames
    assert [f[2] for f in frames[:2]] == ["_batch_p2p", "_warmup_p2p"]  # torch's frames, innermost first
    assert frames[-1] == res.races[0].first.site.user == (__file__, marked_line(_pipeline_rank, "middle"), "_pipeline_rank")


def _last_stage_skips_the_step() -> None:
    if dist.get_rank() == 0:
        _pipeline_rank()


def test_other_diagnoses_name_torchs_line_and_the_users_too():
    with pytest.raises(simdist.DeadlockError) as e:
        simdist.run(_last_stage_skips_the_step, cpu(2), races="error")
    site = (
        f"issued at torch/distributed/pipelining/schedules.py:{torch_issue_line()} in _batch_p2p, "
        f"called from {__file__}:{marked_line(_pipeline_rank, 'first')} in _pipeline_rank)"
    )
    assert site in str(e.value)


@pytest.mark.parametrize("n", [2, 4])
def test_with_the_warmup_waived_the_pipeline_passes_under_error_and_matches_the_reference(n):
    if n == 2:  # nothing to waive at two stages: the waiver is reported unused
        with pytest.warns(RaceWarning, match=f"race waiver '{WARMUP}' named no race in this run"):
            res = simdist.run(_pipeline_rank, cpu(n), races="error", race_waivers=[WARMUP])
        assert res.unused_waivers == [WARMUP]
    else:
        res = simdist.run(_pipeline_rank, cpu(n), races="error", race_waivers=[WARMUP])
        assert res.unused_waivers == []
    assert res.races == []
    assert sorted(r.rank for r in res.waived_races) == ([1, 2] if n == 4 else [])
    assert all(r.waived_by == (WARMUP,) and r.kind == "overlap" for r in res.waived_races)
    check_against_reference(res)
    if n == 4:
        assert "(2 findings waived by race_waivers" in res.race_summary()
        assert f"waived by race_waivers ['{WARMUP}']" in str(res.waived_races[0])


@pytest.mark.parametrize(
    "waiver",
    ["schedules.py", "pipelining/schedules.py:_batch_p2p", "schedules.py:_warmup_p2p", "test_races_torch_sites.py:_pipeline_rank"],
)
def test_a_waiver_names_a_site_by_any_of_its_frames(waiver):
    res = simdist.run(_pipeline_rank, cpu(4), races="error", race_waivers=[waiver])
    assert res.races == [] and len(res.waived_races) == 2


@pytest.mark.parametrize(
    "waiver",
    [
        "stage.py",  # built there, issued from schedules.py: not on the stack
        "edules.py",  # suffixes match whole path components
        "schedules.py:_step_microbatches_typo",
        "schedules.py:1",
        "torch/distributed/pipelining/schedules.py:1:_initialize_stage",  # that function is on the stack, line 1 is not
        "other_file.py:_pipeline_rank",
    ],
)
def test_a_waiver_that_names_no_frame_of_the_race_leaves_it_an_error(waiver):
    with pytest.raises(RaceError, match="two operations in flight"):
        simdist.run(_pipeline_rank, cpu(4), races="error", race_waivers=[waiver])


def _access() -> float:
    g = torch.ones(64)
    work = dist.all_reduce(g, async_op=True)  # LINE op
    total = _reads(g)
    work.wait()
    return total


def _reads(g: torch.Tensor) -> float:
    return float(g.sum())  # LINE access


def test_every_side_of_a_race_must_be_named_by_a_waiver():
    op, access = "test_races_torch_sites.py:_access", "test_races_torch_sites.py:_reads"
    with pytest.raises(RaceError, match=r"rank code read \(in aten.sum"):
        simdist.run(_access, cpu(2), races="error", race_waivers=[op])
    with pytest.raises(RaceError, match=r"rank code read \(in aten.sum"):
        simdist.run(_access, cpu(2), races="error", race_waivers=[access])
    line = marked_line(_access, "op")
    res = simdist.run(_access, cpu(2), races="error", race_waivers=[access, f"test_races_torch_sites.py:{line}"])
    assert res.returns == [64.0, 64.0] and res.races == []  # the read still races: it saw the unreduced ones
    assert [r.waived_by for r in res.waived_races] == [(f"test_races_torch_sites.py:{line}", access)] * 2


def test_waivers_are_not_reported_unused_when_nothing_is_checked_or_the_run_fails():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert simdist.run(_access, cpu(2), races="off", race_waivers=["x.py"]).unused_waivers == []
        with pytest.raises(RaceError):
            simdist.run(_access, cpu(2), races="error", race_waivers=["x.py"])


def _optimizer_reads_in_flight_gradient() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)
    model(torch.randn(3, 4)).sum().backward()
    works = []
    for p in model.parameters():
        works.append(dist.all_reduce(p.grad, async_op=True))  # LINE grads
    opt.step()  # LINE step
    for w in works:
        w.wait()


def test_an_access_inside_torch_names_torchs_line_and_the_users_and_a_direct_call_the_users_alone():
    with pytest.raises(RaceError) as e:
        simdist.run(_optimizer_reads_in_flight_gradient, cpu(2), races="error")
    text = str(e.value)
    op_line, step_line = marked_line(_optimizer_reads_in_flight_gradient, "grads"), marked_line(_optimizer_reads_in_flight_gradient, "step")
    me = "_optimizer_reads_in_flight_gradient"
    assert f"(issued at 0 s from {__file__}:{op_line} in {me}) owns it" in text  # the user called it: one line
    assert re.search(
        rf"access at: torch/optim/sgd\.py:\d+ in _single_tensor_sgd, called from {re.escape(__file__)}:{step_line} in {me}$",
        text,
        re.MULTILINE,
    )


# ---------------------------------------------------------------------- sites

#: code compiled as if it were torch's: ``issue`` issues an operation inside torch, ``via_a``/``via_b`` are
#: two torch paths to it, ``entry`` a public entry point the user calls
_TORCH_CODE = {
    "distributed/pipelining/schedules.py": "def issue(probe):\n    return probe()\n\n\ndef via_a(probe):\n    return issue(probe)\n\n\ndef via_b(probe):\n    return issue(probe)\n",
    "distributed/distributed_c10d.py": "def entry(probe):\n    return probe()\n",
}


#: stands for the simulator's own frames between the operation and torch: passed over, recording the stack
_PROBE = "def probe():\n    stacks.append(traceback.extract_stack()[:-1])\n    return caller_site(('/simdist-probe/',))\n"


def _torch_functions(stacks: list) -> dict:
    scope: dict = {"stacks": stacks, "traceback": traceback, "caller_site": caller_site}
    for rel, src in _TORCH_CODE.items():
        exec(compile(src, TORCH_DIR + rel, "exec"), scope)  # noqa: S102
    exec(compile(_PROBE, "/simdist-probe/probe.py", "exec"), scope)  # noqa: S102
    return scope


def test_a_sites_frames_are_the_stacks_torch_frames_then_the_users_and_each_path_is_its_own_site():
    stacks: list = []
    fns = _torch_functions(stacks)
    sites = []
    for _ in range(2):  # the second round is answered from the table of sites
        sites.append(fns["via_a"](fns["probe"]))  # LINE via a
        sites.append(fns["via_b"](fns["probe"]))
        sites.append(fns["entry"](fns["probe"]))
    me = "test_a_sites_frames_are_the_stacks_torch_frames_then_the_users_and_each_path_is_its_own_site"
    for site, stack in zip(sites, stacks):
        user = max(i for i, f in enumerate(stack) if f.name == me)
        # innermost first: torch's frames outside its entry points, then the user's (the probe is the simulator)
        want = [f for f in reversed(stack[user:]) if "distributed_c10d" not in f.filename]
        assert site.frames == tuple((f.filename, f.lineno, f.name) for f in want)
        assert site.user == site.frames[-1] and site.user[2] == me
    a, b, entry = sites[:3]
    line = marked_line(test_a_sites_frames_are_the_stacks_torch_frames_then_the_users_and_each_path_is_its_own_site, "via a")
    assert a == f"torch/distributed/pipelining/schedules.py:2 in issue, called from {__file__}:{line} in {me}"
    assert [f[2] for f in a.frames] == ["issue", "via_a", me] and [f[2] for f in b.frames] == ["issue", "via_b", me]
    assert entry == f"{__file__}:{line + 2} in {me}"  # through an entry point: the user's line alone
    assert sites[3:] == sites[:3] and all(x is y for x, y in zip(sites[3:], sites[:3]))
    assert pickle.loads(pickle.dumps(a)).frames == a.frames


# ---------------------------------------------------------------------- waiver patterns


@given(
    dirs=st.lists(st.from_regex(r"[a-z_][a-z0-9_]{0,6}", fullmatch=True), max_size=3),
    name=st.from_regex(r"[a-z_][a-z0-9_]{0,6}", fullmatch=True),
    line=st.none() | st.integers(1, 10**6),
    function=st.none() | st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,8}", fullmatch=True),
)
def test_a_pattern_names_exactly_the_frames_under_its_path_line_and_function(dirs, name, line, function):
    path = "/".join([*dirs, f"{name}.py"])
    text = path + (f":{line}" if line is not None else "") + (f":{function}" if function is not None else "")
    w = parse_waiver(text)
    assert (w.path, w.line, w.function) == (os.path.normpath(path), line, function)
    at_line, in_function = line or 7, function or "f"
    here = f"/root/{path}"
    assert w.matches((here, at_line, in_function))
    assert w.matches((path, at_line, in_function))
    assert not w.matches((f"/root/x{path}", at_line, in_function))  # a longer last component is another file
    assert not w.matches((f"/root/{path}x", at_line, in_function))
    assert w.matches((here, at_line + 1, in_function)) == (line is None)
    assert w.matches((here, at_line, in_function + "_")) == (function is None)
    assert not w.matches_site(text)  # plain text carries no frames
    assert w.matches_site(Site("x", (("/elsewhere.py", 1, "g"), (here, at_line, in_function)), None))


def test_torch_frames_are_shown_relative_to_torchs_parent_and_matched_by_their_absolute_path():
    w = parse_waiver("torch/distributed/pipelining/schedules.py")
    assert w.matches((TORCH_DIR + "distributed/pipelining/schedules.py", 648, "_batch_p2p"))


@pytest.mark.parametrize(
    ("given_", "message"),
    [
        ("schedules.py", "must be a list of site patterns, got the string 'schedules.py'; write race_waivers=['schedules.py']"),
        ({"schedules.py"}, "must be a list of site patterns (strings), got set"),
        (["a.py", 3], "race_waivers[1] must be a site pattern string"),
        (["a.py", "a.py"], "lists 'a.py' twice"),
        ([""], "'' does not name a Python file"),
        (["_batch_p2p"], "'_batch_p2p' does not name a Python file"),
        ([":12"], "'' does not name a Python file"),
        (["../a.py"], "'../a.py' does not name a Python file"),
        (["a.py:0"], "line 0 does not exist"),
        (["a.py:Cls.fn"], "'Cls.fn' is not a line number or a function's name (a method is named alone"),
        (["a.py:fn:12"], "'fn' is not a line number"),
        (["a.py:12:34"], "'34' is not a function's name"),
        (["a.py:1:f:g"], "has 4 ':'-separated parts"),
        (["a.py:"], "'' is not a line number or a function's name"),
    ],
)
def test_bad_waivers_are_refused_before_the_run_saying_what_was_expected(given_, message):
    with pytest.raises(simdist.RunArgumentError) as e:
        simdist.run(_access, cpu(2), races="error", race_waivers=given_)
    assert message in str(e.value)
    if not isinstance(given_, (str, set)) and not any(isinstance(g, int) for g in given_) and "twice" not in message:
        assert "PATH[:LINE][:FUNCTION]" in str(e.value)


def test_named_code_objects_and_tuples_are_accepted():
    assert parse_waivers(("<string>:3:<module>", "a.py:<lambda>")) == (
        parse_waiver("<string>:3:<module>"),
        parse_waiver("a.py:<lambda>"),
    )
    assert parse_waivers(None) == () and parse_waivers([]) == ()


# ---------------------------------------------------------------------- the command line


def test_simdist_run_waives_races_by_site_and_reports_unused_and_bad_patterns(tmp_path, capsys):
    script = tmp_path / "racy.py"
    script.write_text(RACY)
    base = ["run", str(script), "--entry", "main", "--world-size", "2", "--races", "error"]
    assert simdist.cli.main(base) == 1
    assert "race on rank 0: two operations in flight" in capsys.readouterr().err
    assert simdist.cli.main([*base, "--waive-race", "racy.py:main"]) == 0
    out = capsys.readouterr()
    assert "no races found\n(2 findings waived by race_waivers ['racy.py:main']" in out.out
    assert out.err == ""
    assert simdist.cli.main([*base, "--waive-race", "racy.py:6", "--waive-race", "racy.py:7", "--waive-race", "racy.py:9"]) == 0
    err = capsys.readouterr().err
    assert "--waive-race 'racy.py:9' named no race in this run" in err and "racy.py:6'" not in err
    assert simdist.cli.main([*base, "--races", "warn", "--waive-race", "racy.py:6"]) == 3  # the other side is not named
    assert "on ranks 0-1 (2 findings)" in capsys.readouterr().out
    assert simdist.cli.main([*base, "--waive-race", "racy"]) == 2
    assert "simdist: error: race waiver 'racy': 'racy' does not name a Python file" in capsys.readouterr().err


#: code compiled as if it were a library's that issues operations for the user (simdist's strategies), and a
#: probe (standing for the simulator) that asks for the site with and without naming that library
_LIBRARY_CODE = "def wrapper_step(probe, library):\n    return probe(library)\n"
_LIBRARY_PROBE = "def probe(library):\n    return caller_site(('/simdist-probe/',), library)\n"


def test_a_librarys_frame_comes_before_the_users_and_is_the_user_to_a_caller_that_names_no_library():
    scope: dict = {"caller_site": caller_site}
    exec(compile(_LIBRARY_CODE, "/lib-probe/strategy.py", "exec"), scope)  # noqa: S102
    exec(compile(_LIBRARY_PROBE, "/simdist-probe/probe.py", "exec"), scope)  # noqa: S102
    me = "test_a_librarys_frame_comes_before_the_users_and_is_the_user_to_a_caller_that_names_no_library"
    line = marked_line(test_a_librarys_frame_comes_before_the_users_and_is_the_user_to_a_caller_that_names_no_library, "call")
    for _ in range(2):  # the second round is answered from the table of sites: each caller keeps its own
        named = scope["wrapper_step"](scope["probe"], ("/lib-probe/",))  # LINE call
        unnamed = scope["wrapper_step"](scope["probe"], ())
        assert named == f"/lib-probe/strategy.py:2 in wrapper_step, called from {__file__}:{line} in {me}"
        assert named.user == (__file__, line, me) and named.frames[0] == ("/lib-probe/strategy.py", 2, "wrapper_step")
        assert unnamed == "/lib-probe/strategy.py:2 in wrapper_step" and unnamed.user == named.frames[0]
