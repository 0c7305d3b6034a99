"""The attention rows of ``benchmarks/fidelity.py``, and the fit of simdist's attention constants from some of them.

The measurements (``benchmarks/fidelity/attention.csv``) are the throughputs FlashAttention-2's and -3's figures
print for FlashAttention-2, cuDNN and xformers kernels on H100 and A100 (forward, or forward and backward), at the
papers' configuration: ``batch = 16384 / seq_len`` sequences, hidden 2048 (``heads = 2048 / head_dim``), fp16, the
FLOPs ``4 * batch * heads * seq_len^2 * head_dim`` per forward pass (2.5 times that backward), halved when causal.

- ``fit()`` derives the constants of ``simdist.compute.attention`` (HOPPER_ATTENTION, AMPERE_ATTENTION) from the
  rows ``FIT_ROWS`` names, in closed form (the derivation is beside each step); every other row is held out;
- ``attention_results()`` prices each row as ``simdist.compute.estimate`` prices the kernel (the GPU kernel's aten
  op on meta tensors, forward and, for forward+backward rows, backward), and this project's H100 timings of
  ``F.scaled_dot_product_attention`` as a run prices them (torch's choice of kernel on the device).

``python3 benchmarks/fidelity_attention.py`` prints the fitted constants.
"""

from __future__ import annotations

import csv
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

# benchmarks/gpu is a folder of scripts, not a package: its modules are imported by name
sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
from ops import by_id
from predict import op_seconds

from simdist.compute import estimate, get_device
from simdist.compute.attention import AttentionModel, KernelFit

DATA = Path(__file__).resolve().parent / "fidelity" / "attention.csv"
H100_RUN = Path(__file__).resolve().parent / "gpu" / "results" / "h100-2026-11-26" / "compute.json"

#: the kernel simdist prices each published implementation as (torch's names)
KERNELS = {"FlashAttention-2": "flash", "cuDNN": "cudnn", "xformers": "efficient"}
#: the sequence lengths the fit reads: the shortest and the longest of the papers' sweeps
SHORT, LONG = 512, 16384
#: the rows (table, kernel, head dim, causal, seq_len) the constants are fitted to; all others are held out
FIT_ROWS = frozenset(
    (table, kernel, d, causal, s)
    for table, kernel, dims in (
        ("fa3-h100-fwd", "cuDNN", (64, 256)),
        ("fa3-h100-fwd", "FlashAttention-2", (64, 256)),
        ("fa2-h100-fwdbwd", "FlashAttention-2", (64,)),
    )
    for d, causal, s in (
        (128, 0, SHORT),
        (128, 0, LONG),
        *((d, 0, LONG) for d in dims),
        (128, 1, SHORT),
        (128, 1, LONG),
    )
) | frozenset(
    ("fa2-a100-fwdbwd", kernel, d, 0, LONG) for kernel in ("FlashAttention-2", "xformers") for d in (64, 128)
)
#: rows (and columns) of a score tile; the blocks per sequence are seq_len / TILE
TILE = 128


def load(path: Path = DATA) -> list[dict[str, str]]:
    """The published rows; each must name its source."""
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    for i, row in enumerate(rows, start=2):
        if not row.get("source", "").strip():
            raise ValueError(
                f"{path.name} line {i}: no source; every measurement names where it was published"
            )
    return rows


def _key(row: dict[str, str]) -> tuple[str, str, int, int, int]:
    return row["table"], row["kernel"], int(row["head_dim"]), int(row["causal"]), int(row["seq_len"])


def counted_flops(row: dict[str, str]) -> float:
    """The FLOPs the source divides by its time: 4 b h s^2 d per forward, 3.5 times that forward and backward,
    halved when causal."""
    b, h, s, d = (int(row[x]) for x in ("batch", "heads", "seq_len", "head_dim"))
    forward = 4.0 * b * h * s * s * d / (2 if row["causal"] == "1" else 1)
    return forward * (3.5 if row["passes"] == "forward+backward" else 1.0)


