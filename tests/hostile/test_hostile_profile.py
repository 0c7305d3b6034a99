"""Hostile profiles for ``compute=simdist.profile(PATH)``: files that are not Kineto traces, traces that cannot
time a run, traces of another device, and malformed events are refused with a message naming what is wrong;
a profile that matches nothing, or rides with memory accounting, times the run as the model would."""

from __future__ import annotations

import json
import pathlib
import tempfile
from typing import Any

import pytest
import torch
from hostile_cases import Case, check, params

import simdist

HTA = pathlib.Path(__file__).resolve().parent.parent / "data" / "profiles" / "hta_backward_thread.json"


def _file(content: Any, name: str = "trace.json") -> pathlib.Path:
    """A fresh file holding ``content`` (bytes, text, or an object written as JSON)."""
    path = pathlib.Path(tempfile.mkdtemp(prefix="hostile-profile-")) / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


def _mm(dur: Any = 5.0, **args: Any) -> dict[str, Any]:
    """One ``aten::mm`` cpu_op event of 4x4 matrices."""
    return {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 0.0, "dur": dur,
            "args": {"Input Dims": [[4, 4], [4, 4]], "Input type": ["float", "float"], **args}}  # fmt: skip


def _read_without_shapes(profile: simdist.Profile) -> None:
    """Malformed shapes are no shapes, malformed ids link nothing: the ops are read, each with no shape and, in a
    GPU trace whose one kernel links to neither, no device time."""
    assert profile.trace.kind == "gpu"
    assert [(op.name, op.shapes, op.seconds) for op in profile.trace.ops] == [("aten::mm", (), 0.0)] * 2


def _simdist_trace() -> pathlib.Path:
    """A Chrome trace simdist itself wrote: spans of its own, no profiler ops."""
    res = simdist.run(lambda: torch.ones(4) * 2, simdist.Cluster.switch(1, device="H100"))
    return res.trace.save_chrome(_file("", "sim.json"))


def _on(device: str) -> pathlib.Path:
    data = json.loads(HTA.read_text())
    data["deviceProperties"] = [{"id": 0, "name": device}]
    return _file(data)


def gpu_step() -> float:
    a = torch.ones(512, 512, device="cuda")
    torch.mm(a, a)
    simdist.synchronize()
    return simdist.now()


def _matching_nothing() -> tuple[float, float, simdist.ReplayStats]:
    cluster = simdist.Cluster.switch(1, device="A100")
    replayed = simdist.run(gpu_step, cluster, compute=simdist.profile(HTA))
    return replayed.sim_time, simdist.run(gpu_step, cluster).sim_time, replayed.profile


def _model_times_all(out: tuple[float, float, simdist.ReplayStats]) -> None:
    replayed, modelled, stats = out
    assert replayed == pytest.approx(modelled, rel=1e-12)
    assert (stats.matched, stats.unmatched_share) == (0, 1.0)
    assert sorted(stats.unmatched_ops) == ["aten::mm", "aten::ones"]


def _with_memory() -> tuple[float, float]:
    def step() -> float:
        a = torch.ones(2048, 2048, device="cuda")
        torch.mm(a, torch.ones(2048, 256, device="cuda"))
        simdist.synchronize()
        return simdist.now()

    cluster = simdist.Cluster.switch(1, device="A100")
    with_memory = simdist.run(step, cluster, compute=simdist.profile(HTA), memory=True)
    without = simdist.run(step, cluster, compute=simdist.profile(HTA))
    assert with_memory.profile.matched == without.profile.matched == 1
    return with_memory.sim_time, without.sim_time


