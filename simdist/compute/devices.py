"""Accelerator specifications: FLOP/s per dtype (and for TF32), memory bandwidth, per-kernel launch overhead and
memory capacity; datasheet figures, or rates measured on the device where its source says so."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from simdist.compute.attention import AMPERE_ATTENTION, HOPPER_ATTENTION, AttentionModel
from simdist.compute.gemm import GemmShapeModel
from simdist.errors import ClusterSpecError

# Fixed time every kernel takes on the device beyond its roofline, in seconds. Not a datasheet figure: an
# estimate of what puts a floor under small ops on a real GPU (an H100 ran small elementwise kernels queued
# ahead in 4.5-4.6 us, benchmarks/gpu/results/h100-2026-11-26). Override per device with dataclasses.replace().
DEFAULT_LAUNCH_OVERHEAD = 5e-6
#: the host's seconds per op an eager PyTorch program launches on an H100 machine: the median host time per call
#: of the 15 elementwise cases of benchmarks/gpu/results/h100-2026-11-26 (6.2 to 8.6 us; matmuls took 9 to 38)
MEASURED_HOST_OVERHEAD = 7.0e-6

#: bytes/s one direction of a PCIe 4.0 x16 link carries (16 GT/s x 16 lanes, 128b/130b coding: 31.5 GB/s; the A100
#: datasheet's "PCIe Gen4: 64 GB/s" counts both directions): the default host link of a device
PCIE4_X16 = 32e9
#: bytes/s one direction of a PCIe 5.0 x16 link carries (the H100 and H200 datasheets' "PCIe Gen5: 128 GB/s" counts
#: both directions)
PCIE5_X16 = 64e9


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator: FLOP/s per dtype (the rate a large matmul runs at), HBM bandwidth (bytes/s), launch
    overhead (seconds each kernel takes on the device beyond its roofline), the host's seconds per kernel it
    launches, memory capacity (bytes; ``math.inf`` for no limit), the TF32 tensor-core
    rate (FLOP/s; None for none), the host link's bandwidth (bytes/s each way, what host<->device copies run
    at), and what ``torch.cuda`` reports of it in a run that emulates CUDA (its name, compute capability and
    multiprocessor count).

    ``peak_flops`` must contain ``torch.float32``; dtypes without an entry use that figure (see ``flops_for``).
    ``tf32_flops`` is what float32 matmuls and convolutions run at where torch lets them use TF32 (cost.py reads
    torch's switches when it prices an op); without it they run at the float32 figure.
    A device whose every peak and bandwidth is infinite and whose launch overhead is zero is *zero-cost*:
    every op takes 0 s, so only communication advances simulated time.
    """

    name: str
    peak_flops: Mapping[torch.dtype, float] = field(hash=False)
    memory_bandwidth: float
    launch_overhead: float = DEFAULT_LAUNCH_OVERHEAD
    source: str = ""
    #: bytes of device memory tensors may occupy; a run with ``memory=True`` raises OutOfMemoryError above it
    memory_capacity: float = math.inf
    #: FLOP/s of float32 matmuls and convolutions run on TF32 tensor cores; None: the device has none
    tf32_flops: float | None = None
    #: bytes/s of one direction of the host link (PCIe): host-to-device and device-to-host copies run at it
    host_link_bandwidth: float = PCIE4_X16
    #: what ``torch.cuda.get_device_name()`` answers ("" for "<name> (simulated)")
    cuda_name: str = ""
    #: ``torch.cuda.get_device_capability()``: (major, minor); bf16 and TF32 need at least (8, 0)
    compute_capability: tuple[int, int] = (8, 0)
    #: ``torch.cuda.get_device_properties().multi_processor_count``
    multiprocessors: int = 108
    #: how matmuls fall short of ``peak_flops`` by shape (tiles and waves over ``multiprocessors``, split-K, the
    #: memory-bound regime); None: every matmul runs at the roofline, max(flops / peak, bytes / bandwidth)
    gemm: GemmShapeModel | None = None
    #: seconds of host time to launch one kernel (eager PyTorch's dispatch and the launch call), in a run whose
    #: host runs ahead of its device: the host's time, overlapping with the device's work, and a kernel starts no
    #: earlier than its launch ends; 0: the host launches in no time
    host_overhead: float = 0.0
    #: how the fused attention kernels (scaled_dot_product_attention) fall short of ``peak_flops`` by head dim,
    #: sequence length and mask, and which one torch picks; None: attention at the roofline of its FLOPs and bytes
    attention: AttentionModel | None = None
    _zero_cost: bool = field(init=False, repr=False, compare=False, hash=False, default=False)

    def __post_init__(self) -> None:
        if torch.float32 not in self.peak_flops:
            raise ClusterSpecError(
                f"device {self.name!r}: peak_flops has no torch.float32 entry (found {sorted(map(str, self.peak_flops))}); "
                "add one, it is the fallback for dtypes without their own figure"
            )
        for dtype, flops in self.peak_flops.items():
            if not isinstance(dtype, torch.dtype) or not flops > 0:
                raise ClusterSpecError(
                    f"device {self.name!r}: peak_flops must map torch.dtype to a positive FLOP/s figure, "
                    f"found {dtype!r}: {flops!r}"
                )
        if not self.memory_bandwidth > 0:
            raise ClusterSpecError(
                f"device {self.name!r}: memory_bandwidth must be a positive number of bytes/s, "
                f"found {self.memory_bandwidth!r}"
            )
        if not (self.launch_overhead >= 0 and math.isfinite(self.launch_overhead)):
            raise ClusterSpecError(
                f"device {self.name!r}: launch_overhead must be a finite number of seconds >= 0, "
                f"found {self.launch_overhead!r}"
            )
        if not (self.host_overhead >= 0 and math.isfinite(self.host_overhead)):
            raise ClusterSpecError(
                f"device {self.name!r}: host_overhead must be a finite number of seconds >= 0, "
                f"found {self.host_overhead!r}"
            )
        capacity = self.memory_capacity
        if isinstance(capacity, bool) or not isinstance(capacity, (int, float)) or not capacity > 0:
            raise ClusterSpecError(
                f"device {self.name!r}: memory_capacity must be a positive number of bytes (math.inf for no "
                f"limit), found {capacity!r}"
            )
        tf32 = self.tf32_flops
        if tf32 is not None and (
            isinstance(tf32, bool) or not isinstance(tf32, (int, float)) or not tf32 > 0
        ):
            raise ClusterSpecError(
                f"device {self.name!r}: tf32_flops must be a positive FLOP/s figure or None (no TF32 tensor "
                f"cores), found {tf32!r}"
            )
        link = self.host_link_bandwidth
        if isinstance(link, bool) or not isinstance(link, (int, float)) or not link > 0:
            raise ClusterSpecError(
                f"device {self.name!r}: host_link_bandwidth must be a positive number of bytes/s (math.inf for "
                f"free copies), found {link!r}"
            )
        major_minor = self.compute_capability
        if (
            not isinstance(major_minor, tuple)
            or len(major_minor) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in major_minor)
        ):
            raise ClusterSpecError(
                f"device {self.name!r}: compute_capability must be a (major, minor) pair of ints, found {major_minor!r}"
            )
        if (
            isinstance(self.multiprocessors, bool)
            or not isinstance(self.multiprocessors, int)
            or self.multiprocessors < 1
        ):
            raise ClusterSpecError(
                f"device {self.name!r}: multiprocessors must be a positive int, found {self.multiprocessors!r}"
            )
        if self.gemm is not None and not isinstance(self.gemm, GemmShapeModel):
            raise ClusterSpecError(
                f"device {self.name!r}: gemm must be a simdist.compute.GemmShapeModel or None, found {self.gemm!r}"
            )
        if self.attention is not None and not isinstance(self.attention, AttentionModel):
            raise ClusterSpecError(
                f"device {self.name!r}: attention must be a simdist.compute.AttentionModel or None, "
                f"found {self.attention!r}"
            )
        if not isinstance(self.cuda_name, str):
            raise ClusterSpecError(f"device {self.name!r}: cuda_name must be a str, found {self.cuda_name!r}")
        # Copy into a read-only view so the frozen spec cannot change under a running simulation.
        object.__setattr__(self, "peak_flops", MappingProxyType(dict(self.peak_flops)))
        zero = (
            self.launch_overhead == 0
            and self.host_overhead == 0
            and math.isinf(self.memory_bandwidth)
            and all(math.isinf(f) for f in self.peak_flops.values())
            and (self.tf32_flops is None or math.isinf(self.tf32_flops))
        )
        object.__setattr__(self, "_zero_cost", zero)

    def __reduce__(
        self,
    ) -> tuple[type[DeviceSpec], tuple[Any, ...]]:
        # The read-only peak table is a mappingproxy, which pickle cannot handle; rebuild from a plain dict.
        return (
            DeviceSpec,
            (
                self.name,
                dict(self.peak_flops),
                self.memory_bandwidth,
                self.launch_overhead,
                self.source,
                self.memory_capacity,
                self.tf32_flops,
                self.host_link_bandwidth,
                self.cuda_name,
                self.compute_capability,
                self.multiprocessors,
                self.gemm,
                self.host_overhead,
                self.attention,
            ),
        )

    @property
    def is_gpu(self) -> bool:
        """Whether rank code sees this device as a GPU (``torch.cuda``): every device with a cost model is one."""
        return not self._zero_cost

    @property
    def cuda_device_name(self) -> str:
        """What ``torch.cuda.get_device_name()`` answers for this device."""
        return self.cuda_name or f"{self.name} (simulated)"

    @property
    def is_zero_cost(self) -> bool:
        """True when every op on this device takes 0 seconds."""
        return self._zero_cost

    def flops_for(self, dtype: torch.dtype, *, tf32: bool = False) -> float:
        """FLOP/s for ``dtype``; dtypes without an entry get the float32 figure. ``tf32``: the op is a
        float32 matmul or convolution that torch lets use TF32, which runs at ``tf32_flops`` where there is one."""
        if tf32 and dtype == torch.float32 and self.tf32_flops is not None:
            return self.tf32_flops
        flops = self.peak_flops.get(dtype)
        return self.peak_flops[torch.float32] if flops is None else flops


