"""Hostile inputs: absurd numbers, broken config files, odd cluster specs, bad command lines and scripts.

Each case ends in a clear error (a SimdistError, or a documented exit status whose one-paragraph message names
the field and what was expected, with no traceback of simdist's own code) or in a result checked by an oracle.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import math
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path

import networkx as nx
import pytest
import torch
import torch.distributed as dist
from hostile_cases import Case, check, params

import simdist
from real.__main__ import main as real_main
from simdist.bench import BenchError, bench, format_table, table_footer, table_header, table_row
from simdist.cli import main as simdist_main
from simdist.network.graph import MAX_LINKS, MAX_WORLD_SIZE
from simdist.units import MAX_BANDWIDTH, MIN_BANDWIDTH, parse_bandwidth, parse_size, parse_time

Main = Callable[[list[str]], int]


class CliExit(SystemExit):
    """A command line's exit, carrying everything it printed: ``str()`` is that output."""

    def __init__(self, status: int, output: str) -> None:
        super().__init__(status)
        self.output = output

    def __str__(self) -> str:
        return self.output


def _invoke(main: Main, argv: list[str]) -> tuple[int, str]:
    """``main(argv)`` in this process: its exit status (argparse's SystemExit counted) and stdout + stderr."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            status = int(main(argv) or 0)
        except SystemExit as e:
            status = e.code if isinstance(e.code, int) else 1
    return status, out.getvalue()


def cli(main: Main, argv: list[str] | Callable[[], list[str]], status: int = 2) -> Callable[[], None]:
    """A case's ``run``: the command line must exit with ``status`` and print no traceback; raises CliExit."""

    def run() -> None:
        args = argv() if callable(argv) else argv
        code, output = _invoke(main, args)
        assert "Traceback" not in output, f"a raw traceback from {args}:\n{output}"
        assert code == status, f"exit status {code} from {args}, expected {status}; it printed:\n{output}"
        raise CliExit(code, output)

    return run


_TMP = Path(tempfile.mkdtemp(prefix="simdist-hostile-inputs-"))
atexit.register(shutil.rmtree, _TMP, ignore_errors=True)


def _file(name: str, content: str | bytes) -> Path:
    """A file of that content under this module's temporary directory."""
    path = _TMP / name
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    return path


def _load(name: str, content: str | bytes) -> Callable[[], simdist.Cluster]:
    """A case's ``run``: write a config file and load it."""
    return lambda: simdist.Cluster.from_file(_file(name, content))


def _load_directory() -> simdist.Cluster:
    """Load a cluster from a directory whose name ends in .json."""
    (_TMP / "adir.json").mkdir(exist_ok=True)
    return simdist.load_cluster(str(_TMP / "adir.json"))


def _script(name: str, source: str | bytes) -> str:
    return str(_file(name, source))


def _all_reduce_four() -> torch.Tensor:
    t = torch.ones(4)
    dist.all_reduce(t)
    return t


def _approx(want: float, rel: float = 1e-9) -> Callable[[float], None]:
    """A check: the result is ``want`` within ``rel``."""

    def check_(got: float) -> None:
        assert got == pytest.approx(want, rel=rel), (got, want)

    return check_


def _equals(want: object) -> Callable[[object], None]:
    """A check: the result equals ``want``."""

    def check_(got: object) -> None:
        assert got == want, (got, want)

    return check_


# --- numbers ------------------------------------------------------------------------------------------

