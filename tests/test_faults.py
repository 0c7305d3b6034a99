"""simdist.faults: each fault against its closed form or an oracle run, determinism, and bad fault specs."""

from __future__ import annotations

import datetime
import json
import math
import os

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

import simdist
from simdist.faults import Crash, FlappingLink, LinkDown, MessageDelay, NodeLoss, SlowLink, Straggler

BW = 1e9  # bytes/s
LAT = 1e-6  # seconds
NBYTES = 4000  # a 1000-element float32 message


def ring(n: int = 4) -> simdist.Cluster:
    return simdist.Cluster.ring(n, bandwidth=BW, latency=LAT, device="cpu")


def steps(n: int = 3, seconds: float = 1e-3) -> float:
    """``n`` steps of ``seconds`` of compute and an all-reduce; returns the sum."""
    t = torch.ones(1000)
    for _ in range(n):
        simdist.charge(seconds)
        dist.all_reduce(t)
    return t[0].item()


def one_send() -> float:
    """Rank 0 sends 1000 float32 to rank 1 at time 0; rank 1 returns when it arrived (simulated seconds)."""
    t = torch.ones(1000)
    if dist.get_rank() == 0:
        dist.send(t, 1)
    elif dist.get_rank() == 1:
        dist.recv(t, 0)
    return simdist.now()


def run(fn, cluster, faults=(), **kw) -> simdist.RunResult:
    return simdist.run(
        fn, cluster, compute=False, faults=faults if isinstance(faults, list) else list(faults), **kw
    )


# ------------------------------------------------------------------ the records


ALL = [
    Crash(rank=1, at=0.5),
    Crash(rank=0, collective=3),
    Straggler(rank=[2, 1], slowdown=2.5, window=(0.0, 1.0)),
    SlowLink(link=[0, "ib"], bandwidth_factor=0.25, latency=1e-6, window=(0.1, math.inf)),
    FlappingLink(link=3, period=1e-3, down=2e-4),
    MessageDelay(src=0, dst=[1, 2], delay=1e-5),
    LinkDown(link=2, at=0.25),
    NodeLoss(node=1, at=0.0),
]


@pytest.mark.parametrize("fault", ALL, ids=lambda f: type(f).__name__)
def test_a_fault_survives_json_and_is_rebuilt_by_its_class_name(fault) -> None:
    data = json.loads(json.dumps(fault.to_json()))
    kind = data.pop("type")
    assert getattr(simdist.faults, kind)(**data) == fault
    assert simdist.faults.from_json(fault.to_json()) == fault
    hash(fault)  # frozen: usable as a key, as a replay token's set of faults is


# ------------------------------------------------------------------ stragglers


@settings(max_examples=3, deadline=None)
@given(slowdown=st.floats(1.0, 6.0), rank=st.integers(0, 3))
def test_a_straggler_slows_every_step_by_its_extra_compute(slowdown: float, rank: int) -> None:
    plain = run(steps, ring())
    slow = run(steps, ring(), [Straggler(rank=rank, slowdown=slowdown)])
    # every rank waits for the straggler in each all-reduce: each of the 3 steps takes (slowdown - 1) x 1 ms more
    assert slow.sim_time == pytest.approx(plain.sim_time + 3 * (slowdown - 1) * 1e-3, rel=1e-9)
    assert slow.returns == plain.returns


def test_a_stragglers_window_slows_only_the_ops_that_start_inside_it() -> None:
    plain = run(steps, ring())
    # the second step's compute starts at 1 ms + one all-reduce: a window [0.5 ms, 1.5 ms) holds it alone
    slow = run(steps, ring(), [Straggler(rank=0, slowdown=3.0, window=(0.5e-3, 1.5e-3))])
    assert slow.sim_time == pytest.approx(plain.sim_time + 2e-3, rel=1e-9)


# ------------------------------------------------------------------ links


def test_an_unfaulted_send_costs_bytes_over_bandwidth_plus_latency() -> None:
    res = run(one_send, ring(2))
    assert res.returns[1] == pytest.approx(NBYTES / BW + LAT, rel=1e-12)


@settings(max_examples=3, deadline=None)
@given(factor=st.floats(0.05, 1.0), added=st.floats(0.0, 1e-4))
def test_a_slow_link_takes_bytes_over_its_reduced_bandwidth_plus_its_added_latency(
    factor: float, added: float
) -> None:
    link = ring(2).route(0, 1)[0]
    res = run(one_send, ring(2), [SlowLink(link=link, bandwidth_factor=factor, latency=added)])
    assert res.returns[1] == pytest.approx(NBYTES / (BW * factor) + LAT + added, rel=1e-12)


