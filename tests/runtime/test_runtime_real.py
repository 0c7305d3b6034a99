"""The runtime's client and worker over a real channel: a worker process on loopback, values as local."""

from __future__ import annotations

from multiprocessing import Pipe

import numpy as np
import pytest
from test_runtime_sim import train

from real.errors import RealError
from real.runtime import RemoteTimeoutError, _Channel, run_remote
from simdist.errors import SimdistError

#: seconds the worker process gets to start and to answer each request: run_remote's default (60 s) is a
#: budget a busy machine can miss while starting a process; these tests are about results, not speed
PATIENT = 240.0


@pytest.mark.real
def test_training_against_a_worker_process_equals_local_execution():
    local = train(3, 4, 5)
    res = run_remote(train, 3, 4, 5, timeout=PATIENT)
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
        res = run_remote(loop, *program, policy=policy, timeout=PATIENT)
        for got, ref in zip(res.value[0], want[0]):
            np.testing.assert_array_equal(got, ref)
        assert res.failure_kinds == [] and res.stats.failures == {}, policy
        compiled[policy] = res.stats.ops_compiled
    # How much gets compiled depends on real timing (a fix may give up a batch it would have to wait for),
    # but batches do run on the compile thread.
    assert any(compiled.values()), compiled


def test_a_worker_that_does_not_answer_is_a_timeout_error_saying_what_to_do():
    ours, _theirs = Pipe()
    message = r"did not answer close within 0.01 s.*run_remote\(timeout="
    with pytest.raises(RemoteTimeoutError, match=message) as e:
        _Channel(ours, timeout=0.01).close()
    assert all(isinstance(e.value, base) for base in (TimeoutError, RealError, SimdistError))