_NUMBERS = [
    Case("bandwidth-overflows", "bandwidth '1e999GB/s'", lambda: parse_bandwidth("1e999GB/s"),
         error=simdist.ClusterSpecError, match=r"bandwidth '1e999GB/s' is not finite"),
    Case("bandwidth-int-beyond-float", "bandwidth 10**400 (an int float() cannot hold)",
         lambda: parse_bandwidth(10**400), error=simdist.ClusterSpecError,
         match=r"bandwidth 1000.*\(401 characters\) is not finite"),
    Case("bandwidth-subnormal", "bandwidth '1e-320 B/s' (a subnormal float: 1/bandwidth overflows)",
         lambda: parse_bandwidth("1e-320 B/s"), error=simdist.ClusterSpecError,
         match=r"'1e-320 B/s' .* outside the accepted range 0\.001 to 1e\+24 bytes/s"),
    Case("bandwidth-exponent-beyond-decimal", "bandwidth '1e99999999999GB/s'",
         lambda: parse_bandwidth("1e99999999999GB/s"), error=simdist.ClusterSpecError, match="not finite"),
    Case("bandwidth-rounds-to-zero", "bandwidth '1e-99999999999GB/s'",
         lambda: parse_bandwidth("1e-99999999999GB/s"), error=simdist.ClusterSpecError, match="rounds to zero"),
    Case("bandwidth-nan", "bandwidth float('nan')", lambda: parse_bandwidth(math.nan),
         error=simdist.ClusterSpecError, match="bandwidth nan is not a number"),
    Case("bandwidth-beyond-max", "bandwidth 1e30 bytes/s", lambda: parse_bandwidth(1e30),
         error=simdist.ClusterSpecError, match="outside the accepted range"),
    Case("bandwidth-range-ends", "bandwidths exactly at both ends of the accepted range",
         lambda: (parse_bandwidth(MIN_BANDWIDTH), parse_bandwidth(f"{MAX_BANDWIDTH!r} B/s")),
         check=_equals((MIN_BANDWIDTH, MAX_BANDWIDTH))),
    Case("bandwidth-foreign-digits", "bandwidth '\u0663GB/s' (an Arabic-Indic digit three)",
         lambda: parse_bandwidth("\u0663GB/s"), error=simdist.ClusterSpecError, match="is not a quantity"),
    Case("bandwidth-bytes-object", "bandwidth b'1GB/s'", lambda: parse_bandwidth(b"1GB/s"),  # type: ignore[arg-type]
         error=simdist.ClusterSpecError, match="found a bytes"),
    Case("bandwidth-fraction", "bandwidth Fraction(10**9, 3)", lambda: parse_bandwidth(Fraction(10**9, 3)),
         check=_approx(10**9 / 3)),
    Case("time-int-beyond-float", "time 10**400", lambda: parse_time(10**400),
         error=simdist.ClusterSpecError, match="time 1000.* is not finite"),
    Case("time-negative-zero", "time '-0s' is +0.0, not -0.0", lambda: parse_time("-0s"),
         check=lambda got: _equals((0.0, 1.0))((got, math.copysign(1.0, got)))),
    Case("size-int-beyond-float", "size 10**400", lambda: parse_size(10**400),
         error=simdist.ClusterSpecError, match="size 1000.* is not finite"),
    Case("size-large-int-exact", "size 2**60 + 1 stays exact (no float rounding)", lambda: parse_size(2**60 + 1),
         check=_equals(2**60 + 1)),
]

# --- cluster specs ------------------------------------------------------------------------------------


def _graph(*edges: tuple[int, int, object, object]) -> nx.DiGraph:
    g = nx.DiGraph()
    for u, v, bw, lat in edges:
        g.add_edge(u, v, bandwidth=bw, latency=lat)
    return g


