"""Scale: every figure of simdist's scale targets, measured in one run, beside the scales others publish.

Prints figures; it is not a test. Usage:
``python benchmarks/scale_bench.py [--sections messages,ranks,symmetry,fake] [--ranks 64,1024]``.

- ``messages``: simulated messages per wall second of a ring all-reduce on a ring cluster (ring algorithm,
  2(n-1) messages per rank), the whole run timed: run in arrays a group of simultaneous messages at a time
  (``simdist.comm.batched``, the default), one message at a time on lanes (``simdist.comm.lane``), and with every
  message a simpy event, in the same process; the three runs must agree on the simulated time, the message count
  and the trace hash, which the table shows. A last line times a run of four such all-reduces in arrays (the
  ranks' start-up, some 0.8 s at 1,024 ranks, shared by all four); then one all-reduce each of element counts that
  do not divide by the ranks (chunks of two lengths).
- ``ranks``: one data-parallel step of 1,024-8,192 ranks on a switch cluster, and of 1,024 ranks on a ring cluster
  (four async ring all-reduces, some 8 million messages), against each rank's plain torch step run once in the
  same process, as written and seeded as a rank seeds (the same work: plain ``torch.manual_seed`` costs about
  half of this step; ``benchmarks/scale_ranks.py``).
- ``symmetry``: ``symmetric=True`` steps of 16,384 and 100,000 ranks, and the check of a reduced run against the
  full one (``benchmarks/scale_symmetry.py``).
- ``fake``: a Llama-style 7B DDP step on 64 ranks under ``tensors="fake"`` (``benchmarks/llama_step.py``, which
  also runs FSDP2 and 512 ranks).

The host's speed moves by a third to a half between hours on a shared VM: the first and last lines time a plain
Python loop of ten million additions, so that figures from different runs can be set side by side.

The anchors, as their authors publish them: ASTRA-sim and SimAI simulate 10k+ GPUs for timing only; Maya
reaches 1k-12k GPUs by deduplicating identical ranks; Multiverse 54k GPUs.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import torch
import torch.distributed as dist

import simdist
from simdist.comm import batched, lane

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama_step  # the benchmarks beside this one
import scale_ranks
import scale_symmetry


def _all_reduce(numel: int, iters: int) -> None:
    t = torch.ones(numel)
    for _ in range(iters):
        dist.all_reduce(t)


#: how a run's messages are handled: every message a simpy event; queued on lanes one at a time; in arrays
MODES = ("events", "lanes", "arrays")


def _timed(n: int, numel: int, iters: int, mode: str) -> tuple[float, float, simdist.RunResult]:
    """(wall seconds, CPU seconds of this process, result) of the ring all-reduce run on ``n`` ranks, its
    messages handled as ``mode`` says."""
    cluster = simdist.Cluster.ring(n, device="cpu", algorithms={"all_reduce": "ring"})
    old = lane.ENABLED, batched.ENABLED
    lane.ENABLED, batched.ENABLED = mode != "events", mode == "arrays"
    try:
        wall, cpu = time.perf_counter(), time.process_time()
        res = simdist.run(_all_reduce, cluster, args=(numel, iters), trace="collectives")
        return time.perf_counter() - wall, time.process_time() - cpu, res
    finally:
        lane.ENABLED, batched.ENABLED = old


def message_rate(ranks: tuple[int, ...] = (64, 1024), numel: int = 4096, iters: int = 1) -> dict[int, dict]:
    """Messages per wall second of ``iters`` ring all-reduces of ``numel`` float32 elements on each of ``ranks``,
    each message a simpy event ("events"), one at a time on lanes ("lanes") and a group of simultaneous messages
    at a time in arrays ("arrays", the default); prints a table and returns its figures per rank count."""
    figures: dict[int, dict] = {}
    print(f"ring all-reduce on a ring cluster, {numel} float32 elements, {iters} per run (whole runs timed)")
    print(
        f"{'ranks':>6} {'messages':>10} {'events msg/s':>13} {'lanes msg/s':>12} {'arrays msg/s':>13} "
        f"{'x events':>8} {'x lanes':>7} {'cpu x events':>12} same"
    )
    for n in ranks:
        timed = {mode: _timed(n, numel, iters, mode) for mode in MODES}
        ref = timed["events"][2]
        same = all(
            got.sim_time == ref.sim_time
            and got.trace.hash() == ref.trace.hash()
            and got.messages == ref.messages
            for _, _, got in timed.values()
        )
        row = {
            "messages": ref.messages,
            **{f"{mode}_per_s": ref.messages / timed[mode][0] for mode in MODES},
            "x_events": timed["events"][0] / timed["arrays"][0],
            "x_lanes": timed["lanes"][0] / timed["arrays"][0],
            "cpu_x_events": timed["events"][1] / timed["arrays"][1],
            "same": same,
        }
        figures[n] = row
        print(
            f"{n:>6} {row['messages']:>10,} {row['events_per_s']:>13,.0f} {row['lanes_per_s']:>12,.0f}"
            f" {row['arrays_per_s']:>13,.0f} {row['x_events']:>8.1f} {row['x_lanes']:>7.1f}"
            f" {row['cpu_x_events']:>12.1f} {'yes' if same else 'NO'}"
        )
    return figures


def message_rate_repeated(n: int = 1024, numel: int = 4096, iters: int = 4) -> dict:
    """Messages per wall second of a run of ``iters`` ring all-reduces on ``n`` ranks in arrays (a training loop's
    all-reduce, every step): the whole run timed, the ranks' start-up shared by all of them; prints one line."""
    wall, cpu, res = _timed(n, numel, iters, "arrays")
    row = {
        "messages": res.messages,
        "wall_s": wall,
        "per_s": res.messages / wall,
        "cpu_per_s": res.messages / cpu,
    }
    print(
        f"{n} ranks, {iters} ring all-reduces per run, in arrays: {res.messages:,} messages in {wall:.2f} s, "
        f"{row['per_s']:,.0f} msg/s ({row['cpu_per_s']:,.0f} per CPU second)"
    )
    return row


