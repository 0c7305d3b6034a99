"""Step time per buffer policy of the remote-tensor runtime, simulated and real, each fix against the current policy.

Prints figures; it is not a test. Usage:
``python benchmarks/runtime_bench.py [--seeds 100] [--sessions 5] [--detect-ops 100000]``.

Hot-path detection: ops per wall second that the worker's ``SegmentDetector`` takes on a loop of two 10-op
phases (forward, backward), each op reading its predecessor and one constant; 0.6-1.0 million ops/s on the
machine below.

The workload is the loop of ``scenarios/hotpath_buffer_race.py`` (a 4-8-1 MLP, 6 SGD steps, the loss fetched
every step). Simulated: mean simulated step time over the seeds each policy completes (jitter 100 us, 10 us
per client command, 0.3x compile times), and the fix's time divided by the current policy's on the seeds both
complete. Real: wall time per step of sessions against a real worker process (loopback socket, compile thread),
all policies in turn in the same run; the current policy's sessions that fail are counted, not timed.

Figures (x86_64 2-core VM, python 3.11.7; 100 seeds, 5 real sessions each):

    simulated       completed   step (us)   / current policy (common seeds)
    fallback            55        764.5        1.000
    flush_on_backward  100        766.4        1.000
    track_dependencies 100        766.1        1.000
    separate_buffers   100        765.9        1.000
    eager_if_independent 100      766.1        1.000
    real            failed      step (ms, median)
    fallback             5          -
    flush_on_backward    0        55.25
    track_dependencies   0        55.93
    separate_buffers     0        57.07
    eager_if_independent 0        56.53
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scenarios"))
import hotpath_buffer_race as scenario

from real.runtime import run_remote
from simdist.runtime import POLICIES, OpRecord, SegmentDetector


def detection(n_ops: int) -> None:
    """Ops per second of hot-path detection with the worker's default settings."""
    ops, tid = [], 1
    while len(ops) < n_ops:
        for phase in ("forward", "backward"):
            prev = 1
            for k in range(10):
                tid += 1
                ops.append((OpRecord("add" if k % 2 else "mul", (prev, 0), (tid,)), phase))
                prev = tid
    detector = SegmentDetector(window=512, threshold=2, min_length=4, max_length=128)
    t0 = time.perf_counter()
    for record, phase in ops:
        detector.observe(record, phase)
    wall = time.perf_counter() - t0
    print(f"hot-path detection: {len(ops) / wall:,.0f} ops/s ({len(ops)} ops, {len(detector.hot_paths)} hot paths)")


def simulated(seeds: int) -> None:
    steps: dict[str, dict[int, float]] = {}
    for policy in POLICIES:
        steps[policy] = {}
        for seed in range(seeds):
            res, _, error = scenario.Config(seed=seed).run(policy)
            if error is None:
                steps[policy][seed] = res.sim_time / scenario.STEPS
    base = steps["fallback"]
    print(f"simulated, {seeds} seeds: policy, completed, mean step (us), / current policy on common seeds")
    for policy, by_seed in steps.items():
        common = [s for s in by_seed if s in base]
        ratio = np.mean([by_seed[s] / base[s] for s in common]) if common else float("nan")
        print(f"  {policy:22s} {len(by_seed):4d} {np.mean(list(by_seed.values())) * 1e6:10.1f} {ratio:8.3f}")


def real(sessions: int) -> None:
    walls: dict[str, list[float]] = {p: [] for p in POLICIES}
    failed = dict.fromkeys(POLICIES, 0)
    for _ in range(sessions):
        for policy in POLICIES:  # in turn, so machine noise hits them alike
            try:
                res = run_remote(scenario.train, policy=policy)
            except Exception:  # noqa: BLE001 - the current policy's race
                failed[policy] += 1
                continue
            walls[policy].append(res.wall_seconds / scenario.STEPS)
    print(f"real worker process, {sessions} sessions each: policy, failed, median step (ms)")
    for policy in POLICIES:
        w = walls[policy]
        median = f"{np.median(w) * 1e3:10.2f}" if w else f"{'-':>10s}"
        print(f"  {policy:22s} {failed[policy]:4d} {median}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seeds", type=int, default=100)
    ap.add_argument("--sessions", type=int, default=5)
    ap.add_argument("--detect-ops", type=int, default=100_000)
    args = ap.parse_args()
    print(f"# machine: {platform.machine()}, {platform.processor() or 'cpu'}; python {platform.python_version()}")
    detection(args.detect_ops)
    simulated(args.seeds)
    real(args.sessions)


if __name__ == "__main__":
    main()
