"""simdist calibrate fitting NCCL's model: a latency per call and per-algorithm bandwidth factors fitted to
nccl-tests times, written as a cluster file's [cluster.nccl] table.

Oracles: times NCCL's model makes with known corrections (the fit must recover them); published nccl-tests
tables (benchmarks/fidelity/collectives.csv: the sizes the fit did not see); the simulator (``simdist.bench`` on
the written cluster times what the fit predicts).
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
from pathlib import Path

import pytest

from simdist import calibrate
from simdist.algorithms import nccl
from simdist.bench import bench
from simdist.calibrate import CalibrationError, Sample
from simdist.calibrate.nccl_model import nccl_cluster, predict
from simdist.cli import main
from simdist.errors import ClusterSpecError
from simdist.network import Cluster

ROOT = Path(__file__).resolve().parent.parent
H20 = Path(__file__).parent / "fixtures" / "calibrate" / "h20_all_reduce.txt"
SIZES = [8 << (2 * k) for k in range(15)]  # 8 B .. 2 GiB
sys.path.insert(0, str(ROOT / "benchmarks"))

from calibrate_nccl import samples as published


def _made_by(overrides: nccl.Overrides, device: str = "H100") -> list[Sample]:
    fab = dataclasses.replace(
        nccl_cluster(device, 8, 1, "x").nccl_fabric(list(range(8))), overrides=overrides
    )
    return [
        Sample(coll, m, 8, nccl.choose(fab, coll, m).seconds, f"{coll} {m}")
        for coll in ("all_reduce", "all_gather")
        for m in SIZES
    ]


def test_the_fit_recovers_the_corrections_that_made_the_times() -> None:
    truth = nccl.Overrides(4e-6, (("NVLS", 0.8), ("Ring", 0.9)))
    fit = calibrate.fit_nccl(_made_by(truth), "H100")
    assert fit.overrides.latency == pytest.approx(4e-6, abs=0.05e-6)
    assert fit.overrides.factor("Ring") == pytest.approx(0.9, rel=0.01)
    assert fit.overrides.factor("NVLS") == pytest.approx(0.8, rel=0.01)
    assert max(abs(r.error) for r in fit.residuals) < 0.01
    # NCCL's model as it stands needs no correction
    plain = calibrate.fit_nccl(_made_by(nccl.NO_OVERRIDES), "H100").overrides
    assert abs(plain.latency) < 0.05e-6 and all(f == pytest.approx(1, rel=0.01) for _, f in plain.bandwidth)


@pytest.mark.parametrize("table, device, bound", [("a100-1node", "A100", 0.12), ("h200-1node", "H200", 0.08)])
def test_fitted_on_half_a_published_table_it_predicts_the_other_half(
    table: str, device: str, bound: float
) -> None:
    samples = published(table)
    seen, held_out = samples[0::2], samples[1::2]
    fit = calibrate.fit_nccl(seen, device, table)
    fitted = statistics.median(
        abs(c.seconds / s.seconds - 1)
        for s, c in zip(held_out, predict(fit.cluster.nccl_fabric(list(range(8))), held_out))
    )
    plain = statistics.median(
        abs(c.seconds / s.seconds - 1)
        for s, c in zip(
            held_out, predict(nccl_cluster(device, 8, 1, "x").nccl_fabric(list(range(8))), held_out)
        )
    )
    # figures in docs/calibrate.md: A100 23.8% -> 5.7%; H200 3.2% -> 4.4%: there NCCL's model as transcribed is
    # already within a few percent, and three corrections fitted to ten sizes follow those sizes' noise
    assert fitted < bound and (fitted < plain or plain < 0.05), (fitted, plain)


def test_the_written_cluster_times_what_the_fit_predicts(tmp_path: Path) -> None:
    fit = calibrate.fit_nccl(calibrate.read_nccl_tests(H20), "H100", "h20")
    fit.cluster.save(tmp_path / "h20.toml")
    loaded = Cluster.from_file(tmp_path / "h20.toml")
    assert (loaded.collective_model, loaded.nccl_overrides) == ("nccl", fit.overrides)
    predicted = {r.sample.nbytes: r.predicted for r in fit.residuals}
    for row in bench(loaded, "all_reduce", 1 << 15, 1 << 21, 4):
        if row.size in predicted:
            assert row.time_us * 1e-6 == pytest.approx(predicted[row.size], rel=1e-3)


def test_nccl_corrections_in_a_cluster_file_are_checked(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(
        '[cluster]\npreset = "dgx-h100"\n\n[cluster.nccl]\nlatency = 3e-6\n\n[cluster.nccl.bandwidth]\nRing = 0.9\n'
    )
    assert Cluster.from_file(path).nccl_overrides == nccl.Overrides(3e-6, (("Ring", 0.9),))
    for body, message in [
        (
            'builder = "switch"\nn = 2\ndevice = "cpu"\n\n[cluster.nccl]\nlatency = 3e-6\n',
            "timed by the alpha-beta model",
        ),
        ('preset = "dgx-h100"\n\n[cluster.nccl.bandwidth]\nRingg = 0.9\n', "unknown algorithm 'Ringg'"),
        (
            'preset = "dgx-h100"\n\n[cluster.nccl.bandwidth]\nRing = -1\n',
            "the factor must be a positive number",
        ),
        ('preset = "dgx-h100"\n\n[cluster.nccl]\nlatncy = 1\n', r"unknown key\(s\) latncy"),
    ]:
        path.write_text("[cluster]\n" + body)
        with pytest.raises(ClusterSpecError, match=message):
            Cluster.from_file(path)


def test_cli_fits_nccl_on_a_gpu_and_alpha_beta_where_asked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "c.toml"
    assert main(["calibrate", str(H20), "--device", "H100", "-o", str(out)]) == 0
    assert "fitted NCCL's model on 'calibrated' (8 x H100)" in capsys.readouterr().out
    assert Cluster.from_file(out).collective_model == "nccl"
    assert main(["calibrate", str(H20), "--device", "H100", "--model", "alpha-beta", "-o", str(out)]) == 0
    assert "fitted 8-rank switch cluster" in capsys.readouterr().out
    assert Cluster.from_file(out).collective_model == "alpha-beta"
    assert main(["calibrate", str(H20), "--model", "nccl"]) == 2
    assert (
        "NCCL's model is known for H100, H200, A100, A100-40GB only; --device 'cpu'"
        in capsys.readouterr().err
    )
    with pytest.raises(CalibrationError, match="sendrecv is not among them"):
        calibrate.fit_nccl(
            [dataclasses.replace(s, collective="sendrecv") for s in calibrate.read_nccl_tests(H20)]
        )
