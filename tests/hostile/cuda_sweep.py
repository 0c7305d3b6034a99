"""A hypothesis sweep over modules, dtypes and ``torch.cuda`` calls on simulated GPUs, run in a child process.

Each example is a program for two ranks: ``torch.cuda`` calls, then a module in a dtype on a device, forward and
backward (sometimes under CUDA autocast, sometimes with a hook that raises on rank 0), then more calls. It may succeed or raise anything; what it must never do
is end the process (a C++ path calling ``std::terminate``). The program about to run is printed first, so a crash
names it. ``test_hostile_cuda.py`` runs this file and checks it reaches its last line.
"""

from __future__ import annotations

import io
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import simdist

PAIR = simdist.Cluster.switch(2, device="H100")

#: modules and an input for each, built on the device and in the dtype of the example
MODULES: dict[str, tuple[Callable[[], torch.nn.Module], tuple[int, ...], bool]] = {
    "Linear": (lambda: torch.nn.Linear(8, 4), (3, 8), False),
    "Conv1d": (lambda: torch.nn.Conv1d(2, 3, 3), (2, 2, 9), False),
    "Conv2d": (lambda: torch.nn.Conv2d(2, 3, 3), (2, 2, 6, 6), False),
    "LayerNorm": (lambda: torch.nn.LayerNorm(8), (3, 8), False),
    "BatchNorm1d": (lambda: torch.nn.BatchNorm1d(8), (4, 8), False),
    "Embedding": (lambda: torch.nn.Embedding(10, 4), (3,), True),
    "LSTM": (lambda: torch.nn.LSTM(8, 4), (5, 2, 8), False),
    "GRU": (lambda: torch.nn.GRU(8, 4), (5, 2, 8), False),
    "SyncBatchNorm": (lambda: torch.nn.SyncBatchNorm(8), (4, 8, 3), False),
    "Dropout": (lambda: torch.nn.Dropout(0.5), (4, 8), False),
    "MultiheadAttention": (lambda: torch.nn.MultiheadAttention(8, 2), (5, 2, 8), False),
    "TransformerEncoderLayer": (lambda: torch.nn.TransformerEncoderLayer(8, 2, 16), (5, 2, 8), False),
    "GELU": (lambda: torch.nn.GELU(), (4, 8), False),
    "CausalAttention": (lambda: _CausalAttention(), (2, 2, 5, 8), False),
}


