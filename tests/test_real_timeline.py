"""``real``'s timeline: each rank's collectives and sends/recvs recorded with their times on one clock, matched
to a simulated run's operations one to one, and set beside it in a run report."""

from __future__ import annotations

import itertools
import json
import re
import threading
import time
from pathlib import Path

import pytest
import real_timeline_fns as fns
import torch
import torch.distributed as dist
from browser import CHROMIUM, chromium

import real
import simdist
from real.__main__ import main as real_main
from real.timeline import OPS, Recorder
from simdist import cli
from simdist.report import real as real_report
from simdist_base.timeline import (
    BY_FUTURE,
    BY_WAIT,
    CommRecord,
    RankTimeline,
    Timeline,
    TimelineError,
    load,
    write,
)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> tuple[real.RealResult, Path]:
    """One real launch of the DDP step on 2 gloo processes, its timeline and profiler traces in a directory."""
    directory = tmp_path_factory.mktemp("timeline")
    return real.run(fns.ddp_step, 2, timeline=directory, profile=True), directory


@pytest.fixture(scope="module")
def simulated() -> simdist.RunResult:
    return simdist.run(fns.ddp_step, simdist.Cluster.switch(2, device="cpu"), backend_name="gloo")


@pytest.mark.real
def test_every_rank_records_its_operations_in_issue_order(recorded, simulated) -> None:
    result, directory = recorded
    timeline = result.timeline
    assert timeline is not None and timeline.ranks == [0, 1] and timeline.clock == "monotonic"
    for rank, records in timeline.records.items():
        assert [r.index for r in records] == list(range(len(records)))
        assert all(a.start <= b.start for a, b in itertools.pairwise(records)), "issue order is time order"
        assert all(r.end is not None and r.end >= r.start for r in records)
        # the oracle for sizes, ops and order: the simulated run of the same function
        spans = real_report._issued(simulated.trace, rank)
        assert [r.op for r in records] == [span.name.rpartition(":")[2] for span in spans]
        assert [r.nbytes for r in records] == [real_report.data.span_bytes(span) for span in spans]
        p2p = [r for r in records if r.op in ("send", "recv")]
        assert [(r.op, r.peer, r.completion) for r in p2p] == [
            ("send" if rank == 0 else "recv", 1 - rank, BY_WAIT)
        ]
        assert all(r.completion == BY_FUTURE for r in records if r not in p2p)
        assert all(r.site.startswith(fns.__file__) for r in records), [r.site for r in records]
    assert load(directory).records == timeline.records  # the files hold what the result holds


@pytest.mark.real
def test_the_ranks_share_one_clock(recorded) -> None:
    # No rank's collective completes before every rank issued it, and a receive ends after its send began: true
    # on one clock, and false for a shift between two ranks' clocks longer than the operation.
    records = recorded[0].timeline.records
    for mine, theirs in ((records[0], records[1]), (records[1], records[0])):
        for a, b in zip(mine, theirs):
            if a.op not in ("send", "recv"):
                assert a.end >= b.start, (a, b)
    send = next(r for r in records[0] if r.op == "send")
    recv = next(r for r in records[1] if r.op == "recv")
    assert recv.end >= send.start


@pytest.mark.real
def test_a_profile_per_rank_holds_the_same_collectives(recorded) -> None:
    result, _directory = recorded
    assert sorted(result.timeline.profiles) == [0, 1]
    for rank, path in result.timeline.profiles.items():
        events = json.loads(Path(path).read_text())["traceEvents"]
        profiled = [e["name"] for e in events if e.get("name", "").startswith("gloo:")]
        collectives = [r for r in result.timeline.records[rank] if r.op not in ("send", "recv")]
        assert len(profiled) >= len(collectives) > 0


