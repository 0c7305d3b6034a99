"""The command line and the scenarios, run as a user would run them; scenario output vs its expected file."""

from __future__ import annotations

import difflib
import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import alpha_beta
import markupsafe
import pytest
from warm_scripts import WarmScripts

import simdist
from simdist import algorithms
from simdist.bench import bench
from simdist.cli import main
from simdist.report import ScenarioReport
from simdist.units import format_size

ROOT = Path(__file__).resolve().parent.parent
EXPECTED = ROOT / "scenarios" / "expected"

SCRIPT = """
import torch, torch.distributed as dist

def main():
    t = torch.ones(4) * dist.get_rank()
    dist.all_reduce(t)
    return t.tolist()
"""


def test_simdist_run_script(tmp_path, capsys):
    script = tmp_path / "prog.py"
    script.write_text(SCRIPT)
    trace = tmp_path / "t.json"
    argv = ["run", str(script), "--entry", "main", "--cluster", "ring", "--world-size", "4", "--seed", "1", "--trace", str(trace)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    for r in range(4):
        assert f"rank {r}: [6.0, 6.0, 6.0, 6.0]" in out
    assert "simulated time" in out
    assert json.loads(trace.read_text())["traceEvents"]


def scenario_module(name: str):
    """Import ``scenarios/<name>.py`` (scenarios are scripts, not a package; they import their siblings)."""
    sys.path.insert(0, str(ROOT / "scenarios"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "scenarios"))


RACY = """
import torch, torch.distributed as dist

def main():
    t = torch.ones(4)
    first = dist.all_reduce(t, async_op=True)
    second = dist.all_reduce(t, async_op=True)
    first.wait()
    second.wait()
    return t.tolist()
"""


def test_simdist_run_reports_races_and_runs_gloo_progress(tmp_path, capsys):
    script = tmp_path / "racy.py"
    script.write_text(RACY)
    assert main(["run", str(script), "--entry", "main", "--world-size", "2", "--progress", "nccl"]) == 3
    out = capsys.readouterr().out
    assert "rank 0: [4.0, 4.0, 4.0, 4.0]" in out  # in order on one stream: the sum of sums
    assert "two operations in flight on overlapping memory" in out and "on ranks 0-1 (2 findings)" in out
    assert main(["run", str(script), "--entry", "main", "--world-size", "2", "--progress", "gloo", "--races", "off"]) == 0
    assert "rank 0: [4.0, 4.0, 4.0, 4.0]" not in capsys.readouterr().out  # two workers interleave
    assert main(["run", str(script), "--entry", "main", "--world-size", "2", "--races", "error"]) == 1  # a diagnosed run
    assert "simdist: error: race on rank 0: two operations in flight" in capsys.readouterr().err


ADAM_STEP = """
import torch


def main(width=256, device="cpu"):
    with torch.device(device):  # "meta": sized, never allocated
        model = torch.nn.Linear(width, width)
        x = torch.randn(32, width)
    opt = torch.optim.Adam(model.parameters())
    model(x).sum().backward()
    opt.step()
"""


def test_simdist_run_memory_prints_the_peaks_and_fails_a_rank_out_of_memory(tmp_path, capsys):
    script = tmp_path / "adam.py"
    script.write_text(ADAM_STEP)
    assert main(["run", str(script), "--entry", "main", "--world-size", "2", "--memory"]) == 0
    out = capsys.readouterr().out
    params = (256 * 256 + 256) * 4  # weight and bias, float32
    line = next(x for x in out.splitlines() if x.startswith("  ranks 0-1: "))
    assert f"parameters {format_size(params)}" in line and f"gradients {format_size(params)}" in line
    assert f"optimizer_state {format_size(2 * params + 2 * 4)}" in line  # exp_avg, exp_avg_sq, two step counters
    # 64 GiB of weight on the meta device: its gradient takes the rank over an H100's 80 GiB
    script.write_text(ADAM_STEP.replace('width=256, device="cpu"', 'width=1 << 17, device="meta"'))
    assert main(["run", str(script), "--entry", "main", "--world-size", "2", "--memory"]) == 1
    assert "simulated out of memory" in capsys.readouterr().err


def test_simdist_run_bad_cluster_is_a_clear_error(tmp_path, capsys):
    script = tmp_path / "prog.py"
    script.write_text(SCRIPT)
    assert main(["run", str(script), "--cluster", "dgx-h10"]) == 2
    assert "dgx-h100" in capsys.readouterr().err


@pytest.mark.parametrize("collective", ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all"])
def test_bench_rows_verify_data_and_match_closed_forms(collective):
    n, lat, bw = 4, 5e-6, 100e9
    cluster = simdist.Cluster.ring(n, bandwidth=bw, latency=lat, device="cpu")
    if collective != "all_to_all":
        cluster.algorithms = {collective: "ring"}
    rows = bench(cluster, collective, min_bytes=64, max_bytes=1 << 20, step_factor=16)
    assert [r.wrong for r in rows] == [0] * len(rows)
    for r in rows:
        assert r.busbw == pytest.approx(r.algbw * algorithms.collective(collective).bus_factor(n))
        if collective != "all_to_all":
            want = algorithms.estimate(collective, "ring", n, r.size, lat, 1 / bw, numel=r.count)
            assert r.time_us == pytest.approx(want * 1e6, rel=0.01)


# "direct" is left out: its n - 1 concurrent messages per rank contend in a way the closed form does not see
@pytest.mark.parametrize("algorithm", ["auto", "ring", "tree"])
def test_bench_cli_prints_the_nccl_tests_table(capsys, algorithm):
    n = 4
    args = ["--cluster", "switch", "--world-size", str(n), "-b", "8", "-e", "256K", "-f", "32", "-a", algorithm]
    assert main(["bench", "all_reduce", *args]) == 0
    out = capsys.readouterr().out
    assert "#wrong" in out and "busbw" in out and "algbw" in out
    assert "Out of bounds values : 0 OK" in out
    cluster = simdist.Cluster.preset("switch", world_size=n)
    alpha, beta = cluster.path_latency(0, 1), 1 / cluster.path_bandwidth(0, 1)
    rows = [line.split() for line in out.splitlines() if line.strip() and not line.startswith("#")]
    assert [int(r[0]) for r in rows] == [8, 256, 8 << 10, 256 << 10]
    for size, count, dtype, redop, root, time_us, algbw, busbw, wrong, algo in rows:
        assert (int(count), dtype, redop, root, wrong) == (int(size) // 4, "float", "sum", "-1", "0")
        assert algo == algorithm or algorithm == "auto"
        want = alpha_beta.all_reduce_seconds(algo, n, int(size), alpha, beta)
        assert float(time_us) == pytest.approx(want * 1e6, rel=1e-3, abs=0.005), (size, algo)
        # GB/s printed with two decimals, from the unrounded time; busbw is algbw x 2(n-1)/n as in nccl-tests
        bw = int(size) / (float(time_us) * 1e-6) / 1e9
        assert float(algbw) == pytest.approx(bw, rel=1e-3, abs=0.006)
        assert float(busbw) == pytest.approx(bw * 2 * (n - 1) / n, rel=1e-3, abs=0.006)
    avg = float(out.split("Avg bus bandwidth    :")[1])
    assert avg == pytest.approx(sum(float(r[7]) for r in rows) / len(rows), rel=1e-3, abs=0.005)


def cpu_capabilities() -> list[str | None]:
    """The SIMD kernel sets the scenarios' expected outputs must hold under: None (the one torch picks on this CPU,
    its best, or the one ``ATEN_CPU_CAPABILITY`` pins) and, unless that variable pins one, every lesser one the CPU
    offers: default and avx2 below avx512, default below avx2 or another architecture's vector kernels."""
    if os.environ.get("ATEN_CPU_CAPABILITY"):
        return [None]
    import torch

    order = ["default", "avx2", "avx512"]
    best = torch.backends.cpu.get_cpu_capability().lower()
    return [None, *(order[: order.index(best)] if best in order else ["default"])]


#: the expected outputs whose numbers torch's CPU kernels compute are checked under each of these (a user's CPU
#: picks other kernels than this one; docs/testing.md#expected-outputs-on-any-cpu)
CAPABILITIES = cpu_capabilities()
on_every_capability = pytest.mark.parametrize(
    "capability", CAPABILITIES, ids=[c or "own" for c in CAPABILITIES]
)


#: interpreters that imported torch, simdist and the scenarios' verdicts once, one per environment (so one per
#: CPU capability), each running a scenario in a fork of itself as a fresh interpreter would run it; DTensor and
#: TorchDynamo too, which torch imports lazily in most scenarios (at the first optimizer): 1-2 s of CPU a run
WARM = WarmScripts(("torch", "torch.distributed.tensor", "torch._dynamo", "simdist", "verdicts"), [str(ROOT / "scenarios")])


@pytest.fixture(scope="session", autouse=True)
def _warm_interpreters_stop():
    yield
    WARM.close()


def run_scenario(name: str, out_dir: Path, capability: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``scenarios/<name>.py --out out_dir`` as ``python`` runs it, on this checkout's simdist, under
    ``ATEN_CPU_CAPABILITY=capability`` where one is given (in a fork of a warm interpreter: tests/warm_scripts.py)."""
    # The scenario's own directory comes first on its sys.path, not the checkout: without PYTHONPATH an
    # installed simdist (another checkout's, say) would be the one under test.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    if capability is not None:
        env["ATEN_CPU_CAPABILITY"] = capability
    return WARM.run(ROOT / "scenarios" / f"{name}.py", ["--out", str(out_dir)], env)


#: a tensor's address in a race report (``at 0x7f38d9b9a600``): where the allocator put it in this process
ADDRESS = re.compile(r"\b0x[0-9a-f]{6,}\b")


def normalise(text: str, out_dir: Path) -> str:
    """A scenario's stdout with its machine-dependent parts replaced (the rules scenarios/README.md lists)."""
    text = text.replace(str(out_dir), "<out>").replace(str(ROOT), "<repo>")
    return ADDRESS.sub("0x<address>", text)


def check_report(name: str, out: subprocess.CompletedProcess[str], out_dir: Path) -> str:
    """The scenario wrote ``out_dir/<name>.html`` with the verdict table it printed, and listed it in the index."""
    page = (out_dir / f"{name}.html").read_text()
    lines = out.stdout.splitlines()
    printed = lines[next(i for i, line in enumerate(lines) if line.startswith("expectation")) + 1 :]
    printed = [line for line in printed if line.strip()]
    failed = sum(" FAIL " in line for line in printed)
    assert f'data-verdicts="{len(printed)}" data-failed="{failed}"' in page
    # every expectation appears as a row of the page's verdict table, escaped as the page escapes text
    for line in printed:
        name_text = line.split(" PASS ")[0].split(" FAIL ")[0].strip()
        assert f"<td>{markupsafe.escape(name_text)}</td>" in page, name_text
    index = (out_dir / "index.html").read_text()
    assert f'href="{name}.html"' in index and f"PASS: {len(printed)} of {len(printed)} expectations held" in index
    return page


def check_golden(name: str, out: subprocess.CompletedProcess[str], out_dir: Path, update: bool) -> None:
    """Compare the run's normalised stdout with ``scenarios/expected/<name>.txt`` (rewrite it when ``update``)."""
    got = normalise(out.stdout, out_dir)
    path = EXPECTED / f"{name}.txt"
    if update:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(got)
    if not path.exists():
        pytest.fail(
            f"no expected output {path}; write it from a real run with: "
            "python3 -m pytest tests/test_cli_and_scenarios.py --update-golden -m 'not real'",
            pytrace=False,
        )
    want = path.read_text()
    if got != want:
        diff = difflib.unified_diff(
            want.splitlines(keepends=True), got.splitlines(keepends=True), str(path), f"{name}.py (this run)"
        )
        pytest.fail(
            f"scenarios/{name}.py printed output that differs from {path.name}:\n{''.join(diff)}\n"
            "If the change is intended, regenerate with: "
            "python3 -m pytest tests/test_cli_and_scenarios.py --update-golden -m 'not real'",
            pytrace=False,
        )


#: a number below 1e-12 in e-notation, or a zero written so (``2.22e-16``, ``0.00e+00``): float64 round-off,
#: whose digits depend on which SIMD kernels torch picks on the CPU at hand
ROUND_OFF = re.compile(r"\b\d\.\d+e-(?:1[3-9]|[2-9]\d|\d{3,})\b|\b0\.0+e[+-]0+\b")


def test_expected_outputs_hold_no_float_round_off():
    # a scenario prints round-off as a bound (verdicts.difference), so its expected file holds on any CPU
    found = [
        f"{path.name}:{n}: {m.group()}"
        for path in sorted(EXPECTED.glob("*.txt"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        for m in ROUND_OFF.finditer(line)
    ]
    assert sorted(EXPECTED.glob("*.txt")) and not found, "\n".join(found)


def test_every_cpu_kernels_test_runs_under_each_capability(request):
    # a test marked cpu_kernels that is not parametrized over CAPABILITIES would check its expected output under
    # this CPU's own kernels only
    seen: dict[str, set] = {}
    for item in request.session.items:
        if item.get_closest_marker("cpu_kernels"):
            params = getattr(item, "callspec", None)
            seen.setdefault(item.originalname, set()).add(params.params.get("capability", "?") if params else "?")
    assert seen and all(got == set(CAPABILITIES) for got in seen.values()), seen


def test_the_capabilities_are_the_cpus_own_and_each_lesser_one(monkeypatch):
    import torch

    best = torch.backends.cpu.get_cpu_capability().lower()
    got = cpu_capabilities()
    assert got[0] is None and len(set(got)) == len(got) and best not in got[1:]
    assert "default" in got or best == "default"
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")  # pinned by hand: that one only
    assert cpu_capabilities() == [None]


def test_round_off_is_printed_as_a_bound():
    difference = scenario_module("verdicts").difference
    assert {difference(x) for x in (0.0, -0.0, 3.47e-18, 2.22e-16, -4.44e-16, 9.9e-13)} == {"below 1e-12"}
    assert [difference(x) for x in (2.74e-2, -5.58e-1, float("nan"))] == ["2.74e-02", "-5.58e-01", "nan"]
    assert not ROUND_OFF.search(" ".join(difference(x) for x in (1e-17, 0.0, 1e-3)))
    assert ROUND_OFF.findall("2.22e-16, 0.00e+00, 1.00e-12, 3.4e-02") == ["2.22e-16", "0.00e+00"]


@pytest.mark.cpu_kernels
@on_every_capability
def test_demo_scenario_passes_and_reports_each_finding(tmp_path, update_golden, capability):
    out = run_scenario("demo", tmp_path, capability)
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    for line in ("both variants equal the single-process model", "overlap shortens the step", "hang reported as a deadlock", "mismatch reported", "same seed, same trace hash"):
        assert any(l.startswith(line) and "PASS" in l for l in text.splitlines()), line
    assert "never issued by rank 11;" in text
    assert json.loads((tmp_path / "demo_step.json").read_text())["traceEvents"]
    check_report("demo", out, tmp_path)
    check_golden("demo", out, tmp_path, update_golden and capability is None)


def ddp_tied_weights_steps() -> int:
    return scenario_module("ddp_tied_weights").STEPS


@pytest.mark.cpu_kernels
@on_every_capability
def test_ddp_tied_weights_scenario_passes_and_names_the_tie(tmp_path, update_golden, capability):
    out = run_scenario("ddp_tied_weights", tmp_path, capability)
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    lines = text.splitlines()
    verdicts = lines[next(i for i, l in enumerate(lines) if l.startswith("expectation")) + 1 :]
    assert len(verdicts) == 12 and all(" PASS " in l for l in verdicts), "\n".join(verdicts)
    # (a): the detector's text names both all-reduces and where the wrapper issued them; the buffer is the tie
    assert "two operations in flight on overlapping memory" in text
    assert "first:  all_reduce #" in text and "second: all_reduce #" in text and "ddp.py" in text
    assert "(the buffer is the gradient of embed.weight = head.weight)" in text
    # (d): autograd read a buffer in flight; the replica check names parameters
    assert "rank code read (in aten." in text and "replicas differ at: embed.weight" in text
    # the oracle's capture wraps backward(): the access is still the scenario's own line, not the wrapper's
    assert "access at: <repo>/scenarios/ddp_tied_weights.py:" in normalise(text, tmp_path)
    # the oracle names the first divergence of (a) and (d) step by step
    assert "step 0: the gradient of 'embed.weight' on ranks 0-3 differs from the reference" in text
    # ... and localises (a) at the second all-reduce of the tied gradient, the one the detector names second
    second = re.search(r"second: (all_reduce #\d+ on group \w+)", text).group(1)
    assert f"first divergent op: {second} at <repo>/simdist/strategies/ddp.py" in normalise(text, tmp_path)
    assert "fastest:" in text and "Chrome trace of this step" in text
    assert json.loads((tmp_path / "ddp_step.json").read_text())["traceEvents"]
    page = check_report("ddp_tied_weights", out, tmp_path)
    # the drift plot: a line per case (a, b, c, d) with a point per step, from the oracle's history
    plot = page.split('id="parameter-drift-per-step-plot"')[1].split("</svg>")[0]
    assert plot.count('<g class="series">') == 4 and plot.count("<circle") == 4 * ddp_tied_weights_steps()
    check_golden("ddp_tied_weights", out, tmp_path, update_golden and capability is None)


@pytest.mark.real
def test_ddp_tied_weights_scenario_on_real_gloo(capsys):
    ddp_tied_weights = scenario_module("ddp_tied_weights")
    verdicts: list = []
    page = ScenarioReport("real", command="")
    ddp_tied_weights.on_real_gloo(0, 1, verdicts, page)
    # the report's table: a row per real case, with its launch's drift
    assert [row[0]["text"] for row in page.sections[-1]["rows"]] == [c[0] for c in ddp_tied_weights.REAL_CASES]
    assert [v[0] for v in verdicts] == ["(c) real gloo: de-duplicated equals the baseline", "(d) real gloo: hook's tensor: replicas diverge"]
    assert all(ok for _, ok, _ in verdicts), verdicts
    assert "(a) on real gloo the double reduction drifted in" in capsys.readouterr().out


@pytest.mark.cpu_kernels
@on_every_capability
def test_silent_bugs_scenario_finds_each_bug_where_it_is_and_passes_each_correction(tmp_path, update_golden, capability):
    out = run_scenario("silent_bugs", tmp_path, capability)
    assert out.returncode == 0, out.stdout + out.stderr
    silent_bugs = scenario_module("silent_bugs")
    lines = out.stdout.splitlines()
    verdicts = lines[next(i for i, l in enumerate(lines) if l.startswith("expectation")) + 1 :]
    assert len(silent_bugs.CASES) >= 12
    assert len(verdicts) == 2 * len(silent_bugs.CASES) and all(" PASS " in l for l in verdicts), "\n".join(verdicts)
    for case in silent_bugs.CASES:
        # the oracle's own report of each bug names the expected step, and each correction is equivalent
        block = out.stdout.split(f"({case.key}) {case.title} ")[1]
        assert block.split("\n")[1].startswith(f"  bug:       step {case.expect.step}: "), block
        assert "  corrected: equivalent: " in block.split("\n(")[0], block
    page = check_report("silent_bugs", out, tmp_path)
    plot = page.split('id="parameter-drift-per-step-buggy-programs-plot"')[1].split("</svg>")[0]
    assert plot.count('<g class="series">') == len(silent_bugs.CASES)
    check_golden("silent_bugs", out, tmp_path, update_golden and capability is None)


@pytest.mark.cpu_kernels
@on_every_capability
def test_pipeline_sync_scenario_shows_which_synchronisation_fits_which_layout(tmp_path, update_golden, capability):
    out = run_scenario("pipeline_sync", tmp_path, capability)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    verdicts = lines[next(i for i, l in enumerate(lines) if l.startswith("expectation")) + 1 :]
    pipeline_sync = scenario_module("pipeline_sync")
    assert len(verdicts) == sum(len(c.variants) for c in pipeline_sync.CASES)
    assert all(" PASS " in l for l in verdicts), "\n".join(verdicts)
    assert {c.key for c in pipeline_sync.CASES} == set("abcdefgh")
    text = out.stdout
    # the shape error names both stages and both parameters; the timeout its stage, microbatch and simulated time
    assert "stage 0 'layers.0.0.weight' (8, 6) vs stage 1 'layers.1.weight' (3, 8)" in text
    assert "stage 1: recv of the activation of microbatch 1" in text and "of simulated time" in text
    assert "rank 0: waits in send to rank 1" in text and "rank 1: waits in send to rank 0" in text
    # each schedule's bubble per stage, printed and drawn as a bar per stage
    shares = re.findall(r"stage (\d) (\d+\.\d)%", text.split("Bubble per schedule")[1])
    assert len(shares) == 4 and all(0 < float(v) < 100 for _, v in shares)
    page = check_report("pipeline_sync", out, tmp_path)
    assert page.count("<title>GPipe, stage ") == 2 and page.count("<title>1F1B, stage ") == 2
    check_golden("pipeline_sync", out, tmp_path, update_golden and capability is None)


@pytest.mark.cpu_kernels
@on_every_capability
def test_fsdp_hazards_scenario_shows_each_hazard_and_its_fix(tmp_path, update_golden, capability):
    out = run_scenario("fsdp_hazards", tmp_path, capability)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    verdicts = lines[next(i for i, l in enumerate(lines) if l.startswith("expectation")) + 1 :]
    fsdp_hazards = scenario_module("fsdp_hazards")
    # a verdict per variant, per race check, and the memory comparison of the timing section
    assert len(verdicts) == sum(len(c.variants) for c in fsdp_hazards.CASES) + len(fsdp_hazards.STEP_BEFORE_FINISH) + 1
    assert all(" PASS " in l for l in verdicts), "\n".join(verdicts)
    # each wrapper's step time and peak are printed, and FSDP's peak is the smaller
    rows = {n: out.stdout.split(f"\n  {n} ")[1].split("\n")[0].split() for n in fsdp_hazards.WRAPPERS}
    assert float(rows["FSDP"][1]) < float(rows["DDP"][1]) and all(float(r[0]) > 0 for r in rows.values())
    text = out.stdout
    assert "does not match across ranks" in text and "gradients 4 x the reference's" in text
    assert "while reduce_scatter_tensor #" in text and "access at: torch/optim/sgd.py" in text
    check_report("fsdp_hazards", out, tmp_path)
    check_golden("fsdp_hazards", out, tmp_path, update_golden and capability is None)


@pytest.mark.real
def test_fsdp_hazards_on_real_gloo_agree_with_the_simulation(capsys):
    fsdp_hazards = scenario_module("fsdp_hazards")
    verdicts: list = []
    simulated = {(c.key, v.label): v.expect == "equal" for c in fsdp_hazards.CASES for v in c.variants}
    page = ScenarioReport("real", command="")
    fsdp_hazards.on_real_gloo(fsdp_hazards.CASES, lambda vs: fsdp_hazards.on_real(vs, 0), simulated, verdicts,
                              keys="c", page=page)
    out = capsys.readouterr().out
    assert verdicts and all(ok for _, ok, _ in verdicts), out + str(verdicts)
    # simulated beside real, a row per variant of (c), each agreeing
    rows = page.sections[-1]["rows"]
    assert len(rows) == len(next(c for c in fsdp_hazards.CASES if c.key == "c").variants)
    assert all(row[-1]["text"] == "yes" for row in rows)
    assert "raised ValueError" in out


@pytest.mark.real
def test_pipeline_sync_on_real_gloo_agrees_with_the_simulation(capsys):
    pipeline_sync = scenario_module("pipeline_sync")
    verdicts: list = []
    simulated = {(c.key, v.label): v.expect == "equal" for c in pipeline_sync.CASES for v in c.variants}
    pipeline_sync.on_real_gloo(pipeline_sync.CASES, lambda vs: pipeline_sync.on_real(vs, 0), simulated, verdicts,
                               keys="ag")
    out = capsys.readouterr().out
    assert verdicts and all(ok for _, ok, _ in verdicts), out + str(verdicts)
    assert "raised PipelineShapeError" in out and "raised TimeoutError" in out


@pytest.mark.real
def test_silent_bugs_on_real_gloo_agree_with_the_simulation(capsys):
    silent_bugs = scenario_module("silent_bugs")
    # a data-parallel and a pipeline case: their simulated verdicts, then the same programs on real processes
    simulated = {"c": (True, True), "g": (True, True)}
    verdicts: list = []
    page = ScenarioReport("real", command="")
    silent_bugs.on_real_gloo(0, 1, simulated, verdicts, keys="cg", page=page)
    assert [(row[0]["text"], row[-1]["text"]) for row in page.sections[-1]["rows"]] == [("(c)", "yes"), ("(g)", "yes")]
    assert verdicts == [("real gloo agrees with the simulation", True, "2 of 2 cases (bug found, correction equal) x 1")]
    out = capsys.readouterr().out
    assert "(c) fc1.weight, fc1.bias, fc2.weight, fc2.bias" in out and "(g) " in out and out.count(" equal\n") == 2


# not cpu_kernels: the runtime computes with NumPy, so torch's choice of SIMD kernels cannot change its output
def test_hotpath_buffer_race_scenario_reproduces_each_race_and_no_fix_fails(tmp_path, update_golden):
    out = run_scenario("hotpath_buffer_race", tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    verdicts = lines[next(i for i, l in enumerate(lines) if l.startswith("expectation")) + 1 :]
    assert len(verdicts) == 10 and all(" PASS " in l for l in verdicts), "\n".join(verdicts)
    for kind in "ABC":
        assert f"FAILED ({kind})" in out.stdout  # the worker's own account of each race
    report = json.loads((tmp_path / "hotpath_buffer_race.json").read_text())
    assert report["runs"] >= 100
    assert all(row["runs"] == report["runs"] for row in report["policies"].values())
    assert report["policies"]["fallback"]["failed"] > 0
    assert all(row["failed"] == 0 for name, row in report["policies"].items() if name != "fallback")
    # the JSON holds the printed table's numbers: failures by kind and fallbacks per policy
    table = [l.split() for l in lines if l.startswith("  ") and l.split()[:1] and l.split()[0] in report["policies"]]
    printed = {row[0]: row[1:6] for row in table}
    assert len(table) == len(printed) == len(report["policies"])
    for name, row in report["policies"].items():
        kinds = row["failures_by_kind"]
        assert printed[name] == [str(v) for v in (row["failed"], kinds["A"], kinds["B"], kinds["C"], row["fallbacks"])]
    check_report("hotpath_buffer_race", out, tmp_path)
    check_golden("hotpath_buffer_race", out, tmp_path, update_golden)


@pytest.mark.real
def test_hotpath_buffer_race_on_a_real_worker(capsys):
    hotpath_buffer_race = scenario_module("hotpath_buffer_race")
    verdicts: list = []
    page = ScenarioReport("real", command="")
    rows = hotpath_buffer_race.on_real_worker(1, verdicts, page)
    assert [row[0]["text"] for row in page.sections[-1]["rows"]] == list(hotpath_buffer_race.POLICIES)
    assert len(verdicts) == 5 and all(ok for _, ok, _ in verdicts), verdicts
    assert set(rows) == set(hotpath_buffer_race.POLICIES)
    assert "the current policy failed in" in capsys.readouterr().out


def test_any_source_order_scenario_finds_replays_and_counts_the_failing_orders(tmp_path, update_golden):
    out = run_scenario("any_source_order", tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    verdicts = lines[next(i for i, l in enumerate(lines) if l.startswith("expectation")) + 1 :]
    assert len(verdicts) == 8 and all(" PASS " in l for l in verdicts), "\n".join(verdicts)
    # shrinking keeps one reordering: the decision at which rank 3 goes before rank 2
    assert "decision 2 at t=0 s: ranks 2, 3 tied; rank 3 went first instead of rank 2" in out.stdout
    # the exhaustive search names every permutation of the three results but rank order
    assert "failing arrival orders: [10, 30, 20], [20, 10, 30], [20, 30, 10], [30, 10, 20], [30, 20, 10]" in out.stdout
    check_report("any_source_order", out, tmp_path)
    check_golden("any_source_order", out, tmp_path, update_golden)


def test_ddp_faults_scenario_times_the_straggler_and_diagnoses_the_crash(tmp_path, update_golden):
    out = run_scenario("ddp_faults", tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    verdicts = lines[next(i for i, l in enumerate(lines) if l.startswith("expectation")) + 1 :]
    assert len(verdicts) == 9 and all(" PASS " in l for l in verdicts), "\n".join(verdicts)
    summary = json.loads((tmp_path / "ddp_faults.json").read_text())
    steps = summary["stragglers"]["step_seconds"]
    # the closed form, computed here from the script's figures: each unit of slowdown adds one step's compute
    compute = summary["stragglers"]["compute_seconds"]
    for s, t in steps.items():
        assert t == pytest.approx(steps["1.0"] + (float(s) - 1) * compute, abs=1e-9)
    assert summary["crash"]["diagnosis"].startswith("rank 5 crashed") and "ddp_faults.py:" in summary["crash"]["diagnosis"]
    assert summary["explore"]["failures"] == 0
    check_report("ddp_faults", out, tmp_path)
    check_golden("ddp_faults", out, tmp_path, update_golden)


def test_elastic_restart_scenario_resumes_from_its_checkpoint_and_ends_as_one_process(tmp_path, update_golden):
    out = run_scenario("elastic_restart", tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    verdicts = lines[next(i for i, l in enumerate(lines) if l.startswith("expectation")) + 1 :]
    assert len(verdicts) == 7 and all(" PASS " in l for l in verdicts), "\n".join(verdicts)
    summary = json.loads((tmp_path / "elastic_restart.json").read_text())
    assert summary["crash"]["resumed_from"] == 4 and summary["node_loss"]["world"] == 2
    check_golden("elastic_restart", out, tmp_path, update_golden)