def message_rate_uneven(n: int = 1024, numels: tuple[int, ...] = (4095, 4608, 1000)) -> list[dict]:
    """Messages per wall second of one ring all-reduce on ``n`` ranks in arrays for each element count in
    ``numels`` (none divides by ``n``: chunks of two lengths, a step's parts arriving apart); prints one line each."""
    rows = []
    for numel in numels:
        wall, cpu, res = _timed(n, numel, 1, "arrays")
        q, extra = divmod(numel, n)
        rows.append({"numel": numel, "messages": res.messages, "wall_s": wall, "per_s": res.messages / wall})
        print(
            f"{n} ranks, one ring all-reduce of {numel} elements ({extra} chunks of {q + 1}, {n - extra} of {q}), "
            f"in arrays: {res.messages:,} messages in {wall:.2f} s, {res.messages / wall:,.0f} msg/s "
            f"({res.messages / cpu:,.0f} per CPU second)"
        )
    return rows


#: a plain Python loop of ten million additions, run as a script's top level runs it (its names global, as
#: ``python3 -c "..."`` runs it: about twice the time of the same loop inside a function)
_LOOP = compile("s = 0\nfor i in range(10_000_000):\n    s += i\n", "<host speed>", "exec")


def host_speed() -> float:
    """Seconds :data:`_LOOP` takes here (the host's speed, for the figures beside it)."""
    start = time.perf_counter()
    exec(_LOOP, {})  # noqa: S102 - a constant loop, compiled above
    return time.perf_counter() - start


#: what the scale simulators others publish reach, for the table beside this run's figures
ANCHORS = (
    ("ASTRA-sim", "10k+ GPUs", "timing only"),
    ("SimAI", "10k+ GPUs", "timing only"),
    ("Maya", "1k-12k GPUs", "identical ranks deduplicated"),
    ("Multiverse", "54k GPUs", "timing only"),
)
SECTIONS = ("messages", "ranks", "symmetry", "fake")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--sections", default=",".join(SECTIONS), help="comma-separated, of: " + ", ".join(SECTIONS)
    )
    ap.add_argument("--ranks", default="64,1024", help="the messages section's world sizes")
    args = ap.parse_args()
    sections = args.sections.split(",")
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        ap.error(f"unknown section(s) {', '.join(unknown)}: choose from {', '.join(SECTIONS)}")
    print(
        f"# machine: {platform.machine()}, {platform.processor() or 'cpu'}; python {platform.python_version()};"
        f" torch {torch.__version__}"
    )
    print("anchors: " + "; ".join(f"{name} {scale} ({how})" for name, scale, how in ANCHORS))
    print(f"host: a Python loop of ten million additions takes {host_speed():.2f} s")
    if "messages" in sections:
        print("\n## messages")
        simdist.run(_all_reduce, simdist.Cluster.ring(2, device="cpu"), args=(8, 1))  # one-time warm-up
        sizes = tuple(int(x) for x in args.ranks.split(","))
        message_rate(sizes)
        message_rate_repeated(max(sizes))
        message_rate_uneven(max(sizes))
    if "ranks" in sections:
        print("\n## ranks")
        scale_ranks.rank_scaling()
        scale_ranks.rank_scaling((1024,), "ring")
    if "symmetry" in sections:
        print("\n## symmetry")
        scale_symmetry.show(scale_symmetry.figures())
    if "fake" in sections:
        print("\n## fake")
        # the 64-rank DDP step (bf16, on H200s, whose 141 GiB hold its 75 GiB per rank); the 512-rank one and FSDP2
        # take tens of minutes: benchmarks/llama_step.py runs them
        llama_step.main(["--run", "ddp:64", "--device", "H200"])
    print(f"\nhost: a Python loop of ten million additions takes {host_speed():.2f} s")


if __name__ == "__main__":
    main()
