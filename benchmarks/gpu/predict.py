"""simdist's side of the GPU comparison: predicted op times, memory peaks and the simulated training program.

Each prediction is what a simdist run would charge for the same code. Op times and memory peaks are priced on
the meta device (shapes only: the measured sizes are too large to compute on a CPU), with one adjustment that
makes meta pricing match a simulated run: attention goes to the CPU's fused kernel, as it does on the CPU
tensors of a simulated run (on meta tensors PyTorch would pick its unfused math path instead).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
import twin_program
from memory import training_step
from model import BlockShape
from ops import OpCase, precision
from torch.overrides import TorchFunctionMode
from training import Job

import simdist
from simdist.compute import DeviceSpec, estimate, get_device

_SDPA_ARGS = ("attn_mask", "dropout_p", "is_causal", "scale")


class _CpuAttention(TorchFunctionMode):
    """Sends scaled_dot_product_attention to the CPU's fused kernel, the one a simulated run's CPU tensors use."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        q, k, v, *rest = args
        kwargs.update(zip(_SDPA_ARGS, rest))
        out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q,
            k,
            v,
            kwargs.get("dropout_p", 0.0),
            kwargs.get("is_causal", False),
            attn_mask=kwargs.get("attn_mask"),
            scale=kwargs.get("scale"),
        )
        return out[0]


@contextmanager
def cpu_attention() -> Iterator[None]:
    """Price attention as a simulated run does (see the module docstring)."""
    with _CpuAttention():
        yield


def preset_for(device_name: str | None) -> str:
    """simdist's device preset for a measured device's name (H100 when nothing matches, e.g. a dry run)."""
    name = (device_name or "").upper()
    return next((p for p in ("H200", "H100", "A100") if p in name), "H100")


def op_seconds(case: OpCase, device: DeviceSpec | str) -> tuple[float, int]:
    """simdist's time for one call of ``case`` (seconds, launch overheads included) and its kernel count."""
    inputs = case.make("meta", 0)
    with cpu_attention(), precision(case.dtype):
        total, charges = estimate(case.run, inputs, device=device)
    return total, len(charges)


def launch_overhead(device: DeviceSpec | str) -> float:
    """The seconds simdist adds to every kernel on ``device``."""
    return (get_device(device) if isinstance(device, str) else device).launch_overhead


def _memory_rank(shape: BlockShape, dtype: str, upto: str) -> None:
    """The rank code of memory_peak: the step on meta tensors, attention as a run prices it."""
    with cpu_attention():
        training_step(shape, dtype, "meta", upto)


def memory_peak(shape: BlockShape, dtype: str, upto: str, device: str) -> int:
    """simdist's peak live bytes of a block's training step cut after phase ``upto`` (memory.PHASES)."""
    result = simdist.run(
        _memory_rank, simdist.Cluster.switch(1, device=device), args=(shape, dtype, upto), memory=True
    )
    return result.memory[0].peak_bytes


def sim_clock() -> float:
    """The rank's simulated seconds once its device has run everything queued (torch.cuda.synchronize's)."""
    simdist.synchronize()
    return simdist.now()


def simulate_program(job: Job, device: str) -> dict[str, Any]:
    """twin_program's job simulated at world size 1 on ``device``: its record, with simdist's peak memory."""
    result = simdist.run(
        twin_program.main,
        simdist.Cluster.switch(1, device=device),
        kwargs={"job": job, "device": "cpu", "clock": sim_clock},
        memory=True,
    )
    return {**result.returns[0], "peak_bytes": result.memory[0].peak_bytes, "sim_time": result.sim_time}
