"""A device model as a cluster file's ``device`` table, and back: every figure of a ``DeviceSpec``, so that a
device fitted by ``simdist calibrate`` (or built by hand) is what a saved cluster loads.

    [cluster.device]
    name = "A100"
    memory_bandwidth = 1.71e12     # bytes/s
    launch_overhead = 2.1e-06      # seconds
    base = "A100"                  # optional: the built-in device the figures not given come from

    [cluster.device.peak_flops]    # FLOP/s per dtype; float32 is every other dtype's fallback
    float32 = 1.95e13
    bfloat16 = 2.6e14
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import torch

from simdist.compute.attention import AttentionModel, KernelFit
from simdist.compute.devices import DEVICES, DeviceSpec, get_device
from simdist.compute.gemm import GemmShapeModel
from simdist.errors import ClusterSpecError

#: the DeviceSpec fields a device table holds as plain numbers or strings
_SCALARS = (
    "memory_bandwidth",
    "launch_overhead",
    "host_overhead",
    "memory_capacity",
    "tf32_flops",
    "host_link_bandwidth",
    "cuda_name",
    "multiprocessors",
    "source",
)
#: every key a device table may have
KEYS = ("name", "base", "peak_flops", "compute_capability", "gemm", "attention", *_SCALARS)


def is_builtin(spec: DeviceSpec) -> bool:
    """Whether ``spec`` is the built-in device of its name, figure for figure (a file names it by name alone)."""
    return DEVICES.get(spec.name) == spec


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def device_config(spec: DeviceSpec) -> dict[str, Any]:
    """``spec`` as a device table: every figure, so that loading it gives an equal DeviceSpec."""
    table: dict[str, Any] = {"name": spec.name}
    for key in _SCALARS:
        value = getattr(spec, key)
        if value is not None and value != "":
            table[key] = value
    table["compute_capability"] = list(spec.compute_capability)
    table["peak_flops"] = {_dtype_name(d): f for d, f in spec.peak_flops.items()}
    if spec.gemm is not None:
        gemm = dataclasses.asdict(spec.gemm)
        gemm["tiles"] = [list(t) for t in spec.gemm.tiles]
        table["gemm"] = gemm
    if spec.attention is not None:
        table["attention"] = _attention_config(spec.attention)
    return table


def _kernel_config(fit: KernelFit) -> dict[str, Any]:
    return {**dataclasses.asdict(fit), "efficiency": [list(e) for e in fit.efficiency]}


def _attention_config(model: AttentionModel) -> dict[str, Any]:
    """An attention model as a table: each backend's forward and backward fit, the tile, cuDNN's head dim."""
    return {
        "tile": model.tile,
        "cudnn_head_dim": model.cudnn_head_dim,
        "kernels": [
            {"backend": name, "forward": _kernel_config(f), "backward": _kernel_config(b)}
            for name, f, b in model.kernels
        ],
    }


def device_from_config(value: Any, where: str = "[cluster] device") -> str | DeviceSpec:
    """A device name as given, or the DeviceSpec a device table describes (figures not given: its ``base``'s)."""
    if isinstance(value, str):
        return value
    if isinstance(value, DeviceSpec):
        return value
    if not isinstance(value, Mapping):
        raise ClusterSpecError(
            f"{where} must be a device name (a string such as 'H100') or a table of its figures; found {value!r}"
        )
    unknown = sorted(set(value) - set(KEYS))
    if unknown:
        raise ClusterSpecError(
            f"{where}: unknown key(s) {', '.join(unknown)}; a device table takes {', '.join(KEYS)}"
        )
    base_name = value.get("base")
    if "name" not in value and base_name is None:
        raise ClusterSpecError(
            f'{where}: a device table needs name = "..." (and base = "H100" to start from one)'
        )
    base = get_device(base_name) if base_name is not None else None
    fields: dict[str, Any] = {}
    if base is not None:
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base) if f.init}
        fields["peak_flops"] = dict(base.peak_flops)
    fields["name"] = value.get("name", base.name if base is not None else "")
    for key in _SCALARS:
        if key in value:
            fields[key] = (
                _number(value[key], f"{where}.{key}") if key not in ("cuda_name", "source") else value[key]
            )
    if "compute_capability" in value:
        cc = value["compute_capability"]
        fields["compute_capability"] = tuple(cc) if isinstance(cc, list) else cc
    if "peak_flops" in value:
        fields["peak_flops"] = {
            **fields.get("peak_flops", {}),
            **_peaks(value["peak_flops"], f"{where}.peak_flops"),
        }
    if "gemm" in value:
        fields["gemm"] = _gemm(value["gemm"], f"{where}.gemm")
    if "attention" in value:
        fields["attention"] = _attention(value["attention"], f"{where}.attention")
    if "peak_flops" not in fields or "memory_bandwidth" not in fields:
        raise ClusterSpecError(
            f'{where}: a device table without base = "..." needs peak_flops (with float32) and memory_bandwidth'
        )
    try:
        return DeviceSpec(**fields)
    except TypeError as exc:
        raise ClusterSpecError(f"{where}: {exc}") from None
    except ClusterSpecError as exc:
        raise ClusterSpecError(f"{where}: {exc}") from None