def measured_seconds(row: dict[str, str]) -> float:
    """The row's time: its FLOPs over its throughput."""
    return counted_flops(row) / (float(row["tflops"]) * 1e12)


# ------------------------------------------------------------------------------------------------------- the fit
# At the papers' configuration a non-causal pass has m = seq_len / TILE query blocks of m key tiles per (batch, head)
# and far more CTAs than SMs, so AttentionModel.seconds is heads * m * (m + cta_tiles) tiles over the SMs and the
# throughput is rate * e * m / (m + c). A causal pass computes m (m + 1) / 2 tiles and pays cta_tiles and
# diagonal_tiles once per query block, so its (halved-FLOP) throughput is rate * e * k * m / (m + 1 + 2 (c + g)).
# Two sequence lengths give two equations; the launch overhead (per pass) is taken off the time first.


@dataclass(frozen=True)
class _Pass:
    """What one pass of one kernel was fitted to: head dim -> kernel-only TFLOP/s at SHORT and LONG."""

    long: dict[tuple[int, int], float]  # (head dim, causal) -> throughput at LONG
    short: dict[tuple[int, int], float]  # (head dim, causal) -> throughput at SHORT


def _shape(short: float, long: float) -> tuple[float, float]:
    """(e / rate-normalised, c) from the non-causal throughputs at SHORT and LONG: r = (m1 / (m1 + c)) / (m2 / (m2 +
    c)) solved for c; then e = tp(LONG) (m2 + c) / m2 (in FLOP/s, divided by the rate by the caller)."""
    m1, m2 = SHORT // TILE, LONG // TILE
    r = short / long
    c = m1 * m2 * (1 - r) / (r * m2 - m1)
    return long * (m2 + c) / m2, c


def _causal(short: float, long: float, c: float, peak: float) -> tuple[float, float]:
    """(diagonal_tiles, causal_efficiency) from the causal throughputs at SHORT and LONG, given c and the non-causal
    asymptote ``peak`` = rate * e: x = c + g from the ratio of m / (m + 1 + 2x) at the two lengths, then k."""
    m1, m2 = SHORT // TILE, LONG // TILE
    r = short / long
    x = (m1 * (m2 + 1) - r * m2 * (m1 + 1)) / (2 * (r * m2 - m1))
    return max(0.0, x - c), min(1.0, long / peak * (m2 + 1 + 2 * x) / m2)


def _kernel_tflops(rows: dict, key: tuple, launches: int, launch: float, less: float = 0.0) -> float:
    """A row's throughput without its launches (and ``less`` seconds of another pass), FLOP/s over the FLOPs of the
    pass that is left (``rows[key]`` is (row, FLOPs of that pass))."""
    row, flops = rows[key]
    return flops / (measured_seconds(row) - launches * launch - less)


def _fit_pass(tp: Callable[[int, int, int], float], rate: float, dims: tuple[int, ...]) -> KernelFit:
    """A KernelFit from ``tp(head_dim, causal, seq_len)``, the kernel-only throughput of the fit rows."""
    peak, c = _shape(tp(128, 0, SHORT), tp(128, 0, LONG))
    efficiency = {128: peak / rate}
    m2 = LONG // TILE
    for d in dims:
        if d != 128:
            efficiency[d] = tp(d, 0, LONG) * (m2 + c) / m2 / rate
    g, k = _causal(tp(128, 1, SHORT), tp(128, 1, LONG), c, peak)
    return KernelFit(
        tuple(sorted((d, round(e, 3)) for d, e in efficiency.items())), round(c, 3), round(g, 3), round(k, 3)
    )


def _scaled(fit: KernelFit, scale: dict[int, float]) -> KernelFit:
    """``fit`` with each head dim's efficiency times ``scale`` (the nearest head dim's where it has none)."""

    def factor(d: int) -> float:
        return scale[min(scale, key=lambda x: (abs(x - d), x))]

    return KernelFit(
        tuple((d, round(min(1.0, e * factor(d)), 3)) for d, e in fit.efficiency),
        fit.cta_tiles,
        fit.diagonal_tiles,
        fit.causal_efficiency,
    )


