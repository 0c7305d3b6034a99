"""The hot-path buffer race of a remote-tensor runtime, reproduced deterministically, and four fixes compared.

A client trains a small MLP (4 -> 8 -> 1, tanh, SGD, 6 steps, fetching the loss every step) through a worker
that buffers hot paths and runs them as compiled batches on a compile stream
(``simdist.runtime.BufferingWorker``), over a simulated link with seeded jitter. Under the current policy
(``fallback``) the worker sometimes answers ``Input tensor not found``:

(A) an eager backward op reads an output of the forward buffer while the stream is still tracing it;
(B) a batch runs while an input it looks up was freed (or never stored) in the meantime;
(C) an eager backward op reads an output of the forward batch while it is compiling or running.

Each is reproduced from a named config and seed, with the failing command and the worker's and the link's
events around it. Then every policy is explored with one ``simdist.explore`` call (the session as a target,
strategy random over the link's delivery jitter and the order of simultaneous events, each run checked against
eager execution), and the current policy's first failure is replayed from its token; the table (failures by
kind, fallbacks, share of ops compiled, simulated step time) is printed and written to
hotpath_buffer_race.json in the output directory (reports/ by default), beside the HTML report
hotpath_buffer_race.html (each reproduction's events, the policy table and its plots). Exits non-zero if an
expectation fails: the current policy fails in some runs, no fix ever fails, every run that completes ends with
the weights of eager execution, and the replayed failure is the same race with the same trace.

With ``--real N`` the loop also runs N times per policy against a real worker process (``real.runtime``; its
compile stream on a thread of its own): the current policy's failure rate there is reported as observed, and
no fix may fail.

Usage: python scenarios/hotpath_buffer_race.py [--runs N] [--real N] [--out DIR]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from verdicts import finish

import simdist
import simdist.autograd as ag
import simdist.report
from simdist.errors import RankError
from simdist.explore import Ran, Target
from simdist.runtime import POLICIES, BufferingWorker, LinkSpec, StreamTimes, simulate

WIDTHS, STEPS, LR = (4, 8, 1), 6, 0.1
#: runs explored per policy: enough that the current policy's failures number in the dozens
RUNS = 100
REPORTS = Path(__file__).resolve().parent.parent / "reports"


def train(seed: int = 0) -> list[np.ndarray]:
    """The client's training loop (simdist.autograd on whatever executor is current)."""
    rng = np.random.default_rng(seed)
    ws = [ag.tensor(rng.standard_normal((a, b)) * 0.5, requires_grad=True) for a, b in itertools.pairwise(WIDTHS)]
    x, y = ag.tensor(rng.standard_normal((6, WIDTHS[0]))), ag.tensor(rng.standard_normal((6, WIDTHS[-1])))
    for _ in range(STEPS):
        h = x
        for i, w in enumerate(ws):
            h = h @ w
            if i < len(ws) - 1:
                h = h.tanh()
        loss = ((h - y) ** 2).mean()
        loss.backward()
        loss.item()
        with ag.no_grad():
            ws = [(w - LR * w.grad).detach().requires_grad_() for w in ws]
    return [w.numpy() for w in ws]


@dataclass(frozen=True)
class Config:
    """Everything a run depends on besides the policy."""

    seed: int
    jitter: float = 100e-6  # s, upper bound of the uniform extra delay per message
    client_seconds: float = 10e-6  # s the client spends issuing one command
    compile_scale: float = 0.3  # x the default compile-stream times
    max_length: int = 128  # longest phase segment that can become hot

    def worker(self, policy: str) -> BufferingWorker:
        base = StreamTimes()
        s = self.compile_scale
        times = StreamTimes(base.trace_per_op * s, base.compile_base * s, base.compile_per_op * s, base.cached_compile * s)
        return BufferingWorker(policy, times=times, max_length=self.max_length)

    def run(self, policy: str, deliveries: list | None = None) -> tuple[object | None, BufferingWorker, str | None]:
        worker = self.worker(policy)
        try:
            res = simulate(
                train, seed=self.seed, link=LinkSpec(jitter=self.jitter), worker=worker, client_seconds=self.client_seconds
            )
            return res, worker, None
        except RankError as e:
            if deliveries is not None:
                deliveries += e.deliveries
            return None, worker, str(e.exc)


