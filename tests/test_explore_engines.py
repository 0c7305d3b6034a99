"""Explorations on Dask distributed and Ray: the same findings as in this process, Ctrl-C keeping what was found;
the progress bar on a terminal only."""

from __future__ import annotations

import io
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import explore_fns as fns
import pytest
from test_explore_cli import SCRIPT

import simdist
from simdist.cli import main
from simdist.explore.engines import resolve
from simdist.explore.progress import ProgressBar
from simdist.explore.runs import Outcome

CPU4 = simdist.Cluster.switch(4, device="cpu")
TESTS = str(Path(__file__).resolve().parent)
#: a small exploration with failures of two kinds (a failed check and a rank's exception)
KWARGS: dict[str, Any] = {"runs": 8, "strategy": "pct", "seed": 5, "jitter": {"latency": 0.2}}


def _findings(ex: simdist.Exploration) -> tuple[list, list]:
    """What must be equal whatever ran the exploration (errors compared by kind and message)."""
    return (
        [o.key() for o in ex.outcomes],
        [(f.run, f.kind, str(f.error), f.replay, f.trace_hash) for f in ex.failures],
    )


def _worker_path() -> str:
    """PYTHONPATH for worker processes: this folder (the programs' module) and what this process was given."""
    return os.pathsep.join(p for p in (TESTS, os.environ.get("PYTHONPATH", "")) if p)


@pytest.fixture(scope="module")
def dask_client() -> Iterator[Any]:
    """A local Dask cluster of two worker processes (one thread each), started once for the module."""
    distributed = pytest.importorskip(
        "distributed", reason="Dask is an optional extra (pip install 'simdist[dask]'), not installed here"
    )
    with (
        distributed.LocalCluster(
            n_workers=2,
            threads_per_worker=1,
            processes=True,
            dashboard_address=None,
            env={"PYTHONPATH": _worker_path()},
        ) as cluster,
        distributed.Client(cluster) as client,
    ):
        yield client


@pytest.fixture(scope="module")
def local() -> simdist.Exploration:
    ex = simdist.explore(fns.any_source_order, CPU4, check=fns.order_is_sorted, **KWARGS)
    assert len(ex.by_kind()) >= 1 and ex.failures
    return ex


def test_dask_finds_exactly_what_this_process_finds(dask_client: Any, local: simdist.Exploration) -> None:
    on_dask = simdist.explore(
        fns.any_source_order, CPU4, check=fns.order_is_sorted, engine=dask_client, **KWARGS
    )
    assert _findings(on_dask) == _findings(local)
    assert not on_dask.interrupted
    # a scheduler's address works as the client does: a client is opened for the exploration and closed after
    address = dask_client.scheduler.address
    by_address = simdist.explore(
        fns.any_source_order, CPU4, check=fns.order_is_sorted, engine=address, **KWARGS
    )
    assert _findings(by_address) == _findings(local)


