"""benchmarks/fidelity.py, simdist against published measurements: its data, its conversions and its --check.

Oracles: simdist's own real-data bench (a collective on meta tensors must be timed as one carrying data), the
time column each source prints beside its busbw (the conversion from busbw to time), and the data files
themselves (every row parses and names its source). The errors the script prints are not asserted: they are
what docs/fidelity.md reports, and they change as the timing model does.
"""

from __future__ import annotations

import contextlib
import io
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from simdist import algorithms
from simdist.algorithms import nccl
from simdist.bench import bench

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
# benchmarks/ is a folder of scripts, not a package
sys.path.insert(0, str(BENCHMARKS))

import fidelity
import fidelity_attention

FILES = ("collectives.csv", "gemm.csv", "attention.csv", "end_to_end.csv")
NUMBERS = {
    "collectives.csv": ("gpus", "nodes", "size_bytes"),
    "gemm.csv": ("m", "n", "k", "tflops"),
    "attention.csv": ("batch", "heads", "seq_len", "head_dim", "tflops"),
    "end_to_end.csv": (
        "gpus",
        "n_layer",
        "n_head",
        "d_model",
        "vocab",
        "seq_len",
        "micro_batch",
        "ms_per_step",
    ),
}


@pytest.mark.parametrize("name", FILES)
def test_every_row_parses_and_names_its_source(name: str) -> None:
    rows = fidelity.load(name)
    assert rows, f"{name} has no rows"
    for row in rows:
        assert row["source"].startswith(("https://", "benchmarks/")), row
        for key in NUMBERS[name]:
            assert fidelity.number(row, key) > 0, (row["table"], key)
        if name == "attention.csv":
            # the papers' configuration: 16k tokens, hidden 2048
            assert int(row["batch"]) * int(row["seq_len"]) == 16384, row
            assert int(row["heads"]) * int(row["head_dim"]) == 2048, row
            assert row["kernel"] in fidelity_attention.KERNELS and row["causal"] in ("0", "1"), row
        if name == "collectives.csv":
            assert row["time_us"] or row["busbw_gbps"], row
            algorithms.collective(row["collective"])  # a collective the registry declares
            cluster = fidelity.cluster_for("alpha-beta", row["preset"], row["overrides"])
            assert cluster.world_size == int(row["gpus"]), row


def test_a_row_without_a_source_is_refused(tmp_path: Path) -> None:
    (tmp_path / "x.csv").write_text("table,size_bytes,source\nt,8,https://example.org\nt,16,\n")
    with pytest.raises(fidelity.FidelityDataError, match="x.csv line 3: no source"):
        fidelity.load("x.csv", tmp_path)


@pytest.mark.parametrize("collective", ["all_reduce", "all_gather", "reduce_scatter"])
def test_meta_tensors_are_timed_as_tensors_carrying_data(collective: str) -> None:
    # simdist bench moves and checks real data; the script prices meta tensors of the same size
    cluster = fidelity.cluster_for("alpha-beta", "dgx-h100", "nodes=2")
    row = bench(cluster, collective, min_bytes=256 << 10, max_bytes=256 << 10)[0]
    assert row.wrong == 0
    meta = fidelity.predict_collective(cluster, collective, row.size)
    assert meta == pytest.approx(row.time_us * 1e-6, rel=1e-9)


def test_a_rows_nccl_variables_are_set_in_its_run() -> None:
    # the NVLS-off rows are predicted with NVLS off: NCCL's tuner on the ring, computed apart from the run
    rows = [r for r in fidelity.load("collectives.csv") if r["nccl_env"] == "NCCL_NVLS_ENABLE=0"]
    assert rows
    row = max(rows, key=lambda r: int(r["gpus"]))  # 8 GPUs, where NVLS would win
    env = fidelity.nccl_env(row)
    assert env == {"NCCL_NVLS_ENABLE": "0"}
    cluster = fidelity.cluster_for("nccl", row["preset"], row["overrides"])
    size, n = int(row["size_bytes"]), int(row["gpus"])
    ring = nccl.choose(nccl.fabric("H100", n, 1, 50e9), "all_reduce", size, nccl.Enabled(frozenset({"Ring"})))
    assert fidelity.predict_collective(cluster, "all_reduce", size, env) == pytest.approx(
        ring.seconds, rel=1e-3
    )
    assert fidelity.nccl_env({**row, "nccl_env": "default"}) == {}
    with pytest.raises(fidelity.FidelityDataError, match="expected 'default' or NCCL_NAME=value pairs"):
        fidelity.nccl_env({**row, "nccl_env": "NVLS off"})


def test_busbw_converts_to_the_time_the_source_prints() -> None:
    # rows that print both: the time derived from busbw agrees within busbw's printed rounding
    rows = [
        r for r in fidelity.load("collectives.csv") if r["time_us"] and fidelity.number(r, "busbw_gbps") >= 10
    ]
    assert len(rows) >= 10
    for row in rows:
        derived = fidelity.measured_collective({**row, "time_us": ""}, int(row["gpus"]))
        assert derived == pytest.approx(fidelity.number(row, "time_us") * 1e-6, rel=0.01), row["size_bytes"]


@given(st.integers(min_value=0, max_value=1 << 40))
def test_every_size_falls_in_exactly_one_band(size: int) -> None:
    assert sum(lo <= size <= hi for _, lo, hi in fidelity.BANDS) == 1
    assert fidelity.band(size) == (
        "<= 64 KiB" if size <= 64 << 10 else ">= 16 MiB" if size >= 16 << 20 else "64 KiB - 16 MiB"
    )


def test_check_prices_every_table_with_finite_positive_predictions() -> None:
    # main fails (status 1) on a prediction that is not finite and positive
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = fidelity.main(["--check"])
    assert status == 0
    tables = {r["table"] for name in FILES for r in fidelity.load(name)} | {
        "h100-this-project",
        "h100-this-project-sdpa",
    }
    for table in tables:
        assert f"| {table} |" in out.getvalue(), table


@pytest.mark.slow
def test_the_docs_show_what_the_script_prints() -> None:
    # docs/fidelity.md's results are the script's output under the default model, verbatim
    doc = (BENCHMARKS.parent / "docs" / "fidelity.md").read_text()
    start = doc.index("<!-- fidelity: output of `python3 benchmarks/fidelity.py` -->\n")
    shown = doc[doc.index("\n", start) + 1 : doc.index("\n<!-- fidelity: end -->")]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert fidelity.main([]) == 0
    assert shown == out.getvalue().rstrip("\n"), (
        "docs/fidelity.md is stale: paste `python3 benchmarks/fidelity.py`"
    )


def test_fp8_gemms_are_priced_near_what_cublas_reached_at_its_best_shapes() -> None:
    # the oracle is the published best-shape throughput of torch._scaled_mm (mamf-finder) on an H100 and an H200;
    # a best shape is the top of what cuBLAS reaches, so simdist should price it no faster than measured, and
    # within 15% (the dense FP8 peak priced both 20-26% too fast)
    rows = [r for r in fidelity.load("gemm.csv") if r["table"] == "mamf-fp8"]
    results = fidelity.gemm_results(rows, own_run=False)
    assert len(results) == 2
    for r in results:
        assert 0 <= r.error <= 0.15, (r.label, r.error)
