"""simdist calibrate: nccl-tests text and real timelines read as samples, the alpha-beta fit, refusals, the CLI.

Oracles: nccl-tests' own algbw column (size / time) for the parser; synthetic times generated from the closed
forms with known parameters for the fit (it must recover them); the simulator (``simdist.bench`` on the
fitted cluster) for the claim that the written cluster predicts what the fit says.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from simdist import algorithms, calibrate
from simdist.bench import bench
from simdist.calibrate import CalibrationError, Sample
from simdist.cli import main
from simdist.network import Cluster
from simdist_base.timeline import SAME_HOST, CommRecord, Timeline

FIXTURES = Path(__file__).parent / "fixtures" / "calibrate"
H20 = FIXTURES / "h20_all_reduce.txt"
V1 = FIXTURES / "v1_gather_8gpu.txt"
ONE_RANK = FIXTURES / "rtx4090_all_gather_1rank.txt"


def _columns(path: Path, first: int) -> list[tuple[int, float, float]]:
    """(size, time us, algbw GB/s) of each row, read by column position, the parser's oracle."""
    rows = []
    for line in path.read_text().splitlines():
        words = line.split()
        if words and words[0].isdigit():
            rows.append((int(words[0]), float(words[first]), float(words[first + 1])))
    return rows


@pytest.mark.parametrize(
    "path, collective, time_col", [(H20, "all_reduce", 5), (V1, "all_gather", 3), (V1, "reduce_scatter", 3)]
)
def test_nccl_tests_rows_agree_with_their_own_algbw(path: Path, collective: str, time_col: int) -> None:
    samples = calibrate.read_nccl_tests(path, None if path == H20 else collective)
    rows = _columns(path, time_col)
    assert [s.nbytes for s in samples] == [size for size, _, _ in rows]
    assert {(s.collective, s.ranks, s.nodes) for s in samples} == {(collective, 8, 1)}
    for s, (size, _, algbw) in zip(samples, rows):
        # nccl-tests prints algbw = size / time rounded to 2 decimals: the parsed time must reproduce it
        assert size / s.seconds / 1e9 == pytest.approx(algbw, abs=0.006, rel=0.002)


def test_in_place_times_are_the_second_time_column() -> None:
    in_place = calibrate.read_nccl_tests(H20, in_place=True)
    assert [s.seconds * 1e6 for s in in_place] == pytest.approx([t for _, t, _ in _columns(H20, 9)])


def test_the_collective_comes_from_the_text_or_the_caller() -> None:
    text = "\n".join(line for line in H20.read_text().splitlines() if "all_reduce_perf" not in line)
    with pytest.raises(CalibrationError, match="does not say which nccl-tests binary"):
        calibrate.parse_nccl_tests(text, "h20")
    assert {s.collective for s in calibrate.parse_nccl_tests(text, "h20", "all_gather")} == {"all_gather"}


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t: "just some text\n1 2 3\n", "not nccl-tests output"),
        (lambda t: t.replace("#  Rank  3", "#  Rank  2"), "rank 2 is listed twice"),
        (lambda t: "\n".join(l for l in t.splitlines() if "Rank" not in l), "world size is unknown"),
        (lambda t: t.replace("195.40  171.72  300.51", "195.40  300.51"), "columns where the header names"),
        (lambda t: t + "./all_gather_perf -b 8\n", "names several nccl-tests"),
        (lambda t: t.replace("  121.33  138.28", "  221.33  138.28"), "but the row's algbw is 138.28"),
    ],
)
def test_text_that_is_not_one_nccl_tests_run_is_refused(edit: object, message: str) -> None:
    with pytest.raises(CalibrationError, match=message):
        calibrate.parse_nccl_tests(edit(H20.read_text()), "h20")  # type: ignore[operator]


def test_one_rank_one_size_mixed_worlds_and_garbage_are_refused() -> None:
    with pytest.raises(CalibrationError, match="world of 1 rank"):
        calibrate.fit(calibrate.read_nccl_tests(ONE_RANK))
    with pytest.raises(CalibrationError, match="different world sizes"):
        calibrate.fit(calibrate.read_nccl_tests(H20) + _synthetic(1e-5, 1e9, 2, ["all_reduce"]))
    h20 = calibrate.read_nccl_tests(H20)
    with pytest.raises(CalibrationError, match="1 distinct non-zero size"):
        calibrate.fit([s for s in h20 if s.nbytes == 1 << 20])
    with pytest.raises(CalibrationError, match="largest size is at least 64 times"):
        calibrate.fit([s for s in h20 if (1 << 20) <= s.nbytes <= (8 << 20)])
    # the time column read as the size column's neighbour: times that fall as sizes grow
    shuffled = [Sample(s.collective, s.nbytes, s.ranks, 1e-3 / (i + 1), s.source) for i, s in enumerate(h20)]
    with pytest.raises(CalibrationError, match="a larger call is not faster"):
        calibrate.fit(shuffled)
    with pytest.raises(CalibrationError, match="not a positive number"):
        calibrate.fit([*h20[:-1], Sample("all_reduce", h20[-1].nbytes, 8, math.nan, "x")])


def _synthetic(alpha: float, bandwidth: float, n: int, collectives: list[str]) -> list[Sample]:
    """Times of ``auto``'s algorithm, by its closed form, on a switch whose routes have ``alpha``, ``bandwidth``."""
    beta = 1 / bandwidth
    out = []
    for c in collectives:
        for k in range(3, 28, 2):
            m = (1 << k) // n * n
            algo = algorithms.choose(c, n, m, (alpha, beta), (alpha, beta))
            out.append(Sample(c, m, n, algo.estimate(n, m, alpha, beta), f"{c}:{m}"))
    return out