def fit(rows: list[dict[str, str]] | None = None) -> tuple[AttentionModel, AttentionModel]:
    """(HOPPER_ATTENTION, AMPERE_ATTENTION) fitted to the rows of FIT_ROWS."""
    rows = load() if rows is None else rows
    by_key = {_key(r): r for r in rows}
    h100, a100 = get_device("H100"), get_device("A100")
    fp16 = torch.float16
    launch = h100.launch_overhead

    def forward(table: str, kernel: str) -> Callable[[int, int, int], float]:
        return lambda d, c, s: (
            counted_flops(by_key[(table, kernel, d, c, s)])
            / (measured_seconds(by_key[(table, kernel, d, c, s)]) - launch)
        )

    rate = h100.flops_for(fp16)
    cudnn_f = _fit_pass(forward("fa3-h100-fwd", "cuDNN"), rate, (64, 128, 256))
    flash_f = _fit_pass(forward("fa3-h100-fwd", "FlashAttention-2"), rate, (64, 128, 256))
    fwd_only = AttentionModel(kernels=(("flash", flash_f, flash_f),))

    def backward(d: int, c: int, s: int) -> float:
        # the forward+backward row less the fitted forward pass and both launches: the backward pass alone
        row = by_key[("fa2-h100-fwdbwd", "FlashAttention-2", d, c, s)]
        b, h = int(row["batch"]), int(row["heads"])
        fwd = fwd_only.seconds("flash", False, b * h, s, s, d, d, bool(c), rate, h100.multiprocessors)
        bwd_flops = counted_flops(row) / 3.5 * 2.5
        return bwd_flops / (measured_seconds(row) - fwd - 2 * launch)

    flash_b = _fit_pass(backward, rate, (64, 128))
    # no head dim 256 backward row: it keeps the forward pass's ratio of head dim 256 to 128
    e = dict(flash_b.efficiency)
    f = dict(flash_f.efficiency)
    flash_b = KernelFit(
        (*flash_b.efficiency, (256, round(e[128] * f[256] / f[128], 3))),
        flash_b.cta_tiles,
        flash_b.diagonal_tiles,
        flash_b.causal_efficiency,
    )
    # no backward row of cuDNN: its backward pass is flash's, faster by what cuDNN's forward pass is at each head dim
    cudnn_b = _scaled(flash_b, {d: dict(cudnn_f.efficiency)[d] / f[d] for d in f})

    # A100: the same FlashAttention-2 and xformers code as on the H100 (sm80 kernels), so the same shape constants;
    # each head dim's efficiency scaled to the 16k non-causal forward+backward rows
    a_rate, a_sms = a100.flops_for(fp16), a100.multiprocessors
    hopper_flash = AttentionModel(kernels=(("flash", flash_f, flash_b),))

    def scale(kernel: str) -> dict[int, float]:
        out = {}
        for d in (64, 128):
            row = by_key[("fa2-a100-fwdbwd", kernel, d, 0, LONG)]
            b, h = int(row["batch"]), int(row["heads"])
            args = (b * h, LONG, LONG, d, d, False, a_rate, a_sms)
            modelled = hopper_flash.seconds("flash", False, *args) + hopper_flash.seconds(
                "flash", True, *args
            )
            out[d] = modelled / (measured_seconds(row) - 2 * a100.launch_overhead)
        return out

    flash_scale, xformers_scale = scale("FlashAttention-2"), scale("xformers")
    ampere = AttentionModel(
        kernels=(
            ("flash", _scaled(flash_f, flash_scale), _scaled(flash_b, flash_scale)),
            ("efficient", _scaled(flash_f, xformers_scale), _scaled(flash_b, xformers_scale)),
        )
    )
    # the H100's memory-efficient kernel: not measured; FlashAttention-2's, slower by what xformers is on the A100
    relative = {d: xformers_scale[d] / flash_scale[d] for d in flash_scale}
    hopper = AttentionModel(
        kernels=(
            ("cudnn", cudnn_f, cudnn_b),
            ("flash", flash_f, flash_b),
            ("efficient", _scaled(flash_f, relative), _scaled(flash_b, relative)),
        )
    )
    return hopper, ampere