# Figure choices, shared by every GPU below (the datasheet's figures, where a device's figures were not measured):
# - float32 is the plain (non-tensor-core) FP32 rate. PyTorch's default for CUDA matmuls is
#   torch.backends.cuda.matmul.allow_tf32 = False, so FP32 matmuls do not use TF32 tensor cores by default;
#   where a program allows it they run at tf32_flops (cuDNN convolutions allow it by default).
# - bfloat16/float16/float8/int8, and tf32_flops, are dense tensor-core rates. NVIDIA datasheets quote these
#   "with sparsity" (2:4 structured); the dense rate is half that figure.
# - float64 is the FP64 tensor-core rate (cuBLAS DGEMM uses it).
# - memory_capacity reads the datasheet's "80 GB" as GiB, the HBM stacks' size (5 x 16 GiB on H100). The CUDA
#   context and driver reserve take about 1 GiB of it on a real device (torch reports 79.1 GiB total on an
#   H100 80GB); override with dataclasses.replace(H100, memory_capacity=...) to model that headroom.

#: bytes in one GiB
GIB = 2**30

# H100 and H200: corrected from a measurement (benchmarks/gpu/results/h100-2026-11-26, an H100 SXM 80GB HBM3,
# driver 580.159.04, torch 2.11.0+cu130, CUDA 13.0). The datasheet's peaks are not reached: cuBLAS sustains
# 65-78% of the dense bf16/fp16 peak on large GEMMs, and elementwise kernels 90% of the HBM bandwidth. The rule
# (benchmarks/gpu/calibrate.py, which prints the figures from the results; tests/test_gpu_results.py checks
# these equal its output): each matmul rate is the median achieved FLOP/s of the large matmuls (the `mm` cases
# of at least 2 * 4096**3 FLOPs: 4096^3, 8192^3, 8192x11008x4096, 8192x4096x11008, 8192x50304x768), the
# bandwidth the median achieved bandwidth of add, mul and gelu on 2**27 elements in bf16 and fp32; rounded to
# three significant digits. FP8 was not measured here: its rate is the same rule applied to Azure's published
# cuBLASLt FP8 GEMMs on an H100 (see _HOPPER_FP8). FP64 and INT8 were not measured and keep the datasheet's dense
# rates.

