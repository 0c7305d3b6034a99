"""Which collective model a cluster's collectives are timed with (``simdist.options.COLLECTIVE_MODELS``)."""

from __future__ import annotations

from simdist.algorithms import nccl
from simdist.compute.devices import get_device
from simdist.errors import ClusterSpecError
from simdist.options import COLLECTIVE_MODELS


def check_collective_model(model: object, device: object) -> str:
    """``model`` if it is a collective model (``simdist.options.COLLECTIVE_MODELS``) that ``device`` can be
    timed with; a ClusterSpecError naming the choices otherwise."""
    if not isinstance(model, str) or model not in COLLECTIVE_MODELS:
        raise ClusterSpecError(
            f"collective_model must be one of {', '.join(COLLECTIVE_MODELS)}; found {model!r}"
        )
    name = _device_name(device)
    if model == "nccl" and nccl.generation_of(name) is None:
        raise ClusterSpecError(
            f"collective_model='nccl' knows NCCL's tuning on {', '.join(nccl.GENERATIONS)} only; this cluster's "
            f"device is {name!r}: use collective_model='alpha-beta'"
        )
    return model


def nccl_knows(device: object) -> bool:
    """Whether NCCL's tuning model knows ``device`` (a device table name or alias, or a DeviceSpec's name)."""
    try:
        return nccl.generation_of(_device_name(device)) is not None
    except ClusterSpecError:  # a name the device table does not know: refused where the cluster is built
        return False


def _device_name(device: object) -> str:
    """``device`` as the device table names it (an alias's model; a DeviceSpec's own name)."""
    name = get_device(device).name if isinstance(device, str) else getattr(device, "name", "")
    return name if isinstance(name, str) else ""
