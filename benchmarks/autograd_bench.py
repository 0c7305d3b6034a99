"""Backward-pass cost of simdist.autograd against torch autograd on the same graphs, in the same process.

Two graphs: a 100,000-node chain of tiny elementwise ops (so the time is engine overhead) and a 12-layer MLP
(where the matrix products dominate as the width grows). For each, the backward pass is timed for both engines
(median of --repeats runs, interleaved so machine noise hits both alike), and per-node figures are derived:

- wall/node: backward wall time divided by the graph's node count (each engine counts its own nodes, leaf
  accumulators included, by walking the graph from the loss);
- engine/node (ours only): wall time minus the time spent inside executor commands (measured in a separate
  run through a timing executor), per node: the cost of the engine itself, separate from NumPy's kernels.

Both engines run single-threaded by default (--threads): on a small shared machine, multi-threaded BLAS in
two libraries at once mostly measures contention.

Run: python benchmarks/autograd_bench.py [--chain 100000] [--repeats 5] [--widths 32 256] [--threads 1]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys


def _threads_from_argv() -> str:
    # BLAS reads its thread count when NumPy is imported, so this has to happen before the imports below.
    if "--threads" in sys.argv[:-1]:
        return sys.argv[sys.argv.index("--threads") + 1]
    return "1"


for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = _threads_from_argv()

import platform
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

import simdist.autograd as ag
from simdist.autograd.executor import TensorMeta
from simdist.autograd.graph import topological_order


class TimingExecutor(ag.NumpyExecutor):
    """The NumPy executor, also adding up the seconds spent inside commands."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds = 0.0
        self.commands = 0

    def execute(
        self, op: str, inputs: tuple[Any, ...], attrs: Mapping[str, Any], outputs: tuple[TensorMeta, ...]
    ) -> tuple[Any, ...]:
        start = time.perf_counter()
        try:
            return super().execute(op, inputs, attrs, outputs)
        finally:
            self.seconds += time.perf_counter() - start
            self.commands += 1


def our_node_count(loss: ag.Tensor) -> int:
    """Nodes reachable from the loss, AccumulateGrad sinks included."""
    return len(topological_order([loss.grad_fn]))


def torch_node_count(loss: torch.Tensor) -> int:
    """Nodes reachable from the loss in torch's graph, AccumulateGrad nodes included."""
    seen, stack = {loss.grad_fn}, [loss.grad_fn]
    while stack:
        for fn, _ in stack.pop().next_functions:
            if fn is not None and fn not in seen:
                seen.add(fn)
                stack.append(fn)
    return len(seen)


class Identity(ag.Function):
    """Passes values and gradients through untouched: a backward pass over these is pure engine traversal."""

    op = "identity"

    @staticmethod
    def forward(ctx: ag.Node, x: ag.Tensor) -> ag.Tensor:
        """A new handle to the same values."""
        return x.detach()

    @staticmethod
    def backward(ctx: ag.Node, grad: ag.Tensor) -> ag.Tensor:
        """The gradient, unchanged."""
        return grad


def traversal_only(n: int, repeats: int) -> float:
    """Median backward seconds per node over a chain of n Identity nodes (no executor command per node)."""
    times = []
    for _ in range(repeats):
        x = ag.tensor(np.ones(8), requires_grad=True)
        y = x
        for _ in range(n):
            y = Identity.apply(y)
        seed = ag.ones(8)
        gc.collect()
        start = time.perf_counter()
        y.backward(seed)
        times.append(time.perf_counter() - start)
    return statistics.median(times) / n


def chain_nodes(n: int) -> Callable[[], int]:
    """torch's node count for an n-op chain, from a 1,000-op chain: per op one node, plus fixed ones.

    Walking a 100,000-deep torch graph from Python creates a Python object per node, and releasing the graph
    afterwards crashes torch 2.13 (a recursive teardown), so the count is taken on a shallow instance.
    """
    small = 1000
    return lambda: torch_node_count(chain(torch, small)()) - small + n


def chain(lib: Any, n: int) -> Callable[[], Any]:
    """Builder of a chain alternating y * w and tanh(y) on 8-element float64 tensors: n op nodes."""
    rng = np.random.default_rng(0)
    x0, w0 = rng.uniform(-1, 1, 8), rng.uniform(0.9, 1.1, 8)

    def build() -> Any:
        if lib is torch:
            x, w = torch.tensor(x0, requires_grad=True), torch.tensor(w0, requires_grad=True)
        else:
            x, w = ag.tensor(x0, requires_grad=True), ag.tensor(w0, requires_grad=True)
        y = x
        for i in range(n - 1):  # the final sum makes n
            y = y * w if i % 2 else y.tanh()
        return y.sum()

    return build