@given(
    alpha=st.floats(1e-6, 1e-3),
    bandwidth=st.floats(1e8, 1e12),
    n=st.integers(2, 16),
    collectives=st.lists(st.sampled_from(["all_reduce", "all_gather", "reduce_scatter", "broadcast"]),
                         min_size=1, max_size=4, unique=True),
)  # fmt: skip
def test_the_fit_recovers_the_parameters_that_made_the_times(
    alpha: float, bandwidth: float, n: int, collectives: list[str]
) -> None:
    result = calibrate.fit(_synthetic(alpha, bandwidth, n, collectives))
    assert result.alpha == pytest.approx(alpha, rel=1e-6)
    assert result.bandwidth == pytest.approx(bandwidth, rel=1e-6)
    assert max(abs(r.error) for r in result.residuals) < 1e-6
    assert result.cluster.path_latency(0, n - 1) == pytest.approx(alpha, rel=1e-9)


def test_one_slow_call_is_noise_left_out_of_the_fit() -> None:
    samples = _synthetic(2e-5, 1e9, 2, ["all_reduce", "broadcast"])
    spiked = [Sample(s.collective, s.nbytes, s.ranks, s.seconds * (1000 if i == 2 else 1), s.source)
              for i, s in enumerate(samples)]  # fmt: skip
    result = calibrate.fit(spiked)
    assert result.alpha == pytest.approx(2e-5, rel=1e-6) and result.bandwidth == pytest.approx(1e9, rel=1e-6)
    assert [o.source for o in result.outliers] == [samples[2].source]
    assert "left out" in result.report()
    # a range of sizes off the model is the model's error, not noise: kept
    last = max(s.nbytes for s in samples)
    bent = [Sample(s.collective, s.nbytes, s.ranks, s.seconds * (3 if s.nbytes >= last // 4 else 1), s.source)
            for s in samples]  # fmt: skip
    assert calibrate.fit(bent).outliers == ()


def test_the_written_cluster_predicts_what_the_fit_says(tmp_path: Path) -> None:
    result = calibrate.fit(calibrate.read_nccl_tests(V1, "all_gather"), device="A100", name="v1")
    result.cluster.save(tmp_path / "c.toml")
    loaded = Cluster.from_file(tmp_path / "c.toml")
    assert (loaded.name, loaded.world_size, loaded.device_name) == ("v1", 8, "A100")
    by_size = {r.sample.nbytes: r.predicted for r in result.residuals}
    for row in bench(loaded, "all_gather", 1 << 16, 1 << 22, 16):
        assert row.time_us * 1e-6 == pytest.approx(by_size[row.size], rel=1e-6)


def test_residual_bands_cover_every_sample() -> None:
    result = calibrate.fit(calibrate.read_nccl_tests(H20), device="H100")
    assert sum(count for _, count, _, _ in result.bands()) == len(result.residuals) == 15
    assert "median" in result.report() and ">= 16 MiB" in result.report()


def _record(rank: int, index: int, op: str, nbytes: int, start: float, end: float | None) -> CommRecord:
    return CommRecord(rank, index, op, "default_pg", (0, 1), nbytes, "float32", "x.py:1 in f", start, end,
                      "completed" if end is not None else "unobserved")  # fmt: skip


def test_timeline_calls_run_from_the_last_rank_in_to_the_last_rank_out() -> None:
    records = {
        0: [_record(0, 0, "all_reduce", 400, 1.0, 1.5), _record(0, 1, "all_gather_into_tensor", 100, 2.0, 2.2),
            _record(0, 2, "send", 8, 3.0, 3.1), _record(0, 3, "broadcast", 8, 4.0, None)],
        1: [_record(1, 0, "all_reduce", 400, 1.2, 1.6), _record(1, 1, "all_gather_into_tensor", 100, 1.9, 2.3),
            _record(1, 2, "recv", 8, 3.0, 3.1), _record(1, 3, "broadcast", 8, 4.0, 4.1)],
    }  # fmt: skip
    samples = calibrate.timeline_samples(Timeline(records, SAME_HOST, {0: "h", 1: "h"}, {}), "tl")
    assert [(s.collective, s.nbytes, s.ranks) for s in samples] == [
        ("all_reduce", 400, 2),
        ("all_gather", 200, 2),
    ]
    assert [s.seconds for s in samples] == pytest.approx([0.4, 0.3])


def test_cli_writes_a_cluster_file_and_prints_the_bands(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "fitted.toml"
    assert main(["calibrate", str(V1), "--collective", "all_gather", "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "residuals" in printed and "1 - 16 MiB" in printed and f"wrote {out}" in printed
    assert Cluster.from_file(out).world_size == 8
    assert main(["calibrate", str(ONE_RANK)]) == 2
    assert "world of 1 rank" in capsys.readouterr().err
    assert main(["calibrate"]) == 2
    assert "give nccl-tests output files" in capsys.readouterr().err
    assert main(["calibrate", str(H20), "-o", str(tmp_path / "fitted.txt")]) == 2
    assert "ends in .toml or .json" in capsys.readouterr().err
    assert main(["calibrate", str(H20), "--device", "H1000"]) == 2
    assert "H1000" in capsys.readouterr().err


@pytest.mark.real
def test_measure_times_gloo_collectives_on_real_processes() -> None:
    samples = calibrate.measure(
        2, collectives=("all_reduce", "all_gather"), sizes=(8, 4096), iters=2, warmup=1
    )
    assert [(s.collective, s.nbytes, s.ranks) for s in samples] == [
        ("all_reduce", 8, 2), ("all_reduce", 4096, 2), ("all_gather", 8, 2), ("all_gather", 4096, 2)
    ]  # fmt: skip
    assert all(0 < s.seconds < 10 for s in samples)
