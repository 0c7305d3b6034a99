"""The equivalence oracle's per-step differences (``EquivalenceReport.history``) against torch's own arithmetic on
what the programs hold, past the first divergence too, and their plot in the equivalence report's page."""

from __future__ import annotations

import math
import re
from pathlib import Path

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from browser import chromium, needs_chromium
from hypothesis import given
from hypothesis.extra import numpy as hnp
from torch import nn

import simdist
from simdist.oracle.capture import Piece, RankStep
from simdist.oracle.check import Comparison, max_abs_difference
from simdist.oracle.names import NameMap
from simdist.oracle.report import HISTORY_KINDS, StepDifference
from simdist.oracle.tolerance import Tolerance, differing

STEPS, BATCH = 4, 8


def _train(bug_step: int | None, factor: float = 1.5) -> list[dict]:
    """An MLP trained with hand-written data parallelism (gradients all-reduced and averaged), SGD with momentum;
    at ``bug_step`` every gradient is scaled by ``factor`` after the average. Returns, per step, what the rank
    held after ``optimizer.step()``: its loss, parameters, gradients and momentum buffers."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    held = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(10 + step)
        x = torch.randn(BATCH, 4, generator=g, dtype=torch.float64)
        y = torch.randn(BATCH, 2, generator=g, dtype=torch.float64)
        b = BATCH // world
        opt.zero_grad()
        loss = F.mse_loss(model(x[rank * b : (rank + 1) * b]), y[rank * b : (rank + 1) * b])
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
            if step == bug_step:
                p.grad *= factor
        opt.step()
        named = dict(model.named_parameters())
        held.append({
            "loss": loss.detach().clone(),
            "param": {n: p.detach().clone() for n, p in named.items()},
            "grad": {n: p.grad.clone() for n, p in named.items()},
            "optimizer": {f"{n}:momentum_buffer": opt.state[p]["momentum_buffer"].clone() for n, p in named.items()},
        })
    return held


def _expected(rep: simdist.EquivalenceReport) -> list[dict[str, float]]:
    """Per step and kind, the largest |parallel - reference| over every tensor every rank returned, by torch."""
    ref = rep.reference.returns[0]
    out = []
    for k in range(len(ref)):
        ranks = [r[k] for r in rep.parallel.returns]
        row = {"loss": (torch.stack([r["loss"] for r in ranks]).mean() - ref[k]["loss"]).abs().item()}
        for kind in ("param", "grad", "optimizer"):
            row[kind] = max((r[kind][n] - t).abs().max().item() for r in ranks for n, t in ref[k][kind].items())
        out.append(row)
    return out


def _check(bug_step: int | None, **options) -> simdist.EquivalenceReport:
    return simdist.check_equivalence(_train, _train, simdist.Cluster.switch(2, device="cpu"), args=(bug_step,),
                                     reference_args=(None,), **options)


def test_an_equivalent_runs_history_is_torchs_difference_at_every_step() -> None:
    rep = _check(None, localize=False)
    assert rep.ok and rep.steps == STEPS and [h.step for h in rep.history] == list(range(STEPS))
    for h, want in zip(rep.history, _expected(rep), strict=True):
        for kind, value in want.items():
            assert h.of(kind) == value, (h, kind, value)
        assert h.buffer is None, "the model has no buffers"
        # summing in another order than one process: rounding, far inside the float64 tolerance
        assert all(h.of(kind) <= 1e-14 for kind in want), h


def test_a_divergent_runs_history_goes_on_past_the_first_divergent_step() -> None:
    rep = _check(1, localize=False)
    # the verdict is as before: every divergence of step 1, and two steps compared
    assert rep.step == 1 and rep.steps == 2 and {d.step for d in rep.divergences} == {1}
    assert rep.first.kind == "grad"
    assert [h.step for h in rep.history] == list(range(STEPS))
    for h, want in zip(rep.history, _expected(rep), strict=True):
        for kind, value in want.items():
            assert h.of(kind) == value, (h, kind, value)
    assert rep.history[0].param <= 1e-14 and rep.history[0].grad <= 1e-14
    # the scaled gradients move the parameters at step 1, and every later step starts from them
    assert all(h.param > 1e-3 and h.grad > 1e-3 and h.optimizer > 1e-3 for h in rep.history[1:]), rep.history
    assert all(h.loss > 1e-6 for h in rep.history[2:]), "the loss differs from the step after the bug on"
    d = rep.to_dict()["history"]
    assert len(d) == STEPS and d[1]["param"] == rep.history[1].param


def test_a_replica_that_differs_counts_in_the_history() -> None:
    # only rank 1's copy is off: the lowest rank's copy alone would hide it
    def one_rank_off() -> None:
        rank = dist.get_rank()
        torch.manual_seed(0)
        model = nn.Linear(3, 2).double()
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        for step in range(3):
            opt.zero_grad()
            model(torch.ones(4, 3, dtype=torch.float64)).sum().backward()
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
                if step == 1 and rank == 1:
                    p.grad += 0.25
            opt.step()

    rep = simdist.check_equivalence(one_rank_off, one_rank_off, simdist.Cluster.switch(2, device="cpu"),
                                    localize=False)
    assert rep.step == 1 and {"grad", "replica"} <= {d.kind for d in rep.divergences}
    assert all(d.ranks == (1,) for d in rep.divergences if d.kind == "grad")
    assert rep.history[0].grad <= 1e-14 and rep.history[1].grad == 0.25
    assert rep.history[1].param == pytest.approx(0.125, abs=1e-14)


def _step(loss: float, w: torch.Tensor, pieces: dict[int, torch.Tensor]) -> tuple[dict[int, RankStep], RankStep]:
    """One step as the capture records it: each rank's loss and piece of ``w``, and the reference's."""
    ranks = {r: RankStep(losses=[torch.tensor(loss, dtype=torch.float64)], params={"w": Piece(r, v.double())},
                         order=["w"]) for r, v in pieces.items()}
    return ranks, RankStep(losses=[torch.tensor(0.0, dtype=torch.float64)], params={"w": Piece(0, w)}, order=["w"])


def test_later_steps_that_do_not_fit_together_end_the_history_without_raising() -> None:
    ref = torch.zeros(4, 3, dtype=torch.float64)
    steps = [
        _step(0.5, ref, {0: torch.zeros(2, 3), 1: torch.ones(2, 3)}),  # rank 1's rows are off by 1
        _step(0.25, ref, {0: torch.zeros(2, 3), 1: torch.zeros(1, 3)}),  # 3 rows against 4: a structure divergence
        _step(0.0, ref, {0: torch.zeros(2, 3), 1: torch.zeros(3)}),  # pieces that cannot be concatenated
        _step(0.0, ref, {0: torch.zeros(2, 3), 1: torch.zeros(2, 3)}),
    ]
    comparison = Comparison(NameMap(None, ()), {"w": (0, None)}, False, {}, "mean")
    parallel = {r: [ranks[r] for ranks, _ in steps] for r in (0, 1)}
    divergences, compared = comparison.run(parallel, [ref_step for _, ref_step in steps])
    assert compared == 1 and {d.step for d in divergences} == {0}
    assert [d.kind for d in divergences] == ["loss", "param"]
    assert comparison.history == [StepDifference(0, loss=0.5, param=1.0), StepDifference(1, loss=0.25)]
    assert comparison.counts == {"loss": 1, "parameters": 1, "gradients": 0, "optimizer state tensors": 0, "buffers": 0}


floats = st.floats(allow_nan=True, allow_infinity=True, width=64)


@given(hnp.arrays(np.float64, st.integers(1, 6), elements=floats), st.data())
def test_max_abs_difference_is_numpys_with_equal_specials_at_zero(a: np.ndarray, data: st.DataObject) -> None:
    b = data.draw(hnp.arrays(np.float64, a.shape, elements=floats))
    if data.draw(st.booleans()):
        b = np.where(data.draw(hnp.arrays(np.bool_, a.shape)), a, b)  # some elements equal, specials included
    with np.errstate(invalid="ignore", over="ignore"):
        same = (np.isnan(a) & np.isnan(b)) | (np.isinf(a) & (a == b))
        d = np.where(same, 0.0, np.abs(a - b))
    want = float(np.nan_to_num(d, nan=math.inf, posinf=math.inf).max())
    assert max_abs_difference(torch.from_numpy(a), torch.from_numpy(b)) == want


@given(hnp.arrays(np.float32, st.integers(1, 6), elements=st.floats(width=32, allow_nan=True)), st.data(),
       st.booleans(), st.sampled_from([None, Tolerance(rtol=1e-3, atol=0.0), Tolerance(rtol=0.0, atol=1e-2)]))
def test_the_comparisons_verdict_is_differings_while_it_measures(
    a: np.ndarray, data: st.DataObject, exact: bool, tolerance: Tolerance | None
) -> None:
    # the comparison reuses its measured maximum for the tolerance test; the verdict must stay differing's
    noise = data.draw(hnp.arrays(np.float32, a.shape, elements=st.sampled_from([0.0, 1e-6, 1e-3, 1.0, math.nan])))
    b = a + noise if data.draw(st.booleans()) else a.copy()
    overrides = {} if tolerance is None else {torch.float32: tolerance}
    comparison = Comparison(NameMap(None, ()), {}, exact, overrides, "mean")
    value, expected = torch.from_numpy(a), torch.from_numpy(b)
    got, want = comparison._differing("param", value, expected), differing(value, expected, exact, overrides)
    assert (got is None) == (want is None) and (got is None or torch.equal(got, want))
    assert comparison._worst["param"] == (0.0 if exact and want is None else max_abs_difference(value, expected))


def test_max_abs_difference_of_other_dtypes() -> None:
    assert max_abs_difference(torch.tensor([True, False]), torch.tensor([False, False])) == 1.0
    assert max_abs_difference(torch.tensor([3, -2]), torch.tensor([1, 5])) == 7.0
    assert max_abs_difference(torch.tensor([1.5], dtype=torch.float32), torch.tensor([1.0], dtype=torch.float64)) == 0.5
    assert max_abs_difference(torch.zeros(0), torch.zeros(0)) == 0.0
    assert max_abs_difference(torch.tensor([3 + 4j]), torch.tensor([0j])) == 5.0


# ---- the page


def _points(html: str) -> dict[str, list[tuple[int, str]]]:
    """Per kind, the plot's points as (step, hover title)."""
    out = {}
    for kind, body in re.findall(r'<g class="history-line" data-kind="(\w+)">(.*?)</g>', html):
        out[kind] = [(int(s), t) for s, t in re.findall(r'data-step="(\d+)"[^>]*><title>([^<]*)</title>', body)]
    return out


