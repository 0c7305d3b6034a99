"""What the GPU measurement scripts share: the machine's description, JSON written as it grows, timing.

Needs torch and the standard library only (GPU machines have their own torch build and nothing of simdist's
dependencies). Every script runs on a CPU too, with ``--dry-run`` (tiny sizes, few repeats), to check it end
to end before a GPU is at hand.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def parser(description: str) -> argparse.ArgumentParser:
    """The options every script takes: where to write, and whether this is a dry run."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument(
        "--out", type=Path, default=Path(os.environ.get("OUT", "gpu-results")), help="result folder"
    )
    p.add_argument("--dry-run", action="store_true", help="tiny sizes and few repeats; runs on a CPU too")
    return p


def device() -> torch.device:
    """The first CUDA device when there is one, else the CPU."""
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def machine() -> dict[str, Any]:
    """Device name, driver, torch, CUDA and Python versions: what every figure is quoted with."""
    info: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "host": platform.node(),
        "cpu": platform.processor() or platform.machine(),
        # the host's own speed sets an eager program's time per op: its processor and kernel (a sandboxed
        # kernel, gVisor's, reports itself as 4.4.0 and passes every GPU call through its own proxy)
        "cpu_model": _cpu_model(),
        "kernel": platform.release(),
        "cores": os.cpu_count(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(
            device=torch.cuda.get_device_name(0),
            capability=".".join(map(str, torch.cuda.get_device_capability(0))),
            memory_bytes=props.total_memory,
            multiprocessors=props.multi_processor_count,
            driver=_driver(),
            cudnn=torch.backends.cudnn.version(),
            nccl=_nccl(),
        )
    else:
        info["device"] = "cpu"
    return info


def _cpu_model() -> str | None:
    """The host processor's model name from /proc/cpuinfo, or None where there is none (not Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        return None
    return None


def _nccl() -> str | None:
    """NCCL's version as "2.27.3" (older torch builds give an int), or None without NCCL."""
    try:
        version = torch.cuda.nccl.version()
    except Exception:  # noqa: BLE001 - a build without NCCL: the figure is simply absent
        return None
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def _driver() -> str | None:
    """The NVIDIA driver version, from nvidia-smi or the kernel module; None if neither answers."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        )
        return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        pass
    try:
        return Path("/proc/driver/nvidia/version").read_text().split("Kernel Module")[1].split()[0]
    except (OSError, IndexError):
        return None


class Results:
    """A JSON file rewritten after every record, so a crash or timeout later loses nothing written before."""

    def __init__(self, path: Path, meta: dict[str, Any]) -> None:
        self.path = path
        self.data: dict[str, Any] = {"meta": meta, "records": [], "errors": []}
        path.parent.mkdir(parents=True, exist_ok=True)
        self.save()

    def add(self, record: dict[str, Any]) -> None:
        """Append one measurement and save."""
        self.data["records"].append(record)
        self.save()

    def error(self, where: str, exc: BaseException) -> None:
        """Note a failed measurement (the others go on) and save."""
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        self.data["errors"].append(
            {"where": where, "error": f"{type(exc).__name__}: {exc}", "traceback": text}
        )
        print(f"  FAILED {where}: {type(exc).__name__}: {exc}", flush=True)
        self.save()

    def set(self, key: str, value: Any) -> None:
        """Store a top-level entry (a summary, a list of per-step values) and save."""
        self.data[key] = value
        self.save()

    def save(self) -> None:
        # Written then renamed: whoever reads the file (or the run's end) never sees half of it.
        """Write the file (all of it, atomically)."""
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(tmp, self.path)

    @contextmanager
    def guard(self, where: str) -> Iterator[None]:
        """Run a block; an exception in it is recorded as an error instead of ending the script."""
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - one failing measurement must not lose the others
            self.error(where, exc)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()


#: GPU clock assumed when turning seconds into the cycles torch.cuda._sleep takes (an H100 boosts to 1.98 GHz)
_SLEEP_HZ = 2e9


def median_seconds(
    fn: Callable[[int], None], reps: int, dev: torch.device, host_s: float | None = None
) -> list[float]:
    """The time of each of ``reps`` calls ``fn(i)``, seconds: CUDA events around each call on a GPU.

    Given ``host_s`` (the host's seconds per call), the calls are queued behind a sleeping kernel long
    enough for the host to enqueue them all before the device starts: each pair of events then brackets the
    kernels alone, not the host's launch gaps (which matter for calls of microseconds). On the CPU,
    ``time.perf_counter`` around each call.
    """
    if dev.type != "cuda":
        times = []
        for i in range(reps):
            start = time.perf_counter()
            fn(i)
            times.append(time.perf_counter() - start)
        return times
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    torch.cuda.synchronize()
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is not None and host_s is not None:
        seconds = min(2.0, 1.5 * reps * max(host_s, 20e-6) + 1e-3)
        sleep(int(seconds * _SLEEP_HZ))
    for i in range(reps):
        starts[i].record()
        fn(i)
        ends[i].record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) / 1e3 for s, e in zip(starts, ends)]


def host_seconds(fn: Callable[[int], None], reps: int) -> float:
    """The host's seconds per call of ``fn`` (enqueueing only, on a GPU: no synchronisation)."""
    start = time.perf_counter()
    for i in range(reps):
        fn(i)
    return (time.perf_counter() - start) / reps


def loop_seconds(fn: Callable[[int], None], reps: int, dev: torch.device) -> float:
    """Seconds per call of ``reps`` calls back to back, host launches included (events around the loop)."""
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    if dev.type == "cuda":
        first, last = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        first.record()
    for i in range(reps):
        fn(i)
    if dev.type == "cuda":
        last.record()
        sync()
        return first.elapsed_time(last) / 1e3 / reps
    return (time.perf_counter() - start) / reps


def summary(times: list[float]) -> dict[str, float]:
    """Median, minimum and maximum of ``times`` (seconds)."""
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times)}
