"""The ``simdist`` command line: ``simdist run``, ``simdist check``, ``simdist bench``, ``simdist report``,
``simdist calibrate``, ``simdist clusters``.

``simdist run SCRIPT [options] -- ARGS`` runs SCRIPT as torchrun would (its module code as ``__main__`` on every
rank, ``sys.argv`` ``[SCRIPT, *ARGS]``); with ``--entry NAME`` it calls SCRIPT's function NAME on every rank instead.

Exit statuses: 0 success; 1 a diagnosed run (deadlock, mismatch, a rank's exception, a race under
``--races error``) or a bench row with wrong values; 2 the run could not start (bad arguments, cluster or
script; argparse's usage errors too); 3 races found under ``--races warn``. Every error is one message on
stderr, never a traceback of simdist's own code.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import textwrap
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from simdist import algorithms, faults
from simdist.bench import (
    COLLECTIVES,
    DTYPES,
    MAX_WORLD,
    REDOPS,
    BenchError,
    Row,
    bench,
    plan,
    table_footer,
    table_header,
    table_row,
    too_many_ranks,
)
from simdist.calibrate.command import add_parser as add_calibrate_parser
from simdist.comm.symmetry import NotSimulated
from simdist.compute.profile import Profile
from simdist.engine.runner import RunResult
from simdist.engine.torchrun import ScriptProgram, run_script
from simdist.errors import (
    ClusterSpecError,
    FaultSpecError,
    ProfileError,
    RaceWarning,
    RankError,
    SimdistError,
)
from simdist.explore import token
from simdist.explore.api import STRATEGIES, default_workers, explore, replay
from simdist.explore.program import Program
from simdist.explore.report import save_exploration_page
from simdist.explore.shrink import DEFAULT_MAX_RUNS, shrink_kinds
from simdist.faults import Fault
from simdist.network import Cluster
from simdist.network.cluster import check_collective_model
from simdist.network.presets import PRESETS
from simdist.options import BACKEND_NAMES, COLLECTIVE_MODELS, LOSS_MODES, PROGRESS_MODES, RACE_MODES
from simdist.oracle import check_equivalence
from simdist.ranks import by_text, format_ranks
from simdist.report import build_index, write_run_report
from simdist.script import ScriptError, load_entry
from simdist.units import format_size, parse_size
from simdist_base.timeline import Timeline, TimelineError
from simdist_base.timeline import load as load_timeline

#: the seeds torch.manual_seed accepts: a negative seed is taken modulo 2**64 (-1 is the seed 2**64 - 1)
SEED_RANGE = (-(2**63), 2**64 - 1)


def _cluster(spec: str, world_size: int | None) -> Cluster:
    return Cluster.load(spec, world_size)


def _whole_number(least: int) -> Callable[[str], int]:
    """An argparse type: a whole number >= ``least``."""

    def parse(text: str) -> int:
        try:
            value = int(text.strip(), 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {least}; found {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {least}; found {value}")
        return value

    parse.__name__ = "whole number"  # what argparse names in "invalid ... value"
    return parse


def _seed(text: str) -> int:
    """An argparse type: a seed torch.manual_seed accepts."""
    low, high = SEED_RANGE
    try:
        value = int(text.strip(), 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number; found {text!r}") from None
    if not low <= value <= high:
        raise argparse.ArgumentTypeError(
            f"{value} is outside the seeds torch accepts, {low}..{high} (a negative seed counts modulo 2**64)"
        )
    return value


def _seconds(text: str) -> float:
    """An argparse type: a positive number of seconds, or inf."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds (or inf); found {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds (or inf); found {text!r}")
    return value


_seconds.__name__ = "seconds"


def _output_file(text: str) -> Path:
    """An argparse type: a file to write, checked before the run so a long run is not lost to a typo."""
    path = Path(text).expanduser()
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a file name; found an empty string")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory; give a file name such as {str(path / 'trace.json')!r}")
    parent = path.parent
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(
            f"the directory of {text!r}, {str(parent)!r}, does not exist; create it first (mkdir -p {parent})"
        )
    if not os.access(parent, os.W_OK):
        raise argparse.ArgumentTypeError(f"the directory {str(parent)!r} is not writable; choose another place")
    return path


def _timeline_dir(text: str) -> Timeline:
    """An argparse type: a real run's timeline directory, read before the run so a long run is not lost to a typo."""
    try:
        return load_timeline(text)
    except TimelineError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


_timeline_dir.__name__ = "timeline directory"