#: the named reproductions: each config and seed makes the current policy fail with that kind first
REPRODUCTIONS = {
    "A": Config(seed=2, compile_scale=3.0, max_length=12),  # backward not buffered; the forward batch still tracing
    "B": Config(seed=2),  # both phases buffered; a saved activation freed before the forward batch stored it
    "C": Config(seed=0, compile_scale=1.0, max_length=12),  # backward not buffered; the forward batch compiling
}


def reproduce(kind: str, config: Config, verdicts: list[tuple[str, bool, str]], page: simdist.report.ScenarioReport) -> None:
    deliveries: list = []
    _, worker, error = config.run("fallback", deliveries)
    first = worker.failures_by_kind[0] if worker.failures_by_kind else None
    ok = first is not None and first[0] == kind and error is not None
    lines = [f"({kind}) {config}", f"    client saw: {error}"]
    if first is not None:
        t = first[2]
        lines.append(f"    worker events around t = {t * 1e6:.1f} us:")
        lines += [f"      {when * 1e6:9.1f} us  {what}" for when, what in worker.events if t - 60e-6 <= when <= t + 1e-12]
        lines.append("    link deliveries arriving in that window:")
        lines += [f"      {d.arrived * 1e6:9.1f} us  {d.direction:15s} {d.what} (sent {d.sent * 1e6:.1f} us)"
                  for d in deliveries if t - 60e-6 <= d.arrived <= t + 1e-12]
    print("\n".join(lines))
    print()
    page.text(f"({kind}) reproduced", "\n".join(line.removeprefix("    ") for line in lines),
              error=True, nav=f"({kind})")
    verdicts.append((f"({kind}) reproduced from its named seed", ok, first[1] if first else "no failure"))


@dataclass(frozen=True)
class Session(Target):
    """One training session under ``policy``, as ``simdist.explore`` runs it: the perturbation's seed draws the
    link's delivery jitter and the order of events due at the same time."""

    policy: str
    jitter: float = 100e-6
    client_seconds: float = 10e-6
    compile_scale: float = 0.3
    max_length: int = 128

    def run(self, perturbation: simdist.Perturbation) -> Ran:
        config = Config(0, self.jitter, self.client_seconds, self.compile_scale, self.max_length)
        worker = config.worker(self.policy)
        try:
            res = simulate(train, link=LinkSpec(jitter=self.jitter), worker=worker, client_seconds=self.client_seconds,
                           perturbation=perturbation)
        except RankError as e:
            e.race = worker.failures_by_kind[0][0] if worker.failures_by_kind else None
            raise
        value = {"weights": [w.tolist() for w in res.value], "fallbacks": sum(res.stats.fallbacks.values()),
                 "compiled_fraction": res.stats.compiled_fraction(), "step_seconds": res.sim_time / STEPS}
        return Ran(value, res.trace_hash)

    def kind(self, error: Exception) -> str | None:
        race = getattr(error, "race", None)
        return f"race ({race})" if race else None


def equals_eager(value: dict) -> bool:
    """The session's final weights are bitwise those of eager execution (the check every explored run passes)."""
    return all(np.array_equal(np.array(a), b) for a, b in zip(value["weights"], eager_weights(), strict=True))


@functools.cache
def eager_weights() -> list[np.ndarray]:
    return train()


