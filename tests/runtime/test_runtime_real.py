"""The runtime's client and worker over a real channel: a worker process on loopback, values as local."""

from __future__ import annotations

import numpy as np
import pytest
from test_runtime_sim import train

from real.runtime import run_remote


@pytest.mark.real
def test_training_against_a_worker_process_equals_local_execution():
    local = train(3, 4, 5)
    res = run_remote(train, 3, 4, 5)
    for got, want in zip(res.value[:2], local[:2]):
        np.testing.assert_array_equal(got, want)
    assert res.value[2] == local[2]
    assert res.stats.ops_total == res.sent["op"] and res.stats.failures == {}
    assert res.sent["free"] > 0 and res.wall_seconds > 0