_CLUSTERS = [
    Case("route-to-missing-rank", "Cluster.ring(4).route(0, 99)", lambda: simdist.Cluster.ring(4).route(0, 99),
         error=simdist.ClusterSpecError, match=r"route destination rank 99 is out of range: this cluster has ranks 0\.\.3"),
    Case("route-from-float", "Cluster.ring(4).route(0.5, 1)", lambda: simdist.Cluster.ring(4).route(0.5, 1),
         error=simdist.ClusterSpecError, match=r"route source must be an int rank in 0\.\.3; found 0\.5"),
    Case("latency-1e300-on-a-ring", "Cluster.ring(4, latency=1e300): routes would sum to infinity",
         lambda: simdist.Cluster.ring(4, latency=1e300), error=simdist.ClusterSpecError,
         match=r"ring: latency 1e\+300 .* largest link latency accepted, 3600 s"),
    Case("latency-1e300-route-run", "simdist.run on a switch whose 1e300 s links would sum along a route",
         lambda: simdist.run(_all_reduce_four, simdist.Cluster.switch(2, latency=1e300)),
         error=simdist.ClusterSpecError, match=r"switch: latency 1e\+300"),
    Case("subnormal-inter-bandwidth", "two_level with inter_bandwidth='1e-320 B/s'",
         lambda: simdist.Cluster.two_level(2, 2, inter_bandwidth="1e-320 B/s"), error=simdist.ClusterSpecError,
         match=r"two_level: inter_bandwidth: bandwidth '1e-320 B/s'.*outside the accepted range"),
    Case("graph-latency-overflow", "from_graph with a link latency of 1e300 s",
         lambda: simdist.Cluster.from_graph(_graph((0, 1, 1e9, 1e300), (1, 0, 1e9, 0.0))),
         error=simdist.ClusterSpecError, match=r"link 0 -> 1: latency 1e\+300"),
    Case("graph-bandwidth-int-beyond-float", "from_graph with a bandwidth of 10**400",
         lambda: simdist.Cluster.from_graph(_graph((0, 1, 10**400, 0.0), (1, 0, 1e9, 0.0))),
         error=simdist.ClusterSpecError, match=r"link 0 -> 1: bandwidth 1000.* is not finite"),
    Case("latency-at-the-limit-sums", "a 3-rank one-way ring with 3000 s links: a 2-hop route sums exactly",
         lambda: simdist.Cluster.ring(3, latency=3000, bidirectional=False).path_latency(0, 2),
         check=_approx(6000.0)),
    Case("slowest-bandwidth-runs", "all_reduce of 4 floats on 2 ranks linked at 1e-3 bytes/s: finite time",
         lambda: simdist.run(_all_reduce_four, simdist.Cluster.ring(2, bandwidth=MIN_BANDWIDTH, latency=0,
                                                                    algorithms={"all_reduce": "ring"})).sim_time,
         # ring all-reduce closed form 2(n-1)a + 2(n-1)/n m b with n=2, a=0, m=16 bytes, b=1000 s/byte
         check=_approx(16 / MIN_BANDWIDTH, rel=1e-6)),
    Case("algorithm-as-list", "algorithms={'all_reduce': ['ring']}",
         lambda: simdist.Cluster.ring(4, algorithms={"all_reduce": ["ring"]}),  # type: ignore[dict-item]
         error=simdist.ClusterSpecError, match=r"algorithms\['all_reduce'\]: an algorithm is named by one string.*list"),
    Case("algorithm-as-dict", "algorithms={'all_reduce': {'name': 'ring'}}",
         lambda: simdist.Cluster.ring(4, algorithms={"all_reduce": {"name": "ring"}}),  # type: ignore[dict-item]
         error=simdist.ClusterSpecError, match=r"algorithms\['all_reduce'\].*found dict"),
    Case("collective-as-tuple", "algorithms={('all_reduce',): 'ring'}",
         lambda: simdist.Cluster.ring(4, algorithms={("all_reduce",): "ring"}),  # type: ignore[dict-item]
         error=simdist.ClusterSpecError, match=r"algorithms: a collective is named by a string.*tuple"),
    Case("ring-a-trillion", "Cluster.ring(10**12)", lambda: simdist.Cluster.ring(10**12),
         error=simdist.ClusterSpecError, match=rf"ring: n gives 1000000000000 ranks, more than the {MAX_WORLD_SIZE}"),
    Case("fully-connected-huge", "Cluster.fully_connected(100000): 10**10 links",
         lambda: simdist.Cluster.fully_connected(100000), error=simdist.ClusterSpecError,
         match=rf"fully_connected: n = 100000 gives 9999900000 directed links, more than the {MAX_LINKS}"),
    Case("torus-2-to-the-30", "Cluster.torus((2,) * 30)", lambda: simdist.Cluster.torus((2,) * 30),
         error=simdist.ClusterSpecError, match="torus: dims .* gives 1073741824 ranks"),
    Case("two-level-ten-million-nodes", "Cluster.two_level(10**7)", lambda: simdist.Cluster.two_level(10**7),
         error=simdist.ClusterSpecError, match=r"two_level: nodes x gpus_per_node \(10000000 x 8\)"),
    Case("preset-world-size-huge", "Cluster.preset('switch', world_size=10**12)",
         lambda: simdist.Cluster.preset("switch", world_size=10**12), error=simdist.ClusterSpecError,
         match="preset 'switch': world_size gives 1000000000000 ranks"),
    Case("unknown-device", "Cluster.ring(2, device='TPUv9') fails when built, not mid-run",
         lambda: simdist.Cluster.ring(2, device="TPUv9"), error=simdist.ClusterSpecError,
         match="unknown device 'TPUv9'; known devices: H100"),
    Case("preset-renamed", "Cluster.preset('ring', name='lab') (name was also preset()'s own argument)",
         lambda: simdist.Cluster.preset("ring", name="lab").name, check=_equals("lab")),
    Case("build-unknown-builder", "Cluster.build('star', {'n': 4})", lambda: simdist.Cluster.build("star", {"n": 4}),
         error=simdist.ClusterSpecError, match="unknown builder 'star'; known builders: ring, switch"),
    Case("build-misspelt-argument", "Cluster.build('torus', {'dims': [2, 2], 'bandwdith': '1GB/s'})",
         lambda: simdist.Cluster.build("torus", {"dims": [2, 2], "bandwdith": "1GB/s"}), error=simdist.ClusterSpecError,
         match=r"builder 'torus': unknown key 'bandwdith'.*Did you mean 'bandwidth'"),
    Case("world-size-string", "load_cluster('ring', '4')", lambda: simdist.load_cluster("ring", "4"),  # type: ignore[arg-type]
         error=simdist.ClusterSpecError, match="world_size must be a positive integer; found '4'"),
]

