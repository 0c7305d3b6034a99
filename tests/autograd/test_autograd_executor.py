"""The executor interface: a command-emitting executor with opaque handles plugs in without engine changes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest
from autograd_programs import OursLib, loss_of, programs, run
from hypothesis import given

import simdist.autograd as ag
from simdist.autograd import INSTRUCTIONS, Executor, NumpyExecutor, TensorMeta


class Handle:
    """A remote value's id. Refuses to become an array, so any engine code touching values directly fails."""

    __slots__ = ("id",)

    def __init__(self, id: int) -> None:
        self.id = id

    def __array__(self, *args: Any, **kwargs: Any) -> np.ndarray:
        raise AssertionError("the engine tried to read a handle's values")

    def __float__(self) -> float:
        raise AssertionError("the engine tried to read a handle's value")


class CommandExecutor(Executor):
    """Records "op, input ids, output ids, attrs" commands and runs them on a private store (a stand-in worker)."""

    def __init__(self) -> None:
        self.worker = NumpyExecutor()
        self.store: dict[int, Any] = {}
        self.commands: list[tuple[str, tuple[int, ...], tuple[int, ...], dict[str, Any]]] = []
        self.downloads = 0

    def _new(self, value: Any) -> Handle:
        handle = Handle(len(self.store))
        self.store[handle.id] = value
        return handle

    def execute(
        self, op: str, inputs: tuple[Any, ...], attrs: Mapping[str, Any], outputs: tuple[TensorMeta, ...]
    ) -> tuple[Any, ...]:
        assert op in INSTRUCTIONS
        assert all(type(h) is Handle for h in inputs)
        results = self.worker.execute(op, tuple(self.store[h.id] for h in inputs), attrs, outputs)
        handles = tuple(self._new(r) for r in results)
        self.commands.append((op, tuple(h.id for h in inputs), tuple(h.id for h in handles), dict(attrs)))
        return handles

    def upload(self, value: np.ndarray) -> Handle:
        return self._new(np.array(value, copy=True))

    def download(self, array: Any, meta: TensorMeta) -> np.ndarray:
        self.downloads += 1
        value = np.asarray(self.store[array.id])
        assert value.shape == meta.shape and value.dtype == meta.dtype
        return value


def _run_program(program, executor):
    """Forward, gradients with create_graph, and a second-order pass, all on `executor`."""
    with ag.use_executor(executor):
        leaves, pool = run(program, OursLib)
        loss = loss_of(program, OursLib, pool)
        inputs = [t for t in leaves if t.requires_grad]
        grads = ag.GradientComputer().compute_gradients(loss, inputs, create_graph=True, allow_unused=True)
        second = None
        terms = [g.sum() for g in grads if g is not None and g.requires_grad]
        if terms:
            second = ag.GradientComputer().compute_gradients(
                sum(terms[1:], terms[0]), inputs, allow_unused=True
            )
    return pool, grads, second


def _same(ours, theirs):
    assert (ours is None) == (theirs is None)
    if ours is not None:
        assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
        np.testing.assert_array_equal(ours.numpy(), theirs.numpy())


@given(programs())
def test_command_executor_gives_the_same_results_without_the_engine_reading_values(program):
    remote = CommandExecutor()
    r_pool, r_grads, r_second = _run_program(program, remote)
    assert remote.downloads == 0  # forward, backward and double backward ran on metadata alone
    pool, grads, second = _run_program(program, NumpyExecutor())
    for ours, theirs in zip(r_pool, pool, strict=True):
        _same(ours, theirs)
    for ours, theirs in zip(r_grads, grads, strict=True):
        _same(ours, theirs)
    assert (r_second is None) == (second is None)
    for ours, theirs in zip(r_second or (), second or (), strict=True):
        _same(ours, theirs)


def test_every_array_computation_of_backward_is_a_command():
    remote = CommandExecutor()
    with ag.use_executor(remote):
        x = ag.tensor(np.ones((2, 3)), requires_grad=True)
        b = ag.tensor(np.ones(3), requires_grad=True)
        y = x * b  # b is broadcast: its gradient must be summed back
        loss = (y + y).sum()  # two paths into y: their gradients must be added
        start = len(remote.commands)
        loss.backward()
    ops = [c[0] for c in remote.commands[start:]]
    assert ops[0] == "full"  # the seed gradient of 1
    assert "expand" in ops  # sum's backward
    assert "add" in ops  # paths converging on y
    # x's and b's gradients are products; b's is then summed over the axis it was broadcast along.
    assert ops.count("mul") == 2 and "sum" in ops
    assert remote.downloads == 0
    np.testing.assert_array_equal(b.grad.numpy(), [4.0, 4.0, 4.0])
    assert remote.downloads == 1


def test_ops_run_on_their_inputs_executor_not_the_current_one():
    remote = CommandExecutor()
    x = ag.tensor([1.0, 2.0], executor=remote, requires_grad=True)
    (x * 3.0).sum().backward()  # the default executor is current here
    assert x.grad.executor is remote and x.grad.numpy().tolist() == [3.0, 3.0]


def test_the_local_executor_implements_exactly_the_instruction_set():
    from simdist.autograd.numpy_executor import _KERNELS

    assert set(_KERNELS) == set(INSTRUCTIONS)


def test_executor_is_abstract():
    with pytest.raises(TypeError):
        Executor()  # type: ignore[abstract]