#: the H100 SXM datasheet's HBM bandwidth, bytes/s (the measured figure's reference)
_H100_DATASHEET_BANDWIDTH = 3.35e12
#: the H100's measured bandwidth, bytes/s: median of 3023, 3026, 3031, 3031, 2984 and 2819 GB/s
_H100_MEASURED_BANDWIDTH = 3.02e12

#: the FP8 rate, FLOP/s, measured by others: Azure's published cuBLASLt FP8 (e4m3) GEMMs on an ND H100 v5 (H100 80GB
#: HBM3, CUDA 12.6, driver 560.35.03; Azure/AI-benchmarking-guide, "Azure Results/ND_H100_v5_results.md", GEMM
#: CuBLASLt), with this project's rule: the median of the GEMMs of at least 2 * 4096**3 FLOPs (4096^3 1216.9,
#: 8192^3 1290.1, 6144x12288x12288 1351.4, 16384^3 1377.3, 32768^3 1382.2 TFLOP/s), three digits. The dense
#: datasheet rate (1979) is not reached any more than BF16's; the same guide's ND H200 v5 run gives 1318
_HOPPER_FP8 = 1350e12

#: H100 SXM and H200 SXM share the GH100 compute die and clocks: same rates, different memory
_HOPPER_SXM_FLOPS = {
    torch.float64: 67e12,  # datasheet (FP64 tensor core), not measured
    torch.float32: 51.3e12,  # measured: median of 49.1, 49.6, 51.3, 52.1, 52.7 TFLOP/s (datasheet 67)
    torch.bfloat16: 688e12,  # measured: median of 629.6, 651.6, 688.0, 768.2, 773.7 (datasheet dense 989.5)
    torch.float16: 643e12,  # measured: median of 540.1, 633.6, 643.3, 652.5, 691.8 (datasheet dense 989.5)
    torch.float8_e4m3fn: _HOPPER_FP8,  # measured by Azure (above); datasheet dense 1979
    torch.float8_e5m2: _HOPPER_FP8,
    torch.int8: 3958e12 / 2,
}
#: measured: median of 281.2, 299.0, 362.7, 379.3, 400.8 TFLOP/s (datasheet dense 494.5)
_HOPPER_SXM_TF32 = 363e12

