"""The host's time to launch kernels, on a host that runs ahead of its GPU: host time that overlaps with the
kernels already queued, so a chain of small kernels is bound by the host on an idle stream and by the device
behind a busy one. Closed forms on a device whose figures make each regime plain."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import simdist
from simdist.compute import DeviceSpec, get_device
from simdist.errors import ClusterSpecError

N = 1000
#: bytes one add of two N-element float32 tensors moves: two inputs and an output
ADD_BYTES = 3 * N * 4
US = 1e-6


def device(host_us: float, kernel_us: float) -> DeviceSpec:
    """A GPU whose add of N floats takes ``kernel_us`` on the device and ``host_us`` for the host to launch."""
    return DeviceSpec(
        "launch-chip",
        peak_flops={torch.float32: 1e15},
        memory_bandwidth=ADD_BYTES / ((kernel_us - 1) * US),
        launch_overhead=1 * US,  # the kernel's own fixed time on the device, part of kernel_us
        host_overhead=host_us * US,
    )


def chain(kernels: int, busy_s: float) -> float:
    """Rank code: ``kernels`` adds after ``busy_s`` of device work queued ahead; the seconds until all are done."""
    a, b = torch.ones(N, device="cuda"), torch.ones(N, device="cuda")
    simdist.synchronize()
    start = simdist.now()
    if busy_s:
        simdist.charge(busy_s)  # a kernel simdist does not run: no host launch
    for _ in range(kernels):
        torch.add(a, b)
    simdist.synchronize()
    return simdist.now() - start


def run_chain(spec: DeviceSpec, kernels: int, busy_s: float = 0.0) -> float:
    return simdist.run(chain, simdist.Cluster.switch(1, device=spec), args=(kernels, busy_s)).returns[0]


@settings(max_examples=25, deadline=None)
@given(kernels=st.integers(1, 12), host_us=st.integers(1, 30), kernel_us=st.integers(2, 30))
def test_on_an_idle_stream_each_kernel_waits_for_its_launch(
    kernels: int, host_us: int, kernel_us: int
) -> None:
    # kernel i is launched by (i + 1) x host and starts then or when kernel i - 1 ends: the slower of the two
    # sets the pace after the first launch
    expected = host_us + kernel_us + (kernels - 1) * max(host_us, kernel_us)
    assert run_chain(device(host_us, kernel_us), kernels) == pytest.approx(expected * US, rel=1e-9)


@settings(max_examples=25, deadline=None)
@given(kernels=st.integers(1, 12), host_us=st.integers(1, 30), kernel_us=st.integers(2, 30))
def test_behind_a_busy_stream_launches_cost_the_device_nothing(
    kernels: int, host_us: int, kernel_us: int
) -> None:
    busy_us = kernels * host_us + 1  # the host has launched them all before the queued work ends
    expected = busy_us + kernels * kernel_us
    assert run_chain(device(host_us, kernel_us), kernels, busy_us * US) == pytest.approx(
        expected * US, rel=1e-9
    )


def test_without_a_host_overhead_the_host_launches_in_no_time() -> None:
    spec = dataclasses.replace(device(10, 13), host_overhead=0.0)
    assert run_chain(spec, 5) == pytest.approx(5 * 13 * US, rel=1e-9)


def test_the_gpu_presets_launch_at_the_measured_host_time() -> None:
    for name in ("H100", "H200", "A100", "A100-40GB"):
        assert get_device(name).host_overhead == 7.0e-6
    assert get_device("cpu").host_overhead == 0.0 and get_device("cpu").is_zero_cost


@pytest.mark.parametrize("bad", [-1e-6, float("inf"), float("nan")])
def test_an_invalid_host_overhead_is_refused(bad: float) -> None:
    with pytest.raises(ClusterSpecError, match="host_overhead must be a finite number of seconds >= 0"):
        dataclasses.replace(device(1, 2), host_overhead=bad)


def test_a_host_synchronous_rank_pays_each_kernel_once() -> None:
    # under gloo-like progress the host waits for its compute: a kernel's launch is not added to its time
    spec = device(10, 13)
    assert simdist.run(chain, simdist.Cluster.switch(1, device=spec), args=(5, 0.0), progress="gloo").returns[
        0
    ] == pytest.approx(5 * 13 * US, rel=1e-9)