def test_a_slow_links_window_leaves_transfers_outside_it_alone() -> None:
    link = ring(2).route(0, 1)[0]
    res = run(one_send, ring(2), [SlowLink(link=link, bandwidth_factor=0.1, window=(1.0, 2.0))])
    assert res.returns[1] == pytest.approx(NBYTES / BW + LAT, rel=1e-12)


def test_a_transfer_waits_for_a_flapping_link_to_come_up() -> None:
    link = ring(2).route(0, 1)[0]
    res = run(one_send, ring(2), [FlappingLink(link=link, period=1e-3, down=4e-4)])
    assert res.returns[1] == pytest.approx(4e-4 + NBYTES / BW + LAT, rel=1e-12)


def test_a_message_delay_adds_to_the_arrival_of_messages_between_its_ranks_only() -> None:
    res = run(one_send, ring(2), [MessageDelay(src=0, dst=1, delay=3e-5)])
    assert res.returns[1] == pytest.approx(NBYTES / BW + LAT + 3e-5, rel=1e-12)
    other = run(one_send, ring(2), [MessageDelay(src=1, dst=0, delay=3e-5)])
    assert other.returns[1] == pytest.approx(NBYTES / BW + LAT, rel=1e-12)


def two_gpus() -> simdist.Cluster:
    """One node of two GPUs: NVLink through the node's switch, and a detour through the fabric switch "ib"."""
    return simdist.Cluster.two_level(
        1, 2, intra_bandwidth="100GB/s", intra_latency="1us", inter_bandwidth="10GB/s", inter_latency="5us"
    )


def test_a_failed_link_is_routed_around_at_the_detours_cost() -> None:
    usual = run(one_send, two_gpus())
    assert usual.returns[1] == pytest.approx(NBYTES / 100e9 + 2e-6, rel=1e-12)
    detour = run(one_send, two_gpus(), [LinkDown(link=[0, "node0.nvswitch"], at=0.0)])
    assert detour.returns[1] == pytest.approx(NBYTES / 10e9 + 2 * 5e-6, rel=1e-12)


def test_a_failed_link_without_a_detour_fails_the_operation_naming_link_and_ranks() -> None:
    link = ring(2).route(0, 1)[0]
    with pytest.raises(
        simdist.LinkFailureError, match=rf"no route from rank 0 to rank 1 .*link {link} \(0 -> 1, LinkDown"
    ):
        run(one_send, ring(2), [LinkDown(link=link, at=0.0)])


def test_a_link_that_fails_later_leaves_earlier_transfers_alone() -> None:
    link = ring(2).route(0, 1)[0]
    res = run(one_send, ring(2), [LinkDown(link=link, at=1.0)])
    assert res.returns[1] == pytest.approx(NBYTES / BW + LAT, rel=1e-12)


# ------------------------------------------------------------------ crashes


def test_a_crash_at_a_time_is_diagnosed_naming_the_dead_rank_and_what_it_was_doing() -> None:
    with pytest.raises(simdist.RankCrashError) as info:
        run(steps, ring(), [Crash(rank=2, at=1.5e-3)])
    e = info.value
    assert e.crashed == {2: 1.5e-3}
    text = str(e)
    assert "rank 2 crashed at simulated time 0.0015 s" in text and "while computing" in text
    assert "never issued by rank 2" in text and "rank 2: crashed" in text
    assert isinstance(e.peer_failure, simdist.DeadlockError)


def test_a_crash_at_the_kth_collective_names_its_call_site() -> None:
    with pytest.raises(
        simdist.RankCrashError,
        match=r"rank 1 crashed .* as it issued its 2nd collective, at .*test_faults.py",
    ):
        run(steps, ring(), [Crash(rank=1, collective=2)])


def test_a_crash_at_the_kth_collective_happens_when_the_rank_issues_it_after_its_compute() -> None:
    # the oracle: the fault-free run's issue time of that collective (every rank of steps() issues the k-th
    # all-reduce after k charges and k - 1 all-reduces); the rank dies there, not when its previous wait ended
    def issue_times() -> list[float]:
        times = []
        t = torch.ones(1000)
        for _ in range(3):
            simdist.charge(1e-3)
            times.append(simdist.now())
            dist.all_reduce(t)
        return times

    issued = run(issue_times, ring()).returns[1]
    for k in (1, 2):
        with pytest.raises(simdist.RankCrashError) as info:
            run(steps, ring(), [Crash(rank=1, collective=k)])
        assert info.value.crashed[1] == pytest.approx(issued[k - 1], abs=1e-12)