def table(runs: int, verdicts: list[tuple[str, bool, str]], page: simdist.report.ScenarioReport) -> dict:
    rows, explorations = {}, {}
    print(f"Every policy explored over {runs} runs (strategy random over the delivery jitter and tie order;")
    print("jitter 100 us, 10 us per client command, 0.3x compile times):")
    print(f"  {'policy':22s} {'failed':>7s} {'A':>4s} {'B':>4s} {'C':>4s} {'fallbacks':>10s} {'compiled':>9s} {'step (us)':>10s} {'= eager':>8s}")
    for policy in POLICIES:
        ex = simdist.explore(Session(policy), runs=runs, strategy="random", seed=0, check=equals_eager)
        explorations[policy] = ex
        groups = ex.by_kind()
        kinds = {k: len(groups.get(f"race ({k})", [])) for k in "ABC"}
        kinds["other"] = len(ex.failures) - sum(kinds.values())
        passed = [o.value for o in ex.outcomes if o.kind is None]
        row = {
            "runs": ex.runs,
            "failed": len(ex.failures),
            "failures_by_kind": kinds,
            "fallbacks": sum(v["fallbacks"] for v in passed),
            "compiled_fraction": float(np.mean([v["compiled_fraction"] for v in passed])) if passed else 0.0,
            "step_seconds": float(np.mean([v["step_seconds"] for v in passed])) if passed else None,
            "completed_runs_equal_eager": "check failed" not in groups,
            "interleavings": ex.interleavings,
        }
        rows[policy] = row
        step = f"{row['step_seconds'] * 1e6:10.1f}" if passed else f"{'-':>10s}"
        print(
            f"  {policy:22s} {row['failed']:7d} {kinds['A']:4d} {kinds['B']:4d} {kinds['C']:4d} {row['fallbacks']:10d} "
            f"{row['compiled_fraction'] * 100:8.1f}% {step} {'yes' if row['completed_runs_equal_eager'] else 'NO':>8s}"
        )
    print()
    page.table(f"Every policy explored over {runs} runs", ["policy", "failed", "A", "B", "C", "fallbacks", "compiled",
               "step", "= eager"], [
        [policy, (r["failed"], "fail" if r["failed"] else "pass"), r["failures_by_kind"]["A"], r["failures_by_kind"]["B"],
         r["failures_by_kind"]["C"], r["fallbacks"], f"{r['compiled_fraction'] * 100:.1f}%",
         "-" if r["step_seconds"] is None else f"{r['step_seconds'] * 1e6:.1f} us",
         ("yes", "pass") if r["completed_runs_equal_eager"] else ("NO", "fail")]
        for policy, r in rows.items()
    ], note="One simdist.explore call per policy (strategy random: each run draws the link's delivery jitter and the "
        "order of simultaneous events; run 0 is the unperturbed run). Jitter 100 us, 10 us per client command, 0.3x "
        "compile times; step time is the mean over completed runs.", nav="policies")
    page.bar_plot("Failures per policy, by kind", {p: {k: float(r["failures_by_kind"][k]) for k in "ABC"}
                                                   for p, r in rows.items()},
                  y_label=f"failed runs of {runs}", nav="failures")
    page.bar_plot("Step time per policy", {p: {"step": r["step_seconds"]} for p, r in rows.items() if r["step_seconds"]},
                  y_label="simulated step time", unit="time", nav="step time",
                  note="Mean over the runs that completed; the fixes trade compiled batches for safety.")
    buggy = rows["fallback"]["failed"]
    verdicts.append(("the current policy fails in some runs", 0 < buggy, f"{buggy} of {runs}"))
    for policy in POLICIES:
        if policy != "fallback":
            verdicts.append((f"{policy} never fails", rows[policy]["failed"] == 0, f"{rows[policy]['failed']} of {runs}"))
    verdicts.append(
        ("every completed run equals eager execution", all(r["completed_runs_equal_eager"] for r in rows.values()), "bitwise")
    )
    replay_one(explorations["fallback"], verdicts, page)
    return rows


def replay_one(ex: simdist.Exploration, verdicts: list[tuple[str, bool, str]], page: simdist.report.ScenarioReport) -> None:
    """Replay the current policy's first failure from its token alone: the same race, the same trace."""
    if not ex.failures:
        verdicts.append(("a failure replays from its token", False, "no failure to replay"))
        return
    failure = ex.failures[0]
    target = Session("fallback")
    try:
        simdist.replay(target, failure.replay)
        again, trace = None, ""
    except RankError as e:
        again, trace = target.kind(e), e.trace_hash
    same = again == failure.kind and trace == failure.trace_hash
    seed = json.loads(failure.replay)["perturbation"]["seed"]
    text = (f"run {failure.run} ({failure.kind}), perturbation seed {seed}: replayed from its token, "
            f"{again or 'no failure'}, {'the same' if trace == failure.trace_hash else 'another'} trace hash")
    print(f"The current policy's first failure, {text}")
    print(f"    client saw: {failure.error.exc}")
    print()
    page.text("A failure replayed from its token", f"simdist.replay(Session('fallback'), token): {text}\n"
              f"client saw: {failure.error.exc}", nav="replay")
    verdicts.append(("a failure replays from its token", same, f"run {failure.run}, {failure.kind}"))


