"""Profile replay: a run charges the durations a torch profiler trace measured, matched by op, shapes and order.

Oracles: the raw events of a real CPU trace recorded here with torch.profiler, the kernels of a public GPU trace
(HolisticTraceAnalysis's test data), and the cost model for the ops a profile does not hold.
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.profiler import ProfilerActivity, profile

import simdist
from simdist import cli
from simdist.compute import estimate, get_device
from simdist.compute.profile import Profile, parse_trace

DATA = Path(__file__).parent / "data" / "profiles"
#: a public GPU trace: one backward aten::mm (2048x2048 @ 2048x256, float) and its 45 us cutlass kernel
HTA = DATA / "hta_backward_thread.json"
#: the ops the CPU program below runs that cost time (aten::linear decomposes into t + addmm)
TIMED = ("aten::mm", "aten::mul", "aten::addmm")


def program(a: torch.Tensor, lin: torch.nn.Linear, x: torch.Tensor, steps: int, extra: bool = False) -> None:
    """A small step run ``steps`` times: a matmul, an elementwise op and a linear layer (optionally one more op)."""
    with torch.no_grad():
        for _ in range(steps):
            y = torch.mm(a, a)
            torch.mul(y, y)
            lin(x)
        if extra:
            torch.sub(a, a)


@pytest.fixture(scope="module")
def inputs() -> tuple[torch.Tensor, torch.nn.Linear, torch.Tensor]:
    torch.manual_seed(0)
    return torch.randn(32, 32), torch.nn.Linear(8, 4), torch.randn(16, 8)


@pytest.fixture(scope="module")
def cpu_trace(tmp_path_factory: pytest.TempPathFactory, inputs: Any) -> Path:
    """A real CPU trace of two steps of ``program``, recorded with shapes."""
    path = tmp_path_factory.mktemp("profile") / "step.json"
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as p:
        program(*inputs, steps=2)
    p.export_chrome_trace(str(path))
    return path


def raw_durations(path: Path) -> dict[str, list[float]]:
    """Each timed op's durations (seconds) straight from the trace's events, in time order."""
    events = sorted(
        (
            e
            for e in json.loads(path.read_text())["traceEvents"]
            if e.get("cat") == "cpu_op" and e["name"] in TIMED
        ),
        key=lambda e: e["ts"],
    )
    out: dict[str, list[float]] = {}
    for e in events:
        out.setdefault(e["name"], []).append(e["dur"] * 1e-6)
    return out


def one_rank(device: str) -> simdist.Cluster:
    return simdist.Cluster.switch(1, device=device)


def compute_spans(result: simdist.RunResult) -> dict[str, list[float]]:
    """Each op's simulated compute durations on rank 0, in the order charged."""
    out: dict[str, list[float]] = {}
    for s in result.trace.spans:
        if s.stream == "compute" and s.rank == 0:
            out.setdefault(s.name, []).append(s.duration)
    return out


def test_cpu_trace_replays_each_occurrence_in_order(cpu_trace: Path, inputs: Any) -> None:
    raw = raw_durations(cpu_trace)
    assert all(len(raw[name]) == 2 for name in TIMED)
    result = simdist.run(program, one_rank("cpu"), args=(*inputs, 2), compute=simdist.profile(cpu_trace))
    spans = compute_spans(result)
    for name in TIMED:
        assert spans[name] == pytest.approx(raw[name], rel=1e-12, abs=1e-15)
    # an idle stream of one host-synchronous rank: the run lasts the sum of the measured durations
    assert result.sim_time == pytest.approx(sum(map(sum, raw.values())), rel=1e-9)
    stats = result.profile
    assert (stats.matched, stats.reused, stats.unmatched) == (6, 0, 0)
    assert stats.replayed_seconds == pytest.approx(result.sim_time, rel=1e-9)


def test_occurrences_past_the_profile_take_its_median(cpu_trace: Path, inputs: Any) -> None:
    raw = raw_durations(cpu_trace)
    result = simdist.run(program, one_rank("cpu"), args=(*inputs, 3), compute=simdist.profile(cpu_trace))
    spans = compute_spans(result)
    for name in TIMED:
        assert spans[name] == pytest.approx([*raw[name], statistics.median(raw[name])], rel=1e-12, abs=1e-15)
    assert (result.profile.matched, result.profile.reused) == (9, 3)