# --- config files -------------------------------------------------------------------------------------

_RING_JSON = '{"cluster": {"builder": "ring", "n": 4, %s}}'
_TWO_HOPS = (
    '{"cluster": {"world_size": 3}, "links": ['
    '{"src": 0, "dst": 1, "bandwidth": 1e9, "latency": 1e300, "duplex": true},'
    '{"src": 1, "dst": 2, "bandwidth": 1e9, "latency": 1e300, "duplex": true}]}'
)

_CONFIGS = [
    Case("json-not-utf8", "a JSON cluster file with a 0xff byte", _load("latin.json", b'{"cluster": {"preset": "ring\xff"}}'),
         error=simdist.ClusterSpecError, match=r"latin\.json: not UTF-8 text: byte 0xff at offset 28 \(line 1\)"),
    Case("toml-not-utf8", "a TOML cluster file with a 0xff byte on line 2",
         _load("latin.toml", b'[cluster]\npreset = "ring\xff"\n'), error=simdist.ClusterSpecError,
         match=r"latin\.toml: not UTF-8 text: .*\(line 2\)"),
    Case("json-utf16", "a JSON cluster file saved as UTF-16",
         _load("wide.json", '{"cluster": {"preset": "ring"}}'.encode("utf-16")),
         error=simdist.ClusterSpecError, match="not UTF-8 text.*save the file as UTF-8"),
    Case("json-byte-order-mark", "a UTF-8 JSON file starting with a byte-order mark loads",
         lambda: _load("bom.json", b'\xef\xbb\xbf{"cluster": {"preset": "ring"}}')().world_size,
         check=_equals(8)),
    Case("json-builder-table", 'a JSON "builder" that is a table',
         _load("builder-table.json", '{"cluster": {"builder": {"name": "ring"}, "n": 4}}'),
         error=simdist.ClusterSpecError, match="builder must be a builder name .* found a dict"),
    Case("json-builder-list", 'a JSON "builder" that is a list',
         _load("builder-list.json", '{"cluster": {"builder": ["ring"], "n": 4}}'),
         error=simdist.ClusterSpecError, match="builder must be a builder name .* found a list"),
    Case("json-duplicate-key", 'a JSON object giving "n" twice (JSON keeps the last silently)',
         _load("dup.json", '{"cluster": {"builder": "ring", "n": 4, "n": 8}}'),
         error=simdist.ClusterSpecError, match="key 'n' is given twice"),
    Case("json-nested-deep", "a JSON file of 100000 nested lists",
         _load("deep.json", "[" * 100000 + "]" * 100000), error=simdist.ClusterSpecError, match="nest too deeply"),
    Case("toml-nested-deep", "a TOML value of 100000 nested arrays",
         _load("deep.toml", "a = " + "[" * 100000 + "]" * 100000), error=simdist.ClusterSpecError,
         match="nest too deeply"),
    Case("json-nan-bandwidth", "a JSON bandwidth NaN (Python's json reads it)",
         _load("nan.json", _RING_JSON % '"bandwidth": NaN'), error=simdist.ClusterSpecError,
         match="ring: bandwidth nan is not a number"),
    Case("json-huge-int-bandwidth", "a JSON bandwidth of 1 followed by 400 zeros",
         _load("bigint.json", _RING_JSON % ('"bandwidth": 1' + "0" * 400)), error=simdist.ClusterSpecError,
         match="ring: bandwidth 1000.* is not finite"),
    Case("json-latency-sum-overflow", "explicit links of 1e300 s each on a 2-hop route",
         _load("hops.json", _TWO_HOPS), error=simdist.ClusterSpecError, match=r"link 0 -> 1: latency 1e\+300"),
    Case("json-list-for-number", 'a JSON "n": [4]', _load("nlist.json", '{"cluster": {"builder": "ring", "n": [4]}}'),
         error=simdist.ClusterSpecError, match=r"ring: n \(number of ranks\) must be a positive integer; found \[4\]"),
    Case("json-algorithm-list", 'JSON algorithms {"all_reduce": ["ring"]}',
         _load("alist.json", _RING_JSON % '"algorithms": {"all_reduce": ["ring"]}'), error=simdist.ClusterSpecError,
         match=r"algorithms\['all_reduce'\]: an algorithm is named by one string"),
    Case("json-world-size-trillion", "explicit links form with world_size 10**12",
         _load("trillion.json", '{"cluster": {"world_size": 1000000000000}, "links": []}'),
         error=simdist.ClusterSpecError, match=r"\[cluster\] world_size gives 1000000000000 ranks"),
    Case("json-switch-names-ints", "switches = [1] (ints, not names)",
         _load("switches.json", '{"cluster": {"world_size": 2, "switches": [1]}, "links": []}'),
         error=simdist.ClusterSpecError, match=r"switches must be a list of switch names \(strings\); found \[1\]"),
    Case("config-path-is-directory", "load_cluster on a directory named x.json", _load_directory,
         error=simdist.ClusterSpecError, match=r"cluster file .*adir\.json' is a directory"),
    Case("toml-preset-renamed", 'a TOML preset = "ring" with name = "lab"',
         lambda: _load("renamed.toml", '[cluster]\npreset = "ring"\nname = "lab"\n')().name, check=_equals("lab")),
    Case("toml-empty", "an empty TOML file", _load("empty.toml", ""), error=simdist.ClusterSpecError,
         match=r"needs a \[cluster\] table"),
    Case("json-truncated", "a JSON file cut off mid-object", _load("cut.json", '{"cluster": '),
         error=simdist.ClusterSpecError, match=r"cut\.json: not valid JSON: Expecting value: line 1 column 13"),
]

