"""The remote-tensor runtime in simulated time: values against local execution, the link, frees, failures."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from runtime_mlp import train

import simdist.autograd as ag
from simdist.errors import RankError, SimdistError
from simdist.runtime import LinkSpec, RemoteError, RuntimeConfigError, Worker, simulate
from simdist.runtime.commands import Op


@given(
    steps=st.integers(1, 4),
    width=st.integers(1, 6),
    seed=st.integers(0, 2**16),
    jitter=st.sampled_from([0.0, 1e-6, 50e-6]),
)
def test_training_through_the_runtime_equals_local_execution(steps, width, seed, jitter):
    local = train(steps, width, seed)
    res = simulate(train, steps, width, seed, seed=seed, link=LinkSpec(jitter=jitter))
    for got, want in zip(res.value[:2], local[:2]):
        np.testing.assert_array_equal(got, want)
    assert res.value[2] == local[2]
    assert res.stats.ops_total == res.sent["op"] and res.stats.ops_eager == res.sent["op"]
    assert res.stats.failures == {}
    # every handle the client dropped was freed on the worker: what is left is what was alive at the end
    assert len(res.worker.store) == res.sent["put"] + res.sent["op"] - res.sent["free"]


def test_deliveries_are_in_order_and_follow_latency_bandwidth_and_seeded_jitter():
    spec = LinkSpec(latency=10e-6, bandwidth=1e9, jitter=20e-6)
    a = simulate(train, 2, 3, 0, seed=7, link=spec)
    b = simulate(train, 2, 3, 0, seed=7, link=spec)
    c = simulate(train, 2, 3, 0, seed=8, link=spec)
    assert a.deliveries == b.deliveries and a.sim_time == b.sim_time
    assert a.deliveries != c.deliveries
    for direction in ("client->worker", "worker->client"):
        ds = [d for d in a.deliveries if d.direction == direction]
        assert all(x.arrived <= y.arrived for x, y in itertools.pairwise(ds))  # FIFO
        assert all(d.arrived >= d.sent + spec.latency for d in ds)
    puts = [d for d in a.deliveries if " put " in d.what]
    nbytes = 64 + 4 * 3 * 8  # header + the (4, 3) float64 first weight
    assert puts[0].arrived >= puts[0].sent + spec.latency + nbytes / spec.bandwidth
    assert puts[0].arrived <= puts[0].sent + spec.latency + nbytes / spec.bandwidth + spec.jitter + 1e-12


def test_a_slower_link_makes_a_longer_session():
    fast = simulate(train, 2, 3, 0, link=LinkSpec(latency=1e-6))
    slow = simulate(train, 2, 3, 0, link=LinkSpec(latency=100e-6))
    # every fetch (a loss per step, the two weights) is a round trip: 2 x 99 us more each, at least
    assert slow.sent["fetch"] == 4
    assert slow.sim_time - fast.sim_time >= slow.sent["fetch"] * 2 * 99e-6 - 1e-12


class ForgetfulWorker(Worker):
    """Loses the output of the first matmul, as a worker with a broken store would."""

    def run_eager(self, cmd: Op) -> bool:
        ok = super().run_eager(cmd)
        if cmd.op == "matmul" and not getattr(self, "forgot", False):
            self.forgot = True
            del self.store[cmd.outputs[0]]
        return ok


def test_a_missing_input_fails_the_next_fetch_naming_the_command():
    with pytest.raises(RankError) as e:
        simulate(train, 1, 3, 0, worker=ForgetfulWorker())
    err = e.value.exc
    assert isinstance(err, RemoteError) and isinstance(err, SimdistError) and isinstance(err, RuntimeError)
    assert "Input tensor not found: t" in str(err) and "tanh(" in str(err) and "[forward]" in str(err)


def _phases():
    x = ag.tensor(np.ones(3), requires_grad=True)
    (x * x).sum().backward()
    return x.grad.numpy()


def test_ops_are_tagged_forward_or_backward():
    res = simulate(_phases)
    kinds = [d.what.rsplit("[", 1)[-1].rstrip("]") for d in res.deliveries if d.what.endswith("]")]
    assert kinds[:2] == ["forward", "forward"] and "backward" in kinds
    np.testing.assert_array_equal(res.value, [2.0, 2.0, 2.0])


@pytest.mark.parametrize("field,value", [("latency", -1.0), ("bandwidth", 0.0), ("jitter", float("nan"))])
def test_bad_link_specs_are_rejected(field, value):
    with pytest.raises(RuntimeConfigError, match=f"LinkSpec.{field}"):
        LinkSpec(**{field: value})