_MEASURED_ON_H100 = (
    "measured on an H100 SXM 80GB HBM3 (benchmarks/gpu/results/h100-2026-11-26: driver 580.159.04, "
    "torch 2.11.0+cu130, CUDA 13.0): each matmul rate is the median achieved FLOP/s of the mm cases of at "
    "least 2*4096^3 FLOPs (bf16 629.6/651.6/688.0/768.2/773.7 -> 688 TF, datasheet dense 989.5; fp16 "
    "540.1/633.6/643.3/652.5/691.8 -> 643 TF; fp32 with TF32 off 49.1/49.6/51.3/52.1/52.7 -> 51.3 TF, "
    "datasheet 67; TF32 281.2/299.0/362.7/379.3/400.8 -> 363 TF, datasheet dense 494.5), rounded to three "
    "digits; FP8 the same rule on Azure's published cuBLASLt FP8 GEMMs on an ND H100 v5 (Azure/AI-benchmarking-guide, "
    "ND_H100_v5_results.md: 1216.9/1290.1/1351.4/1377.3/1382.2 -> 1350 TF, datasheet dense 1979); FP64 and INT8 "
    "not measured: datasheet dense rates"
)

#: Hopper's GEMMs: the shape model with stream-K for a last, partial wave. Without it, an H100 sweep the model was not
#: fitted to (benchmarks/fidelity/gemm.csv, triton-h100-fp16) ran squares just past a whole wave (2176-3072) 13-41%
#: faster than priced, as persistent stream-K kernels (CUTLASS's sm90 schedulers) would; the A100 has no such
#: evidence and keeps whole waves
HOPPER_GEMM = GemmShapeModel(stream_k=True)

