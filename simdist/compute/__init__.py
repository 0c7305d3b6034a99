"""Compute-time model: device specs and the per-op roofline cost charged to simulated time (seconds)."""

from simdist.compute.attention import AttentionModel, KernelFit
from simdist.compute.cost import ComputeCostMode, estimate, op_cost, op_flops
from simdist.compute.devices import DEVICES, DeviceSpec, get_device
from simdist.compute.gemm import GemmShapeModel

__all__ = [
    "DEVICES",
    "AttentionModel",
    "ComputeCostMode",
    "DeviceSpec",
    "GemmShapeModel",
    "KernelFit",
    "estimate",
    "get_device",
    "op_cost",
    "op_flops",
]