class _CausalAttention(torch.nn.Module):
    """Causal self-attention through ``F.scaled_dot_product_attention``, as nanoGPT calls it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(x, x, x, is_causal=True)


def _load(map_location: str) -> object:
    buffer = io.BytesIO()
    torch.save({"w": torch.ones(3), "v": torch.ones(3)[1:]}, buffer)
    buffer.seek(0)
    return torch.load(buffer, map_location=map_location)


def _assign_data(new: torch.Tensor) -> None:
    x = torch.nn.Parameter(torch.zeros(2, device="cuda"))
    x.data = new
    (x * 2).sum().backward()


#: mostly what programs use, sometimes what they must not (an integer module, a device the node lacks)
DTYPES = [torch.float32, torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64]
DEVICES = ["cuda", "cuda", "cuda:0", "cuda:1", "cuda:2", "cpu"]


def _on_side_stream() -> None:
    """An op on a side stream that the default stream then waits for."""
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.ones(2, device="cuda").mul_(2)
    torch.cuda.current_stream().wait_stream(side)


def _call(name: str) -> None:
    """One ``torch.cuda`` call by name (some with arguments a careless program passes); an error it raises is
    caught, as careless programs do, and the program goes on."""
    calls: dict[str, Callable[[], object]] = {
        "set_device_0": lambda: torch.cuda.set_device(0),
        "set_device_1": lambda: torch.cuda.set_device(1),
        "set_device_7": lambda: torch.cuda.set_device(7),
        "synchronize": torch.cuda.synchronize,
        "event": lambda: torch.cuda.Event(enable_timing=True).record(),
        "elapsed": lambda: torch.cuda.Event(enable_timing=True).elapsed_time(torch.cuda.Event()),
        "memory": lambda: (
            torch.cuda.memory_allocated(),
            torch.cuda.max_memory_allocated(),
            torch.cuda.memory_stats(),
        ),
        "reset_peak": torch.cuda.reset_peak_memory_stats,
        "mem_get_info": torch.cuda.mem_get_info,
        "manual_seed": lambda: torch.cuda.manual_seed_all(3),
        "rng_state": lambda: torch.cuda.set_rng_state(torch.cuda.get_rng_state()),
        "bad_rng_state": lambda: torch.cuda.set_rng_state(torch.zeros(3, dtype=torch.uint8)),
        "stream": lambda: torch.cuda.stream(torch.cuda.Stream()).__enter__(),
        "props": lambda: torch.cuda.get_device_properties(5),
        "device_ctx": lambda: torch.cuda.device(3).__enter__(),
        "generator": lambda: torch.randn(3, device="cuda", generator=torch.Generator(device="cuda")),
        "empty_cache": torch.cuda.empty_cache,
        "all_reduce": lambda: dist.all_reduce(torch.ones(2, device="cuda")),
        "numpy": lambda: torch.ones(2, device="cuda").numpy(),
        "pin": lambda: torch.ones(2).pin_memory().to("cuda", non_blocking=True),
        "copy_wrong_shape": lambda: torch.zeros(4, device="cuda").copy_(torch.ones(3, device="cuda")),
        "setitem_wrong_shape": lambda: torch.zeros(4, device="cuda").__setitem__(slice(0, 2), torch.ones(3)),
        "data_gpu": lambda: _assign_data(torch.ones(3, 2, device="cuda", dtype=torch.float64)),
        "data_host": lambda: _assign_data(torch.ones(5)),
        "load_cuda": lambda: _load("cuda"),
        "load_cuda_5": lambda: _load("cuda:5"),
        "side_stream": lambda: _on_side_stream(),
        "wait_stream": lambda: torch.cuda.current_stream().wait_stream(torch.cuda.Stream()),
        "event_wait": lambda: torch.cuda.Event().wait(torch.cuda.Stream()),
        "record_stream": lambda: torch.ones(2, device="cuda").record_stream(torch.cuda.Stream()),
        "nvtx_push": lambda: torch.cuda.nvtx.range_push("x"),
        "nvtx_pop": torch.cuda.nvtx.range_pop,
        "nvtx_mark": lambda: torch.cuda.nvtx.mark("x"),
        "nvtx_end_unknown": lambda: torch.cuda.nvtx.range_end(12345),
    }
    try:
        calls[name]()
    except Exception:  # noqa: BLE001, S110 - an error is an acceptable outcome of a careless call
        pass


CALLS = sorted(
    [
        "set_device_0",
        "set_device_1",
        "copy_wrong_shape",
        "setitem_wrong_shape",
        "data_gpu",
        "data_host",
        "load_cuda",
        "load_cuda_5",
        "set_device_7",
        "synchronize",
        "event",
        "elapsed",
        "memory",
        "reset_peak",
        "mem_get_info",
        "manual_seed",
        "rng_state",
        "bad_rng_state",
        "stream",
        "props",
        "device_ctx",
        "generator",
        "empty_cache",
        "all_reduce",
        "numpy",
        "pin",
        "side_stream",
        "wait_stream",
        "event_wait",
        "record_stream",
        "nvtx_push",
        "nvtx_pop",
        "nvtx_mark",
        "nvtx_end_unknown",
    ]
)


#: where rank 0 registers a hook that raises: none, a gradient hook on the output, the module's backward or
#: forward hook (C++ unwinds from the hook's error through the device guard)
HOOKS = [None, None, "tensor", "backward", "forward"]


def _raise(*args: object) -> None:
    raise ValueError("a hook raised")


def _program(
    module: str,
    dtype: torch.dtype,
    device: str,
    autocast: bool,
    before: list[str],
    after: list[str],
    hook: str | None = None,
) -> Callable[[], None]:
    make, shape, indices = MODULES[module]

    def program() -> None:
        for name in before:
            _call(name)
        m = make().to(device=device, dtype=dtype) if not indices else make().to(device)
        x = torch.randint(0, 10, shape) if indices else torch.randn(shape)
        x = x.to(device=device, dtype=None if indices else dtype)
        if x.is_floating_point():
            x.requires_grad_()
        raises = dist.get_rank() == 0 and hook is not None
        if raises and hook == "backward":
            m.register_full_backward_hook(_raise)
        elif raises and hook == "forward":
            m.register_forward_hook(_raise)
        with torch.autocast("cuda", enabled=autocast):
            out = m(x)
        out = out[0] if isinstance(out, tuple) else out
        if raises and hook == "tensor" and out.requires_grad:
            out.register_hook(_raise)
        out.float().sum().backward()
        for name in after:
            _call(name)

    return program


@settings(
    max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck), database=None
)
@given(
    module=st.sampled_from(sorted(MODULES)),
    dtype=st.sampled_from(DTYPES),
    device=st.sampled_from(DEVICES),
    autocast=st.booleans(),
    before=st.lists(st.sampled_from(CALLS), max_size=3),
    after=st.lists(st.sampled_from(CALLS), max_size=3),
    memory=st.booleans(),
    hook=st.sampled_from(HOOKS),
)
def sweep(
    module: str,
    dtype: torch.dtype,
    device: str,
    autocast: bool,
    before: list[str],
    after: list[str],
    memory: bool,
    hook: str | None,
) -> None:
    print(
        f"program: {module} {dtype} {device} autocast={autocast} before={before} after={after} memory={memory} "
        f"hook={hook}",
        flush=True,
    )
    try:
        simdist.run(
            _program(module, dtype, device, autocast, before, after, hook), PAIR, memory=memory, watchdog=120
        )
    except Exception as e:  # noqa: BLE001 - any error is an acceptable outcome; ending the process is not
        outcome = type(getattr(e, "exc", e)).__name__
    else:
        outcome = "ok"
    OUTCOMES[outcome] = OUTCOMES.get(outcome, 0) + 1
    print(f"  -> {outcome}", flush=True)


OUTCOMES: dict[str, int] = {}

if __name__ == "__main__":
    sweep()
    print(f"sweep done: {dict(sorted(OUTCOMES.items()))}", flush=True)
    sys.exit(0)