def test_simdist_explore_runs_a_script_on_a_dask_scheduler(
    dask_client: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "collect.py"
    script.write_text(SCRIPT)
    args = ["explore", str(script), "--world-size", "3", "--runs", "6", "--strategy", "pct", "--tokens"]
    local_tokens, dask_tokens = tmp_path / "local.json", tmp_path / "dask.json"
    assert main([*args, str(local_tokens), "--workers", "1", "--", "--strict"]) == 1
    address = dask_client.scheduler.address
    assert main([*args, str(dask_tokens), "--engine", address, "--", "--strict"]) == 1
    assert f"on {address}" in capsys.readouterr().out
    assert json.loads(dask_tokens.read_text()) == json.loads(local_tokens.read_text())


def test_ctrl_c_on_dask_keeps_what_was_found_and_cancels_the_rest(dask_client: Any) -> None:
    seen: list[Outcome] = []

    def interrupt(outcome: Outcome) -> None:
        seen.append(outcome)
        if len(seen) == 3:
            raise KeyboardInterrupt

    ex = simdist.explore(fns.any_source_order, CPU4, runs=40, seed=1, engine=dask_client, on_run=interrupt)
    assert ex.interrupted and "interrupted" in ex.summary()
    assert sorted(o.index for o in seen) == [o.index for o in ex.outcomes]
    assert [f.run for f in ex.failures] == [o.index for o in ex.outcomes if o.kind is not None]
    assert not dask_client.futures, "the runs still pending were left on the cluster"


@pytest.mark.slow
def test_ctrl_c_on_the_local_pool_keeps_every_run_that_ended() -> None:
    seen: list[int] = []

    def interrupt(outcome: Outcome) -> None:
        seen.append(outcome.index)
        if len(seen) == 4:
            raise KeyboardInterrupt

    ex = simdist.explore(fns.any_source_order, CPU4, runs=30, seed=1, workers=2, on_run=interrupt)
    assert ex.interrupted and sorted(seen) == [o.index for o in ex.outcomes]
    assert [f.run for f in ex.failures] == [o.index for o in ex.outcomes if o.kind is not None]


def test_an_engine_needs_programs_loadable_by_name_and_says_what_it_takes() -> None:
    with pytest.raises(simdist.ExplorationError, match="cannot be loaded by name in a worker process"):
        simdist.explore(lambda: None, CPU4, runs=2, engine="tcp://127.0.0.1:1")
    for bad in (42, "localhost:8786", "tcp://"):
        with pytest.raises(
            simdist.ExplorationError, match="engine must be a distributed.Client, a Dask scheduler"
        ):
            simdist.explore(fns.returns_rank, CPU4, runs=2, engine=bad)
    assert resolve(None) is None


@pytest.mark.slow
def test_ray_finds_exactly_what_this_process_finds(local: simdist.Exploration) -> None:
    ray = pytest.importorskip(
        "ray",
        reason="Ray is an optional extra (pip install 'simdist[ray]') left out of the test environment: its wheels "
        "weigh hundreds of MB and a local ray.init() takes about 6 s of a 2-core machine before its workers import "
        "torch; run this test by hand where Ray is installed",
    )
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": _worker_path()}})
    try:
        on_ray = simdist.explore(
            fns.any_source_order, CPU4, check=fns.order_is_sorted, engine="ray", **KWARGS
        )
        assert _findings(on_ray) == _findings(local)
        seen: list[int] = []

        def interrupt(outcome: Outcome) -> None:
            seen.append(outcome.index)
            if len(seen) == 3:
                raise KeyboardInterrupt

        cut = simdist.explore(fns.any_source_order, CPU4, runs=40, seed=1, engine="ray", on_run=interrupt)
        assert cut.interrupted and sorted(seen) == [o.index for o in cut.outcomes]
    finally:
        ray.shutdown()


# ---------------------------------------------------------------------- the progress bar
def test_the_progress_bar_shows_runs_per_second_failures_and_an_eta(
    capsys: pytest.CaptureFixture[str],
) -> None:
    ex = simdist.explore(fns.any_source_order, CPU4, runs=6, seed=1, progress_bar=True)
    err = capsys.readouterr().err
    last = err.replace("\r", "\n").strip().splitlines()[-1]
    assert last.startswith("exploring: 100%") and "6/6" in last
    assert f"failures={len(ex.failures)}" in last and ex.failures
    assert "runs/s" in last and "<00:00" in last  # elapsed<remaining: the ETA


def test_no_progress_bar_in_captured_output_by_default(capsys: pytest.CaptureFixture[str]) -> None:
    simdist.explore(fns.any_source_order, CPU4, runs=3, seed=1)
    assert capsys.readouterr().err == ""


def test_the_progress_bar_is_shown_on_a_terminal_by_default() -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    for file, shown in ((Terminal(), True), (io.StringIO(), False)):
        bar = ProgressBar(2, None, file)
        bar.update(Outcome(0, simdist.Perturbation(), "", kind="check failed"))
        bar.close()
        assert ("failures=1" in file.getvalue()) is shown


def test_a_progress_bar_that_is_not_a_flag_is_refused() -> None:
    with pytest.raises(simdist.ExplorationError, match="progress_bar must be True, False or None"):
        simdist.explore(fns.returns_rank, CPU4, runs=1, progress_bar="yes")