# --- simdist run ----------------------------------------------------------------------------------------

#: runs as torchrun runs it (simdist run) and by its entry function (python -m real)
_OK = _script("allreduce.py", "import torch\nimport torch.distributed as dist\n\n\ndef main():\n"
              "    t = torch.rand(3)\n    dist.all_reduce(t)\n    return t\n\n\n"
              "if __name__ == '__main__':\n    dist.init_process_group()\n    print(main())\n")


def _same_run(argv_a: list[str], argv_b: list[str]) -> tuple[tuple[int, str], tuple[int, str]]:
    return _invoke(simdist_main, argv_a), _invoke(simdist_main, argv_b)


def _same_output_but_wall(runs: tuple[tuple[int, str], tuple[int, str]]) -> None:
    (status_a, a), (status_b, b) = runs
    assert status_a == status_b == 0, (a, b)
    strip = re.compile(r"wall [0-9.]+ s")
    assert strip.sub("", a) == strip.sub("", b), (a, b)  # rank values and trace hash alike


def _trace_into_missing_directory() -> list[str]:
    missing = _TMP / "no-such-dir" / "t.json"
    return ["run", _OK, "--world-size", "2", "--trace", str(missing)]


def _into_closed_pipe() -> tuple[int, str]:
    """``simdist run`` of 256 ranks printing long values into a reader that stops after 100 bytes (``| head -c 100``)."""
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "wide.py"
        script.write_text("def main():\n    return 'x' * 2000\n")
        command = [sys.executable, "-c", "import sys; from simdist.cli import main; sys.exit(main())", "run", str(script),
                   "--entry", "main", "--world-size", "256"]
        child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp)
        assert child.stdout is not None and child.stderr is not None
        child.stdout.read(100)
        child.stdout.close()  # the reader goes away
        err = child.stderr.read().decode()
        return child.wait(timeout=120), err


def _quiet_exit(result: tuple[int, str]) -> None:
    """Oracle: what Unix tools do when their reader goes away: stop, no traceback on stderr."""
    status, err = result
    assert status == 1 and "Traceback" not in err and "BrokenPipeError" not in err, (status, err)