def test_the_page_plots_one_point_per_step_and_kind_and_names_the_first_divergent_op(tmp_path: Path) -> None:
    rep = _check(1)
    html = rep.save_report(tmp_path / "bad.html").read_text()
    plot = html[html.index('id="history-plot"'):]
    assert f'data-steps="{STEPS}"' in plot[:200]
    points = _points(plot)
    assert sorted(points) == sorted(["loss", "grad", "param", "optimizer"])
    for kind, got in points.items():
        assert [s for s, _ in got] == list(range(STEPS)), kind
        for (step, title), h in zip(got, rep.history, strict=True):
            v = h.of(kind)
            assert title.endswith("0 (bitwise equal)" if v == 0 else f"max |diff| {v:.3g}"), (title, v)
    assert "bitwise equal</text>" in plot and "first divergence</text>" in plot
    assert "<title>first divergent step: 1</title>" in plot
    # the localisation as its own line above the plot and the table, with its call site
    loc = rep.localization
    assert loc is not None and loc.site
    line = html[html.index('id="first-divergent-op"'):]
    assert line.index("history-plot") < line.index('id="divergences"')
    site = loc.site.replace("<", "&lt;").replace(">", "&gt;")
    assert f"<code>{loc.label or loc.op}</code> at <code class=\"site\">{site}</code>" in line[:2000]