def test_unmatched_ops_fall_back_to_the_model_and_are_counted(cpu_trace: Path, inputs: Any) -> None:
    result = simdist.run(
        program,
        one_rank("cpu"),
        args=(*inputs, 2),
        kwargs={"extra": True},
        compute=simdist.profile(cpu_trace),
    )
    stats = result.profile
    assert (stats.matched, stats.unmatched) == (6, 1)
    assert stats.unmatched_ops == {"aten::sub": [1, 0.0]}  # the cpu device's model prices it at 0 s
    assert "1 priced by the model" in stats.summary() and "aten::sub x1" in stats.summary()


def test_other_shapes_do_not_match(cpu_trace: Path, inputs: Any) -> None:
    _, lin, x = inputs
    result = simdist.run(
        program, one_rank("cpu"), args=(torch.randn(16, 16), lin, x, 1), compute=simdist.profile(cpu_trace)
    )
    assert result.profile.matched == 1  # the linear layer's addmm; mm and mul ran on other shapes
    assert sorted(result.profile.unmatched_ops) == ["aten::mm", "aten::mul"]


def test_each_rank_counts_its_own_occurrences(cpu_trace: Path, inputs: Any) -> None:
    raw = raw_durations(cpu_trace)
    result = simdist.run(
        program,
        simdist.Cluster.switch(2, device="cpu"),
        args=(*inputs, 2),
        compute=simdist.profile(cpu_trace),
    )
    assert result.finish_times == pytest.approx([sum(map(sum, raw.values()))] * 2, rel=1e-9)
    assert (result.profile.matched, result.profile.reused) == (12, 0)


def gpu_step() -> float:
    a = torch.ones(2048, 2048, device="cuda")
    b = torch.ones(2048, 256, device="cuda")
    torch.mm(a, b)
    torch.mm(a, b)
    torch.add(b, b)
    simdist.synchronize()
    return simdist.now()


def test_gpu_trace_charges_the_kernels_an_op_launched() -> None:
    trace = parse_trace(HTA)
    assert trace.kind == "gpu"
    assert [(op.name, op.shapes, op.seconds) for op in trace.ops] == [
        ("aten::mm", ((2048, 2048), (2048, 256)), pytest.approx(45e-6))
    ]
    result = simdist.run(gpu_step, one_rank("A100"), compute=simdist.profile(HTA))
    spans = compute_spans(result)
    assert spans["aten::mm"] == pytest.approx([45e-6, 45e-6])  # the second past the profile: its median
    b = torch.empty(2048, 256, device="meta")
    assert spans["aten::add"] == pytest.approx([estimate(torch.add, b, b, device="A100")[0]])
    stats = result.profile
    assert (stats.matched, stats.reused, stats.unmatched) == (2, 1, 3)  # add and two ones (fills) unmatched
    assert stats.model_seconds == pytest.approx(sum(sum(v) for k, v in spans.items() if k != "aten::mm"))
    # the stream runs the replayed kernels in order; each starts once its host has launched it (7 us per launch on
    # the A100 preset, overlapping the kernel before), so the step ends with the last kernel, its gaps the launches'
    kernels = sorted((s for s in result.trace.spans if s.stream == "compute" and s.rank == 0), key=lambda s: s.start)
    assert result.returns[0] == pytest.approx(kernels[-1].end)
    assert kernels[0].start == pytest.approx(get_device("A100").host_overhead)
    busy = sum(map(sum, spans.values()))
    assert busy <= result.returns[0] <= busy + len(kernels) * get_device("A100").host_overhead


def _edited(tmp_path: Path, edit: Any) -> Path:
    data = json.loads(HTA.read_text())
    edit(data)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    return path


def test_gpu_kernel_found_by_external_id_without_its_runtime_call(tmp_path: Path) -> None:
    def newer_kineto(data: dict[str, Any]) -> None:
        # newer traces give the kernel its op's External id; drop the runtime call that links it by correlation
        data["traceEvents"] = [e for e in data["traceEvents"] if e.get("cat") != "cuda_runtime"]
        kernel = next(e for e in data["traceEvents"] if e.get("cat") == "kernel")
        kernel["args"]["External id"] = 67247

    assert [op.seconds for op in parse_trace(_edited(tmp_path, newer_kineto)).ops] == [pytest.approx(45e-6)]