def _profile(text: str) -> Profile:
    """An argparse type: a torch profiler trace to replay, read before the run so a long run is not lost to a typo."""
    try:
        return Profile(text)
    except ProfileError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


_profile.__name__ = "profile"


def _fault(text: str) -> Fault:
    """An argparse type: one fault as JSON, e.g. '{"type": "Crash", "rank": 1, "at": 0.01}'."""
    try:
        return faults.from_json(json.loads(text))
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"expected a fault as JSON ({e.msg}); found {text!r}") from None
    except FaultSpecError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


_fault.__name__ = "fault"


def _restarts(text: str) -> int:
    """An argparse type: a whole number of restarts, 0 or more."""
    if not text.strip().isdigit():
        raise argparse.ArgumentTypeError(f"expected a whole number of restarts (0 or more); found {text!r}")
    return int(text)


_restarts.__name__ = "restarts"


def _size(text: str) -> int:
    """Bytes from "8", "64K", "128M", "1G" (nccl-tests' binary suffixes) or any unit string ("25MiB")."""
    suffix = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip()
    try:
        if t[-1:].upper() in suffix and t[:-1].isascii() and t[:-1].isdigit():
            return int(t[:-1]) * suffix[t[-1].upper()]
        return parse_size(t)
    except ClusterSpecError as e:
        raise argparse.ArgumentTypeError(
            f"{e}; or a whole number with nccl-tests' suffix K, M or G (64K, 128M, 1G)"
        ) from None


_size.__name__ = "size"


def _local_ranks(text: str) -> tuple[int, ...]:
    """An argparse type: torchrun's ``--local-ranks-filter``, local ranks separated by commas ("0,1,2")."""
    try:
        ranks = tuple(int(part, 10) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected local ranks separated by commas, such as 0 or 0,1,2; found {text!r}"
        ) from None
    if any(r < 0 for r in ranks):
        raise argparse.ArgumentTypeError(f"local ranks are whole numbers >= 0; found {text!r}")
    return ranks


_local_ranks.__name__ = "local ranks"


def cmd_run(args: argparse.Namespace) -> int:
    """Run a script on every rank of a simulated cluster: as torchrun would, or its entry function (``--entry``)."""
    if args.real is not None and args.report is None:
        print("simdist run: error: --real sets a real run beside this one in its report: add --report OUT.html",
              file=sys.stderr)
        return 2
    cluster = _cluster(args.cluster, args.world_size)
    program = f"{args.script}:{args.entry}" if args.entry else args.script
    t0 = time.perf_counter()
    with warnings.catch_warnings():  # races are summarised once below rather than warned per site
        warnings.simplefilter("ignore", RaceWarning)
        try:
            res = run_script(
                args.script, cluster, argv=args.script_args, entry=args.entry, prefix_output=not args.no_prefix,
                local_ranks_filter=args.local_ranks_filter, seed=args.seed, progress=args.progress,
                gloo_threads=args.gloo_threads, races=args.races or ("off" if args.fake else "warn"),
                race_waivers=args.waive_race, watchdog=args.watchdog, backend_name=args.backend_name, memory=args.memory,
                tensors="fake" if args.fake else "real",
                compute=args.profile if args.profile is not None else True,
                faults=args.fault, max_restarts=args.max_restarts, nnodes=args.nnodes, symmetric=args.symmetric,
            )
        except SimdistError as e:
            # a diagnosed run is what a report is most often shared for: write it, then report as usual
            if args.report and not isinstance(e, ScriptError):
                title = f"simdist run: {Path(args.script).name}"
                path = write_run_report(None, args.report, error=e, cluster=cluster, seed=args.seed,
                                        program=program, title=title)
                print(f"report written to {path}", file=sys.stderr)
            raise
    wall = time.perf_counter() - t0
    for rank, value in enumerate(res.returns):
        if isinstance(value, NotSimulated):
            continue  # a symmetric run's copies: the line below says which ranks ran
        if args.entry and (value is not None or args.show_none):
            print(f"rank {rank}: {value!r}")
    print(
        f"simulated time {res.sim_time * 1e6:.3f} us on {cluster.name} ({cluster.world_size} ranks); "
        f"{res.messages} messages; wall {wall:.2f} s; trace hash {res.trace_hash[:16]}"
    )
    if res.simulated_ranks is not None:
        print(f"symmetric run: simulated {format_ranks(res.simulated_ranks)}; the others ran as rank {res.simulated_ranks[0]}")
    for attempt, failure in enumerate(res.failures):
        print(f"attempt {attempt} failed and the job restarted (--max-restarts): {failure.splitlines()[0]}")
    if args.trace:
        try:
            path = res.trace.save_chrome(args.trace)
        except OSError as e:  # checked before the run, but the disk can fill or the directory vanish
            print(f"simdist: error: --trace: cannot write {str(args.trace)!r}: {e.strerror or e}", file=sys.stderr)
            return 2
        print(f"trace written to {path} (open it in ui.perfetto.dev)")
    if args.report:
        title = f"simdist run: {Path(args.script).name}"
        path = write_run_report(res, args.report, program=program, title=title, real=args.real)
        print(f"report written to {path}")
    if args.memory:
        print(_memory_summary(res))
    if res.profile is not None:
        print(res.profile.summary())
    for text in res.unused_waivers:
        print(f"simdist: warning: --waive-race {text!r} named no race in this run; remove it or correct it", file=sys.stderr)
    if res.races or res.waived_races:
        print(res.race_summary())
    hint = None if args.entry else ScriptProgram.load(args.script).entry_hint()
    if hint:
        print(f"simdist: note: {hint}", file=sys.stderr)
    elif not args.entry and res.messages == 0 and res.world_size > 1 and not _symmetric_collectives(res):
        # a script that stops before training (a GPU check, a missing dataset) still ends with status 0
        print(
            f"simdist: note: no rank of {res.world_size} communicated (0 messages): if the script was to train, it "
            "stopped before its first collective; its output above may say why",
            file=sys.stderr,
        )
    return 3 if res.races else 0