_RUN = [
    Case("run-into-closed-pipe", "simdist run ... | head -c 100 (the reader stops reading)", _into_closed_pipe,
         check=_quiet_exit),
    Case("seed-minus-one", "simdist run --seed -1 is torch's seed 2**64 - 1, as torch.manual_seed(-1) is",
         lambda: _same_run(["run", _OK, "--world-size", "2", "--seed", "-1"],
                           ["run", _OK, "--world-size", "2", "--seed", str(2**64 - 1)]),
         check=_same_output_but_wall),
    Case("seed-beyond-torch", "simdist run --seed 2**64", cli(simdist_main, ["run", _OK, "--seed", str(2**64)]),
         error=SystemExit, match=r"argument --seed: 18446744073709551616 is outside the seeds torch accepts"),
    Case("watchdog-zero", "simdist run --watchdog 0", cli(simdist_main, ["run", _OK, "--watchdog", "0"]),
         error=SystemExit, match=r"argument --watchdog: expected a positive number of seconds \(or inf\); found '0'"),
    Case("backend-name-unknown-cli", "simdist run --backend-name mpi",
         cli(simdist_main, ["run", _OK, "--backend-name", "mpi"]),
         error=SystemExit, match=r"argument --backend-name: invalid choice: 'mpi'"),
    Case("seed-not-a-number", "simdist run --seed 1.5", cli(simdist_main, ["run", _OK, "--seed", "1.5"]),
         error=SystemExit, match=r"argument --seed: expected a whole number; found '1\.5'"),
    Case("trace-missing-directory", "simdist run --trace into a directory that does not exist (checked before the run)",
         cli(simdist_main, _trace_into_missing_directory), error=SystemExit,
         match=r"argument --trace: the directory of .*no-such-dir/t\.json.* does not exist; create it first"),
    Case("trace-is-a-directory", "simdist run --trace naming a directory",
         cli(simdist_main, ["run", _OK, "--trace", str(_TMP)]), error=SystemExit,
         match=r"argument --trace: .* is a directory; give a file name"),
    Case("run-world-size-zero", "simdist run --world-size 0", cli(simdist_main, ["run", _OK, "--world-size", "0"]),
         error=SystemExit, match=r"argument --world-size: expected a whole number >= 1; found 0"),
    Case("run-world-size-negative", "simdist run --world-size -3",
         cli(simdist_main, ["run", _OK, "--world-size", "-3"]), error=SystemExit,
         match=r"argument --world-size: expected a whole number >= 1; found -3"),
    Case("run-world-size-trillion", "simdist run --world-size 10**12",
         cli(simdist_main, ["run", _OK, "--world-size", str(10**12)]), error=SystemExit,
         match=r"simdist: error: preset 'switch': world_size gives 1000000000000 ranks"),
    Case("gloo-threads-zero", "simdist run --gloo-threads 0",
         cli(simdist_main, ["run", _OK, "--progress", "gloo", "--gloo-threads", "0"]), error=SystemExit,
         match=r"argument --gloo-threads: expected a whole number >= 1; found 0"),
    Case("run-syntax-error", "simdist run on a script with a syntax error: python's own report, no simdist frames",
         cli(simdist_main, ["run", _script("syntax.py", "x = 1\ndef main(:\n    pass\n")]), error=SystemExit,
         match=r'syntax\.py is not valid Python:\n  File ".*syntax\.py", line 2\n    def main\(:\n +\^\nSyntaxError'),
    Case("run-import-raises", "simdist run --entry main on a script whose top level raises",
         cli(simdist_main, ["run", _script("raises.py", "import json\njson.loads('{')\n"), "--entry", "main"]),
         error=SystemExit,
         match=r'raises\.py raised JSONDecodeError while being imported.*\n  File ".*raises\.py", line 2, in <module>'),
    Case("run-import-exits", "simdist run --entry main on a script calling sys.exit(3) at import (3 means races found)",
         cli(simdist_main, ["run", _script("exits.py", "import sys\nsys.exit(3)\n"), "--entry", "main"]), error=SystemExit,
         match=r"called sys\.exit\(3\) while being imported"),
    Case("run-no-entry", "simdist run --entry main on a script without main()",
         cli(simdist_main, ["run", _script("noentry.py", "def train():\n    pass\n"), "--entry", "main"]), error=SystemExit,
         match=r"defines no 'main'.*functions it defines: train"),
    Case("run-cluster-not-utf8", "simdist run --cluster on a non-UTF-8 file",
         cli(simdist_main, lambda: ["run", _OK, "--cluster", str(_file("run-latin.toml", b"[cluster]\xff\n"))]),
         error=SystemExit, match=r"simdist: error: .*run-latin\.toml: not UTF-8 text"),
    Case("run-unknown-preset", "simdist run --cluster dgx-h10", cli(simdist_main, ["run", _OK, "--cluster", "dgx-h10"]),
         error=SystemExit, match=r"unknown cluster preset 'dgx-h10'.*Did you mean 'dgx-h100'"),
]

# --- simdist bench ------------------------------------------------------------------------------------


def _streamed_rows() -> tuple[list[str], list[simdist.bench.Row], str]:
    """Rows as on_row saw them, the rows returned, and the table of those rows."""
    seen: list[str] = []
    cluster = simdist.Cluster.switch(4, device="cpu")
    rows = bench(cluster, "all_reduce", 8, 512, 8, on_row=lambda r: seen.append(table_row(r)))
    return seen, rows, format_table(rows, "all_reduce", cluster)


def _streamed_in_order(got: tuple[list[str], list[simdist.bench.Row], str]) -> None:
    seen, rows, table = got
    assert seen == [table_row(r) for r in rows] and len(rows) == 3
    assert table.splitlines()[3:6] == seen