def on_real_worker(
    runs: int, verdicts: list[tuple[str, bool, str]], page: simdist.report.ScenarioReport | None = None
) -> dict:
    """The same loop against a real worker process (compile stream on its own thread), ``runs`` times per policy."""
    from real.runtime import run_remote

    eager = train()
    rows = {}
    print(f"Real worker process on this machine, {runs} sessions per policy:")
    print(f"  {'policy':22s} {'failed':>7s} {'kinds':18s} {'compiled':>9s} {'wall per session (ms)':>22s}")
    for policy in POLICIES:
        failed, kinds, compiled, walls, equal = 0, [], [], [], []
        for _ in range(runs):
            try:
                res = run_remote(train, policy=policy)
            except Exception as e:  # noqa: BLE001 - a RemoteError from the worker is the finding
                failed += 1
                kinds += getattr(e, "failure_kinds", [])[:1] or [type(e).__name__]
                continue
            kinds += res.failure_kinds
            compiled.append(res.stats.compiled_fraction())
            walls.append(res.wall_seconds)
            equal.append(all(np.array_equal(a, b) for a, b in zip(res.value, eager)))
        rows[policy] = {"runs": runs, "failed": failed, "kinds": kinds, "completed_runs_equal_eager": all(equal)}
        wall = f"{np.mean(walls) * 1e3:22.1f}" if walls else f"{'-':>22s}"
        frac = f"{np.mean(compiled) * 100:8.1f}%" if compiled else f"{'-':>9s}"
        print(f"  {policy:22s} {failed:7d} {','.join(sorted(set(kinds))) or '-':18s} {frac} {wall}")
    print()
    print(f"  the current policy failed in {rows['fallback']['failed']} of {runs} real sessions (real timing decides)")
    if page is not None:
        page.table("Real worker process", ["policy", "failed", "kinds", "= eager"], [
        [p, r["failed"], ",".join(sorted(set(r["kinds"]))) or "-", "yes" if r["completed_runs_equal_eager"] else "NO"]
        for p, r in rows.items()
    ], note=f"{runs} sessions per policy against a real worker process (compile stream on its own thread).",
        nav="real worker")
    print()
    for policy in POLICIES:
        if policy != "fallback":
            verdicts.append((f"{policy} never fails on the real worker", rows[policy]["failed"] == 0, f"{runs} sessions"))
    verdicts.append(
        ("real completed runs equal eager execution", all(r["completed_runs_equal_eager"] for r in rows.values()), "bitwise")
    )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=RUNS, help="runs explored per policy (default: %(default)s)")
    ap.add_argument("--real", type=int, default=0, metavar="N", help="also run N sessions per policy on a real worker process")
    ap.add_argument("--out", type=Path, default=REPORTS, metavar="DIR", help="where the HTML report and the JSON table are written (default: %(default)s)")
    args = ap.parse_args(argv)
    verdicts: list[tuple[str, bool, str]] = []
    page = simdist.report.ScenarioReport(
        "The hot-path buffer race", description=__doc__,
        command=f"python scenarios/hotpath_buffer_race.py --runs {args.runs}" + (f" --real {args.real}" if args.real else ""))
    for kind, config in REPRODUCTIONS.items():
        reproduce(kind, config, verdicts, page)
    rows = table(args.runs, verdicts, page)
    real_rows = on_real_worker(args.real, verdicts, page) if args.real else None
    report_path = args.out / "hotpath_buffer_race.json"
    report_path.parent.mkdir(parents=True, exist_ok=True)
    descriptions = {name: policy.description for name, policy in POLICIES.items()}
    report_path.write_text(
        json.dumps({"runs": args.runs, "policies": rows, "real": real_rows, "descriptions": descriptions}, indent=2)
    )
    print(f"table written to {report_path}")
    print()
    return finish(page, verdicts, args.out, "hotpath_buffer_race")


if __name__ == "__main__":
    sys.exit(main())