def _pairs(values: list[str] | None, what: str, convert: Callable[[str], object] = str) -> dict[str, object]:
    """``["A=B", ...]`` as a dict (the value converted), with an error naming the option on a bad item."""
    out: dict[str, object] = {}
    for item in values or []:
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise ValueError(f"{what} expects NAME=VALUE, got {item!r}")
        out[key] = convert(value)
    return out


def _shard_spec(text: str) -> int | tuple[int, int]:
    dim, _, size = text.partition(":")
    try:
        return (int(dim), int(size)) if size else int(dim)
    except ValueError:
        raise ValueError(f"--shard expects PATTERN=DIM or PATTERN=DIM:GROUP_SIZE (whole numbers), got {text!r}") from None


def cmd_check(args: argparse.Namespace) -> int:
    """Run SCRIPT on every rank and REFERENCE on one rank; compare them at each optimizer step."""
    parallel = load_entry(args.script, args.entry)
    reference = load_entry(args.reference, args.reference_entry)
    cluster = _cluster(args.cluster, args.world_size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RaceWarning)
        rep = check_equivalence(
            parallel, reference, cluster, steps=args.steps, seed=args.seed, exact=args.exact,
            names=_pairs(args.name, "--name"), ignore=args.ignore or (),
            shards=_pairs(args.shard, "--shard", _shard_spec), loss=None if args.loss == "none" else args.loss,
            progress=args.progress, races=args.races, watchdog=args.watchdog,
        )
    print(rep)
    if args.json:
        args.json.write_text(json.dumps(rep.to_dict(), indent=1) + "\n")
        print(f"report written to {args.json}")
    return 0 if rep.ok else 3


def _symmetric_collectives(res: RunResult) -> bool:
    """Whether ``res`` is a symmetric run whose ranks met in collectives (timed whole, so without messages)."""
    return res.simulated_ranks is not None and bool(res.trace.collectives())


def _memory_summary(res: RunResult) -> str:
    """Each rank's peak live bytes, its time and its largest categories; ranks alike share a line."""
    lines = ["peak memory per rank (live tensor bytes):"]
    rows = []
    for m in res.memory:
        parts = ", ".join(f"{k} {format_size(v)}" for k, v in sorted(m.breakdown.items(), key=lambda kv: -kv[1]) if v)
        rows.append((m.rank, f"{format_size(m.peak_bytes)} at {m.peak_time * 1e6:.3f} us ({parts or 'nothing'})"))
    lines += [f"  {format_ranks(ranks)}: {text}" for ranks, text in by_text(rows)]
    return "\n".join(lines)