def _cli_table_matches() -> tuple[str, str]:
    status, output = _invoke(simdist_main, ["bench", "--cluster", "ring", "--world-size", "3", "-b", "8", "-e", "64"])
    assert status == 0, output
    cluster = simdist.Cluster.preset("ring", world_size=3)
    rows = bench(cluster, "all_reduce", 8, 64)
    return output, "\n".join([table_header("all_reduce", cluster), *map(table_row, rows), table_footer(rows)])


def _algorithms_after_bench() -> tuple[dict[str, str], dict[str, str]]:
    cluster = simdist.Cluster.switch(4, device="cpu", algorithms={"all_reduce": "tree"})
    before = dict(cluster.algorithms)
    bench(cluster, "all_reduce", 8, 8, algorithm="ring")
    return before, cluster.algorithms


_BENCH = [
    Case("bench-world-100000", "simdist bench --world-size 100000 (once minutes of silence): refused at once",
         cli(simdist_main, ["bench", "--world-size", "100000"]), error=SystemExit,
         match=r"--world-size: a world of 100000 ranks is more than simdist bench simulates \(4096\)"),
    Case("bench-beyond-memory", "simdist bench -b 1G -e 1G on 4096 ranks (12 TiB)",
         cli(simdist_main, ["bench", "--cluster", "switch", "--world-size", "4096", "-b", "1G", "-e", "1G"]),
         error=SystemExit, match=r"the largest row needs about 12 TiB .* of memory is available; use a largest size"),
    Case("bench-api-beyond-memory", "bench() with a 2**62-byte buffer", lambda: bench(
        simdist.Cluster.switch(2, device="cpu"), "all_reduce", 2**62, 2**62), error=BenchError,
         match=r"needs about .* only .* of memory is available"),
    Case("bench-size-unknown-unit", "simdist bench -e 1X", cli(simdist_main, ["bench", "-e", "1X"]), error=SystemExit,
         match=r"argument -e/--maxbytes: size '1X' has unknown unit 'X'"),
    Case("bench-size-negative", "simdist bench -b -8", cli(simdist_main, ["bench", "-b", "-8"]), error=SystemExit,
         match=r"argument -b/--minbytes: size '-8' is negative"),
    Case("bench-size-overflows", "simdist bench -b 1e999", cli(simdist_main, ["bench", "-b", "1e999"]),
         error=SystemExit, match=r"argument -b/--minbytes: size '1e999' is not finite"),
    Case("bench-size-zero", "simdist bench -b 0", cli(simdist_main, ["bench", "-b", "0"]), error=SystemExit,
         match=r"min_bytes \(-b, the smallest size\) must be a whole number >= 1; found 0"),
    Case("bench-sizes-reversed", "simdist bench -b 16 -e 8", cli(simdist_main, ["bench", "-b", "16", "-e", "8"]),
         error=SystemExit, match=r"max_bytes \(-e\) 8 is below min_bytes \(-b\) 16"),
    Case("bench-step-one", "simdist bench -f 1 (would loop forever)", cli(simdist_main, ["bench", "-f", "1"]),
         error=SystemExit, match=r"argument -f/--stepfactor: expected a whole number >= 2; found 1"),
    Case("bench-root-out-of-range", "simdist bench broadcast -r 99 on 8 ranks",
         cli(simdist_main, ["bench", "broadcast", "-r", "99"]), error=SystemExit,
         match=r"root \(-r\) 99 is not a rank of this 8-rank cluster; expected 0\.\.7"),
    Case("bench-root-negative", "simdist bench -r -1", cli(simdist_main, ["bench", "-r", "-1"]), error=SystemExit,
         match=r"argument -r/--root: expected a whole number >= 0; found -1"),
    Case("bench-barrier", "simdist bench barrier (no size to sweep)", cli(simdist_main, ["bench", "barrier"]),
         error=SystemExit, match=r"argument collective: invalid choice: 'barrier'"),
    Case("bench-unknown-type", "simdist bench -d complex64", cli(simdist_main, ["bench", "-d", "complex64"]),
         error=SystemExit, match=r"argument -d/--datatype: invalid choice: 'complex64'"),
    Case("bench-algorithm-lacking", "simdist bench all_gather -a tree: refused before the table starts",
         cli(simdist_main, ["bench", "all_gather", "-a", "tree"]), error=SystemExit,
         match=r"\A(?!# simdist bench)simdist: error: algorithms\['all_gather'\]: 'tree' does not implement"),
    Case("bench-api-float-sizes", "bench(min_bytes=8.5)", lambda: bench(
        simdist.Cluster.switch(2, device="cpu"), "all_reduce", 8.5, 64), error=BenchError,  # type: ignore[arg-type]
         match=r"min_bytes \(-b, the smallest size\) must be a whole number >= 1; found 8\.5"),
    Case("bench-rows-stream", "bench(on_row=...) sees every row as it finishes, in order",
         _streamed_rows, check=_streamed_in_order),
    Case("bench-cli-streams-the-table", "simdist bench prints the same table, row by row",
         _cli_table_matches, check=lambda got: _equals(got[1])(got[0].rstrip("\n"))),
    Case("bench-keeps-cluster-algorithms", "bench(cluster, algorithm='ring') leaves the cluster's own choice",
         _algorithms_after_bench, check=_equals(({"all_reduce": "tree"}, {"all_reduce": "tree"}))),
]

