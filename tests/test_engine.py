"""The engine: determinism, RNG isolation, torchrun environment, thread hygiene, scale."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import simdist


def mlp_step(width: int = 16):
    """A 2-layer MLP forward/backward plus an all-reduce of its gradients (the benchmark's step)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 1))
    torch.manual_seed(dist.get_rank())
    x = torch.randn(8, width)
    model(x).pow(2).mean().backward()
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    dist.all_reduce(flat)
    return flat.div_(dist.get_world_size())


def test_same_inputs_give_same_trace_hash():
    c = simdist.Cluster.ring(4, bandwidth="100GB/s", latency="5us", device="H100")
    a = simdist.run(mlp_step, c, seed=3)
    b = simdist.run(mlp_step, c, seed=3)
    assert a.trace_hash == b.trace_hash
    assert a.sim_time == b.sim_time > 0
    other = simdist.run(mlp_step, simdist.Cluster.ring(4, bandwidth="10GB/s", latency="5us", device="H100"), seed=3)
    assert other.trace_hash != a.trace_hash


_HASH_SCRIPT = """
import simdist, sys
sys.path.insert(0, {tests!r})
from test_engine import mlp_step
c = simdist.Cluster.two_level(2, 4, device="H100")
print(simdist.run(mlp_step, c, seed=7).trace_hash)
"""


def test_trace_hash_is_stable_across_processes_and_hash_seeds():
    # this process is one side, another process with another hash seed the other
    other_seed = "12345" if os.environ.get("PYTHONHASHSEED") == "0" else "0"
    code = _HASH_SCRIPT.format(tests=os.path.dirname(__file__))
    env = {**os.environ, "PYTHONHASHSEED": other_seed}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    here = simdist.run(mlp_step, simdist.Cluster.two_level(2, 4, device="H100"), seed=7).trace_hash
    assert out.stdout.strip().splitlines()[-1] == here
    assert len(here) == 64


def _rng_draws():
    torch.manual_seed(dist.get_rank())
    a = torch.rand(3)
    dist.barrier()  # other ranks run and draw in between
    b = torch.rand(3)
    return torch.cat([a, b])


def test_rank_rng_behaves_as_in_separate_processes():
    res = simdist.run(_rng_draws, simdist.Cluster.switch(4, device="cpu"))
    for r in range(4):
        torch.manual_seed(r)
        want = torch.cat([torch.rand(3), torch.rand(3)])
        assert torch.equal(res.returns[r], want)


def test_callers_rng_and_threads_are_restored():
    torch.manual_seed(123)
    before = torch.get_rng_state()
    n_threads = threading.active_count()
    simdist.run(_rng_draws, simdist.Cluster.switch(4, device="cpu"))
    assert torch.equal(torch.get_rng_state(), before)
    assert threading.active_count() == n_threads
    with pytest.raises(simdist.RankError):
        simdist.run(_raise_on_2, simdist.Cluster.switch(4, device="cpu"))
    assert threading.active_count() == n_threads
    assert not dist.is_initialized()


def _env():
    return (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"], dist.get_backend(), dist.is_initialized())


def test_torchrun_environment_per_rank():
    res = simdist.run(_env, simdist.Cluster.two_level(2, 2, device="cpu"))
    assert [r[0] for r in res.returns] == ["0", "1", "2", "3"]
    assert {r[1] for r in res.returns} == {"4"}
    assert [r[2] for r in res.returns] == ["0", "1", "0", "1"]
    assert {r[3] for r in res.returns} == {"simdist"}


def _user_init_and_destroy():
    dist.init_process_group(backend="simdist")  # what torchrun-style code does; tolerated
    t = torch.ones(2)
    dist.all_reduce(t)
    dist.destroy_process_group()
    assert not dist.is_initialized()
    dist.init_process_group()  # and again after destroying it
    dist.all_reduce(t)
    dist.destroy_process_group()
    return t.tolist()


def test_user_init_process_group_is_tolerated():
    res = simdist.run(_user_init_and_destroy, simdist.Cluster.switch(3, device="cpu"))
    assert res.returns == [[9.0, 9.0]] * 3


def _init_gloo():
    dist.init_process_group(backend="gloo")


def test_init_with_another_backend_is_a_clear_error():
    with pytest.raises(simdist.RankError, match="already exists with the 'simdist' backend"):
        simdist.run(_init_gloo, simdist.Cluster.switch(2, device="cpu"))


def _raise_on_2():
    if dist.get_rank() == 2:
        raise KeyError("boom")
    dist.barrier()


def test_rank_exception_names_rank_and_traceback():
    with pytest.raises(simdist.RankError) as ei:
        simdist.run(_raise_on_2, simdist.Cluster.switch(4, device="cpu"))
    assert ei.value.rank == 2
    assert isinstance(ei.value.exc, KeyError)
    assert "_raise_on_2" in str(ei.value) and "boom" in str(ei.value)


def _mismatch():
    t = torch.ones(3, dtype=torch.float32 if dist.get_rank() != 1 else torch.float64)
    dist.all_reduce(t)


def _order_mismatch():
    t = torch.ones(3)
    if dist.get_rank() == 0:
        dist.broadcast(t, src=0)
        dist.all_reduce(t)
    else:
        dist.all_reduce(t)
        dist.broadcast(t, src=0)


@pytest.mark.parametrize("fn,needle", [(_mismatch, "dtype=float64"), (_order_mismatch, "broadcast(")])
def test_mismatched_collectives_name_each_rank_and_site(fn, needle):
    with pytest.raises(simdist.CollectiveMismatchError) as ei:
        simdist.run(fn, simdist.Cluster.switch(3, device="cpu"))
    text = str(ei.value)
    assert needle in text
    # every rank is named once, on the line of what it issued; the odd one out first
    lines = text.splitlines()[1:3]
    assert lines[0].startswith("  rank ") and needle in lines[0]
    named = {lines[0].split(":")[0].strip(), lines[1].split(":")[0].strip()}
    assert named in ({"rank 1", "ranks 0, 2"}, {"rank 0", "ranks 1-2"}), lines
    assert "test_engine.py" in text


def _hang():
    if dist.get_rank() != 0:
        dist.all_reduce(torch.ones(1))


def _p2p_hang():
    dist.recv(torch.zeros(1), src=(dist.get_rank() + 1) % dist.get_world_size())


def test_deadlock_lists_what_each_rank_waits_on():
    with pytest.raises(simdist.DeadlockError) as ei:
        simdist.run(_hang, simdist.Cluster.switch(3, device="cpu"))
    text = str(ei.value)
    assert "rank 0: finished" in text
    assert "never issued by rank 0;" in text
    assert "ranks 1-2: waits in all_reduce #0" in text
    with pytest.raises(simdist.DeadlockError, match="recv from rank 1"):
        simdist.run(_p2p_hang, simdist.Cluster.switch(3, device="cpu"))


def _group_timeout():
    dist.init_process_group("simdist", timeout=timedelta(seconds=2))
    if dist.get_rank() == 0:
        simdist.charge(5.0)
    dist.all_reduce(torch.ones(1))


def _wait_timeout():
    if dist.get_rank() == 0:
        simdist.charge(1.0)  # rank 0 joins one simulated second late
        dist.all_reduce(torch.ones(1))
        return "ok"
    w = dist.all_reduce(torch.ones(1), async_op=True)
    try:
        w.wait(timeout=timedelta(milliseconds=10))
    except dist.DistBackendError as e:
        return f"timeout: {e}"
    return "no timeout"


def test_simulated_timeouts_raise_like_torch():
    with pytest.raises(simdist.RankError) as ei:
        simdist.run(_group_timeout, simdist.Cluster.switch(2, device="cpu"))
    assert isinstance(ei.value.exc, simdist.SimTimeoutError)
    assert isinstance(ei.value.exc, dist.DistBackendError)
    assert "Not issued by rank 0." in str(ei.value)
    res = simdist.run(_wait_timeout, simdist.Cluster.switch(2, device="cpu"))
    assert res.returns[0] == "ok"
    assert res.returns[1].startswith("timeout: Timed out after 0.01 s")


def _slow_all_reduce():
    simdist.set_algorithms(all_reduce="ring")
    w = dist.all_reduce(torch.ones(1 << 20), async_op=True)  # 4 MiB at 1 GB/s: milliseconds per step
    try:
        w.wait(timeout=timedelta(microseconds=100))
    except dist.DistBackendError as e:
        return str(e)
    return "no timeout"


def test_a_timeout_while_the_collective_runs_shows_its_schedule_and_progress():
    res = simdist.run(_slow_all_reduce, simdist.Cluster.ring(4, bandwidth="1GB/s", latency="1us", device="cpu"))
    text = res.returns[0]
    assert text.startswith("Timed out after 0.0001 s of simulated time: rank 0 waits in all_reduce #0")
    assert "Every rank issued it; it was still running. Its schedule:" in text
    schedule = text.split("Its schedule:\n", 1)[1].splitlines()
    assert schedule[0].split()[:3] == ["step", "rank", "0"]
    assert len(schedule) == 1 + 2 * 3 + 1  # header, 2(n-1) steps, the legend
    # 100 us into a ring all-reduce whose first step takes about 1 ms, no rank has finished step 0
    assert all(" *" in line for line in schedule[1:7]) and schedule[-1] == "* not yet done"


def test_world_size_zero_and_bad_cluster_are_clear_errors():
    with pytest.raises(simdist.ClusterSpecError):
        simdist.Cluster.ring(0)
    with pytest.raises(simdist.ClusterSpecError):
        simdist.Cluster.ring(4, bandwidth="-3GB/s")
    with pytest.raises(simdist.ClusterSpecError, match="dgx-h100"):
        simdist.Cluster.preset("dgx-h10")


def test_chrome_trace_export(tmp_path):
    import json

    res = simdist.run(mlp_step, simdist.Cluster.ring(4, device="H100"))
    path = res.trace.save_chrome(tmp_path / "step.json")
    data = json.loads(path.read_text())
    ev = data["traceEvents"]
    spans = [e for e in ev if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1, 2, 3}
    assert any(e["name"].startswith("aten::") and e["tid"] == 0 for e in spans)
    coll = [e for e in spans if e["name"] == "nccl:all_reduce"]
    assert len(coll) == 4 and coll[0]["args"]["Collective name"] == "all_reduce" and coll[0]["args"]["Group size"] == 4
    flows = [e for e in ev if e["ph"] in ("s", "f")]
    assert flows and len(flows) == 2 * res.messages
    names = {(e["pid"], e["args"]["name"]) for e in ev if e["ph"] == "M" and e["name"] == "thread_name"}
    assert (0, "compute") in names


@pytest.mark.slow
def test_1024_ranks():
    c = simdist.Cluster.switch(1024, bandwidth="50GB/s", latency="5us", device="H100")
    res = simdist.run(mlp_step, c, trace="collectives")
    ref = res.returns[0]
    assert all(torch.equal(r, ref) for r in res.returns)
    # the oracle: the mean of every rank's local gradient, computed here one rank after another
    grads = []
    for rank in range(1024):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        torch.manual_seed(rank)
        model(torch.randn(8, 16)).pow(2).mean().backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    torch.testing.assert_close(ref, torch.stack(grads).mean(0), rtol=1e-4, atol=1e-6)
    assert res.sim_time > 0


def _fails_in_user_code() -> None:
    raise ValueError("from the user's code")


def test_a_ranks_traceback_starts_at_the_users_code() -> None:
    """The traceback a RankError shows begins with the rank function's frame: none of simdist's own frames above."""
    with pytest.raises(simdist.RankError) as info:
        simdist.run(_fails_in_user_code, simdist.Cluster.ring(2))
    text = info.value.traceback_text
    frames = [line for line in text.splitlines() if line.lstrip().startswith('File "')]
    assert frames and "_fails_in_user_code" in frames[0] and "test_engine.py" in frames[0], text
    assert "simdist" + os.sep not in text.split("ValueError")[0], text