CASES: list[Case] = [
    Case("profile-path-as-compute", "simdist.run(fn, c, compute='step.json') (the path, not simdist.profile)",
         lambda: simdist.run(gpu_step, "dgx-h100", compute="step.json"), error=simdist.RunArgumentError,
         match=r"compute must be True, False or simdist.profile\(PATH\), got str 'step.json'"),
    Case("profile-missing-file", "simdist.profile of a file that does not exist",
         lambda: simdist.profile("/nonexistent/step.json"), error=simdist.ProfileError,
         match=r"cannot read the profiler trace /nonexistent/step.json"),
    Case("profile-directory", "simdist.profile of a directory",
         lambda: simdist.profile(tempfile.mkdtemp()), error=simdist.ProfileError, match=r"cannot read the profiler"),
    Case("profile-empty-file", "simdist.profile of an empty file", lambda: simdist.profile(_file("")),
         error=simdist.ProfileError, match=r"is not JSON .*export_chrome_trace writes"),
    Case("profile-binary-file", "simdist.profile of a binary file (a gzipped trace)",
         lambda: simdist.profile(_file(b"\x1f\x8b\x08\x00\xff\xfe")), error=simdist.ProfileError, match=r"is not JSON"),
    Case("profile-json-list", "simdist.profile of JSON that is a list", lambda: simdist.profile(_file([1, 2])),
         error=simdist.ProfileError, match=r"not a Kineto trace: it has no 'traceEvents' list"),
    Case("profile-simdist-trace", "simdist.profile of a Chrome trace simdist wrote (res.trace.save_chrome)",
         lambda: simdist.profile(_simdist_trace()), error=simdist.ProfileError,
         match=r"holds no op \('cpu_op' events\)"),
    Case("profile-junk-events", "traceEvents of strings, numbers and events without times",
         lambda: simdist.profile(_file({"traceEvents": ["x", 3, None, {**_mm(), "ts": "0"}, {"ph": "X"}]})),
         error=simdist.ProfileError, match=r"holds no op"),
    Case("profile-without-shapes", "a trace recorded without record_shapes=True",
         lambda: simdist.profile(_file({"traceEvents": [{**_mm(), "args": {"External id": 1}}]})),
         error=simdist.ProfileError, match=r"without input shapes.*record_shapes=True"),
    Case("profile-negative-duration", "an op event lasting -5 us",
         lambda: simdist.profile(_file({"traceEvents": [_mm(-5.0)]})), error=simdist.ProfileError,
         match=r"event 0 \('aten::mm'\) lasts -5.0 us"),
    Case("profile-nan-duration", "an op event lasting NaN us (JSON's NaN)",
         lambda: simdist.profile(_file('{"traceEvents": [' + json.dumps(_mm(1.0)).replace("1.0", "NaN") + "]}")),
         error=simdist.ProfileError, match=r"lasts nan us"),
    Case("profile-malformed-shapes-and-ids", "Input Dims of strings and lists, args a list, ids that are lists",
         lambda: simdist.profile(_file({"traceEvents": [
             _mm(**{"Input Dims": [["4", 4], [[4]]], "External id": [1]}), {**_mm(), "ts": 10.0, "args": [1]},
             {"ph": "X", "cat": "kernel", "name": "k", "ts": 1.0, "dur": 2.0, "args": {"correlation": [1]}}]})),
         check=_read_without_shapes),
    Case("profile-other-gpu", "a trace of an A100 replayed on an H100 cluster",
         lambda: simdist.run(gpu_step, "dgx-h100", compute=simdist.profile(_on("NVIDIA A100-SXM4-80GB"))),
         error=simdist.ProfileError, match=r"recorded on 'NVIDIA A100-SXM4-80GB' and the cluster's device is H100"),
    Case("profile-cpu-trace-on-gpu", "a CPU-only trace replayed on an H100 cluster",
         lambda: simdist.run(gpu_step, "dgx-h100", compute=simdist.profile(_file({"traceEvents": [_mm()]}))),
         error=simdist.ProfileError, match=r"is a CPU trace \(no GPU kernels in it\)"),
    Case("profile-gpu-trace-on-cpu", "a GPU trace replayed on a cluster of the cpu device",
         lambda: simdist.run(gpu_step, simdist.Cluster.switch(2, device="cpu"), compute=simdist.profile(HTA)),
         error=simdist.ProfileError, match=r"times GPU kernels .* the cluster's device is cpu"),
    Case("profile-matches-nothing", "a profile of another program: every op priced by the model",
         _matching_nothing, check=_model_times_all),
    Case("profile-with-memory", "compute=simdist.profile(...) with memory=True",
         _with_memory, check=lambda t: t[0] == pytest.approx(t[1], rel=1e-12) or pytest.fail(str(t))),
]  # fmt: skip


@pytest.mark.parametrize("case", params(CASES))
def test_hostile(case: Case) -> None:
    check(case)