_SHAPE_AND_HOST = (
    "GEMM shape model (tiles, waves, split-K, skinny shapes at 80% of the bandwidth; stream-K for a last partial "
    "wave on the H100 and H200) fitted to the 37 matmuls of "
    "benchmarks/gpu/results/h100-2026-11-26; host overhead 7.0 us per kernel measured there (the median host time "
    "per call of its elementwise cases); attention model (simdist/compute/attention.py) fitted to published "
    "FlashAttention-2, cuDNN and xformers throughputs (benchmarks/fidelity/attention.csv)"
)

H100 = DeviceSpec(
    name="H100",
    peak_flops=_HOPPER_SXM_FLOPS,
    tf32_flops=_HOPPER_SXM_TF32,
    memory_bandwidth=_H100_MEASURED_BANDWIDTH,
    memory_capacity=80 * GIB,
    source=(
        f"{_MEASURED_ON_H100}; HBM bandwidth measured: the median achieved bandwidth of add, mul and gelu on "
        "2^27 elements in bf16 and fp32 (2819/2984/3023/3026/3031/3031 GB/s -> 3.02 TB/s; datasheet 3.35 TB/s); "
        "memory 80 GB HBM3 as on the NVIDIA H100 datasheet, SXM column; name, compute capability 9.0 and 132 SMs "
        "as torch.cuda reported them on that H100; host link PCIe Gen5 x16 (datasheet: 128 GB/s both ways); "
        f"{_SHAPE_AND_HOST}"
    ),
    host_link_bandwidth=PCIE5_X16,
    cuda_name="NVIDIA H100 80GB HBM3",
    compute_capability=(9, 0),
    multiprocessors=132,
    gemm=HOPPER_GEMM,
    host_overhead=MEASURED_HOST_OVERHEAD,
    attention=HOPPER_ATTENTION,
)

H200 = DeviceSpec(
    name="H200",
    peak_flops=_HOPPER_SXM_FLOPS,
    tf32_flops=_HOPPER_SXM_TF32,
    # its datasheet figure, scaled by what the H100 reached of its own datasheet's; two H200s then measured 4.31
    # and 4.33 TB/s by the same rule (benchmarks/gpu/results/h200-2026-11-27)
    memory_bandwidth=4.8e12 * _H100_MEASURED_BANDWIDTH / _H100_DATASHEET_BANDWIDTH,
    memory_capacity=141 * GIB,
    source=(
        f"compute rates those of the H100 (the same GH100 die and clocks), {_MEASURED_ON_H100}; HBM bandwidth "
        "the H200 SXM datasheet's 4.8 TB/s scaled by the H100's measured/datasheet ratio 3.02/3.35 (4.33 TB/s); "
        "both checked on two H200 SXM machines (benchmarks/gpu/results/h200-2026-11-27: driver 580.159.04, torch "
        "2.11.0+cu130, CUDA 13.0), which gave by the same rule bf16 667/688, fp16 631/627, fp32 50.9/50.7, TF32 "
        "359/358 TFLOP/s (within 3% of the H100's) and 4.31/4.33 TB/s; memory 141 GB HBM3e as on the NVIDIA H200 datasheet, SXM column; compute "
        "capability 9.0 and 132 SMs of the GH100 die as configured on the SXM parts (NVIDIA H100 Tensor Core GPU "
        "Architecture whitepaper); host link PCIe Gen5 x16 (datasheet: 128 GB/s both ways); "
        f"{_SHAPE_AND_HOST}"
    ),
    host_link_bandwidth=PCIE5_X16,
    cuda_name="NVIDIA H200",
    compute_capability=(9, 0),
    multiprocessors=132,
    gemm=HOPPER_GEMM,
    host_overhead=MEASURED_HOST_OVERHEAD,
    attention=HOPPER_ATTENTION,
)