# ------------------------------------------------------------------------------------------------ the predictions
def _meta(b: int, h: int, s: int, d: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(b, h, s, d, dtype=dtype, device="meta")


def _kernel_call(
    kernel: str, b: int, h: int, s: int, d: int, causal: bool, backward: bool
) -> Callable[[], None]:
    """The GPU kernel's aten ops (forward, and backward where asked) on meta fp16 tensors."""
    q = _meta(b, h, s, d, torch.float16)
    aten = torch.ops.aten

    def run() -> None:
        if kernel == "flash":
            out = aten._scaled_dot_product_flash_attention(q, q, q, 0.0, causal)
            if backward:
                aten._scaled_dot_product_flash_attention_backward(
                    q, q, q, q, out[0], out[1], out[2], out[3], s, s, 0.0, causal, out[6], out[7]
                )
        elif kernel == "efficient":
            out = aten._scaled_dot_product_efficient_attention(q, q, q, None, backward, 0.0, causal)
            if backward:
                aten._scaled_dot_product_efficient_attention_backward(
                    q, q, q, q, None, out[0], out[1], out[2], out[3], 0.0, [True, True, True, False], causal
                )
        else:
            out = aten._scaled_dot_product_cudnn_attention(q, q, q, None, backward, 0.0, causal)
            if backward:
                aten._scaled_dot_product_cudnn_attention_backward(
                    q, q, q, q, out[0], out[1], out[6], out[7], None, out[2], out[3], s, s, 0.0, causal
                )

    return run


def predict(row: dict[str, str]) -> float:
    """simdist's seconds for a published row: ``estimate`` of its kernel's forward (and backward) op."""
    b, h, s, d = (int(row[x]) for x in ("batch", "heads", "seq_len", "head_dim"))
    call = _kernel_call(
        KERNELS[row["kernel"]], b, h, s, d, row["causal"] == "1", row["passes"] == "forward+backward"
    )
    return estimate(call, device=row["device"])[0]


@dataclass(frozen=True)
class AttentionRow:
    """One attention row: its table and label, measured and predicted seconds, and whether the fit read it."""

    table: str
    label: str
    measured_s: float
    predicted_s: float
    fitted: bool


def attention_results(limit: int | None = None) -> list[AttentionRow]:
    """Every published row (the first ``limit`` per table) and this project's H100 SDPA timings, priced."""
    out = []
    seen: dict[str, int] = {}
    for row in load():
        seen[row["table"]] = seen.get(row["table"], 0) + 1
        if limit is not None and seen[row["table"]] > limit:
            continue
        causal = " causal" if row["causal"] == "1" else ""
        label = (
            f"{row['kernel']} {row['passes']}{causal} d{row['head_dim']} s{row['seq_len']} "
            f"(b{row['batch']} h{row['heads']})"
        )
        out.append(
            AttentionRow(row["table"], label, measured_seconds(row), predict(row), _key(row) in FIT_ROWS)
        )
    catalogue = by_id(False)
    records = [r for r in json.loads(H100_RUN.read_text())["records"] if r["class"] == "attention"]
    for record in records[:limit]:
        predicted, _ = op_seconds(catalogue[record["id"]], "H100")
        out.append(AttentionRow("h100-this-project-sdpa", record["id"], record["median_s"], predicted, False))
    return out


def main() -> int:
    """Print the fitted constants."""
    hopper, ampere = fit()
    for name, model in (("HOPPER_ATTENTION", hopper), ("AMPERE_ATTENTION", ampere)):
        print(f"{name}:")
        for backend, forward, backward in model.kernels:
            print(f"  {backend} forward:  {forward}")
            print(f"  {backend} backward: {backward}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
