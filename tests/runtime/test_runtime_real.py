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


@pytest.mark.real
def test_every_fix_on_a_real_worker_with_its_compile_thread_equals_local_execution():
    from test_buffering import FIXES, loop

    program = ((4, 8, 1), "tanh", 6, True, 0)
    want = loop(*program)
    compiled = {}
    for policy in FIXES:
        res = run_remote(loop, *program, policy=policy)
        for got, ref in zip(res.value[0], want[0]):
            np.testing.assert_array_equal(got, ref)
        assert res.failure_kinds == [] and res.stats.failures == {}, policy
        compiled[policy] = res.stats.ops_compiled
    # How much gets compiled depends on real timing (a fix may give up a batch it would have to wait for),
    # but batches do run on the compile thread.
    assert any(compiled.values()), compiled