def with_timeout(handling: str | None = None, backend: str = "gloo") -> str:
    """Steps on a group made with a 0.5 s timeout; returns what the rank caught, if anything."""
    if handling is not None:
        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = handling
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=0.5))
    device = "cpu"
    if backend == "nccl":
        torch.cuda.set_device(dist.get_rank())
        device = "cuda"
    t = torch.ones(10, device=device)
    try:
        for _ in range(3):
            simdist.charge(1e-3)
            dist.all_reduce(t)
    except dist.DistBackendError as e:
        return f"{simdist.now():.6f} {e}"
    return "done"


def test_with_a_timeout_the_peers_collective_times_out_at_that_time_naming_the_crash() -> None:
    with pytest.raises(simdist.RankCrashError) as info:
        run(with_timeout, ring(), [Crash(rank=3, collective=2)], default_group=False, backend_name="gloo")
    assert info.value.peer_failure is None  # the peers caught their timeout and finished


def test_under_nccl_the_timeout_reads_as_the_watchdogs_and_a_tear_down_mode_ends_the_process() -> None:
    cluster = simdist.Cluster.ring(4, bandwidth=BW, latency=LAT)  # GPUs
    caught = {}

    def keep(handling: str | None) -> str:
        out = with_timeout(handling, "nccl")
        caught[dist.get_rank()] = out
        return out

    with pytest.raises(simdist.RankCrashError):
        run(
            keep,
            cluster,
            [Crash(rank=3, collective=2)],
            default_group=False,
            backend_name="nccl",
            args=(None,),
        )
    when, text = caught[0].split(" ", 1)
    # the wait starts as the second all-reduce is issued, after two steps' compute and the first all-reduce
    assert 0.502 < float(when) < 0.503
    assert text.startswith(
        "[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=2, "
        "OpType=ALLREDUCE, NumelIn=10, NumelOut=10, Timeout(ms)=500) ran for 500 milliseconds"
    )
    assert "rank 3 crashed" in caught[0]
    with pytest.raises(simdist.RankCrashError) as info:
        run(
            keep,
            cluster,
            [Crash(rank=3, collective=2)],
            default_group=False,
            backend_name="nccl",
            args=("3",),
        )
    failure = info.value.peer_failure
    assert isinstance(failure, simdist.errors.ProcessTornDown)
    assert "we are taking the entire process down" in str(failure)


def test_a_lost_node_crashes_its_ranks_and_takes_its_links_down() -> None:
    cluster = simdist.Cluster.two_level(2, 2, device="cpu")
    with pytest.raises(simdist.RankCrashError) as info:
        run(steps, cluster, [NodeLoss(node=1, at=1.5e-3)])
    assert info.value.crashed == {2: 1.5e-3, 3: 1.5e-3}
    assert "NodeLoss(node=1" in str(info.value)


def test_a_crash_after_the_rank_finished_changes_nothing() -> None:
    plain = run(steps, ring())
    late = run(steps, ring(), [Crash(rank=0, at=1.0)])
    assert late.trace_hash == plain.trace_hash


def queue_and_read(seconds: float = 1e-3, read: bool = True) -> float:
    """On a GPU: queue ``seconds`` of kernels (the host runs ahead), read a value if ``read``, and return."""
    x = torch.ones(4, device="cuda")
    simdist.charge(seconds)
    return x.sum().item() if read else 0.0


@pytest.mark.parametrize("read", [True, False])
def test_a_crash_while_the_host_waits_for_its_gpu_lands_before_the_rank_ends(read: bool) -> None:
    """The host reaches its device's end before its rank ends (a value read waits for it, the end waits for the
    rest): a crash in between lands, where a crash after changes nothing."""
    gpus = simdist.Cluster.switch(2, device="H100")
    with pytest.raises(simdist.RankCrashError) as info:
        simdist.run(queue_and_read, gpus, args=(1e-3, read), faults=[Crash(rank=1, at=0.5e-3)])
    assert info.value.crashed == {1: 0.5e-3}
    late = simdist.run(queue_and_read, gpus, args=(1e-3, read), faults=[Crash(rank=1, at=2e-3)])
    assert late.trace_hash == simdist.run(queue_and_read, gpus, args=(1e-3, read)).trace_hash


# ------------------------------------------------------------------ determinism