def test_an_equivalent_page_plots_every_step_without_a_divergence_mark(tmp_path: Path) -> None:
    rep = _check(None)
    html = rep.save_report(tmp_path / "good.html").read_text()
    points = _points(html)
    assert all([s for s, _ in got] == list(range(STEPS)) for got in points.values()) and len(points) == 4
    assert "first divergence</text>" not in html and 'id="first-divergent-op"' not in html


def test_zero_differences_sit_on_the_bitwise_equal_line(tmp_path: Path) -> None:
    # one rank against the same program: every difference is exactly 0, which a log scale cannot place
    rep = simdist.check_equivalence(_train, _train, simdist.Cluster.switch(1, device="cpu"), args=(None,),
                                    reference_args=(None,), exact=True)
    assert rep.ok and all(h.of(k) == 0.0 for h in rep.history for k in ("loss", "grad", "param", "optimizer"))
    html = rep.save_report(tmp_path / "same.html").read_text()
    plot = html[html.index('id="history-plot"'):html.index("</svg>", html.index('id="history-plot"'))]
    floor = re.search(r'<line x1="\d+" y1="([\d.]+)" x2="[\d.]+" y2="[\d.]+" class="floor"/>', plot).group(1)
    points = _points(plot)
    assert len(points) == 4 and all(len(got) == STEPS for got in points.values())
    assert all(t.endswith("max |diff| 0 (bitwise equal)") for got in points.values() for _, t in got)
    ys = re.findall(r'class="history-point" data-step="\d+" cx="[\d.]+" cy="([\d.]+)"', plot)
    assert len(ys) == 4 * STEPS and {float(y) for y in ys} == {float(floor)}
    assert "bitwise equal to the reference's at every step" in plot and 'class="grid"' not in plot


@needs_chromium
def test_the_plot_is_drawn_in_a_browser_without_errors(tmp_path: Path) -> None:
    page = _check(1, localize=False).save_report(tmp_path / "check.html")
    dom = chromium("--dump-dom", page.as_uri())
    assert 'data-js-errors=""' in re.search(r"<body [^>]*>", dom).group(0)
    assert len(re.findall(r'<circle class="history-point"', dom)) == STEPS * 4
    assert 'id="first-divergent-op"' in dom and "localisation is off" in dom


def test_history_kinds_are_a_steps_fields() -> None:
    h = StepDifference(3, grad=0.5)
    assert [h.of(k) for k in HISTORY_KINDS] == [None, 0.5, None, None, None]
    assert StepDifference(0, param=math.inf).to_dict()["param"] == "inf"
    with pytest.raises(ValueError, match="per kind"):
        h.of("replica")
