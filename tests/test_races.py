"""The in-flight buffer race detector: overlapping operations, rank code touching owned buffers, modes."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

import simdist
from simdist import RaceError, RaceWarning
from simdist.options import default_race_mode


def switch(n: int) -> simdist.Cluster:
    return simdist.Cluster.switch(n, bandwidth="10GB/s", latency="5us", device="cpu")


def _read_before_wait():
    g = torch.ones(1000)
    w = dist.all_reduce(g, async_op=True)
    y = g * 2  # LINE read
    w.wait()
    return y.sum().item()


def test_reading_a_buffer_before_wait_is_an_error_naming_op_site_and_access():
    with pytest.raises(RaceError) as e:
        simdist.run(_read_before_wait, switch(2), races="error")
    text = str(e.value)
    assert "rank code read (in aten.mul.Tensor)" in text
    assert "all_reduce #0" in text and "test_races.py" in text and "_read_before_wait" in text
    assert "wait()" in text  # says what to do


def test_the_check_rides_on_the_compute_cost_mode_when_compute_is_charged():
    cluster = simdist.Cluster.switch(2, bandwidth="10GB/s", latency="5us", device="H100")
    with pytest.warns(RaceWarning, match=r"rank code read \(in aten.mul.Tensor\)"):
        res = simdist.run(_read_before_wait, cluster, races="warn")
    assert sorted(r.rank for r in res.races) == [0, 1] and res.sim_time > 0
    assert any(s.stream == "compute" for s in res.trace.spans)  # the op was charged too


def test_warn_mode_warns_once_per_site_pair_and_records_every_rank():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = simdist.run(_read_before_wait, switch(4), races="warn")
    races = [w for w in caught if issubclass(w.category, RaceWarning)]
    assert len(races) == 1
    assert races[0].filename.endswith("test_races.py")  # points at the user's line, not at simdist
    assert sorted(r.rank for r in res.races) == [0, 1, 2, 3]
    assert {r.kind for r in res.races} == {"access"}
    assert "on ranks 0-3 (4 findings)" in res.race_summary()
    # the read happened at the issue time: the window is [issue, access]
    start, end = res.races[0].window
    assert start == end == res.races[0].first.issued_at


def test_off_mode_checks_nothing_and_default_follows_pytest_and_env(monkeypatch):
    assert simdist.run(_read_before_wait, switch(2), races="off").races == []
    assert default_race_mode() == "error"  # we are inside a pytest test
    monkeypatch.setenv("SIMDIST_RACES", "warn")
    assert default_race_mode() == "warn"
    with pytest.raises(ValueError, match="races must be one of"):
        simdist.run(_read_before_wait, switch(2), races="loud")


def _correct_patterns():
    r = dist.get_rank()
    a = torch.full((64,), float(r))
    w = dist.all_reduce(a, async_op=True)
    v = a.view(8, 8)  # views and metadata read no data
    _ = torch.empty_like(a), a.shape, a.detach()
    w.wait()
    out = [v.sum().item()]
    b = torch.full((64,), float(r))
    fut = dist.all_reduce(b, async_op=True).get_future()
    fut.wait()
    out.append(b.sum().item())
    c = torch.full((64,), float(r))
    chained = dist.all_reduce(c, async_op=True).get_future().then(lambda f: f.value()[0] + 1)
    out.append(chained.wait().sum().item())
    d = torch.full((64,), float(r))
    w = dist.all_reduce(d, async_op=True)
    while not w.is_completed():
        simdist.charge(1e-6)
    out.append(d.sum().item())
    # a broadcast's root only reads its buffer: reading it meanwhile is fine, on every other rank it is written
    e = torch.full((64,), float(r))
    w = dist.broadcast(e, src=0, async_op=True)
    if r == 0:
        out.append(e.sum().item())
    w.wait()
    f = [torch.full((64,), float(r))]
    torch.futures.wait_all([dist.all_reduce(f[0], async_op=True).get_future()])
    out.append(f[0].sum().item())
    return out


def test_waiting_in_any_of_torchs_ways_releases_the_buffer():
    res = simdist.run(_correct_patterns, switch(2), races="error")
    assert res.races == []
    assert res.returns[1] == [64.0, 64.0, 128.0, 64.0, 64.0]


def _write_broadcast_root_buffer():
    e = torch.ones(16)
    w = dist.broadcast(e, src=0, async_op=True)
    e.add_(1)  # on the root: writes what the broadcast reads; elsewhere: writes what it writes
    w.wait()


def test_writing_a_buffer_an_operation_reads_is_a_race():
    with pytest.warns(RaceWarning, match=r"rank code wrote \(in aten.add_.Tensor\)"):
        res = simdist.run(_write_broadcast_root_buffer, switch(2), races="warn")
    assert sorted(r.rank for r in res.races) == [0, 1]
    assert all(r.access == "wrote (in aten.add_.Tensor)" for r in res.races)


def _isend_then_modify():
    t = torch.arange(4.0)
    if dist.get_rank() == 0:
        w = dist.isend(t, dst=1)
        t.zero_()
        w.wait()
    else:
        dist.recv(t, src=0)
    return t.tolist()


def test_point_to_point_buffers_are_owned_until_waited():
    with pytest.warns(RaceWarning, match=r"rank code wrote \(in aten.zero_\)"):
        res = simdist.run(_isend_then_modify, switch(2), races="warn")
    assert [r.rank for r in res.races] == [0]
    assert "send" in res.races[0].first.op


def _optimizer_before_wait():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    works = [dist.all_reduce(p.grad, async_op=True) for p in model.parameters()]
    opt.step()  # reads the gradients the all-reduces are still writing
    for w in works:
        w.wait()


def test_optimizer_step_before_wait_is_reported_at_the_step():
    with pytest.raises(RaceError, match=r"rank code read .* owns it\n  access at: .*test_races.py:\d+ in _optimizer_before_wait"):
        simdist.run(_optimizer_before_wait, switch(2), races="error")


def _step_before_waits(foreach: bool) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=foreach)
    model(torch.randn(3, 4)).sum().backward()
    works = [dist.all_reduce(p.grad, async_op=True) for p in model.parameters()]
    opt.step()
    for w in works:
        w.wait()


def test_an_op_over_a_list_reports_every_owned_tensor_as_the_loop_over_them_does():
    # the foreach step (CUDA's optimizer path) reads four gradients in one op, the loop in four; every all-reduce
    # whose buffer is read is a finding either way
    found = {}
    for foreach in (False, True):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RaceWarning)
            res = simdist.run(_step_before_waits, switch(2), args=(foreach,), races="warn")
        found[foreach] = sorted((r.rank, r.first.seq, r.nbytes) for r in res.races)
    assert len(found[False]) == 2 * 4
    assert found[True] == found[False]


def _tied_hooks():
    emb = torch.nn.Parameter(torch.randn(6, 3, generator=torch.Generator().manual_seed(dist.get_rank())))
    works = []
    for _ in range(2):  # one hook per (module, parameter) pair: a tied weight gets two
        emb.register_post_accumulate_grad_hook(lambda p: works.append(dist.all_reduce(p.grad, async_op=True)))
    (emb.sum() + (emb * 2).sum()).backward()
    for w in works:
        w.wait()
    return emb.grad.tolist()


@pytest.mark.parametrize("progress", ["nccl", "gloo"])
def test_a_tied_weight_reduced_twice_is_an_overlap_under_both_progress_modes(progress):
    with pytest.warns(RaceWarning, match="two operations in flight on overlapping memory"):
        res = simdist.run(_tied_hooks, switch(2), progress=progress, races="warn")
    assert sorted(r.rank for r in res.races) == [0, 1]
    race = res.races[0]
    assert race.kind == "overlap"
    assert race.first.op == race.second.op == "all_reduce"
    assert race.first.seq == 0 and race.second.seq == 1
    assert "test_races.py" in race.first.site and race.first.site == race.second.site and race.buffer == "tensor (6, 3) float32"
    start, end = race.window
    assert start == race.second.issued_at and end is not None and end > start
    text = str(race)
    assert ("Under NCCL-like progress" in text) == (progress == "nccl")
    if progress == "nccl":  # in order on one stream: sum of sums, 2 * n * 3
        assert res.returns[0] == [[12.0] * 3] * 6


# ---------------------------------------------------------------------------------------------- property
# A random program of async all-reduces on slices of one shared buffer, with waits in random places. The
# oracle is program order: issuing an operation while an earlier, not yet waited one covers an overlapping
# slice is a race with that one (all-reduce writes its buffer); nothing else is.

slices = st.tuples(st.integers(0, 15), st.integers(1, 8)).map(lambda t: (t[0], min(16, t[0] + t[1])))
programs = st.lists(st.tuples(slices, st.booleans()), min_size=1, max_size=6)


def _slices_program(prog):
    buf = torch.zeros(16)
    pending = []
    for (lo, hi), wait_now in prog:
        w = dist.all_reduce(buf[lo:hi], async_op=True)
        if wait_now:
            w.wait()
        else:
            pending.append(w)
    for w in pending:
        w.wait()


def expected_overlaps(prog) -> list[tuple[int, int]]:
    """(earlier op, later op) pairs the detector must report, by program order."""
    live, found = [], []
    for k, ((lo, hi), wait_now) in enumerate(prog):
        found += [(j, k) for j, (a, b) in live if a < hi and lo < b]
        if not wait_now:
            live.append((k, (lo, hi)))
    return found


@given(prog=programs, progress=st.sampled_from(["nccl", "gloo"]))
def test_overlaps_are_reported_exactly_when_program_order_says_so(prog, progress):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RaceWarning)
        res = simdist.run(_slices_program, switch(2), args=(prog,), progress=progress, races="warn")
    for rank in (0, 1):
        got = [(r.first.seq, r.second.seq) for r in res.races if r.rank == rank]
        assert got == expected_overlaps(prog)
    # every overlap comes from the same pair of call sites: one warning if any, none otherwise
    assert sum(issubclass(w.category, RaceWarning) for w in caught) == (1 if expected_overlaps(prog) else 0)


# ---------------------------------------------------------------------------------------------- review cases
# Programs a review of the detector found misjudged once; each pins the behaviour down.


def _poll(kind):
    a = torch.ones(4)
    w = dist.all_reduce(a, async_op=True)
    f = w.get_future()
    for i in range(1000):
        if (w.is_completed() if kind == "work" else f.done()):
            return i, a.tolist()  # completion seen by polling: the buffer is the rank's again
    return None


@pytest.mark.parametrize("kind", ["work", "future"])
def test_polling_lets_simulated_time_pass_and_releases_the_buffer(kind):
    res = simdist.run(_poll, switch(2), args=(kind,), races="error")
    assert all(r is not None and r[1] == [2.0] * 4 for r in res.returns)


def _collect_all_then_write():
    t = torch.ones(1 << 12)
    fut = torch.futures.collect_all([dist.all_reduce(t, async_op=True).get_future()])
    before = simdist.now()
    t.add_(1)  # still owned: collect_all does not wait
    fut.wait()
    return before


def test_collect_all_waits_only_when_its_future_is_waited_on():
    with pytest.warns(RaceWarning, match=r"rank code wrote \(in aten.add_.Tensor\)"):
        res = simdist.run(_collect_all_then_write, switch(2), races="warn")
    assert res.returns == [0.0, 0.0]
    assert {r.access for r in res.races} == {"wrote (in aten.add_.Tensor)"}


def _then_after_completion():
    t = torch.ones(8)
    w = dist.all_reduce(t, async_op=True)
    w.wait()
    return w.get_future().then(lambda f: f.value()[0].sum().item()).wait()


def test_a_callback_chained_after_completion_may_read_the_buffer():
    assert simdist.run(_then_after_completion, switch(2), races="error").returns == [16.0, 16.0]


def _future_in_hook_never_waited():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    futs = []
    model.weight.register_post_accumulate_grad_hook(lambda p: futs.append(dist.all_reduce(p.grad, async_op=True).get_future()))
    model(torch.ones(2, 8)).sum().backward()
    opt.step()  # the future was taken in backward but nobody waited on it
    torch.futures.wait_all(futs)


def test_a_future_taken_in_a_hook_still_owns_its_buffer_after_backward():
    with pytest.warns(RaceWarning, match="rank code"):
        res = simdist.run(_future_in_hook_never_waited, switch(2), races="warn")
    assert {r.kind for r in res.races} == {"access"} and all("_foreach" in r.access or "add" in r.access for r in res.races)


def _readers(how):
    t = torch.ones(8)
    w = dist.all_reduce(t, async_op=True)
    {"tolist": t.tolist, "str": lambda: str(t), "numpy": lambda: t.numpy().sum(), "item": lambda: t[0].item()}[how]()
    w.wait()


@pytest.mark.parametrize("how", ["tolist", "str", "numpy", "item"])
def test_reads_outside_the_dispatcher_are_reported(how):
    with pytest.warns(RaceWarning, match="rank code read"):
        res = simdist.run(_readers, switch(2), args=(how,), races="warn")
    assert sorted(r.rank for r in res.races) == [0, 1]


def _metadata_only(op):
    t = torch.ones(2, 4)
    w = dist.all_reduce(t, async_op=True)
    {"t_": t.t_, "unsqueeze_": lambda: t.unsqueeze_(0), "transpose_": lambda: t.transpose_(0, 1), "resize_": lambda: t.resize_(64, 64)}[op]()
    w.wait()


@pytest.mark.parametrize("op,race", [("t_", False), ("unsqueeze_", False), ("transpose_", False), ("resize_", True)])
def test_in_place_metadata_changes_are_not_accesses_but_resizing_is(op, race):
    if race:
        with pytest.raises(RaceError, match=r"wrote \(in aten.resize_\)"):
            simdist.run(_metadata_only, switch(2), args=(op,), races="error")
    else:
        assert simdist.run(_metadata_only, switch(2), args=(op,), races="error").races == []


class Tagged(torch.Tensor):
    """A plain subclass: its data is its storage's bytes."""