def mlp(lib: Any, width: int, depth: int = 12, batch: int = 64) -> Callable[[], Any]:
    """Builder of a depth-layer tanh MLP (width units per layer) with a mean-squared-error loss, float64."""
    rng = np.random.default_rng(1)
    sizes = [width] * depth + [1]
    weights = [rng.normal(scale=1 / np.sqrt(i), size=(i, o)) for i, o in zip([width] + sizes, sizes)]
    biases = [rng.normal(scale=0.1, size=(o,)) for o in sizes]
    x, y = rng.normal(size=(batch, width)), rng.normal(size=(batch, 1))

    def build() -> Any:
        if lib is torch:
            make = lambda a, grad=True: torch.tensor(a, requires_grad=grad)
        else:
            make = lambda a, grad=True: ag.tensor(a, requires_grad=grad)
        h = make(x, False)
        for k, (w, b) in enumerate(zip(weights, biases)):
            h = h @ make(w) + make(b)
            if k < len(weights) - 1:
                h = h.tanh()
        return ((h - make(y, False)) ** 2).mean()

    return build


def measure(
    build_ours: Callable[[], Any],
    build_torch: Callable[[], Any],
    repeats: int,
    torch_nodes: Callable[[], int] | None = None,
) -> dict[str, float]:
    """Median backward times of both engines (graphs rebuilt each run), our executor time, node counts.

    torch_nodes: how to count torch's nodes when walking the timed graph from Python is unsafe (see chain_nodes).
    """
    executor = TimingExecutor()
    ours, ours_kernels, theirs, forward_ours, forward_torch = [], [], [], [], []
    nodes_ours = nodes_torch = 0
    for _ in range(repeats):
        # Wall time with the plain NumPy executor.
        start = time.perf_counter()
        loss = build_ours()
        forward_ours.append(time.perf_counter() - start)
        nodes_ours = our_node_count(loss)
        gc.collect()
        start = time.perf_counter()
        loss.backward()
        ours.append(time.perf_counter() - start)
        del loss
        # Time inside commands, from a second run whose executor times them (timing adds its own overhead,
        # so this run's wall time is not used).
        with ag.use_executor(executor):
            loss = build_ours()
            gc.collect()
            executor.seconds = 0.0
            loss.backward()
            ours_kernels.append(executor.seconds)
        del loss
        start = time.perf_counter()
        t_loss = build_torch()
        forward_torch.append(time.perf_counter() - start)
        nodes_torch = torch_nodes() if torch_nodes is not None else torch_node_count(t_loss)
        gc.collect()
        start = time.perf_counter()
        t_loss.backward()
        theirs.append(time.perf_counter() - start)
        del t_loss
    return {
        "ours_s": statistics.median(ours),
        "ours_kernel_s": statistics.median(ours_kernels),
        "torch_s": statistics.median(theirs),
        "ours_fwd_s": statistics.median(forward_ours),
        "torch_fwd_s": statistics.median(forward_torch),
        "nodes_ours": nodes_ours,
        "nodes_torch": nodes_torch,
    }


def report(name: str, r: dict[str, float]) -> str:
    """One markdown table row."""
    us = 1e6
    return (
        f"| {name} | {r['nodes_ours']:,} / {r['nodes_torch']:,} "
        f"| {r['ours_s'] * 1e3:,.1f} | {r['torch_s'] * 1e3:,.1f} | {r['ours_s'] / r['torch_s']:.2f}x "
        f"| {r['ours_s'] / r['nodes_ours'] * us:.2f} | {(r['ours_s'] - r['ours_kernel_s']) / r['nodes_ours'] * us:.2f} "
        f"| {r['torch_s'] / r['nodes_torch'] * us:.2f} "
        f"| {r['ours_fwd_s'] * 1e3:,.1f} / {r['torch_fwd_s'] * 1e3:,.1f} |"
    )


def main() -> None:
    """Run both benchmarks and print a markdown table plus the machine description."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chain", type=int, default=100_000, help="nodes in the chain (default 100000)")
    parser.add_argument("--repeats", type=int, default=5, help="runs per measurement (MLPs: 4x); the median")
    parser.add_argument("--threads", type=int, default=1, help="BLAS and torch threads (default 1)")
    parser.add_argument(
        "--widths", type=int, nargs="+", default=[32, 256], help="MLP widths (default 32 256)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    print(
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}; "
        f"Python {platform.python_version()}, NumPy {np.__version__}, torch {torch.__version__} "
        f"({torch.get_num_threads()} thread(s), BLAS {os.environ['OPENBLAS_NUM_THREADS']}); float64; median of "
        f"{args.repeats} runs (MLPs {4 * args.repeats})\n"
    )
    print(
        "| graph | nodes (ours / torch) | backward ms (ours) | backward ms (torch) | ours / torch "
        "| wall µs/node (ours) | engine µs/node (ours) | wall µs/node (torch) | forward ms (ours / torch) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    r = measure(chain(ag, args.chain), chain(torch, args.chain), args.repeats, chain_nodes(args.chain))
    print(report(f"chain of {args.chain:,} ops", r))
    for width in args.widths:
        r = measure(mlp(ag, width), mlp(torch, width), 4 * args.repeats)
        print(report(f"12-layer MLP, width {width}, batch 64", r))
    per_node = traversal_only(args.chain, args.repeats)
    print(
        f"\nengine traversal alone (ours): {per_node * 1e6:.2f} µs/node, from a chain of {args.chain:,} identity "
        "Functions whose backward runs no command"
    )


if __name__ == "__main__":
    main()
