"""A device model in a cluster file: a device built by hand or fitted keeps every figure through save and load.

Oracle: DeviceSpec equality (every field) between the device a cluster was built with and the one its saved file
loads; ``dataclasses.replace`` of a built-in device for a table that names a ``base``.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from simdist.compute.devices import A100, H100, DeviceSpec
from simdist.network import Cluster

_figures = st.floats(min_value=1e6, max_value=1e16, allow_nan=False)


@settings(max_examples=8, deadline=None)
@given(
    bandwidth=_figures, rate=_figures, launch=st.floats(0, 1e-3), host=st.floats(0, 1e-3), gemm=st.booleans()
)
def test_a_custom_device_round_trips_through_a_cluster_file(
    tmp_path_factory: pytest.TempPathFactory,
    bandwidth: float,
    rate: float,
    launch: float,
    host: float,
    gemm: bool,
) -> None:
    base = H100 if gemm else DeviceSpec("mine", {torch.float32: 1.0}, 1.0, memory_capacity=math.inf)
    device = dataclasses.replace(
        base, memory_bandwidth=bandwidth, peak_flops={**base.peak_flops, torch.bfloat16: rate},
        launch_overhead=launch, host_overhead=host,
    )  # fmt: skip
    cluster = Cluster.switch(2, bandwidth=1e9, latency=1e-6, device=device)
    for suffix in ("toml", "json"):
        path = tmp_path_factory.mktemp("c") / f"c.{suffix}"
        cluster.save(path)
        assert Cluster.from_file(path).device == device


def test_a_device_table_takes_a_base_and_refuses_what_is_not_a_figure(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(
        '[cluster]\nbuilder = "switch"\nn = 2\n\n[cluster.device]\nbase = "A100"\nmemory_bandwidth = 1.5e12\n\n'
        "[cluster.device.peak_flops]\nbfloat16 = 2.5e14\n"
    )
    device = Cluster.from_file(path).device
    assert device == dataclasses.replace(
        A100, memory_bandwidth=1.5e12, peak_flops={**A100.peak_flops, torch.bfloat16: 2.5e14}
    )
    path.write_text(
        '[cluster]\nbuilder = "switch"\nn = 2\n\n[cluster.device]\nbase = "H100"\n\n[cluster.device.peak_flops]\nfloat33 = 1e12\n'
    )
    with pytest.raises(
        ValueError, match=r"c.toml: \[cluster\] device.peak_flops: 'float33' is not a torch dtype"
    ):
        Cluster.from_file(path)


def test_an_attention_table_is_checked(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    head = '[cluster]\nbuilder = "switch"\nn = 2\n\n[cluster.device]\nbase = "H100"\n\n'
    path.write_text(head + '[cluster.device.attention]\nkernels = "flash"\n')
    with pytest.raises(ValueError, match=r"device.attention.kernels must be a list of tables"):
        Cluster.from_file(path)
    # false: no attention model (attention priced as its matmuls)
    path.write_text(head.replace('base = "H100"\n', 'base = "H100"\nattention = false\n'))
    assert Cluster.from_file(path).device == dataclasses.replace(H100, attention=None)
