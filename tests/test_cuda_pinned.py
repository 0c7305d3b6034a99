"""Pinned and pageable host memory on a simulated GPU: ``is_pinned()`` only for memory pinned by CUDA, copies from
or to pinned memory at the host link's bandwidth and asynchronous with ``non_blocking=True``, copies from or to
pageable memory slower and synchronous for the host.

Oracles: closed forms over the host link (bytes / bandwidth, at ``PAGEABLE_SHARE`` of it for pageable memory, plus
the launch overhead) and over charged durations (a pinned copy on a side stream overlaps compute; a pageable one
holds the host, so compute queued after it starts after it), what torch documents of ``is_pinned``.
"""

from __future__ import annotations

import math

import torch
from hypothesis import given
from hypothesis import strategies as st

import simdist
from simdist.compute.devices import H100
from simdist.cuda.pinned import PAGEABLE_SHARE

ONE = simdist.Cluster.switch(1, device="H100")


def _which_are_pinned():
    torch.cuda.set_device(0)
    page = torch.ones(64)
    pinned = page.pin_memory()
    made = torch.empty(64, pin_memory=True)
    zeros = torch.zeros(8, pin_memory=True)
    dev = page.to("cuda")
    back_async = dev.to("cpu", non_blocking=True)  # torch pins a non-blocking copy's host output
    back = dev.cpu()
    return {
        "pageable": page.is_pinned(),
        "pin_memory()": pinned.is_pinned(),
        "pinned again": pinned.pin_memory() is pinned,
        "view of pinned": pinned[8:16].is_pinned(),
        "clone of pinned": pinned.clone().is_pinned(),
        "pin_memory=True": made.is_pinned() and zeros.is_pinned(),
        "gpu tensor": dev.is_pinned(),
        "non_blocking to host": back_async.is_pinned(),
        "blocking to host": back.is_pinned(),
        "values": torch.equal(pinned, page) and torch.equal(back_async, page),
    }


def test_is_pinned_is_true_only_for_memory_cuda_pinned():
    got = simdist.run(_which_are_pinned, ONE).returns[0]
    assert got == {
        "pageable": False,
        "pin_memory()": True,
        "pinned again": True,
        "view of pinned": True,
        "clone of pinned": False,
        "pin_memory=True": True,
        "gpu tensor": False,
        "non_blocking to host": True,
        "blocking to host": False,
        "values": True,
    }


def _copy_times(nbytes: int, pinned: bool, non_blocking: bool):
    torch.cuda.set_device(0)
    host = torch.ones(nbytes, dtype=torch.uint8)
    if pinned:
        host = host.pin_memory()
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    t0 = simdist.now()
    dev.copy_(host, non_blocking=non_blocking)  # host to device
    h2d_host = simdist.now() - t0
    torch.cuda.synchronize()
    h2d = simdist.now() - t0
    t1 = simdist.now()
    host.copy_(dev, non_blocking=non_blocking)  # device to host, into the same host memory
    d2h_host = simdist.now() - t1
    torch.cuda.synchronize()
    return h2d_host, h2d, d2h_host, simdist.now() - t1


@given(st.integers(1, 1 << 24), st.booleans(), st.booleans())
def test_pinned_copies_run_at_the_links_bandwidth_and_pageable_ones_slower_holding_the_host(
    nbytes, pinned, non_blocking
):
    h2d_host, h2d, d2h_host, d2h = simdist.run(_copy_times, ONE, args=(nbytes, pinned, non_blocking)).returns[
        0
    ]
    share = 1.0 if pinned else PAGEABLE_SHARE
    copy = H100.launch_overhead + nbytes / (H100.host_link_bandwidth * share)
    assert math.isclose(h2d, copy, rel_tol=1e-9) and math.isclose(d2h, copy, rel_tol=1e-9)
    # only a non-blocking copy from or to pinned memory leaves the host free
    held = 0.0 if pinned and non_blocking else copy
    assert math.isclose(h2d_host, held, rel_tol=1e-9, abs_tol=1e-15)
    assert math.isclose(d2h_host, held, rel_tol=1e-9, abs_tol=1e-15)


def _prefetch(pinned: bool, compute: float):
    """Copy the next batch on a side stream, then compute on the default stream (the usual prefetch)."""
    torch.cuda.set_device(0)
    batch = torch.ones(1 << 22, dtype=torch.uint8)  # 4 MiB
    if pinned:
        batch = batch.pin_memory()
    copier = torch.cuda.Stream()
    torch.cuda.synchronize()
    t0 = simdist.now()
    with torch.cuda.stream(copier):
        batch.to("cuda", non_blocking=True)
    simdist.charge(compute)
    torch.cuda.synchronize()
    return simdist.now() - t0


def test_a_non_blocking_copy_from_pinned_memory_overlaps_compute_and_one_from_pageable_memory_does_not():
    compute = 200e-6
    copy = H100.launch_overhead + (1 << 22) / H100.host_link_bandwidth
    assert math.isclose(
        simdist.run(_prefetch, ONE, args=(True, compute)).returns[0], max(copy, compute), rel_tol=1e-9
    )
    staged = H100.launch_overhead + (1 << 22) / (H100.host_link_bandwidth * PAGEABLE_SHARE)
    assert math.isclose(
        simdist.run(_prefetch, ONE, args=(False, compute)).returns[0], staged + compute, rel_tol=1e-9
    )