def test_gpu_op_without_kernels_took_no_device_time(tmp_path: Path) -> None:
    def kernel_of_another_op(data: dict[str, Any]) -> None:
        data["traceEvents"] = [e for e in data["traceEvents"] if e.get("cat") != "cuda_runtime"]

    assert [op.seconds for op in parse_trace(_edited(tmp_path, kernel_of_another_op)).ops] == [0.0]


def _write(tmp_path: Path, content: Any) -> Path:
    path = tmp_path / "trace.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


def _cpu_op(
    name: str, ts: float, dur: float, dims: list[Any] | None, types: list[str] | None = None
) -> dict[str, Any]:
    args: dict[str, Any] = {}
    if dims is not None:
        args = {"Input Dims": dims, "Input type": types or ["float"] * len(dims)}
    return {"ph": "X", "cat": "cpu_op", "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": dur, "args": args}


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ("{not json", "is not JSON"),
        ([1, 2], "no 'traceEvents' list"),
        ({"traceEvents": [{"ph": "M", "name": "process_name"}]}, "holds no op"),
        ({"traceEvents": [_cpu_op("aten::mm", 0, 5, None)]}, r"record_shapes=True"),
    ],
    ids=["not-json", "not-kineto", "no-ops", "no-shapes"],
)
def test_files_that_cannot_be_replayed_are_refused(tmp_path: Path, content: Any, match: str) -> None:
    with pytest.raises(simdist.ProfileError, match=match):
        simdist.profile(_write(tmp_path, content))


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(simdist.ProfileError, match="cannot read the profiler trace .*missing.json"):
        simdist.profile(tmp_path / "missing.json")


def test_trace_of_another_gpu_is_refused(tmp_path: Path) -> None:
    def on_an_a100(data: dict[str, Any]) -> None:
        data["deviceProperties"] = [{"id": 0, "name": "NVIDIA A100-SXM4-80GB"}]

    path = _edited(tmp_path, on_an_a100)
    simdist.run(lambda: None, one_rank("A100"), compute=simdist.profile(path))  # its own GPU is accepted
    with pytest.raises(
        simdist.ProfileError, match=r"recorded on 'NVIDIA A100-SXM4-80GB' and the cluster's device is H100"
    ):
        simdist.run(lambda: None, one_rank("H100"), compute=simdist.profile(path))


@pytest.mark.parametrize(
    ("gpu", "device", "same"),
    [
        ("NVIDIA H100 80GB HBM3", "H100", True),
        ("NVIDIA H100 PCIe", "H100", True),
        ("NVIDIA A100-SXM4-40GB", "A100-40GB", True),
        ("NVIDIA A100-SXM4-40GB", "A100", False),
        ("NVIDIA A100-SXM4-80GB", "A100-40GB", False),
        ("NVIDIA H200", "H100", False),
    ],
)
def test_gpu_names_match_their_device(tmp_path: Path, gpu: str, device: str, same: bool) -> None:
    def on(data: dict[str, Any]) -> None:
        data["deviceProperties"] = [{"id": 0, "name": gpu}]

    profile = simdist.profile(_edited(tmp_path, on))
    if same:
        profile.check_device(simdist.compute.get_device(device))
    else:
        with pytest.raises(simdist.ProfileError, match=f"recorded on '{gpu}'"):
            profile.check_device(simdist.compute.get_device(device))


def test_cpu_and_gpu_traces_replay_only_on_their_kind_of_device(cpu_trace: Path) -> None:
    with pytest.raises(simdist.ProfileError, match=r"is a CPU trace .* cluster's device is H100"):
        simdist.run(lambda: None, one_rank("H100"), compute=simdist.profile(cpu_trace))
    with pytest.raises(simdist.ProfileError, match=r"times GPU kernels .* cluster's device is cpu"):
        simdist.run(lambda: None, one_rank("cpu"), compute=simdist.profile(HTA))


def test_compute_takes_only_a_flag_or_a_profile() -> None:
    with pytest.raises(
        simdist.RunArgumentError, match=r"compute must be True, False or simdist.profile\(PATH\), got str"
    ):
        simdist.run(lambda: None, one_rank("cpu"), compute="step.json")


