"""Behaviours a review of the core found wrong once; each test is the minimal program that showed it."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import simdist


def switch(n: int) -> simdist.Cluster:
    return simdist.Cluster.switch(n, device="cpu")


def _then_chain():
    t = torch.full((4,), float(dist.get_rank() + 1))
    fut = dist.all_reduce(t, async_op=True).get_future()
    chained = fut.then(lambda f: f.value()[0] * 2).then(lambda f: f.value() + 15)
    return chained.wait().tolist()


def test_future_then_chains_wait_in_simulated_time():
    assert simdist.run(_then_chain, switch(2)).returns == [[21.0] * 4] * 2


def _wait_all():
    t = torch.ones(4)
    futs = [dist.all_reduce(t, async_op=True).get_future()]
    torch.futures.wait_all(futs)
    torch.futures.collect_all(futs).wait()
    return t.tolist()


def test_wait_all_and_collect_all_on_simdist_futures():
    assert simdist.run(_wait_all, switch(2)).returns == [[2.0] * 4] * 2


def _parameters():
    p = torch.nn.Parameter(torch.full((4,), float(dist.get_rank() + 1)))
    dist.broadcast(p, src=0)
    a = p.detach().clone()
    w1 = dist.all_reduce(p, async_op=True)
    w2 = dist.all_reduce(p, async_op=True)  # starts from the simpy thread when the first one frees the stream
    w1.wait()
    w2.wait()
    return a.tolist(), p.detach().tolist(), p.grad_fn is None


def test_collectives_on_tensors_that_require_grad_record_no_autograd():
    # the two in-place all-reduces of one buffer are what the race detector reports; this test is about
    # autograd, so the detector is off
    res = simdist.run(_parameters, switch(2), races="off")
    assert res.returns == [([1.0] * 4, [4.0] * 4, True)] * 2


def _recv_any_in_subgroup(ranks):
    g = dist.new_group(ranks)
    me = dist.get_rank()
    if me == ranks[0]:
        t = torch.zeros(1)
        src = dist.recv(t, group=g)
        return src, t.item()
    if me == ranks[-1]:
        dist.send(torch.tensor([float(me)]), dst=ranks[0], group=g)
    return None


def test_recv_from_any_source_in_a_subgroup_names_the_global_sender():
    for ranks in ([1, 2, 3], [1, 3]):
        res = simdist.run(_recv_any_in_subgroup, switch(4), args=(ranks,))
        assert res.returns[ranks[0]] == (ranks[-1], float(ranks[-1]))


def _hook_issues_collective_others_join_later():
    rank = dist.get_rank()
    w = torch.nn.Parameter(torch.ones(2))
    works = []
    if rank == 0:
        w.register_post_accumulate_grad_hook(lambda p: works.append(dist.all_reduce(p.grad, async_op=True)))
        (w * 3).sum().backward()
        dist.send(torch.ones(1), dst=1)
        works[0].wait()
    else:
        dist.recv(torch.zeros(1), src=0)
        dist.all_reduce(torch.ones(2))
    return "ok"


def test_collective_issued_in_backward_may_complete_after_backward():
    assert simdist.run(_hook_issues_collective_others_join_later, switch(2)).returns == ["ok", "ok"]


def _environ():
    env = os.environ
    seen = {"get": env.get("RANK"), "in": "RANK" in env, "or": (env | {"X": "1"})["RANK"], "copy": env.copy()["RANK"]}
    env["WORLD_SIZE"] = "99"
    seen["set"] = env["WORLD_SIZE"]
    seen["pop"] = env.pop("MASTER_ADDR", None)
    seen["after_pop"] = "MASTER_ADDR" in env
    return seen


def test_os_environ_in_rank_code_behaves_like_a_process_environment():
    before = os.environ.get("WORLD_SIZE")
    res = simdist.run(_environ, switch(2))
    for r in range(2):
        assert res.returns[r] == {"get": str(r), "in": True, "or": str(r), "copy": str(r), "set": "99", "pop": "127.0.0.1", "after_pop": False}
    assert os.environ.get("WORLD_SIZE") == before  # a rank's writes never reach the real environment


def test_rank_code_helpers_are_no_ops_outside_a_run():
    simdist.set_algorithms(all_reduce="tree")  # as under real: only checks its arguments
    simdist.charge(1.0)
    assert simdist.now() == 0.0


def _charge_bad(value):
    simdist.charge(value)


def test_charge_refuses_nan_inf_and_negative_and_accepts_unit_strings():
    import pytest

    for bad in (float("nan"), float("inf"), -1.0):
        with pytest.raises(simdist.RankError, match="ValueError"):
            simdist.run(_charge_bad, switch(1), args=(bad,))
    res = simdist.run(_charge_bad, switch(1), args=("250us",))
    assert res.sim_time == 250e-6


def test_a_user_built_device_spec_and_a_preset_name_can_be_run():
    import dataclasses

    import pytest

    from simdist.compute import get_device

    slow = dataclasses.replace(get_device("H100"), name="H100-slow-launch", launch_overhead=1e-3)
    cluster = simdist.Cluster.switch(2, device=slow)
    res = simdist.run(lambda_free_add, cluster)
    # four aten ops (ones, add, sum, item), each one launch; their roofline time is nanoseconds. The host
    # launches the first before the device starts; the others while the device runs the one before
    assert res.sim_time == pytest.approx(4 * 1e-3 + slow.host_overhead, rel=1e-6)
    assert simdist.run(lambda_free_add, "cpu-ethernet").world_size == 4


def lambda_free_add():
    return (torch.ones(4) + 1).sum().item()


def test_an_algorithm_that_does_not_implement_a_collective_is_a_cluster_spec_error():
    import pytest

    with pytest.raises(simdist.ClusterSpecError, match="does not implement all_to_all"):
        simdist.Cluster.ring(4, algorithms={"all_to_all": "ring"})


def test_auto_never_picks_a_slower_algorithm_than_the_ones_it_could_have_picked():
    # simdist's own auto (the alpha-beta model); under NCCL's model auto is NCCL's tuner's choice, which may be
    # slower than a pinned ring once the NVLS pipeline fills, as in NCCL (tests/test_nccl_model.py)
    from simdist.bench import bench

    ab = {"world_size": 16, "collective_model": "alpha-beta"}
    cluster = simdist.Cluster.preset("dgx-h100", **ab)
    auto = bench(cluster, "all_reduce", 8 << 20, 8 << 20)[0]
    for algo in ("ring", "rhd", "tree"):
        fixed = simdist.Cluster.preset("dgx-h100", **ab, algorithms={"all_reduce": algo})
        assert auto.time_us <= bench(fixed, "all_reduce", 8 << 20, 8 << 20)[0].time_us * 1.001


def test_trace_reports_the_algorithm_that_ran_and_p2p_names_like_the_profiler():
    from simdist.bench import bench

    cluster = simdist.Cluster.ring(6, device="cpu", algorithms={"reduce_scatter": "rhd"})
    assert bench(cluster, "reduce_scatter", 256, 256)[0].algorithm == "ring"  # rhd needs a power of two
    res = simdist.run(_p2p_pair, switch(2))
    assert {s.name for s in res.trace.spans if s.stream == "p2p"} == {"nccl:send", "nccl:recv"}


def _p2p_pair():
    if dist.get_rank() == 0:
        dist.send(torch.ones(2), dst=1)
    else:
        dist.recv(torch.zeros(2), src=0)


def test_bench_products_do_not_overflow_at_many_ranks():
    from simdist.bench import bench

    rows = bench(switch(16), "all_reduce", 64, 64, dtype="int32", redop="prod")
    assert rows[0].wrong == 0


def test_cli_exit_status_two_for_a_script_that_cannot_be_loaded(tmp_path, capsys):
    from simdist.cli import main

    assert main(["run", str(tmp_path / "missing.py")]) == 2
    bad = tmp_path / "bad.py"
    bad.write_text("def main(:\n")
    assert main(["run", str(bad)]) == 2
    assert "SyntaxError" in capsys.readouterr().err