# --- python -m real -----------------------------------------------------------------------------------

_REAL = [
    Case("real-syntax-error", "python -m real on a script with a syntax error",
         cli(real_main, [_script("real-syntax.py", "def main(:\n"), "--nproc", "2"]), error=SystemExit,
         match=r'python -m real: error: script .*real-syntax\.py is not valid Python:\n  File ".*real-syntax\.py", '
               r"line 1\n    def main\(:\n +\^\nSyntaxError"),
    Case("real-import-raises", "python -m real on a script whose import fails",
         cli(real_main, [_script("real-missing-import.py", "import no_such_module_for_real\n"), "--nproc", "2",
                         "--entry", "main"]),
         error=SystemExit, match=r"raised ModuleNotFoundError while being imported.*\n.*line 1, in <module>"),
    Case("real-missing-script", "python -m real on a script that does not exist",
         cli(real_main, [str(_TMP / "absent.py"), "--nproc", "2"]), error=SystemExit,
         match=r"script '.*absent\.py' not found"),
    Case("real-no-entry", "python -m real --entry main on a script without main()",
         cli(real_main, [_script("real-noentry.py", "x = 1\n"), "--nproc", "2", "--entry", "main"]), error=SystemExit,
         match="defines no 'main'"),
    Case("real-timeout-infinite", "python -m real --timeout inf",
         cli(real_main, [_OK, "--nproc", "2", "--timeout", "inf"]), error=SystemExit,
         match=r"timeout must be a positive number of seconds, at most 2592000 \(30 days\); got inf"),
    Case("real-timeout-nan", "python -m real --timeout nan", cli(real_main, [_OK, "--nproc", "2", "--timeout", "nan"]),
         error=SystemExit, match="timeout must be a positive number of seconds.*got nan"),
    Case("real-nproc-100000", "python -m real --nproc 100000 (each process imports torch)",
         cli(real_main, [_OK, "--nproc", "100000"]), error=SystemExit,
         match=r"nproc 100000 would not fit: each rank process needs about 256 MiB"),
    Case("real-nproc-zero", "python -m real --nproc 0", cli(real_main, [_OK, "--nproc", "0"]), error=SystemExit,
         match="--nproc must be at least 1; got 0"),
    Case("real-backend-without-entry", "python -m real --backend nccl on a script run as torchrun runs it",
         cli(real_main, [_OK, "--nproc", "2", "--backend", "nccl"]), error=SystemExit,
         match=r"--backend nccl chooses the group real creates around an entry function; without --entry the "
               r"script runs as torchrun runs it and creates its own group"),
    Case("real-nodes-without-endpoint", "python -m real --nnodes 2 with no rendezvous endpoint",
         cli(real_main, [_OK, "--nproc", "2", "--nnodes", "2", "--node-rank", "1"]), error=SystemExit,
         match=r"a launch on 2 nodes needs the rendezvous endpoint every node meets at \(node 0's address and "
               r"port\): pass --rdzv-endpoint HOST:PORT"),
    Case("real-script-args-without-dashes", "torchrun's habit: python -m real --nproc-per-node 2 allreduce.py --lr 1 "
         "(the script's arguments right after it, no --)",
         cli(real_main, ["--nproc-per-node", "2", _OK, "--lr", "1"]), error=SystemExit,
         match=r"unrecognized arguments: --lr 1; the script's own arguments follow `--`: python -m real "
               r".*allreduce\.py \[options\] -- --lr 1"),
    Case("real-standalone-two-nodes", "python -m real --standalone --nnodes 2 (standalone is one node)",
         cli(real_main, [_OK, "--nproc", "2", "--standalone", "--nnodes", "2"]), error=SystemExit,
         match=r"--standalone runs one node meeting itself on a free local port, but --nnodes is given"),
]

CASES: list[Case] = [*_NUMBERS, *_CLUSTERS, *_CONFIGS, *_RUN, *_BENCH, *_REAL]


@pytest.mark.parametrize("case", params(CASES))
def test_hostile(case: Case) -> None:
    check(case)
