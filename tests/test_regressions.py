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
    res = simdist.run(_parameters, switch(2))
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