@pytest.mark.real
def test_the_simulated_run_matches_one_to_one_and_the_report_shows_both(
    recorded, simulated, tmp_path
) -> None:
    result, directory = recorded
    comparison = real_report.compare(
        simulated.trace, result.timeline, 2, simulated.call_sites, simulated.p2p_sites
    )
    assert comparison.mismatches == []
    assert (
        comparison.matched
        == len(simulated.trace.collectives())
        == sum(map(len, result.timeline.records.values()))
    )
    page = simulated.save_report(tmp_path / "run.html", real=directory)
    html = page.read_text()
    rows = re.findall(r"<tr><td data-value=\"(\d)\">", html.split('id="real-table"')[1])
    assert len(rows) == comparison.matched
    payload = json.loads(re.search(r'id="timeline-data">(.*?)</script>', html).group(1))
    real_rows = [i for i, (_, stream) in enumerate(payload["rows"]) if stream.startswith("real")]
    assert {tuple(payload["rows"][i]) for i in real_rows} == {(0, "real comm"), (0, "real p2p"), (1, "real comm"),
                                                              (1, "real p2p")}  # fmt: skip
    if CHROMIUM is not None:  # the page's script draws every row, the real ones too
        body = re.search(r"<body [^>]*>", chromium("--dump-dom", page.as_uri())).group(0)
        assert 'data-js-errors=""' in body and f'data-timeline-rows="{len(payload["rows"])}"' in body
    drawn = [s for s in payload["spans"] if s[0] in real_rows]
    assert sorted(s[1] for s in drawn) == sorted(
        r.start * 1e6 for rs in result.timeline.records.values() for r in rs
    )


@pytest.mark.real
def test_a_different_program_is_reported_not_crashed_on(recorded, tmp_path) -> None:
    result, _directory = recorded
    other = simdist.run(fns.ddp_step_and_more, simdist.Cluster.switch(2, device="cpu"), backend_name="gloo")
    comparison = real_report.compare(other.trace, result.timeline, 2, other.call_sites, other.p2p_sites)
    assert len(comparison.mismatches) == 2 and all("barrier at" in m for m in comparison.mismatches)
    only = [p for p in comparison.pairs if p.note == real_report.ONLY_SIMULATED]
    assert [(p.rank, p.op) for p in only] == [(0, "barrier"), (1, "barrier")]
    html = other.save_report(tmp_path / "other.html", real=result.timeline).read_text()
    assert "The runs differ" in html and "only in the simulated run" in html


def test_a_timeline_of_other_ranks_and_missing_completions_is_described() -> None:
    def record(rank: int, index: int, op: str, end: float | None) -> CommRecord:
        return CommRecord(rank, index, op, "0", (0, 1), 4, "float32", "x.py:1 in f", 0.0, end, "unobserved")

    timeline = Timeline({0: [record(0, 0, "all_reduce", None)], 5: []}, "monotonic", {0: "h", 5: "h"}, {})
    sim = simdist.run(_one_all_reduce, simdist.Cluster.switch(2, device="cpu"))
    comparison = real_report.compare(sim.trace, timeline, 2)
    assert any("ranks 5" in m for m in comparison.mismatches)
    assert any("no real timeline for ranks 1" in m for m in comparison.mismatches)
    assert comparison.pairs[0].measured is None and "not observed" in comparison.pairs[0].note
    assert comparison.median_error() is None


def _one_all_reduce() -> None:
    dist.all_reduce(torch.ones(1))


def test_recording_changes_no_result_and_leaves_the_process_as_found(tmp_path) -> None:
    def state() -> tuple:
        kernels = tuple(
            torch._C._dispatch_has_kernel_for_dispatch_key(f"c10d::{op}", "ADInplaceOrView") for op in OPS
        )
        return kernels, dist.Work.wait, torch.autograd.profiler._is_profiler_enabled

    def program() -> torch.Tensor:
        t = torch.arange(6.0, requires_grad=True) * 2
        dist.all_reduce(t)
        dist.broadcast(t, 0)
        return t.sum() * 3

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        before = state()
        plain = program()
        with Recorder(0, tmp_path, profile=True).recording():
            recorded_value = program()
        assert state() == before
        assert torch.equal(plain, recorded_value) and recorded_value.requires_grad
        with pytest.raises(ValueError, match="inside"), Recorder(0, tmp_path / "failed").recording():
            program()
            raise ValueError("inside")
        assert state() == before
    finally:
        dist.destroy_process_group()
    assert [r.op for r in load(tmp_path).records[0]] == ["all_reduce", "broadcast"]
    assert [r.op for r in load(tmp_path / "failed").records[0]] == ["all_reduce", "broadcast"]


