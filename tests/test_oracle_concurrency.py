"""``check_equivalence`` and localisation called from several Python threads at once, and beside plain runs.

The oracle: each check run alone, one after another. A check in a thread must give the same verdict, the same
per-step differences and the same localisation as that check alone, and leave no hook behind.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from oracle_fns import Setup, parallel, reference
from torch import nn
from torch.optim import optimizer as torch_optimizer

import simdist
from simdist.c10d import process_group
from simdist.oracle.localize import localize

#: a correct program and a program whose gradient is perturbed on rank 1 at step 1 (found and localised)
CORRECT = ("naive", Setup())
PERTURBED = ("bucketed", Setup(widths=(5, 7, 2), perturb=(1, 0, 0, 1), delta=1e-3))
ROUNDS = 6


def _check(strategy: str, setup: Setup, world: int) -> simdist.EquivalenceReport:
    return simdist.check_equivalence(
        parallel,
        reference,
        simdist.Cluster.switch(world),
        args=(setup, strategy),
        reference_args=(setup,),
        compute=False,
    )


def _summary(rep: simdist.EquivalenceReport) -> tuple[Any, ...]:
    """What two runs of one check must agree on: the verdict, the first divergence, the history, the localisation."""
    return (rep.ok, rep.steps, str(rep.first), rep.history, str(rep.localization), rep.localization_note)


def _hooks() -> tuple[Any, ...]:
    """The process-wide state the oracle's hooks touch."""
    return (
        torch.autograd.backward,
        torch.autograd.grad,
        len(nn.modules.module._global_forward_pre_hooks),
        len(nn.modules.module._global_forward_hooks),
        len(torch_optimizer._global_optimizer_post_hooks),
        len(torch_optimizer._global_optimizer_pre_hooks),
        list(process_group.ISSUE_OBSERVERS),
    )


def _in_threads(*calls: Any) -> list[Any]:
    """Run each ``(fn, args)`` in its own thread, all released at once; their results (or exceptions) in order."""
    barrier = threading.Barrier(len(calls))
    out: list[Any] = [None] * len(calls)

    def body(i: int, fn: Any, args: tuple) -> None:
        barrier.wait()
        try:
            out[i] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - the caller's assertion shows the thread's error
            out[i] = e

    threads = [threading.Thread(target=body, args=(i, fn, args)) for i, (fn, args) in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_checks_in_two_threads_at_once_agree_with_each_check_alone() -> None:
    before = _hooks()
    alone = [_summary(_check(*CORRECT, 2)), _summary(_check(*PERTURBED, 4))]
    assert alone[0][0] and not alone[1][0] and "first divergent op" in alone[1][4]
    for _ in range(ROUNDS):
        got = _in_threads((_check, (*CORRECT, 2)), (_check, (*PERTURBED, 4)))
        assert [_summary(r) for r in got] == alone
    assert _hooks() == before


#: the plain run's rank 0 sets ``started`` once it runs; it trains once the check has installed its hooks
_started = threading.Event()
_original_backward = torch.autograd.backward


def _plain_training() -> None:
    """Train an unrelated model (other widths, four steps) once some capture's hooks are in place."""
    _started.set()
    tick = threading.Event()
    for _ in range(3000):  # wall-clock wait (time.sleep in a rank waits in simulated time): at most 30 s
        if torch.autograd.backward is not _original_backward:
            break
        tick.wait(0.01)
    parallel(Setup(widths=(6, 4, 3), steps=4), "flat")


def test_a_plain_run_in_another_thread_while_a_check_waits_to_run_stays_out_of_it() -> None:
    # the plain run holds the run lock while the check, started in another thread, has its hooks installed
    # and waits for its own run: every step the plain run takes happens while the check captures
    alone = _summary(_check(*CORRECT, 2))
    _started.clear()
    plain: list[Any] = []
    runner = threading.Thread(
        target=lambda: plain.append(simdist.run(_plain_training, simdist.Cluster.switch(2)))
    )
    runner.start()
    assert _started.wait(60)
    rep = _check(*CORRECT, 2)
    runner.join()
    assert _summary(rep) == alone
    assert plain and plain[0].world_size == 2
    assert torch.autograd.backward is _original_backward


def test_localisations_in_two_threads_at_once_agree_with_each_alone() -> None:
    def loc(world: int) -> str:
        strategy, setup = PERTURBED
        found = localize(
            parallel,
            reference,
            simdist.Cluster.switch(world),
            1,
            args=(setup, strategy),
            reference_args=(setup,),
            run_options={"compute": False},
        )
        return str(found)

    before = _hooks()
    alone = [loc(2), loc(4)]
    assert "first divergent op" in alone[0]
    for _ in range(ROUNDS):
        assert _in_threads((loc, (2,)), (loc, (4,))) == alone
    assert _hooks() == before