def test_the_same_faults_give_the_same_run_and_no_faults_give_todays_run() -> None:
    faults = [
        Straggler(rank=1, slowdown=1.7),
        SlowLink(link=2, bandwidth_factor=0.3, latency=2e-6),
        FlappingLink(link=5, period=2e-4, down=5e-5),
        MessageDelay(src=0, dst=3, delay=1e-6),
    ]
    a = run(steps, ring(), faults)
    b = run(steps, ring(), faults)
    assert a.trace_hash == b.trace_hash
    assert run(steps, ring(), []).trace_hash == run(steps, ring()).trace_hash
    assert a.trace_hash != run(steps, ring()).trace_hash


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    ("faults", "message"),
    [
        ([Crash(rank=9, at=0.1)], r"Crash: rank 9 is not a rank of cluster .* whose ranks are 0..3"),
        ([Straggler(rank=[1, 4], slowdown=2)], r"Straggler: rank 4 is not a rank"),
        ([MessageDelay(src=0, dst=7, delay=1e-3)], r"MessageDelay: rank 7 is not a rank"),
        ([LinkDown(link=99, at=0.0)], r"LinkDown: link 99 is not a link of cluster .* numbered 0..7"),
        ([SlowLink(link=[0, 2], bandwidth_factor=0.5)], r"SlowLink: no link joins 0 and 2"),
        ([NodeLoss(node=0)], r"NodeLoss\(node=0\): cluster .* has no nodes"),
        (["Crash"], r"faults\[0\] must be a simdist.faults record"),
        ([{"type": "Meteor", "rank": 0}], r"unknown fault type 'Meteor'"),
    ],
)
def test_faults_the_cluster_lacks_are_refused_before_the_run(faults, message) -> None:
    with pytest.raises(simdist.FaultSpecError, match=message):
        run(steps, ring(), faults)


def test_one_fault_not_in_a_list_is_refused() -> None:
    with pytest.raises(
        simdist.FaultSpecError, match=r"faults must be a list of faults, got one Crash: write faults=\[...\]"
    ):
        simdist.run(steps, ring(), faults=Crash(rank=0, at=0.0))


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: Crash(rank=0, at=-1.0), r"Crash: at must be a non-negative finite number"),
        (lambda: Crash(rank=0), r"give exactly one of at= .* or collective="),
        (lambda: Crash(rank=0, collective=0), r"collective must be at least 1"),
        (lambda: Crash(rank=-1, at=0.0), r"rank must be at least 0"),
        (lambda: Straggler(rank=0, slowdown=0.5), r"slowdown must be at least 1"),
        (lambda: Straggler(rank=0, slowdown=2, window=(2.0, 1.0)), r"ends before it starts"),
        (
            lambda: SlowLink(link=0, bandwidth_factor=0.0),
            r"bandwidth_factor must be a positive finite number",
        ),
        (lambda: FlappingLink(link=0, period=1e-3, down=1e-3), r"must be shorter than period"),
        (lambda: MessageDelay(src=[], dst=0, delay=1.0), r"src must name at least one rank"),
        (lambda: LinkDown(link=[0], at=0.0), r"link must be a link id \(int\) or the two ends of a cable"),
        (lambda: LinkDown(link=0, at=math.nan), r"at must be a non-negative finite number"),
        (lambda: NodeLoss(node=True), r"node must be a whole number, got bool"),
    ],
)
def test_malformed_faults_are_refused_naming_the_field(make, message) -> None:
    with pytest.raises(simdist.FaultSpecError, match=message):
        make()


def test_a_straggler_on_a_gpu_slows_its_stream_as_its_host_runs_ahead() -> None:
    gpus = simdist.Cluster.ring(4, bandwidth=BW, latency=LAT)

    def on_gpu() -> float:
        torch.cuda.set_device(dist.get_rank())
        t = torch.ones(1000, device="cuda")
        for _ in range(3):
            simdist.charge(1e-3)
            dist.all_reduce(t)
        torch.cuda.synchronize()
        return simdist.now()

    plain = simdist.run(on_gpu, gpus)
    slow = simdist.run(on_gpu, gpus, faults=[Straggler(rank=1, slowdown=2.0)])
    # the 3 ms charged, and rank 1's few microseconds of other kernels (its tensors' fills) twice as long
    assert 3e-3 <= slow.sim_time - plain.sim_time <= 3e-3 + 1e-5


def test_a_slow_link_divides_the_pace_of_a_collective_timed_by_nccls_model() -> None:
    """A paced message (NCCL's model) over a slow link: its bytes at the pace divided by the factor, plus the
    pace's latency and the added one."""
    import simpy

    from simdist.network.faulty import LinkFaults
    from simdist.network.links import Network

    cluster = ring(2)
    link = cluster.route(0, 1)[0]
    env = simpy.Environment()
    network = Network(env, cluster)
    network.faults = LinkFaults(cluster, [SlowLink(link=link, bandwidth_factor=0.5, latency=1e-6)])
    arrived = []
    network.send(0, 1, NBYTES, lambda ev: arrived.append(env.now), None, pace=(3e-6, 1e-10))
    env.run()
    assert arrived == [pytest.approx(NBYTES * 1e-10 / 0.5 + 3e-6 + 1e-6, rel=1e-12)]