def _number(value: Any, where: str) -> float | int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ClusterSpecError(f"{where} must be a number; found {value!r}")
    return value


def _peaks(value: Any, where: str) -> dict[torch.dtype, float]:
    """A ``peak_flops`` table (dtype name -> FLOP/s) as DeviceSpec takes it."""
    if not isinstance(value, Mapping):
        raise ClusterSpecError(
            f"{where} must be a table of dtype names and FLOP/s (float32 = 1e13); found {value!r}"
        )
    out: dict[torch.dtype, float] = {}
    for name, flops in value.items():
        dtype = getattr(torch, str(name), None)
        if not isinstance(dtype, torch.dtype):
            raise ClusterSpecError(
                f"{where}: {name!r} is not a torch dtype name (float32, bfloat16, float16, ...)"
            )
        out[dtype] = float(_number(flops, f"{where}.{name}"))
    return out


def _kernel(value: Any, where: str) -> KernelFit:
    """A kernel fit's table as the KernelFit it describes."""
    known = [f.name for f in dataclasses.fields(KernelFit)]
    if not isinstance(value, Mapping) or set(value) - set(known):
        raise ClusterSpecError(
            f"{where} must be a table of KernelFit's fields ({', '.join(known)}); found {value!r:.80}"
        )
    args = dict(value)
    efficiency = args.get("efficiency")
    if not isinstance(efficiency, list) or not all(isinstance(e, list) and len(e) == 2 for e in efficiency):
        raise ClusterSpecError(
            f"{where}.efficiency must be a list of [head dim, fraction]; found {efficiency!r:.80}"
        )
    args["efficiency"] = tuple(tuple(e) for e in efficiency)
    try:
        return KernelFit(**args)
    except TypeError as exc:
        raise ClusterSpecError(f"{where}: {exc}") from None


def _attention(value: Any, where: str) -> AttentionModel | None:
    """An ``attention`` table as the AttentionModel it describes (``false``: none, attention as its matmuls)."""
    if value is False:
        return None
    if not isinstance(value, Mapping) or set(value) - {"tile", "cudnn_head_dim", "kernels"}:
        raise ClusterSpecError(
            f"{where} must be a table with tile, cudnn_head_dim and kernels, or false; found {value!r:.80}"
        )
    kernels = value.get("kernels")
    if not isinstance(kernels, list) or not all(
        isinstance(k, Mapping) and set(k) == {"backend", "forward", "backward"} for k in kernels
    ):
        raise ClusterSpecError(
            f"{where}.kernels must be a list of tables with backend, forward and backward; found {kernels!r:.80}"
        )
    args = {k: v for k, v in value.items() if k != "kernels"}
    args["kernels"] = tuple(
        (
            k["backend"],
            _kernel(k["forward"], f"{where}.kernels[{i}].forward"),
            _kernel(k["backward"], f"{where}.kernels[{i}].backward"),
        )
        for i, k in enumerate(kernels)
    )
    try:
        return AttentionModel(**args)
    except TypeError as exc:
        raise ClusterSpecError(f"{where}: {exc}") from None


def _gemm(value: Any, where: str) -> GemmShapeModel | None:
    """A ``gemm`` table as the GemmShapeModel it describes (``false``: none, every matmul at the roofline)."""
    if value is False:
        return None
    if value is True:
        return GemmShapeModel()
    if not isinstance(value, Mapping):
        raise ClusterSpecError(
            f"{where} must be a table of GemmShapeModel's fields, true or false; found {value!r}"
        )
    known = [f.name for f in dataclasses.fields(GemmShapeModel)]
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise ClusterSpecError(f"{where}: unknown key(s) {', '.join(unknown)}; expected {', '.join(known)}")
    args = dict(value)
    if "tiles" in args:
        tiles = args["tiles"]
        if not isinstance(tiles, list) or not all(isinstance(t, list) and len(t) == 3 for t in tiles):
            raise ClusterSpecError(
                f"{where}.tiles must be a list of [rows, columns, efficiency]; found {tiles!r}"
            )
        args["tiles"] = tuple(tuple(t) for t in tiles)
    return GemmShapeModel(**args)