@given(
    durations=st.lists(st.floats(1e-7, 1e-2), min_size=1, max_size=6),
    runs=st.integers(0, 10),
)
def test_occurrence_policy(
    tmp_path_factory: pytest.TempPathFactory, durations: list[float], runs: int
) -> None:
    """The k-th occurrence of an (op, shapes) gets the profile's k-th duration, later ones its median."""
    starts = [sum(durations[:i]) * 1e6 + i for i in range(len(durations))]  # one after another, 1 us apart
    events = [_cpu_op("aten::mul", t, d * 1e6, [[4, 4], [4, 4]]) for t, d in zip(starts, durations)]
    path = tmp_path_factory.mktemp("policy") / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    replay = Profile(path).replay(simdist.compute.get_device("cpu"))
    price = replay.provider()
    t = torch.empty(4, 4)
    charged = [price("aten::mul", (t, t), None, 0.0) for _ in range(runs)]
    expected = [*durations, *[statistics.median(durations)] * max(0, runs - len(durations))][:runs]
    assert charged == pytest.approx(expected, rel=1e-9)
    assert replay.stats.reused == max(0, runs - len(durations))


def test_report_counts_the_ops_the_profile_did_not_time(tmp_path: Path) -> None:
    result = simdist.run(gpu_step, one_rank("A100"), compute=simdist.profile(HTA))
    page = result.save_report(tmp_path / "run.html").read_text()
    assert '<span id="profile-matched">2</span>' in page
    assert '<span id="profile-unmatched">3</span>' in page
    share = 100 * result.profile.model_seconds / (result.profile.model_seconds + 90e-6)
    assert f"{share:.1f}% of compute time" in page
    rows = page.split('id="profile-unmatched-ops"')[1].split("</table>")[0]
    # the most model time first: two fills of 2048x2048 and 2048x256 floats before one add of 2048x256
    assert rows.index("aten::ones") < rows.index("aten::add")
    assert rows.split("aten::ones")[1].startswith("</code></td><td>2</td>")


def test_report_without_a_profile_says_nothing_of_one(tmp_path: Path) -> None:
    page = simdist.run(lambda: None, one_rank("cpu")).save_report(tmp_path / "run.html").read_text()
    assert 'id="profile"' not in page


def test_compute_md_example_prints_what_the_page_shows(monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/compute.md's replay example: the summary it shows is the one the run prints."""
    root = Path(__file__).parent.parent
    page = (root / "docs" / "compute.md").read_text()
    shown = next(line for line in page.splitlines() if line.startswith("profile tests/data/profiles/"))

    def step() -> None:
        a = torch.ones(2048, 2048, device="cuda")
        b = torch.ones(2048, 256, device="cuda")
        for _ in range(2):
            torch.mm(a, b)
        torch.add(b, b)

    monkeypatch.chdir(root)
    res = simdist.run(
        step,
        simdist.Cluster.switch(1, device="A100"),
        compute=simdist.profile("tests/data/profiles/hta_backward_thread.json"),
    )
    # the model's share depends on the model's prices of the fills and the add, which may be refined
    share = re.compile(r"\d+\.\d% of compute time")
    assert share.sub("", res.profile.summary()) == share.sub("", shown)


STEP_SCRIPT = """import torch


def main():
    a = torch.ones(2048, 2048, device="cuda")
    b = torch.ones(2048, 256, device="cuda")
    torch.mm(a, b)
"""


def test_cli_run_replays_a_profile_and_prints_its_counts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "step.py"
    script.write_text(STEP_SCRIPT)
    argv = ["run", str(script), "--entry", "main", "--world-size", "2", "--profile", str(HTA)]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert f"profile {HTA}: 2 ops replayed (0 past the profile's occurrences" in out  # one mm per rank
    assert "4 priced by the model (" in out and "aten::ones x4" in out


def test_cli_refuses_a_file_that_is_not_a_profile_before_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "step.py"
    script.write_text(STEP_SCRIPT)
    with pytest.raises(SystemExit) as exited:
        cli.main(["run", str(script), "--entry", "main", "--profile", str(script)])
    assert exited.value.code == 2
    assert "argument --profile: " in capsys.readouterr().err