def _list_all_to_all_and_subclass():
    ins = [torch.ones(2) for _ in range(2)]
    outs = [torch.empty(2) for _ in range(2)]
    w = dist.all_to_all(outs, ins, async_op=True)
    ins[1].add_(1)
    w.wait()
    x = torch.ones(4).as_subclass(Tagged)
    w = dist.all_reduce(x, async_op=True)
    x.mul_(2)
    w.wait()


def test_list_all_to_all_inputs_and_plain_subclasses_are_owned():
    with pytest.warns(RaceWarning) as caught:
        res = simdist.run(_list_all_to_all_and_subclass, switch(2), races="warn")
    # one warning per pair of call sites: the all-to-all's input written, then the subclass's data written
    found = sorted(re.search(r"wrote \(in (\S+)\).*?, while (\w+)", str(w.message)).groups() for w in caught)
    assert found == [("aten.add_.Tensor", "all_to_all"), ("aten.mul_.Tensor", "all_reduce")]
    assert sorted((r.rank, r.first.op) for r in res.races) == [(0, "all_reduce"), (0, "all_to_all"), (1, "all_reduce"), (1, "all_to_all")]


def _dropped_list_op():
    outs = [torch.empty(2) for _ in range(2)]
    dist.all_to_all(outs, [torch.ones(2) for _ in range(2)], async_op=True)  # handle dropped
    dist.barrier()
    simdist.charge("1ms")  # long after every rank's part completed
    outs[0].add_(1)


def test_a_dropped_operation_stops_owning_its_buffers_at_completion():
    import gc

    gc.disable()  # ownership must end without the cyclic collector
    try:
        assert simdist.run(_dropped_list_op, switch(2), races="error").races == []
    finally:
        gc.enable()


def test_recorded_races_do_not_keep_tensors_alive():
    with pytest.warns(RaceWarning, match="rank code read"):
        res = simdist.run(_read_before_wait, switch(2), races="warn")
    assert res.races and all(r.first.tensors == [] for r in res.races)