def cmd_report(args: argparse.Namespace) -> int:
    """(Re)build DIR/index.html linking every HTML report in DIR."""
    try:
        path = build_index(args.directory)
    except NotADirectoryError as e:
        raise ValueError(str(e)) from None
    print(f"index written to {path}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """Print the nccl-tests table for one collective, each row as soon as it is simulated (as nccl-tests does)."""
    if args.world_size is not None and args.world_size > MAX_WORLD:
        raise BenchError(f"--world-size: {too_many_ranks(args.world_size)}")  # before building a huge cluster
    cluster = _cluster(args.cluster, args.world_size)
    if args.collective_model is not None:
        cluster.collective_model = check_collective_model(args.collective_model, cluster.device)
        if cluster.collective_model == "nccl":
            cluster.nccl_fabric(list(range(cluster.world_size)))  # a cluster without nodes is refused here
    sweep = (args.collective, args.minbytes, args.maxbytes, args.stepfactor, args.datatype, args.op, args.root, args.algorithm)
    plan(cluster, *sweep)  # every refusal comes before the table starts
    print(table_header(args.collective, cluster), flush=True)

    def show(row: Row) -> None:
        print(table_row(row), flush=True)

    rows = bench(cluster, *sweep, on_row=show)
    print(table_footer(rows))
    return 1 if any(r.wrong for r in rows) else 0


def cmd_clusters(args: argparse.Namespace) -> int:
    """List the named cluster presets."""
    for name, preset in sorted(PRESETS.items()):
        print(f"{name:14s} {preset.summary}")
    return 0


def _jitter(text: str) -> dict[str, float]:
    """``latency=0.2,compute=0.1``: relative jitter per scheduling point."""
    out: dict[str, float] = {}
    for part in filter(None, text.split(",")):
        key, _, value = part.partition("=")
        try:
            out[key.strip()] = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected KEY=AMOUNT pairs such as latency=0.2,compute=0.1, got {text!r}"
            ) from None
    return out


def cmd_explore(args: argparse.Namespace) -> int:
    """Run a script under many perturbations and report what fails (``simdist explore``)."""
    cluster = _cluster(args.cluster, args.world_size)
    program = Program(script=os.path.abspath(args.script), entry=args.entry, argv=tuple(args.script_args))
    ScriptProgram.load(program.script)  # a missing or broken script is refused before any run
    print(
        f"exploring {args.script} on {cluster.name} ({cluster.world_size} ranks): {args.runs} runs, strategy "
        f"{args.strategy}" + (f" (depth {args.depth})" if args.strategy == "pct" else "") + (f", on {args.engine}" if args.engine else f", {args.workers} workers")
    )
    before = _listing(Path.cwd())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RaceWarning)
        ex = explore(
            program, cluster, runs=args.runs, strategy=args.strategy, depth=args.depth, seed=args.seed,
            jitter=args.jitter, workers=args.workers, progress=args.progress, races=args.races,
            watchdog=args.watchdog, prefix_output=not args.no_prefix, engine=args.engine,
            progress_bar=False if args.no_progress_bar else None, faults=args.fault or (),
            **({"local_ranks_filter": []} if args.quiet else {}),
        )
    print(ex.summary())
    changed = sorted(name for name, stamp in _listing(Path.cwd()).items() if before.get(name) != stamp)
    if changed:
        print(
            f"simdist explore: warning: the runs wrote {', '.join(changed[:5])}{' ...' if len(changed) > 5 else ''} in "
            "the working directory, so each run after the first may have read what an earlier one wrote (a snapshot "
            "to resume from, a cache): the runs were not independent, and a replay token may not reproduce its run "
            "until these files are as they were. Explore from a scratch directory, or have the script skip them",
            file=sys.stderr,
        )
    if args.shrink and ex.failures:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RaceWarning)
            shrink_kinds(ex, program, cluster, max_runs=args.shrink_runs)
    for kind, found in ex.by_kind().items():
        first = found[0]
        message = str(first.error).splitlines()[0] if str(first.error) else ""
        print(f"first {kind}: run {first.run}, trace {first.trace_hash[:16]}: {message}")
        if first.shrunk is not None:
            print(textwrap.indent(str(first.shrunk), "  "))
    if args.tokens is not None:
        failures = [{"run": f.run, "kind": f.kind, "error": str(f.error).splitlines()[0] if str(f.error) else "",
                     "trace_hash": f.trace_hash, "replay": json.loads(f.replay)} for f in ex.failures]
        args.tokens.write_text(json.dumps(failures, indent=1))
        print(f"replay tokens of {len(failures)} failures written to {args.tokens} (simdist.replay(fn, cluster, token))")
    if args.report is not None:
        command = " ".join(shlex.quote(a) for a in ["simdist", *sys.argv[1:]]) if sys.argv[1:2] == ["explore"] else None
        path = save_exploration_page(
            ex, args.report, program=args.script, cluster=cluster, command=command, fn=program
        )
        print(f"report written to {path}")
    return 1 if ex.failures else 0


def _token_from(path: str, failure: int) -> tuple[str, str | None]:
    """The replay token in ``path`` ('-': standard input): a token itself, or failure ``failure`` of the list that
    ``simdist explore --tokens`` writes; with the trace hash the exploration recorded for it, where the list has it."""
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
    except OSError as e:
        raise ValueError(f"cannot read the replay token file {path!r}: {e.strerror or e}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path!r} is not JSON ({e}): a replay token file holds what explore --tokens wrote") from None
    if isinstance(data, list):
        if not data:
            raise ValueError(f"{path!r} lists no failures: the exploration that wrote it found none")
        if not 0 <= failure < len(data):
            raise ValueError(f"{path!r} lists {len(data)} failures (--failure 0 to {len(data) - 1}); got --failure {failure}")
        entry = data[failure]
        if not isinstance(entry, dict) or "replay" not in entry:
            raise ValueError(f"{path!r}: failure {failure} holds no replay token (a 'replay' field)")
        return json.dumps(entry["replay"]), entry.get("trace_hash")
    if failure != 0:
        raise ValueError(f"{path!r} holds one token, not a list of failures: --failure {failure} names none")
    return json.dumps(data), None  # as text: token.read fills in the parsed object it is given


def cmd_replay(args: argparse.Namespace) -> int:
    """Run again the run a replay token records (``simdist replay``)."""
    text, explored = _token_from(args.token, args.failure)
    data = token.read(text)
    program = Program.from_json(data["program"])
    if program.fields is not None:
        raise ValueError("this token replays a target (a simulation other than simdist.run): replay it from Python "
                         "with simdist.replay(target, token)")
    cluster = Cluster.from_config(data["cluster"])
    what = program.script or f"{program.module}.{program.name}"
    print(f"replaying {what} on {cluster.name} ({cluster.world_size} ranks)")
    options: dict[str, Any] = {} if args.watchdog is None else {"watchdog": args.watchdog}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RaceWarning)
        try:
            res = replay(program, cluster, text, **options)
        except SimdistError as e:
            print(f"the run failed again; trace hash {_against(str(getattr(e, 'trace_hash', '')), explored)}",
                  file=sys.stderr)
            raise
    print(
        f"the run ended: simulated time {res.sim_time * 1e6:.3f} us; trace hash {_against(res.trace_hash, explored)}. "
        "A failure found by the exploration's check (a check= function) is not in the token: run the check on "
        "simdist.replay's result"
    )
    return 0


def _listing(directory: Path) -> dict[str, int]:
    """The files directly in ``directory`` with their modification times (what a run writing there changes)."""
    try:
        return {p.name: p.stat().st_mtime_ns for p in directory.iterdir() if p.is_file()}
    except OSError:  # an unreadable or vanished directory: nothing to compare
        return {}


def _against(trace_hash: str, explored: str | None) -> str:
    """A replayed run's trace hash, and whether it is the one the exploration recorded."""
    if explored is None:
        return trace_hash[:16]
    same = "the same as explored" if trace_hash == explored else f"NOT the explored run's {explored[:16]}"
    return f"{trace_hash[:16]} ({same})"


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for tests and documentation)."""
    p = argparse.ArgumentParser(prog="simdist", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    positive = _whole_number(1)

    r = sub.add_parser(
        "run", help="run SCRIPT on every rank of a simulated cluster, as torchrun would (or its --entry function)",
        usage="simdist run SCRIPT [options] [-- SCRIPT_ARGS ...]",
    )
    r.add_argument("script", help="a Python file: run as torchrun runs it, its module code as __main__ on every rank")
    r.add_argument("--cluster", default="switch", help="preset name or .toml/.json cluster file (default: switch)")
    r.add_argument("--world-size", type=positive, default=None, help="number of ranks (sizes a preset; checks a file)")
    r.add_argument("--seed", type=_seed, default=0,
                   help="the run's seed (default 0); any seed torch.manual_seed takes: -2**63..2**64-1, negative ones modulo 2**64")
    r.add_argument("--trace", type=_output_file, default=None,
                   help="write the Chrome/Perfetto trace JSON here (its directory must exist)")
    r.add_argument("--report", type=_output_file, default=None,
                   help="write a self-contained HTML report of the run here (also when a diagnosis stops the run)")
    r.add_argument("--real", type=_timeline_dir, default=None, metavar="DIR",
                   help="with --report: set the real run recorded in DIR (python -m real --timeline DIR) beside this "
                        "one: its operations on the timeline, and each one's predicted and measured time")
    r.add_argument("--entry", default=None, metavar="NAME",
                   help="call SCRIPT's function NAME on every rank, in a world whose default process group exists, "
                        "instead of running SCRIPT as torchrun would")
    r.add_argument("--local-ranks-filter", "--local_ranks_filter", type=_local_ranks, default=None, metavar="RANKS",
                   help="show the output of these local ranks only, e.g. 0 or 0,1 (as torchrun's option)")
    r.add_argument("--no-prefix", action="store_true",
                   help="leave the ranks' output lines unprefixed (torchrun's default) instead of starting each with [rankN]:")
    r.add_argument("--progress", default="nccl", choices=PROGRESS_MODES,
                   help="backend progress semantics: nccl (one stream per group) or gloo (a pool of threads per group; default: nccl)")
    r.add_argument("--gloo-threads", type=positive, default=2, help="threads per group with --progress gloo (default: 2)")
    r.add_argument("--races", default=None, choices=RACE_MODES,
                   help="race detector: error (stop at the first race), warn (report every race; exit status 3), off "
                        "(default: warn; off with --fake)")
    r.add_argument("--waive-race", action="append", default=None, metavar="PATTERN",
                   help="a known race to waive, by call site: PATH[:LINE][:FUNCTION], e.g. "
                        "torch/distributed/pipelining/schedules.py:_warmup_p2p (repeatable)")
    r.add_argument("--watchdog", type=_seconds, default=None, metavar="SECONDS",
                   help="wall-clock seconds a rank may run without communicating before the run stops "
                        "(default: $SIMDIST_WATCHDOG, else 600; inf turns it off)")
    r.add_argument("--backend-name", default="simdist", choices=BACKEND_NAMES,
                   help="the backend name rank code sees in dist.get_backend() (default: simdist)")
    r.add_argument("--memory", action="store_true",
                   help="account each rank's live tensor bytes: print the peaks; a rank over its device's memory fails "
                        "with a simulated out-of-memory error")
    r.add_argument("--symmetric", action="store_true",
                   help="every rank runs the same program on same-shaped data: simulate a few ranks and time each "
                        "collective for the whole group (docs/symmetry.md)")
    r.add_argument("--fake", action="store_true",
                   help="time and size the program without data (tensors=\"fake\"; GPU clusters): tensors on the "
                        "simulated GPUs hold shapes and dtypes only, collectives carry nothing, reading a value is an "
                        "error, the race detector is off")
    r.add_argument("--profile", type=_profile, default=None, metavar="TRACE",
                   help="time ops by the durations this torch profiler trace (Kineto JSON) of the program measured; "
                        "the model prices the ops it does not hold, and their count is printed")
    r.add_argument("--show-none", action="store_true", help="with --entry, also print ranks that returned None")
    r.add_argument("--fault", type=_fault, action="append", default=None, metavar="JSON",
                   help='a fault the run meets, as JSON: {"type": "Crash", "rank": 1, "at": 0.01} (simdist.faults; '
                        "repeatable)")
    r.add_argument("--max-restarts", type=_restarts, default=0, metavar="N",
                   help="restart every rank at most N times after a failure, as torchrun's --max-restarts (default 0)")
    r.add_argument("--nnodes", default=None, metavar="N|MIN:MAX",
                   help="as torchrun's --nnodes: with MIN:MAX a job that lost nodes re-forms on the survivors")
    r.set_defaults(func=cmd_run, script_args=[])

    k = sub.add_parser("check", help="compare SCRIPT on every rank with REFERENCE on one rank, step by step")
    k.add_argument("script", help="the parallel training script (entry function: main)")
    k.add_argument("--reference", required=True, help="the single-process training script (entry function: main)")
    k.add_argument("--cluster", default="switch", help="preset name or .toml/.json cluster file (default: switch)")
    k.add_argument("--world-size", type=positive, default=None, help="number of ranks (sizes a preset; checks a file)")
    k.add_argument("--steps", type=positive, default=None, help="compare the first STEPS optimizer steps (default: all)")
    k.add_argument("--seed", type=_seed, default=0, help="the seed of both runs (default 0)")
    k.add_argument("--entry", default="main", help="entry function of SCRIPT (default: main)")
    k.add_argument("--reference-entry", default="main", help="entry function of REFERENCE (default: main)")
    k.add_argument("--exact", action="store_true", help="compare bitwise instead of within the per-dtype tolerances")
    k.add_argument("--loss", default="mean", choices=[m or "none" for m in LOSS_MODES],
                   help="how the backward roots of all ranks combine into a step's loss: mean, sum, accumulated "
                        "(each rank's sum averaged over ranks, for gradient accumulation), none (default: mean)")
    k.add_argument("--name", action="append", metavar="PARALLEL=REFERENCE",
                   help="map a tensor name (fnmatch patterns; * carries over) of SCRIPT to REFERENCE's (repeatable)")
    k.add_argument("--ignore", action="append", metavar="PATTERN", help="tensors to leave out (fnmatch; repeatable)")
    k.add_argument("--shard", action="append", metavar="PATTERN=DIM[:SIZE]",
                   help="plain tensors sharded by hand along DIM, over groups of SIZE ranks (default: all holders)")
    k.add_argument("--progress", default="nccl", choices=PROGRESS_MODES, help="backend progress semantics")
    k.add_argument("--races", default="warn", choices=RACE_MODES, help="race detector (default: warn)")
    k.add_argument("--watchdog", type=_seconds, default=None, metavar="SECONDS", help="as for simdist run")
    k.add_argument("--json", type=_output_file, default=None, help="also write the report as JSON here")
    k.set_defaults(func=cmd_check)

    b = sub.add_parser("bench", help="nccl-tests style table for one collective on a simulated cluster")
    b.add_argument("collective", nargs="?", default="all_reduce", choices=COLLECTIVES,
                   help=f"one of {', '.join(COLLECTIVES)} (default: all_reduce)")
    b.add_argument("--cluster", default="dgx-h100")
    b.add_argument("--world-size", type=positive, default=None, help=f"number of ranks, at most {MAX_WORLD}")
    b.add_argument("-b", "--minbytes", type=_size, default=8)
    b.add_argument("-e", "--maxbytes", type=_size, default=64 << 20)
    b.add_argument("-f", "--stepfactor", type=_whole_number(2), default=2)
    b.add_argument("-d", "--datatype", default="float", choices=sorted(DTYPES))
    b.add_argument("-o", "--op", default="sum", choices=sorted(REDOPS))
    b.add_argument("-r", "--root", type=_whole_number(0), default=0)
    b.add_argument("-a", "--algorithm", default="auto", choices=(*algorithms.NAMES, algorithms.AUTO),
                   help=f"one of {', '.join(algorithms.NAMES)}, or auto (default)")
    b.add_argument("-m", "--collective-model", default=None, choices=COLLECTIVE_MODELS,
                   help="how collectives are timed (default: the cluster's own; see docs/nccl.md)")
    b.set_defaults(func=cmd_bench)

    x = sub.add_parser(
        "explore", help="run SCRIPT under many perturbations (tie orders, jitter) and report the runs that fail",
        usage="simdist explore SCRIPT [options] [-- SCRIPT_ARGS ...]",
    )
    x.add_argument("script", help="a Python file, run as simdist run runs it (or its --entry function)")
    x.add_argument("--cluster", default="switch", help="preset name or .toml/.json cluster file (default: switch)")
    x.add_argument("--world-size", type=positive, default=None, help="number of ranks (sizes a preset; checks a file)")
    x.add_argument("--entry", default=None, metavar="NAME", help="call SCRIPT's function NAME on every rank")
    x.add_argument("--runs", type=positive, default=100, help="how many runs (the bound of --strategy exhaustive; default: 100)")
    x.add_argument("--strategy", default="random", choices=STRATEGIES, help="how runs are perturbed (default: random)")
    x.add_argument("--depth", type=positive, default=2, help="with --strategy pct: the bug depth searched for (default: 2)")
    x.add_argument("--seed", type=_seed, default=0, help="the exploration's seed (default 0)")
    x.add_argument("--jitter", type=_jitter, default=None, metavar="latency=A,compute=B",
                   help="stretch latencies and op times by random factors up to 1 + A and 1 + B (random and pct)")
    x.add_argument("--workers", type=positive, default=default_workers(),
                   help="processes that run the exploration (default: every core this process may use)")
    x.add_argument("--tokens", type=_output_file, default=None, metavar="FILE.json",
                   help="write each failure's replay token here")
    x.add_argument("--report", type=_output_file, default=None, metavar="FILE.html",
                   help="write a self-contained HTML page of the exploration here (failures by kind, their replay "
                        "tokens, failures over runs, interleavings)")
    x.add_argument("--shrink", action=argparse.BooleanOptionalAction, default=True,
                   help="shrink the first failure of each kind to its fewest decisions off the unperturbed order and "
                        "print where it departs from the unperturbed run (default: on)")
    x.add_argument("--shrink-runs", type=_whole_number(3), default=DEFAULT_MAX_RUNS, metavar="N",
                   help=f"the most runs shrinking one failure makes (default: {DEFAULT_MAX_RUNS})")
    x.add_argument("--fault", type=_fault, action="append", default=None, metavar="JSON",
                   help='a fault every run meets, as JSON: {"type": "Straggler", "rank": 3, "slowdown": 2.0} '
                        "(simdist.faults; repeatable; part of each replay token)")
    x.add_argument("--engine", default=None, metavar="ADDRESS",
                   help="run on a Dask scheduler (tcp://host:8786) or Ray ('ray', ray://host:10001) instead of "
                        "--workers local processes")
    x.add_argument("--no-progress-bar", action="store_true",
                   help="no progress bar (by default one is drawn when standard error is a terminal)")
    x.add_argument("--progress", default="nccl", choices=PROGRESS_MODES, help="backend progress semantics")
    x.add_argument("--races", default="warn", choices=RACE_MODES, help="race detector (default: warn)")
    x.add_argument("--watchdog", type=_seconds, default=None, metavar="SECONDS", help="as for simdist run")
    x.add_argument("--no-prefix", action="store_true", help="leave the ranks' output lines unprefixed")
    x.add_argument("--quiet", action="store_true",
                   help="hide what the ranks print (simdist replay shows a failing run's output again)")
    x.set_defaults(func=cmd_explore, script_args=[])

    y = sub.add_parser(
        "replay", help="run again a failure that simdist explore found, from its replay token",
        usage="simdist replay TOKENS.json [--failure N]",
    )
    y.add_argument("token", metavar="TOKENS.json",
                   help="a replay token, or the list simdist explore --tokens wrote ('-': standard input)")
    y.add_argument("--failure", type=_whole_number(0), default=0, metavar="N",
                   help="which failure of the list to replay (default: 0, the first)")
    y.add_argument("--watchdog", type=_seconds, default=None, metavar="SECONDS", help="as for simdist run")
    y.set_defaults(func=cmd_replay)

    rp = sub.add_parser("report", help="(re)build DIR/index.html linking every HTML report in DIR")
    rp.add_argument("directory", help="the directory the reports were written to, e.g. reports/")
    rp.set_defaults(func=cmd_report)

    add_calibrate_parser(sub, _output_file)

    c = sub.add_parser("clusters", help="list cluster presets")
    c.set_defaults(func=cmd_clusters)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``simdist`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # The script's own arguments follow the first "--", as torchrun's follow the script: none of them is simdist's.
    script_args = argv[argv.index("--") + 1 :] if "--" in argv else None
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv[: argv.index("--")] if "--" in argv else argv)
    if unknown:
        hint = (
            f"; a script's own arguments go after --: simdist run {args.script} [options] -- {' '.join(unknown)}"
            if args.command == "run" else ""
        )
        parser.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
    if script_args is not None:
        if args.command not in ("run", "explore"):
            parser.error(
                f"arguments after -- are a script's arguments, taken by simdist run and explore only; found them after "
                f"simdist {args.command}"
            )
        args.script_args = script_args
    try:
        return args.func(args)
    except BrokenPipeError:
        return _reader_gone()
    except RankError as e:
        if isinstance(e.exc, BrokenPipeError):  # a rank printing into the pipe found it closed
            return _reader_gone()
        print(f"simdist: error: {e}", file=sys.stderr)
        return 1
    except (ClusterSpecError, ScriptError, ValueError) as e:
        # the run could not start: bad arguments, cluster or script (as python -m real, exit status 2)
        print(f"simdist: error: {e}", file=sys.stderr)
        return 2
    except SimdistError as e:  # the run started and simdist diagnosed it
        print(f"simdist: error: {e}", file=sys.stderr)
        return 1


def _reader_gone() -> int:
    """The reader of stdout went away (``simdist run ... | head``): stop quietly, as other command-line tools do."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 1


if __name__ == "__main__":
    sys.exit(main())
