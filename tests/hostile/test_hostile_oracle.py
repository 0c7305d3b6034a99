"""Hostile uses of the equivalence oracle: checks from several threads at once, and bugs that localisation must
pin on the op that made them."""

from __future__ import annotations

import pathlib
import threading
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hostile_cases import Case, check, params
from torch import nn

import simdist

BATCH = 8


def _model_and_data() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The same model and full batch in every program (seeded here, not by the run)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).double()
    return model, torch.randn(BATCH, 4, dtype=torch.float64), torch.randn(BATCH, 2, dtype=torch.float64)


def _reference(steps: int = 2) -> None:
    """The single-process model: full batch, mean loss, SGD."""
    model, x, y = _model_and_data()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _data_parallel(steps: int = 2, scale_step: int | None = None) -> None:
    """Hand-written data parallelism (gradients all-reduced, then averaged); at ``scale_step`` rank 1 halves its
    first parameter's gradient after the average."""
    model, x, y = _model_and_data()
    r, n = dist.get_rank(), dist.get_world_size()
    b = BATCH // n
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        opt.zero_grad()
        nn.functional.mse_loss(model(x[r * b : (r + 1) * b]), y[r * b : (r + 1) * b]).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad.div_(n)
        if step == scale_step and r == 1:
            next(model.parameters()).grad.mul_(0.5)
        opt.step()


def _presummed(steps: int = 2, bug: str = "") -> None:
    """torch DDP's recipe by hand: each gradient divided by the world size, then all-reduced; ``bug`` "twice"
    divides once more, "one rank" scales rank 1's gradients by 1e-3."""
    model, x, y = _model_and_data()
    r, n = dist.get_rank(), dist.get_world_size()
    b = BATCH // n
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.mse_loss(model(x[r * b : (r + 1) * b]), y[r * b : (r + 1) * b]).backward()
        for p in model.parameters():
            p.grad.div_(n)
            if bug == "twice":
                p.grad.div_(n)  # divided again
            if bug == "one rank" and r == 1:
                p.grad.mul_(1e-3)  # scaled on one rank
            dist.all_reduce(p.grad)
        opt.step()


def _line(marker: str) -> str:
    """``test_hostile_oracle.py:N`` of the line of this file that ends with ``# marker``."""
    lines = pathlib.Path(__file__).read_text().splitlines()
    (n,) = [i + 1 for i, text in enumerate(lines) if text.rstrip().endswith(f"# {marker}")]
    return f"{pathlib.Path(__file__).name}:{n}"


def _localised(bug: str) -> simdist.EquivalenceReport:
    return simdist.check_equivalence(
        _presummed,
        _reference,
        simdist.Cluster.switch(2, device="cpu"),
        kwargs={"bug": bug},
        reference_kwargs={},
        compute=False,
    )


def _found_at(op: str, marker: str, ranks: tuple[int, ...]) -> Any:
    """Oracle: the program diverges, and localisation names ``op`` at the marked line on ``ranks``, its input
    having matched (the all-reduce after it only carries the difference on)."""

    def check_(rep: simdist.EquivalenceReport) -> None:
        assert not rep.ok and rep.first is not None and rep.first.kind == "grad", str(rep)
        loc = rep.localization
        assert loc is not None, rep.localization_note
        assert (loc.op, loc.ranks, loc.inputs_matched) == (op, ranks, True), str(loc)
        assert _line(marker) in loc.site, str(loc)

    return check_


def _check(world: int, scale_step: int | None) -> simdist.EquivalenceReport:
    return simdist.check_equivalence(
        _data_parallel,
        _reference,
        simdist.Cluster.switch(world, device="cpu"),
        kwargs={"scale_step": scale_step},
        reference_kwargs={},
        compute=False,
    )


def _outcome(rep: simdist.EquivalenceReport) -> tuple[Any, ...]:
    return rep.ok, rep.steps, str(rep.first), rep.history, str(rep.localization)


def _at_once(calls: list[tuple[int, int | None]]) -> list[Any]:
    """Every check of ``calls`` in its own thread, all released at once: their outcomes (or errors) in order."""
    barrier = threading.Barrier(len(calls))
    got: list[Any] = [None] * len(calls)

    def body(i: int) -> None:
        barrier.wait()
        try:
            got[i] = _outcome(_check(*calls[i]))
        except Exception as e:  # noqa: BLE001 - compared with the outcome alone, so the error shows there
            got[i] = repr(e)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return got


def _checks_in_threads() -> list[tuple[Any, Any]]:
    """A correct check and a divergent one, each alone, then both at once from two threads (four rounds):
    (at once, alone) per check and round."""
    calls = [(2, None), (4, 1)]
    alone = [_outcome(_check(*c)) for c in calls]
    return [pair for _ in range(4) for pair in zip(_at_once(calls), alone)]


def _each_as_alone(pairs: list[tuple[Any, Any]]) -> None:
    """Oracle: every check run at once with another gives what it gives alone (the correct one: equivalent)."""
    for at_once, alone in pairs:
        assert at_once == alone
    assert pairs[0][1][0] is True and pairs[1][1][0] is False


CASES: list[Case] = [
    Case(
        "checks-from-two-threads",
        "check_equivalence from two threads at once, a correct program and a divergent one, four rounds",
        _checks_in_threads,
        check=_each_as_alone,
    ),
    Case(
        "gradient-divided-twice",
        "each gradient divided by the world size twice before the all-reduce: localised at the second division",
        lambda: _localised("twice"),
        check=_found_at("aten.div_", "divided again", (0, 1)),
    ),
    Case(
        "gradient-scaled-on-one-rank",
        "rank 1 scales its gradients by 1e-3 before the all-reduce: localised at that scaling, on rank 1",
        lambda: _localised("one rank"),
        check=_found_at("aten.mul_", "scaled on one rank", (1,)),
    ),
]


@pytest.mark.parametrize("case", params(CASES))
def test_hostile(case: Case) -> None:
    check(case)