_AMPERE_SXM_FLOPS = {
    torch.float64: 19.5e12,
    torch.float32: 19.5e12,
    torch.bfloat16: 624e12 / 2,
    torch.float16: 624e12 / 2,
    torch.int8: 1248e12 / 2,
}
_AMPERE_SXM_TF32 = 312e12 / 2

A100 = DeviceSpec(
    name="A100",
    peak_flops=_AMPERE_SXM_FLOPS,
    tf32_flops=_AMPERE_SXM_TF32,
    memory_bandwidth=2.039e12,
    memory_capacity=80 * GIB,
    source=(
        "NVIDIA A100 Tensor Core GPU datasheet, A100 80GB SXM column (80 GB HBM2e, 2,039 GB/s; PCIe Gen4: 64 GB/s "
        "both ways); compute capability 8.0 and 108 SMs (NVIDIA A100 Tensor Core GPU Architecture whitepaper); "
        f"not measured; {_SHAPE_AND_HOST} (not measured on an A100)"
    ),
    host_link_bandwidth=PCIE4_X16,
    cuda_name="NVIDIA A100-SXM4-80GB",
    compute_capability=(8, 0),
    multiprocessors=108,
    gemm=GemmShapeModel(),
    host_overhead=MEASURED_HOST_OVERHEAD,
    attention=AMPERE_ATTENTION,
)

A100_40GB = DeviceSpec(
    name="A100-40GB",
    peak_flops=_AMPERE_SXM_FLOPS,
    tf32_flops=_AMPERE_SXM_TF32,
    memory_bandwidth=1.555e12,
    memory_capacity=40 * GIB,
    source=(
        "NVIDIA A100 Tensor Core GPU datasheet, A100 40GB SXM column (40 GB HBM2, 1,555 GB/s; PCIe Gen4: 64 GB/s "
        "both ways); compute capability 8.0 and 108 SMs (NVIDIA A100 Tensor Core GPU Architecture whitepaper); "
        f"not measured; {_SHAPE_AND_HOST} (not measured on an A100)"
    ),
    host_link_bandwidth=PCIE4_X16,
    cuda_name="NVIDIA A100-SXM4-40GB",
    compute_capability=(8, 0),
    multiprocessors=108,
    gemm=GemmShapeModel(),
    host_overhead=MEASURED_HOST_OVERHEAD,
    attention=AMPERE_ATTENTION,
)

CPU = DeviceSpec(
    name="cpu",
    peak_flops={torch.float32: math.inf},
    memory_bandwidth=math.inf,
    launch_overhead=0.0,
    host_link_bandwidth=math.inf,
    source="zero-cost placeholder: compute takes no simulated time, memory has no limit",
)

DEVICES: Mapping[str, DeviceSpec] = MappingProxyType({d.name: d for d in (H100, H200, A100, A100_40GB, CPU)})
"""Built-in devices by canonical name."""

_ALIASES: Mapping[str, str] = {
    "h100-sxm": "H100",
    "h200-sxm": "H200",
    "a100-sxm": "A100",
    "a100-80gb": "A100",
}
_BY_LOWER: Mapping[str, DeviceSpec] = {
    **{name.lower(): spec for name, spec in DEVICES.items()},
    **{alias: DEVICES[name] for alias, name in _ALIASES.items()},
}


def get_device(name: str) -> DeviceSpec:
    """The built-in device called ``name`` (case-insensitive; aliases such as "H100-SXM" accepted)."""
    spec = _BY_LOWER.get(name.lower()) if isinstance(name, str) else None
    if spec is None:
        known = ", ".join([*DEVICES, *(a.upper() for a in _ALIASES)])
        raise ClusterSpecError(
            f"unknown device {name!r}; known devices: {known}. "
            "Pass one of these, or build a DeviceSpec with your own figures"
        )
    return spec
