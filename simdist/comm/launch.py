"""Starting a matched collective: choose its algorithm, plan its buffers, run its messages, trace each rank's part.

Called once every rank of the group has joined the instance and has a free stream or gloo thread for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from simdist.algorithms import reduce_op
from simdist.comm import symmetric_data, symmetry
from simdist.comm.group import Call, GroupState, Instance
from simdist.comm.messages import ScheduleRun
from simdist.comm.ordering import GlooResult, backend_for, order_matters, reduces_as_gloo
from simdist.comm.plans import Plan
from simdist.trace.trace import Span

if TYPE_CHECKING:  # annotations only: the run's context imports the machinery, not the other way
    from simdist.comm.context import RunContext


def launch(sim: RunContext, st: GroupState, inst: Instance) -> None:
    """Run instance ``inst`` of group ``st`` on ``sim`` (a :class:`~simdist.comm.context.RunContext`)."""
    if sim.simulated is not None:
        _launch_symmetric(sim, st, inst)
        return
    n = st.size
    calls = [inst.calls[r] for r in range(n)]
    specs = [c.spec for c in calls]
    first = specs[0]
    kind = type(first)
    kind.check_across(specs, [c.site for c in calls])
    # NCCL's model times what NCCL would run: not a group that presents gloo for these tensors
    by_nccl = backend_for(st.backend_name, first.device_type()) != "gloo"
    selection = sim.selector.select(
        st.index, st.global_ranks, st.algorithms, first.collective, first.buffer_bytes(n), st.nccl_enabled, by_nccl
    )
    algo = selection.algorithm
    plan = kind.plan(specs, algo)
    name = f"{sim.progress}:{first.name}"
    # every rank's stream reaches the collective (a CUDA event on its compute stream) before it runs
    start_time = max(sim.env.now, *(c.ready_at for c in calls))
    streams = [st.stream_of(inst, r) for r in range(n)]

    order = _gloo_result(plan, st, first.device_type())

    def rank_done(r: int) -> None:
        if order is not None:
            order.write(r)
        plan.finish[r]()
        c = calls[r]
        sim.trace.add(
            Span(
                st.global_ranks[r], streams[r], name, start_time, sim.env.now,
                _span_args(c, st, inst, algo.name, selection.nccl),
            )
        )
        c.work.complete()
        st.rank_done(inst, r)

    run = ScheduleRun(
        sim, plan.msgs, n, plan.src, plan.dst, plan.reduce_op, st.global_ranks, rank_done, streams, name, order,
        selection.pace, selection.reduce_cost, selection.local,
    )
    for c in calls:
        c.work.messages = run
    if start_time > sim.env.now:
        sim.env.timeout(start_time - sim.env.now).callbacks.append(lambda _ev: run.start())
    else:
        run.start()


def _launch_symmetric(sim: RunContext, st: GroupState, inst: Instance) -> None:
    """Instance ``inst`` in a symmetric run: it starts once every simulated member's stream reaches it (every
    member, by symmetry) and each member's part ends at the closed-form time of the whole group's schedule (its
    uncontended last rank's end), when its results are written as if every rank not simulated held what the
    first simulated member holds (:mod:`simdist.comm.symmetric_data`)."""
    calls = [inst.calls[r] for r in st.members]
    first = calls[0].spec
    write = symmetric_data.writer(first, calls[0].site)
    by_nccl = backend_for(st.backend_name, first.device_type()) != "gloo"
    nbytes = first.buffer_bytes(st.size)
    selection = sim.selector.select(
        st.index, st.global_ranks, st.algorithms, first.collective, nbytes, st.nccl_enabled, by_nccl
    )
    if selection.nccl is None and sim.cluster.collective_model == "nccl":
        symmetry.check_hops(
            sim.cluster,
            f"where a collective is timed by its messages, as {first.name} at {calls[0].site} is (NCCL's model "
            "does not time it: its group presents gloo, or its algorithm is one NCCL does not run)",
        )
    seconds = sim.selector.seconds(st.index, st.global_ranks, selection, nbytes)
    name = f"{sim.progress}:{first.name}"
    start_time = max(sim.env.now, *(c.ready_at for c in calls))
    _note_overlap(sim, st, name, start_time, start_time + seconds)

    def finish(_ev: object) -> None:
        write([c.spec for c in calls], st.members, st.size)
        for r, c in zip(st.members, calls):
            sim.trace.add(
                Span(
                    st.global_ranks[r], st.stream_of(inst, r), name, start_time, sim.env.now,
                    _span_args(c, st, inst, selection.algorithm.name, selection.nccl),
                )
            )
            c.work.complete()
            st.rank_done(inst, r)

    sim.env.timeout(start_time + seconds - sim.env.now).callbacks.append(finish)


def _note_overlap(sim: RunContext, st: GroupState, name: str, start: float, end: float) -> None:
    """Record a symmetric run's collective from ``start`` to ``end`` (seconds), and the first time it overlaps one
    of a group that shares ranks with ``st``: the full run would share links between them (gloo's threads, two
    groups' streams), which the closed form of each does not see."""
    running = [r for r in sim.symmetric_running if r[1] > start]
    if sim.symmetric_overlap is None:
        for other_start, other_end, other in running:
            if other_start < end and other.shares_ranks(st):
                sim.symmetric_overlap = (
                    f"{name.split(':', 1)[-1]} on group {st.name or 'default'} ran from {start:.9g} s to {end:.9g} s "
                    f"while a collective of group {other.name or 'default'}, which shares ranks with it, ran from "
                    f"{other_start:.9g} s to {other_end:.9g} s"
                )
                break
    running.append((start, end, st))
    sim.symmetric_running = running


def _gloo_result(plan: Plan, st: GroupState, device_type: str) -> GlooResult | None:
    """What puts the results of ``plan`` in gloo's order, or None where its schedule's order stands: a
    collective that reduces nothing, a group presented as NCCL, types and sizes on which the orders agree."""
    if plan.gloo_spans is None or not reduces_as_gloo(st.backend_name, device_type):
        return None
    bufs = [b for b in plan.dst if b is not None and not b.is_meta]
    if len(bufs) < len(plan.dst):  # no values to order
        return None
    reduction = reduce_op(plan.reduce_op)
    if not order_matters(reduction, bufs[0].dtype, st.size):
        return None
    return GlooResult(plan.gloo_spans, bufs, reduction.gloo_step)


def _span_args(call: Call, st: GroupState, inst: Instance, algorithm: str, nccl: str | None) -> dict[str, Any]:
    """A collective span's arguments, named as torch's profiler names them (plus the algorithm, NCCL's
    algorithm and protocol where NCCL's model timed it, and the issue time)."""
    sizes = call.spec.sizes()
    args = {
        "Collective name": call.op,
        "In msg nelems": sizes.in_nelems,
        "Out msg nelems": sizes.out_nelems,
        "Group size": st.size,
        "dtype": sizes.dtype,
        "Process Group Name": st.name or "default",
        "Seq": inst.seq,
        "algorithm": algorithm,
        "issued": call.work.issued_at,
    }
    if nccl is not None:
        args["nccl"] = nccl
    return args
