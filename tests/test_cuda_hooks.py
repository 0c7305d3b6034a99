"""Parameters moved to a simulated GPU keep their hooks and attributes, as on a GPU: tensor hooks and
post-accumulate-grad hooks registered before or after ``model.to("cuda")`` (or ``.cuda()``, a dtype change there,
``p.data = host``) fire as often and see the same gradients as in the program's CPU twin, gradients accumulate
across backward passes, and a data-parallel program built on such hooks averages its gradients; under
``simdist.run`` (with and without memory accounting), in a process emulating CUDA by itself, and on real gloo
processes with emulated devices (``python -m real --emulate-cuda``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from cuda_hook_fns import PLANS, Plan, all_of_them, hooked_ddp, hooked_moves, single_process_grads
from hypothesis import given
from hypothesis import strategies as st

import real
import simdist
from simdist.cudart.process import emulated_process

ONE = simdist.Cluster.switch(1, device="H100")
PAIR = simdist.Cluster.switch(2, device="H100")

plans = st.builds(
    Plan,
    before=st.booleans(),
    after=st.booleans(),
    method_cuda=st.booleans(),
    to_double=st.booleans(),
    host_data=st.booleans(),
    backwards=st.integers(1, 3),
)


def _assert_as_the_twin(got: dict[str, Any], plan: Plan, device: str) -> None:
    """``got`` (the program on a GPU) equals the program's CPU twin, run here in plain torch: the oracle."""
    twin = hooked_moves("cpu", plan)
    assert [s[:3] for s in got["seen"]] == [s[:3] for s in twin["seen"]]
    assert all(torch.equal(a[3], b[3]) for a, b in zip(got["seen"], twin["seen"])), "a hook saw other values"
    assert got["grads"].keys() == twin["grads"].keys()
    assert all(torch.equal(got["grads"][n], twin["grads"][n]) for n in twin["grads"])
    assert got["attributes"] == twin["attributes"] and got["kept"] == twin["kept"]
    assert got["device"] == ("cpu" if plan.host_data else device)


@given(plan=plans, memory=st.booleans())
def test_hooks_fire_as_in_the_cpu_twin_under_simdist(plan: Plan, memory: bool) -> None:
    got = simdist.run(hooked_moves, ONE, args=("cuda", plan), memory=memory).returns[0]
    _assert_as_the_twin(got, plan, "cuda:0")


@given(plan=plans)
def test_hooks_fire_as_in_the_cpu_twin_in_a_process_emulating_cuda(plan: Plan) -> None:
    # the process's memory accounting puts a post-accumulate-grad hook on every parameter as it is made
    with emulated_process(1):
        got = hooked_moves("cuda", plan)
    _assert_as_the_twin(got, plan, "cuda:0")


def test_a_data_parallel_program_built_on_post_accumulate_grad_hooks_averages() -> None:
    average = single_process_grads(2)
    for memory in (False, True):
        for grads in simdist.run(hooked_ddp, PAIR, args=("cuda",), memory=memory).returns:
            assert all(torch.equal(grads[n], average[n]) for n in average), f"memory={memory}"


@pytest.mark.real
def test_on_real_processes_with_emulated_cuda_hooks_fire_as_in_the_cpu_twin() -> None:
    # one launch runs every plan and the data-parallel program
    launched = real.run(all_of_them, 2, backend="nccl", emulate_cuda=True, timeout=240)
    average = single_process_grads(2)
    for rank, out in enumerate(launched.returns):
        for plan, got in zip(PLANS, out["plans"]):
            _assert_as_the_twin(got, plan, f"cuda:{rank}")
        assert all(torch.equal(out["ddp"][n], average[n]) for n in average), f"rank {rank}"
