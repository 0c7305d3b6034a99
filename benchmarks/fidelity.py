"""simdist against published measurements: ``python benchmarks/fidelity.py [--model nccl|alpha-beta] [--check]``.

Reads the measurements kept under ``benchmarks/fidelity/`` (each row with its source; see its README) and the
matmuls of this project's own H100 run (``benchmarks/gpu/results/h100-2026-11-26``), predicts each row with simdist
and prints Markdown: every row with its error (simdist / measured - 1, positive when simdist is slower), then the
median and largest |error| per table, per collective size band, and against the targets of docs/fidelity.md.

- collectives: the collective simulated by ``simdist.run`` on the row's cluster preset (overrides from the row),
  on meta tensors of the row's size (timing needs no data; ``tests/test_fidelity.py`` checks that meta tensors are
  timed as real ones), nccl-tests' size convention (the all-reduce buffer, the all-gather output, the
  reduce-scatter input); where a source gives only busbw, the measured time is size x bus factor / busbw;
- GEMMs: ``simdist.compute.estimate`` of the same call on meta tensors of the row's shape and dtype;
- attention: the published FlashAttention-2, cuDNN and xformers throughputs and this project's H100 timings of
  ``scaled_dot_product_attention``, priced as ``fidelity_attention.py`` says (rows the attention constants were
  fitted to are marked ``[fit]``, and the held-out rows get a table of their own);
- end-to-end: an op-level price of the published configuration (``fidelity_step.py``).

``--model`` picks the timing model the clusters are built with (``TIMING_MODELS``). ``--check`` prices a few
rows of every table and fails unless every row has a source and every prediction is finite and positive.
Predictions do not depend on the machine that runs this.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import statistics
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from fidelity_attention import attention_results
from fidelity_step import StepShape, price_step

# benchmarks/gpu is a folder of scripts, not a package: its modules are imported by name
sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
from ops import by_id
from predict import op_seconds

import simdist
from simdist import algorithms
from simdist.compute import estimate
from simdist.network.cluster import Cluster

DATA = Path(__file__).resolve().parent / "fidelity"
#: this project's own H100 measurements (docs/gpu-measurements.md), whose matmuls form one GEMM table
H100_RUN = Path(__file__).resolve().parent / "gpu" / "results" / "h100-2026-11-26" / "compute.json"

#: the timing models a cluster can be built with; a new model is one entry: name -> (preset, overrides) -> Cluster
TIMING_MODELS: dict[str, Callable[..., Cluster]] = {
    "nccl": lambda preset, **overrides: Cluster.preset(preset, collective_model="nccl", **overrides),
    "alpha-beta": lambda preset, **overrides: Cluster.preset(
        preset, collective_model="alpha-beta", **overrides
    ),
}

#: collective size bands (bytes): the latency-bound, the protocol-switching and the bandwidth-bound sizes
BANDS = (
    ("<= 64 KiB", 0, 64 << 10),
    ("64 KiB - 16 MiB", (64 << 10) + 1, (16 << 20) - 1),
    (">= 16 MiB", 16 << 20, math.inf),
)
LARGE = 16 << 20

#: median |error| targets (docs/fidelity.md): (what, target)
TARGETS = {
    "single-node collectives, all sizes": 0.10,
    "multi-node collectives, >= 16 MiB": 0.20,
    "GEMMs, all shapes and dtypes": 0.10,
    "end-to-end steps": 0.10,
}

DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
}


class FidelityDataError(ValueError):
    """A data file under benchmarks/fidelity/ is malformed: a row without a source, a bad number."""


@dataclass(frozen=True)
class Result:
    """One row: what was measured, what simdist predicts (seconds) and the kind of table it belongs to."""

    kind: str  # "collective", "gemm", "attention" or "step"
    table: str
    label: str
    measured_s: float
    predicted_s: float
    size: int = 0  # bytes, for collectives
    nodes: int = 1
    detail: str = ""  # how the prediction breaks down, where it has parts

    @property
    def error(self) -> float:
        """simdist / measured - 1."""
        return self.predicted_s / self.measured_s - 1


def load(name: str, folder: Path = DATA) -> list[dict[str, str]]:
    """The rows of ``folder/NAME``; raise FidelityDataError for a row without a source."""
    path = folder / name
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    for i, row in enumerate(rows, start=2):
        if not row.get("source", "").strip():
            raise FidelityDataError(
                f"{path.name} line {i}: no source; every measurement names where it was published"
            )
    return rows


def number(row: dict[str, str], key: str) -> float:
    """A published number, read as printed ("~300" is the approximate 300)."""
    text = row[key].strip().lstrip("~")
    try:
        return float(text)
    except ValueError:
        raise FidelityDataError(f"{row['table']}: {key}={row[key]!r} is not a number") from None


def cluster_for(model: str, preset: str, overrides: str) -> Cluster:
    """The cluster ``preset`` with ``overrides`` ("key=value;..."; sizes as ints) under timing model ``model``."""
    kwargs: dict[str, object] = {}
    for item in filter(None, overrides.split(";")):
        key, _, value = item.partition("=")
        kwargs[key] = int(value) if value.isdigit() else value
    return TIMING_MODELS[model](preset, **kwargs)


_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def _collective_rank(collective: str, nbytes: int, env: dict[str, str]) -> None:
    """Rank code: one collective of ``nbytes`` (nccl-tests' size) on meta float32 tensors, with the NCCL
    variables ``env`` set as the measured run set them."""
    os.environ.update(env)
    n = dist.get_world_size()
    count = nbytes // 4
    if collective == "all_reduce":
        dist.all_reduce(torch.empty(count, device="meta"))
    elif collective == "all_gather":
        _all_gather(torch.empty(count // n * n, device="meta"), torch.empty(count // n, device="meta"))
    elif collective == "reduce_scatter":
        _reduce_scatter(torch.empty(count // n, device="meta"), torch.empty(count // n * n, device="meta"))
    else:
        raise FidelityDataError(f"collective {collective!r} is not priced here; add it to _collective_rank")


def predict_collective(
    cluster: Cluster, collective: str, nbytes: int, env: dict[str, str] | None = None
) -> float:
    """Simulated seconds of one ``collective`` of ``nbytes`` on ``cluster`` under the NCCL variables ``env``:
    first start to last end."""
    res = simdist.run(
        _collective_rank, cluster, args=(collective, nbytes, env or {}), trace="collectives", compute=False
    )
    spans = res.trace.collectives()
    return max(s.end for s in spans) - min(s.start for s in spans)


def nccl_env(row: dict[str, str]) -> dict[str, str]:
    """The NCCL variables a row's run set (``nccl_env``: ``default`` for none, else ``NAME=value`` pairs
    separated by spaces)."""
    text = row["nccl_env"].strip()
    if text == "default":
        return {}
    pairs = [item.partition("=") for item in text.split()]
    if any(not name.startswith("NCCL_") or not sep for name, sep, _ in pairs):
        raise FidelityDataError(
            f"{row['table']}: nccl_env={text!r}; expected 'default' or NCCL_NAME=value pairs"
        )
    return {name: value for name, _, value in pairs}


def measured_collective(row: dict[str, str], n: int) -> float:
    """The measured seconds of a collective row on ``n`` ranks: its time, or else its busbw undone."""
    if row["time_us"]:
        return number(row, "time_us") * 1e-6
    factor = algorithms.collective(row["collective"]).bus_factor(n)
    return int(row["size_bytes"]) * factor / (number(row, "busbw_gbps") * 1e9)


def collective_results(model: str, rows: Iterable[dict[str, str]]) -> list[Result]:
    """Each nccl-tests row beside its simulated time."""
    out = []
    for row in rows:
        cluster = cluster_for(model, row["preset"], row["overrides"])
        n, size = cluster.world_size, int(row["size_bytes"])
        env = "" if row["nccl_env"] == "default" else f", {row['nccl_env']}"
        label = f"{row['collective']} {n} GPUs {size} B{env}"
        predicted = predict_collective(cluster, row["collective"], size, nccl_env(row))
        out.append(
            Result(
                "collective",
                row["table"],
                label,
                measured_collective(row, n),
                predicted,
                size,
                int(row["nodes"]),
            )
        )
    return out


def _gemm_call(row: dict[str, str]) -> Callable[[], object]:
    """The published call on meta tensors: torch.mm, or torch._scaled_mm for float8 (as mamf-finder.py calls them)."""
    m, n, k = (int(row[x]) for x in ("m", "n", "k"))
    dtype = DTYPES[row["dtype"]]
    a = torch.empty(m, k, dtype=dtype, device="meta")
    b = torch.empty(n, k, dtype=dtype, device="meta").t()
    if dtype.itemsize == 1:
        scale = torch.ones((), device="meta")
        return lambda: torch._scaled_mm(a, b, scale, scale, out_dtype=dtype)
    return lambda: torch.mm(a, b)


def gemm_results(
    rows: Iterable[dict[str, str]], own_run: bool = True, limit: int | None = None
) -> list[Result]:
    """Each published GEMM (and the matmuls of this project's H100 run) beside simdist's price."""
    out = []
    for row in rows:
        m, n, k = (int(row[x]) for x in ("m", "n", "k"))
        measured = 2 * m * n * k / (number(row, "tflops") * 1e12)
        predicted, _ = estimate(_gemm_call(row), device=row["device"])
        label = f"{row['hardware']} {row['dtype']} {m}x{n}x{k}"
        out.append(Result("gemm", row["table"], label, measured, predicted))
    if own_run:
        catalogue = by_id(False)
        records = [r for r in json.loads(H100_RUN.read_text())["records"] if r["class"] == "matmul"]
        for record in records[:limit]:
            predicted, _ = op_seconds(catalogue[record["id"]], "H100")
            out.append(Result("gemm", "h100-this-project", record["id"], record["median_s"], predicted))
    return out


def attention_table_results(limit: int | None = None) -> list[Result]:
    """Each attention row beside simdist's price; a row the attention constants were fitted to is marked [fit]."""
    return [
        Result("attention", r.table, r.label + (" [fit]" if r.fitted else ""), r.measured_s, r.predicted_s)
        for r in attention_results(limit)
    ]


def attention_report(results: list[Result]) -> list[str]:
    """The attention tables' errors on the rows the fit did not read."""
    held = [r for r in results if r.kind == "attention" and not r.label.endswith(" [fit]")]
    if not held:
        return []
    lines = [
        "",
        "| attention table | held-out rows | median abs error | max abs error |",
        "|---|---:|---:|---:|",
    ]
    for table in dict.fromkeys(r.table for r in held):
        rows, med, worst = _stats([r for r in held if r.table == table])
        lines.append(f"| {table} | {rows} | {med * 100:.0f}% | {worst * 100:.0f}% |")
    return lines


def step_results(model: str, rows: Iterable[dict[str, str]], n_layer: int | None = None) -> list[Result]:
    """Each published training step beside simdist's op-level price (``n_layer`` overrides depth, for --check)."""
    out = []
    for row in rows:
        shape = StepShape(
            *(
                int(row[x])
                for x in ("n_layer", "n_head", "d_model", "vocab", "seq_len", "micro_batch", "gpus")
            )
        )
        if n_layer is not None:
            shape = StepShape(n_layer, *list(vars(shape).values())[1:])
        price = price_step(shape, cluster_for(model, row["preset"], ""), predict_collective)
        label = f"{row['name']} on {row['hardware']}"
        detail = (
            f"{label}: forward and backward {price.compute_s * 1e3:.1f} ms, AdamW on the shard "
            f"{price.optimizer_s * 1e3:.1f} ms, reduce-scatter and all-gather {price.comm_s * 1e3:.1f} ms "
            f"({price.params:,} parameters)"
        )
        measured = number(row, "ms_per_step") * 1e-3
        out.append(Result("step", row["table"], label, measured, price.total_s, detail=detail))
    return out


def band(size: int) -> str:
    """The size band of a collective of ``size`` bytes."""
    return next(name for name, lo, hi in BANDS if lo <= size <= hi)


def _stats(results: list[Result]) -> tuple[int, float, float]:
    """(rows, median |error|, max |error|)."""
    errs = [abs(r.error) for r in results]
    return len(errs), statistics.median(errs), max(errs)


def target_groups(results: list[Result]) -> dict[str, list[Result]]:
    """The rows each target of TARGETS is judged on."""
    return {
        "single-node collectives, all sizes": [r for r in results if r.kind == "collective" and r.nodes == 1],
        "multi-node collectives, >= 16 MiB": [
            r for r in results if r.kind == "collective" and r.nodes > 1 and r.size >= LARGE
        ],
        "GEMMs, all shapes and dtypes": [r for r in results if r.kind == "gemm"],
        "end-to-end steps": [r for r in results if r.kind == "step"],
    }


def _pct(x: float) -> str:
    return f"{x * 100:+.0f}%"


def report(results: list[Result], model: str) -> str:
    """The Markdown tables: rows, per table, per band, against the targets."""
    lines = [f"Timing model: `{model}`", ""]
    lines += ["| table | row | measured (us) | simdist (us) | error |", "|---|---|---:|---:|---:|"]
    lines += [
        f"| {r.table} | {r.label} | {r.measured_s * 1e6:.1f} | {r.predicted_s * 1e6:.1f} | {_pct(r.error)} |"
        for r in results
    ]
    lines += [""] + [f"- {r.detail}" for r in results if r.detail]
    lines += ["", "| table | rows | median abs error | max abs error |", "|---|---:|---:|---:|"]
    for table in dict.fromkeys(r.table for r in results):
        rows, med, worst = _stats([r for r in results if r.table == table])
        lines.append(f"| {table} | {rows} | {med * 100:.0f}% | {worst * 100:.0f}% |")
    lines += [
        "",
        "| collectives | size band | rows | median abs error | max abs error |",
        "|---|---|---:|---:|---:|",
    ]
    for nodes, where in ((False, "single node"), (True, "several nodes")):
        for name, _, _ in BANDS:
            group = [
                r
                for r in results
                if r.kind == "collective" and (r.nodes > 1) == nodes and band(r.size) == name
            ]
            if group:
                rows, med, worst = _stats(group)
                lines.append(f"| {where} | {name} | {rows} | {med * 100:.0f}% | {worst * 100:.0f}% |")
    lines += ["", "| target | rows | median abs error | target | met |", "|---|---:|---:|---:|---|"]
    for what, group in target_groups(results).items():
        if group:
            rows, med, _ = _stats(group)
            met = "yes" if med <= TARGETS[what] else "no"
            lines.append(f"| {what} | {rows} | {med * 100:.0f}% | {TARGETS[what] * 100:.0f}% | {met} |")
    lines += attention_report(results)
    return "\n".join(lines)


def _ends(rows: list[dict[str, str]]) -> list[dict[str, str]]:
    """The first and last row of every table (the smallest and largest sizes): --check's subset."""
    tables: dict[str, list[dict[str, str]]] = {}
    for row in rows:
        tables.setdefault(row["table"], []).append(row)
    return [r for group in tables.values() for r in (group[:1] + group[1:][-1:])]


def results(model: str, check: bool = False) -> list[Result]:
    """Every row predicted under ``model`` (a few per table with ``check``)."""
    collectives, gemms, steps = load("collectives.csv"), load("gemm.csv"), load("end_to_end.csv")
    if check:
        collectives = _ends(collectives)
        return [
            *collective_results(model, collectives),
            *gemm_results(gemms, limit=2),
            *attention_table_results(limit=2),
            *step_results(model, steps[:1], n_layer=1),
        ]
    return [
        *collective_results(model, collectives),
        *gemm_results(gemms),
        *attention_table_results(),
        *step_results(model, steps),
    ]


def main(argv: list[str] | None = None) -> int:
    """Print the comparison; with --check, return 1 unless every prediction is finite and positive."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        choices=sorted(TIMING_MODELS),
        default="nccl",
        help="timing model (default: nccl, the GPU presets')",
    )
    parser.add_argument("--check", action="store_true", help="a few rows per table; fail on a bad prediction")
    args = parser.parse_args(argv)
    got = results(args.model, args.check)
    print(report(got, args.model))
    bad = [r for r in got if not (math.isfinite(r.predicted_s) and r.predicted_s > 0)]
    for r in bad:
        print(f"bad prediction: {r.table} {r.label}: {r.predicted_s!r} s", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