def test_bad_timeline_options_are_refused_before_anything_starts(tmp_path, capsys) -> None:
    a_file = tmp_path / "f"
    a_file.write_text("")
    with pytest.raises(real.RealConfigError, match="is a file"):
        real.run(fns.ddp_step, 2, timeline=a_file)
    with pytest.raises(real.RealConfigError, match="pass timeline=DIR"):
        real.run(fns.ddp_step, 2, profile=True)
    with pytest.raises(real.RealConfigError, match="timeline must be True, False or a directory"):
        real.run(fns.ddp_step, 2, timeline=3)
    assert real_main([fns.__file__, "--nproc", "2", "--entry", "ddp_step", "--profile"]) == 2
    assert "add --timeline DIR" in capsys.readouterr().err


def test_a_directory_without_a_timeline_is_named(tmp_path, capsys) -> None:
    with pytest.raises(TimelineError, match="holds no rank"):
        load(tmp_path)
    (tmp_path / "rank0.timeline.json").write_text('{"format": 99}')
    with pytest.raises(TimelineError, match="not a real timeline of format 1"):
        load(tmp_path)
    with pytest.raises(SystemExit):
        cli.main(["run", fns.__file__, "--entry", "ddp_step", "--report", str(tmp_path / "r.html"), "--real",
                  str(tmp_path / "none")])  # fmt: skip
    assert "does not exist" in capsys.readouterr().err
    valid = tmp_path / "valid"
    valid.mkdir()
    write(RankTimeline(0, "host", 0.0, 0.0), valid)
    assert cli.main(["run", fns.__file__, "--entry", "ddp_step", "--real", str(valid)]) == 2
    assert "add --report" in capsys.readouterr().err


@pytest.mark.real
@pytest.mark.slow
def test_code_on_emulated_gpus_is_timed_on_the_host() -> None:
    # the emulated device computes on the CPU: the host's times are the ops' (no CUDA events), and every
    # completion is seen, also those that gloo's worker thread reports
    result = real.run(fns.ddp_step_on_cuda, 2, emulate_cuda=True, timeline=True)
    for records in result.timeline.records.values():
        assert [r.op for r in records] == ["all_gather", "broadcast", "broadcast", "all_reduce", "all_reduce"]
        assert all(r.completion == BY_FUTURE and r.end >= r.start for r in records), records


def test_an_ops_end_noted_after_its_waiter_woke_is_in_the_records(tmp_path) -> None:
    """torch wakes a future's waiters before it runs the future's callbacks (on the thread that completed it): the
    records taken right after the last wait returned still hold the end its callback notes."""
    from real.timeline import _Pending

    recorder = Recorder(0, tmp_path)
    future: torch.futures.Future = torch.futures.Future()
    slow = threading.Event()
    future.add_done_callback(lambda _f: slow.wait(5))  # runs before the recorder's callback
    fields = {"rank": 0, "index": 0, "op": "all_reduce", "group": "default", "group_ranks": (0, 1)}
    pending = _Pending({**fields, "nbytes": 4, "dtype": "float32", "site": "here", "start": time.monotonic()})
    recorder._pending.append(pending)
    recorder._on_future(pending, future, cuda=False)
    threading.Thread(target=future.set_result, args=(None,), daemon=True).start()
    future.wait()  # the rank's wait returns; the callbacks may not have run yet
    threading.Timer(0.2, slow.set).start()
    (record,) = recorder._records()
    assert record.end is not None and record.end >= record.start and record.completion == BY_FUTURE
